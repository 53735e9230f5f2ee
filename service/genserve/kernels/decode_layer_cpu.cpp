// One decoder layer of a decode-only CPU step in a single op call:
//
//   normed = rms_norm(x);  qkv = normed Wqkvᵀ;  rotary + K/V store;  paged decode attention;
//   h = attn Woᵀ;  x2, normed2 = add_rms_norm(h, x);  x2 += down(silu(gate) * up)
//
// The ops are genserve's own (genserve_ops.h), run in the same order on the same tensors as
// the Python layer (model/llama.py) runs them one by one, so the result is identical.  What
// goes away is Python: at one stream a layer is ~10 small ops whose Python and dispatch cost
// (~100 µs per layer measured by runner_bench --profile) was a fifth of the step, the part
// llama.cpp never pays.  Used for decode-only steps of an unsharded model whose projections
// carry no LoRA hook (LlamaForCausalLM.use_fused_cpu_ops).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "genserve_ops.h"
#include "int_dot.h"

namespace {

// The weight of a projection is a plain [N, K] matrix (half precision): streamed by the
// matvec up to `matvec_rows` rows, torch's GEMM beyond, as layers.py's _linear does.
constexpr int64_t kPlainWeight = -1;
// bits[i] of a projection in the integer dot-product layout (model/int_dot_panels.py): 8 or 4
// plus this (--cpu-int-dot).
constexpr int64_t kIntDotBits = 100;

// Projection i of the layer (0 qkv, 1 o, 2 gate_up, 3 down): weights[3i .. 3i + 2] are
// (panels, quantized data or the plain weight; scales; mins), bits[i] 0 for float32 panels,
// kPlainWeight for a plain weight, 8 or 4 for quantized panels; an empty tensor for none.
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
  const bool fuse_add = residual != nullptr && x.scalar_type() == at::kFloat &&
                        residual->scalar_type() == at::kFloat && residual->is_contiguous();
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

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& cos,
                        const at::Tensor& signed_sin, const at::Tensor& kv_cache,
                        const at::Tensor& slots, const at::Tensor& block_table,
                        const at::Tensor& context_lens, double scale, int64_t window,
                        int64_t num_heads, int64_t num_kv_heads, at::TensorList weights,
                        at::IntArrayRef bits, at::IntArrayRef groups, at::IntArrayRef outs,
                        const c10::List<c10::optional<at::Tensor>>& biases,
                        int64_t matvec_rows) {
  TORCH_CHECK(weights.size() == 12 && bits.size() == 4 && groups.size() == 4 &&
                  outs.size() == 4 && biases.size() == 4,
              "decode_layer: four projections (qkv, o, gate_up, down) expected");
  TORCH_CHECK(x.dim() == 2 && kv_cache.dim() == 5, "decode_layer: x [tokens, hidden] expected");
  const int64_t tokens = x.size(0), head_dim = kv_cache.size(4);
  const int64_t h = num_heads, kvh = num_kv_heads;
  const auto normed = genserve_ops::rms_norm(x, input_norm, eps);
  const auto qkv = project(0, normed, weights, bits, groups, outs, biases, matvec_rows);
  TORCH_CHECK(qkv.size(1) == (h + 2 * kvh) * head_dim, "decode_layer: qkv width");
  const auto qk_in = qkv.narrow(1, 0, (h + kvh) * head_dim).view({tokens, h + kvh, head_dim});
  const auto v = qkv.narrow(1, (h + kvh) * head_dim, kvh * head_dim).view({tokens, kvh, head_dim});
  const auto qk = genserve_ops::rotary_write_kv(qk_in, cos, signed_sin, v, kv_cache, slots);
  const auto attn = genserve_ops::paged_decode_attention(qk.narrow(1, 0, h), kv_cache,
                                                         block_table, context_lens, scale, window);
  const auto o = project(1, attn.view({tokens, h * head_dim}), weights, bits, groups, outs,
                         biases, matvec_rows);
  auto [summed, normed2] = genserve_ops::add_rms_norm(o, x, post_norm, eps);
  const auto gate_up = project(2, normed2, weights, bits, groups, outs, biases, matvec_rows);
  return project(3, genserve_ops::silu_and_mul(gate_up), weights, bits, groups, outs, biases,
                 matvec_rows, &summed);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("decode_layer(Tensor x, Tensor input_norm, Tensor post_norm, float eps, Tensor cos, "
        "Tensor signed_sin, Tensor(a!) kv_cache, Tensor slots, Tensor block_table, "
        "Tensor context_lens, float scale, int window, int num_heads, int num_kv_heads, "
        "Tensor[] weights, int[] bits, int[] groups, int[] outs, Tensor?[] biases, "
        "int matvec_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("decode_layer", &decode_layer); }
