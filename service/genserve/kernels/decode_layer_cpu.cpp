// One decoder layer of a decode-only CPU step in a single op call.  The Llama layer:
//
//   normed = rms_norm(x);  qkv = normed Wqkvᵀ;  rotary + K/V store;  paged decode attention;
//   h = attn Woᵀ;  x2, normed2 = add_rms_norm(h, x);  x2 += down(silu(gate) * up)
//
// and every other layer a native family's spec describes (model/spec.py, the options below):
// LayerNorm with or without bias, no pre-norm (OLMo-2), per-head or full-width q/k norm,
// post-sublayer norms (Gemma 2/3, OLMo-2), a residual multiplier (Granite), parallel
// attention + MLP (Phi-2, GPT-NeoX, Cohere), GELU / GeGLU MLPs, biases on any projection,
// score soft-capping, and any scale, window and rotary table per layer.
//
// The ops are genserve's own (genserve_ops.h) or ATen's, run in the same order on the same
// tensors as the Python layer (model/decoder.py) runs them one by one.  What goes away is
// Python: at one stream a layer is ~10-16 small ops whose Python and dispatch cost (~100 µs
// per layer measured by runner_bench --profile) was a fifth of the step, the part llama.cpp
// never pays.  Used for decode-only steps of an unsharded model whose projections carry no
// LoRA hook (DecoderForCausalLM.use_fused_cpu_ops).

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <vector>

#include "genserve_ops.h"
#include "int_dot.h"

namespace {

// The weight of a projection is a plain [N, K] matrix (half precision): streamed by the
// matvec up to `matvec_rows` rows, torch's GEMM beyond, as layers.py's _linear does.
constexpr int64_t kPlainWeight = -1;
// bits[i] of a projection in the integer dot-product layout (model/int_dot_panels.py): 8 or 4
// plus this (--cpu-int-dot).
constexpr int64_t kIntDotBits = 100;
// bits[i] of GGUF K-quant rows (model/kquants.py): weights[3i .. 3i + 2] are (the super-blocks,
// uint8; the segments' GGML types, int64 [S]; their row counts, int64 [S]) and groups[i] the
// kernel path (-1 float, else an int_dot.h code), as KQuantWeight.linear passes them.
constexpr int64_t kKQuantBits = 200;

at::IntArrayRef int_list(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous() && t.dim() == 1,
              "decode_layer: K-quant segment lists must be int64 [S]");
  return at::IntArrayRef(t.data_ptr<int64_t>(), t.numel());
}

// Projection i of the layer (0 qkv, 1 o, 2 gate_up, 3 down): weights[3i .. 3i + 2] are
// (panels, quantized data or the plain weight; scales; mins), bits[i] 0 for float32 panels,
// kPlainWeight for a plain weight, 8 or 4 for quantized panels, kIntDotBits + 8 or 4 for the
// integer layout, kKQuantBits for K-quant rows; an empty tensor for none.
// With `residual` (the down projection), returns residual += the product: float32 panels
// and quantized panels on float32 add it as they store each output tile, the same sums in
// the same order as the separate add_ they replace.
at::Tensor project(int64_t i, const at::Tensor& x, at::TensorList weights,
                   at::IntArrayRef bits, at::IntArrayRef groups, at::IntArrayRef outs,
                   const c10::List<c10::optional<at::Tensor>>& biases, int64_t matvec_rows,
                   at::Tensor* residual = nullptr) {
  const c10::optional<at::Tensor> bias = biases.get(i);
  const at::Tensor& data = weights[3 * i];
  const at::Tensor& mins = weights[3 * i + 2];
  const c10::optional<at::Tensor> maybe_mins =
      mins.defined() && mins.numel() > 0 ? c10::optional<at::Tensor>(mins) : c10::nullopt;
  // Not with a bias: the kernels' out += (y + b) may be reassociated to (out + y) + b by the
  // build's -fassociative-math, which would round otherwise than the per-op path's add.
  const bool fuse_add = residual != nullptr && !(bias.has_value() && bias->defined()) &&
                        x.scalar_type() == at::kFloat && residual->scalar_type() == at::kFloat &&
                        residual->is_contiguous();
  if (bits[i] == kKQuantBits) {
    const auto types = int_list(weights[3 * i + 1]);
    const auto rows = int_list(weights[3 * i + 2]);
    if (fuse_add) {
      return genserve_ops::kquant_linear_add_(*residual, x, data, types, rows, groups[i]);
    }
    const auto y = genserve_ops::kquant_linear(x, data, types, rows, bias, groups[i]);
    return residual != nullptr ? residual->add_(y) : y;
  }
  if (bits[i] > kIntDotBits) {
    if (fuse_add) {
      return genserve_ops::int_dot_linear_add_(*residual, x, data, weights[3 * i + 1],
                                               maybe_mins, bits[i] - kIntDotBits, outs[i], bias);
    }
    const auto y = genserve_ops::int_dot_linear(x, data, weights[3 * i + 1], maybe_mins,
                                                bits[i] - kIntDotBits, outs[i], bias,
                                                genserve_ops::kIntDotAuto);
    return residual != nullptr ? residual->add_(y) : y;
  }
  if (fuse_add && bits[i] == 0) {
    return genserve_ops::panel_linear_add_(*residual, x, data, outs[i], bias);
  }
  if (fuse_add && bits[i] != kPlainWeight) {
    return genserve_ops::qpanel_linear_add_(*residual, x, data, weights[3 * i + 1], maybe_mins,
                                            bits[i], groups[i], outs[i], bias);
  }
  at::Tensor y;
  if (bits[i] == 0) {
    y = genserve_ops::panel_linear(x, data, outs[i], bias);
  } else if (bits[i] == kPlainWeight) {
    y = x.size(0) <= matvec_rows ? genserve_ops::matvec(x, data, bias)
                                 : at::linear(x, data, bias);
  } else {
    y = genserve_ops::qpanel_linear(x, data, weights[3 * i + 1], maybe_mins, bits[i], groups[i],
                                    outs[i], bias);
  }
  return residual != nullptr ? residual->add_(y) : y;
}

// What a layer is made of (decode_layer's `options`, set by model/fused_decode.py from the
// spec).  Norms: 0 RMSNorm (Gemma's (1 + w) is folded into its weight at load), 1 LayerNorm.
enum Option : int64_t {
  kNormKind = 0,      // the block's norms
  kQKNorm = 1,        // 0 none, 1 per head, 2 over all heads' features at once
  kQKNormKind = 2,    // the q/k norm's kind
  kActivation = 3,    // 0 SiLU, 1 GELU (erf), 2 GELU (tanh)
  kGated = 4,         // down(act(gate) * up), else down(act(up))
  kParallel = 5,      // x + attn(n(x)) + mlp(n'(x) or n(x))
  kNumOptions = 6,
};
enum Scalar : int64_t {
  kEps = 0,
  kQKEps = 1,
  kScale = 2,       // attention softmax scale
  kSoftcap = 3,     // attention score soft-cap, 0: none
  kResidualMultiplier = 4,
  kNumScalars = 5,
};
// decode_layer's `norms`: (weight, bias) of each, None where the layer has none.
enum NormSlot : int64_t {
  kPreAttn = 0,
  kPostAttn = 1,
  kPreMlp = 2,
  kPostMlp = 3,
  kQ = 4,
  kK = 5,
  kNumNorms = 6,
};
constexpr int64_t kLayerNorm = 1;

struct Norms {
  const c10::List<c10::optional<at::Tensor>>& list;
  bool has(int64_t slot) const { return list.get(2 * slot).has_value(); }
  at::Tensor weight(int64_t slot) const { return *list.get(2 * slot); }
  c10::optional<at::Tensor> bias(int64_t slot) const { return list.get(2 * slot + 1); }
};

// x normalised over its last dimension as model/norms.py does: RMSNorm by genserve's op;
// LayerNorm in float32 and cast back, a weight of one row per head ([heads, dim] against
// x [tokens, heads, dim], Cohere) applied after the weightless norm.
at::Tensor apply_norm(const at::Tensor& x, const Norms& norms, int64_t slot, int64_t kind,
                      double eps) {
  const auto weight = norms.weight(slot);
  if (kind != kLayerNorm) return genserve_ops::rms_norm(x, weight, eps);
  const auto bias = norms.bias(slot);
  const auto xf = x.to(at::kFloat);
  if (weight.dim() == 1) {
    const c10::optional<at::Tensor> bias_f =
        bias.has_value() ? c10::optional<at::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
    return at::layer_norm(xf, {weight.size(0)}, weight.to(at::kFloat), bias_f, eps)
        .to(x.scalar_type());
  }
  auto scaled = at::layer_norm(xf, {x.size(-1)}, {}, {}, eps).mul_(weight.to(at::kFloat));
  if (bias.has_value()) scaled.add_(bias->to(at::kFloat));
  return scaled.to(x.scalar_type());
}

at::Tensor activation(const at::Tensor& x, int64_t kind) {
  if (kind == 0) return at::silu(x);
  return at::gelu(x, kind == 2 ? "tanh" : "none");
}

// The attention half of a layer (projections 0 qkv and 1 o), shared by decode_layer and
// decode_attention: returns (the attention block's input after its pre-norm, its output o).
struct Attended {
  at::Tensor attn_in;
  at::Tensor o;
};

Attended attention_half(const at::Tensor& x, const Norms& norms, at::IntArrayRef options,
                        at::ArrayRef<double> scalars, const at::Tensor& cos,
                        const at::Tensor& signed_sin, const at::Tensor& kv_cache,
                        const at::Tensor& slots, const at::Tensor& block_table,
                        const at::Tensor& context_lens, int64_t window, int64_t num_heads,
                        int64_t num_kv_heads, at::TensorList weights, at::IntArrayRef bits,
                        at::IntArrayRef groups, at::IntArrayRef outs,
                        const c10::List<c10::optional<at::Tensor>>& biases,
                        int64_t matvec_rows) {
  const int64_t norm_kind = options[kNormKind], qk_norm = options[kQKNorm];
  const int64_t tokens = x.size(0), head_dim = kv_cache.size(4);
  const int64_t h = num_heads, kvh = num_kv_heads;
  const auto proj = [&](int64_t i, const at::Tensor& in) {
    return project(i, in, weights, bits, groups, outs, biases, matvec_rows);
  };
  const auto attn_in =
      norms.has(kPreAttn) ? apply_norm(x, norms, kPreAttn, norm_kind, scalars[kEps]) : x;
  const auto qkv = proj(0, attn_in);
  TORCH_CHECK(qkv.size(1) == (h + 2 * kvh) * head_dim, "decode_layer: qkv width");
  at::Tensor qk_in = qkv.narrow(1, 0, (h + kvh) * head_dim).view({tokens, h + kvh, head_dim});
  if (qk_norm != 0) {
    TORCH_CHECK(norms.has(kQ) && norms.has(kK), "decode_layer: q/k norm weights expected");
    const int64_t kind = options[kQKNormKind];
    const double qk_eps = scalars[kQKEps];
    const auto q = qkv.narrow(1, 0, h * head_dim);
    const auto k = qkv.narrow(1, h * head_dim, kvh * head_dim);
    // Per head: [tokens, heads, head_dim]; full width: [tokens, heads * head_dim].
    const auto shaped = [&](const at::Tensor& t, int64_t heads) {
      return qk_norm == 1 ? t.view({tokens, heads, head_dim}) : t;
    };
    const auto qn = apply_norm(shaped(q, h), norms, kQ, kind, qk_eps);
    const auto kn = apply_norm(shaped(k, kvh), norms, kK, kind, qk_eps);
    qk_in = at::cat({qn.reshape({tokens, h, head_dim}), kn.reshape({tokens, kvh, head_dim})}, 1);
  }
  const auto v = qkv.narrow(1, (h + kvh) * head_dim, kvh * head_dim).view({tokens, kvh, head_dim});
  const auto qk = genserve_ops::rotary_write_kv(qk_in, cos, signed_sin, v, kv_cache, slots);
  const auto attn = genserve_ops::paged_decode_attention(
      qk.narrow(1, 0, h), kv_cache, block_table, context_lens, scalars[kScale], window,
      scalars[kSoftcap]);
  return {attn_in, proj(1, attn.view({tokens, h * head_dim}))};
}

at::Tensor decode_layer(const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& norm_list,
                        at::IntArrayRef options, at::ArrayRef<double> scalars,
                        const at::Tensor& cos, const at::Tensor& signed_sin,
                        const at::Tensor& kv_cache, const at::Tensor& slots,
                        const at::Tensor& block_table, const at::Tensor& context_lens,
                        int64_t window, int64_t num_heads, int64_t num_kv_heads,
                        at::TensorList weights, at::IntArrayRef bits, at::IntArrayRef groups,
                        at::IntArrayRef outs, const c10::List<c10::optional<at::Tensor>>& biases,
                        int64_t matvec_rows) {
  TORCH_CHECK(weights.size() == 12 && bits.size() == 4 && groups.size() == 4 &&
                  outs.size() == 4 && biases.size() == 4,
              "decode_layer: four projections (qkv, o, gate_up, down) expected");
  TORCH_CHECK(options.size() == kNumOptions && scalars.size() == kNumScalars &&
                  norm_list.size() == 2 * kNumNorms,
              "decode_layer: options, scalars or norms of the wrong length");
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 5, "decode_layer: x [tokens, hidden] expected");
  const Norms norms{norm_list};
  const int64_t norm_kind = options[kNormKind];
  const double eps = scalars[kEps];
  const double multiplier = scalars[kResidualMultiplier];
  const auto proj = [&](int64_t i, const at::Tensor& in, at::Tensor* residual = nullptr) {
    return project(i, in, weights, bits, groups, outs, biases, matvec_rows, residual);
  };
  const auto norm = [&](const at::Tensor& t, int64_t slot) {
    return apply_norm(t, norms, slot, norm_kind, eps);
  };

  const auto attended = attention_half(x, norms, options, scalars, cos, signed_sin, kv_cache,
                                       slots, block_table, context_lens, window, num_heads,
                                       num_kv_heads, weights, bits, groups, outs, biases,
                                       matvec_rows);
  const auto& attn_in = attended.attn_in;
  auto o = attended.o;

  // MLP: act(gate) * up (SiLU by genserve's op) or act(up), then down with the residual.
  const auto mlp_hidden = [&](const at::Tensor& in) {
    const auto gate_up = proj(2, in);
    if (options[kGated] == 0) return activation(gate_up, options[kActivation]);
    if (options[kActivation] == 0) return genserve_ops::silu_and_mul(gate_up);
    const int64_t n = gate_up.size(1) / 2;
    return activation(gate_up.narrow(1, 0, n), options[kActivation]).mul_(gate_up.narrow(1, n, n));
  };

  if (options[kParallel] != 0) {  // x + h + mlp(pre_mlp(x) or attn_in)
    const auto mlp_in = norms.has(kPreMlp) ? norm(x, kPreMlp) : attn_in;
    auto summed = at::add(x, o);
    return proj(3, mlp_hidden(mlp_in), &summed);
  }
  const bool plain_sublayers = !norms.has(kPostAttn) && !norms.has(kPostMlp) && multiplier == 1.0;
  if (plain_sublayers && norm_kind != kLayerNorm && norms.has(kPreMlp)) {
    // Llama: the residual add and the norm in one pass; the down projection adds into x2.
    auto [summed, normed2] = genserve_ops::add_rms_norm(o, x, norms.weight(kPreMlp), eps);
    return proj(3, mlp_hidden(normed2), &summed);
  }
  if (norms.has(kPostAttn)) o = norm(o, kPostAttn);
  auto x2 = multiplier == 1.0 ? at::add(x, o) : at::add(x, o.mul(multiplier));
  const auto mlp_in = norms.has(kPreMlp) ? norm(x2, kPreMlp) : x2;
  if (!norms.has(kPostMlp) && multiplier == 1.0) return proj(3, mlp_hidden(mlp_in), &x2);
  auto m = proj(3, mlp_hidden(mlp_in));
  if (norms.has(kPostMlp)) m = norm(m, kPostMlp);
  return x2.add_(multiplier == 1.0 ? m : m.mul(multiplier));
}

// The attention half of a Llama-block layer whose MLP runs outside the op (a mixture of
// experts: model/moe.py routes and runs genserve::moe_experts on the second output).
// Returns (x2, normed2) = add_rms_norm(o, x), exactly as the Python layer's
// pre_mlp_norm.add_forward(h, x) does, so the layer's output is x2 + mlp(normed2) either way.
std::tuple<at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& norm_list,
    at::IntArrayRef options, at::ArrayRef<double> scalars, const at::Tensor& cos,
    const at::Tensor& signed_sin, const at::Tensor& kv_cache, const at::Tensor& slots,
    const at::Tensor& block_table, const at::Tensor& context_lens, int64_t window,
    int64_t num_heads, int64_t num_kv_heads, at::TensorList weights, at::IntArrayRef bits,
    at::IntArrayRef groups, at::IntArrayRef outs,
    const c10::List<c10::optional<at::Tensor>>& biases, int64_t matvec_rows) {
  TORCH_CHECK(weights.size() == 6 && bits.size() == 2 && groups.size() == 2 &&
                  outs.size() == 2 && biases.size() == 2,
              "decode_attention: two projections (qkv, o) expected");
  TORCH_CHECK(options.size() == kNumOptions && scalars.size() == kNumScalars &&
                  norm_list.size() == 2 * kNumNorms,
              "decode_attention: options, scalars or norms of the wrong length");
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 5,
              "decode_attention: x [tokens, hidden] expected");
  const Norms norms{norm_list};
  TORCH_CHECK(options[kNormKind] != kLayerNorm && options[kParallel] == 0 &&
                  norms.has(kPreMlp) && !norms.has(kPostAttn) && !norms.has(kPostMlp) &&
                  scalars[kResidualMultiplier] == 1.0,
              "decode_attention: a sequential RMSNorm block (Llama's) expected");
  const auto attended = attention_half(x, norms, options, scalars, cos, signed_sin, kv_cache,
                                       slots, block_table, context_lens, window, num_heads,
                                       num_kv_heads, weights, bits, groups, outs, biases,
                                       matvec_rows);
  return genserve_ops::add_rms_norm(attended.o, x, norms.weight(kPreMlp), scalars[kEps]);
}

// A mixture-of-experts layer of a decode-only step through its routed experts: the attention
// half (decode_attention), the router (genserve_ops::moe_route: logits, scoring, top-k and
// weights, as model/moe.py's `route`) and the experts' op (moe_experts on float w13/w2 when
// `expert_types` is empty, else moe_experts_gguf on the [gate, up, down] blocks), in the order
// SparseMoeBlock.forward runs them, so the results are bit-identical to the per-op path.
// Returns (out, normed2, routed): out = x2 + routed when `add_routed` (no shared expert: the
// layer's output), else x2, and the caller adds routed + the shared expert of normed2 (in
// that order, as the Python block sums them).
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_moe_layer(
    const at::Tensor& x, const c10::List<c10::optional<at::Tensor>>& norm_list,
    at::IntArrayRef options, at::ArrayRef<double> scalars, const at::Tensor& cos,
    const at::Tensor& signed_sin, const at::Tensor& kv_cache, const at::Tensor& slots,
    const at::Tensor& block_table, const at::Tensor& context_lens, int64_t window,
    int64_t num_heads, int64_t num_kv_heads, at::TensorList weights, at::IntArrayRef bits,
    at::IntArrayRef groups, at::IntArrayRef outs,
    const c10::List<c10::optional<at::Tensor>>& biases, int64_t matvec_rows,
    const at::Tensor& router, const std::optional<at::Tensor>& router_bias,
    const std::optional<at::Tensor>& correction_bias, at::IntArrayRef routing,
    double scaling_factor, at::TensorList experts, at::IntArrayRef expert_types,
    int64_t expert_isa, const std::optional<at::Tensor>& b13, const std::optional<at::Tensor>& b2,
    double swiglu_alpha, double swiglu_limit, bool add_routed) {
  TORCH_CHECK(expert_types.empty() ? experts.size() == 2 : experts.size() == 3,
              "decode_moe_layer: experts must be [w13, w2] (float) or [gate, up, down] blocks");
  auto [x2, normed] = decode_attention(x, norm_list, options, scalars, cos, signed_sin, kv_cache,
                                       slots, block_table, context_lens, window, num_heads,
                                       num_kv_heads, weights, bits, groups, outs, biases,
                                       matvec_rows);
  const auto [expert_weights, ids] = genserve_ops::moe_route(normed, router, router_bias,
                                                             correction_bias, routing,
                                                             scaling_factor);
  const auto routed =
      expert_types.empty()
          ? genserve_ops::moe_experts(normed, ids, expert_weights, experts[0], experts[1], b13,
                                      b2, swiglu_alpha, swiglu_limit)
          : genserve_ops::moe_experts_gguf(normed, ids, expert_weights, experts[0], experts[1],
                                           experts[2], expert_types, expert_isa, b13, b2,
                                           swiglu_alpha, swiglu_limit);
  if (add_routed) x2.add_(routed);
  return {x2, normed, routed};
}

// decode_layer's arguments that do not change from step to step, for every layer of a model
// whose layers are all whole decode_layer layers (model/fused_decode.py builds it once at
// load): decode_layers then runs a decode step's layers in one call.  Why: from Python each
// decode_layer call converted its ~19 arguments (lists of up to 12 tensors) into the
// dispatcher's values, ~10-15 us a layer, a tenth of a 135M model's one-row layer.
struct DecodeStack : torch::CustomClassHolder {
  struct Layer {
    c10::List<c10::optional<at::Tensor>> norms;
    std::vector<int64_t> options;
    std::vector<double> scalars;
    int64_t window, num_heads, num_kv_heads;
    std::vector<at::Tensor> weights;
    std::vector<int64_t> bits, groups, outs;
    c10::List<c10::optional<at::Tensor>> biases;
    int64_t matvec_rows;
    int64_t table;  // the index of its cos / sin in decode_layers' lists
  };
  std::vector<Layer> layers;

  // decode_layer's arguments after kv_cache's neighbours, in its order, plus `table`.
  void add_layer(c10::List<c10::optional<at::Tensor>> norms, std::vector<int64_t> options,
                 std::vector<double> scalars, int64_t window, int64_t num_heads,
                 int64_t num_kv_heads, std::vector<at::Tensor> weights, std::vector<int64_t> bits,
                 std::vector<int64_t> groups, std::vector<int64_t> outs,
                 c10::List<c10::optional<at::Tensor>> biases, int64_t matvec_rows,
                 int64_t table) {
    TORCH_CHECK(table >= 0, "DecodeStack.add_layer: a table index >= 0 expected");
    layers.push_back(Layer{std::move(norms), std::move(options), std::move(scalars), window,
                           num_heads, num_kv_heads, std::move(weights), std::move(bits),
                           std::move(groups), std::move(outs), std::move(biases), matvec_rows,
                           table});
  }
  int64_t size() const { return static_cast<int64_t>(layers.size()); }
};

// Every layer of `stack` in order, as decode_layer runs one: layer i reads and writes
// kv_caches[i] and rotates by cos[table], sin[table] (its table index).
at::Tensor decode_layers(const at::Tensor& x, const c10::intrusive_ptr<DecodeStack>& stack,
                         at::TensorList kv_caches, at::TensorList cos, at::TensorList sin,
                         const at::Tensor& slots, const at::Tensor& block_table,
                         const at::Tensor& context_lens) {
  TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == stack->size(),
              "decode_layers: one KV cache per layer expected");
  TORCH_CHECK(cos.size() == sin.size(), "decode_layers: as many cos as sin tables expected");
  at::Tensor h = x;
  for (size_t i = 0; i < stack->layers.size(); ++i) {
    const DecodeStack::Layer& l = stack->layers[i];
    TORCH_CHECK(l.table < static_cast<int64_t>(cos.size()), "decode_layers: layer ", i,
                " rotates by table ", l.table, " of ", cos.size());
    h = decode_layer(h, l.norms, l.options, l.scalars, cos[l.table], sin[l.table], kv_caches[i],
                     slots, block_table, context_lens, l.window, l.num_heads, l.num_kv_heads,
                     l.weights, l.bits, l.groups, l.outs, l.biases, l.matvec_rows);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("size", &DecodeStack::size);
  m.def("decode_layers(Tensor x, __torch__.torch.classes.genserve.DecodeStack stack, "
        "Tensor(a!)[] kv_caches, Tensor[] cos, Tensor[] sin, Tensor slots, Tensor block_table, "
        "Tensor context_lens) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor?[] norms, int[] options, float[] scalars, Tensor cos, "
        "Tensor signed_sin, Tensor(a!) kv_cache, Tensor slots, Tensor block_table, "
        "Tensor context_lens, int window, int num_heads, int num_kv_heads, "
        "Tensor[] weights, int[] bits, int[] groups, int[] outs, Tensor?[] biases, "
        "int matvec_rows) -> Tensor");
  m.def("decode_attention(Tensor x, Tensor?[] norms, int[] options, float[] scalars, "
        "Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slots, "
        "Tensor block_table, Tensor context_lens, int window, int num_heads, "
        "int num_kv_heads, Tensor[] weights, int[] bits, int[] groups, int[] outs, "
        "Tensor?[] biases, int matvec_rows) -> (Tensor, Tensor)");
  m.def("decode_moe_layer(Tensor x, Tensor?[] norms, int[] options, float[] scalars, "
        "Tensor cos, Tensor signed_sin, Tensor(a!) kv_cache, Tensor slots, "
        "Tensor block_table, Tensor context_lens, int window, int num_heads, "
        "int num_kv_heads, Tensor[] weights, int[] bits, int[] groups, int[] outs, "
        "Tensor?[] biases, int matvec_rows, Tensor router, Tensor? router_bias, "
        "Tensor? correction_bias, int[] routing, float scaling_factor, Tensor[] experts, "
        "int[] expert_types, int expert_isa, Tensor? b13, Tensor? b2, float swiglu_alpha, "
        "float swiglu_limit, bool add_routed) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("decode_layer", &decode_layer);
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_moe_layer", &decode_moe_layer);
}
