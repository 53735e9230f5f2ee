// The entry points of genserve's CPU ops (registered as torch.ops.genserve.*), declared for
// the ops that chain them in C++ (decode_layer_cpu.cpp) without a trip through Python.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <optional>
#include <tuple>

namespace genserve_ops {

// --deterministic (set_batch_invariant, registered in paged_attention_cpu.cpp): every row of
// every op is computed by the same code path in the same order whatever the step's batch
// holds, so a token's result never depends on its neighbours.  Off, the kernels choose by
// row count and thread count (a one-row stream, torch's GEMM past 256 rows, split-K
// attention for few long sequences), whose float sums round differently.
inline std::atomic<bool> g_batch_invariant{false};
inline bool batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

// t ([tokens, heads, dim]) itself when each token's [heads, dim] rows are contiguous, at any
// stride between tokens (a column slice of a wider projection output, read in place by the
// rotary + KV store and the decode attention), else a contiguous copy.
inline at::Tensor rows_in_place(const at::Tensor& t) {
  const bool in_place = t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2) &&
                        t.stride(0) >= t.size(1) * t.size(2);
  return in_place ? t : t.contiguous();
}

// fused_cpu.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& signed_sin);
at::Tensor rotary_write_kv(const at::Tensor& qk, const at::Tensor& cos,
                           const at::Tensor& signed_sin, const at::Tensor& v,
                           const at::Tensor& kv_cache, const at::Tensor& slots);

// paged_attention_cpu.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& context_lens,
                                  double scale, int64_t window, double softcap = 0.0,
                                  const std::optional<at::Tensor>& sinks = std::nullopt);

// matvec_cpu.cpp
at::Tensor matvec(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias);

// panel_gemm_cpu.cpp
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& bias);
at::Tensor qpanel_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                         int64_t N, const c10::optional<at::Tensor>& bias);
// acc += the product, each output tile added as it is stored (float32 x and acc [M, N]).
at::Tensor& panel_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& panels,
                              int64_t N, const c10::optional<at::Tensor>& bias);
at::Tensor& qpanel_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& data,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               int64_t bits, int64_t group, int64_t N,
                               const c10::optional<at::Tensor>& bias);

// kquant_cpu.cpp: x Wᵀ (+ b) on GGUF K-quant rows (`types` GGML codes 12/13/14, `rows` per
// segment), `isa` -1 for the float path or an int_dot.h code; and acc += x Wᵀ (float32, no bias).
at::Tensor kquant_linear(const at::Tensor& x, const at::Tensor& data, at::IntArrayRef types,
                         at::IntArrayRef rows, const c10::optional<at::Tensor>& bias, int64_t isa);
at::Tensor& kquant_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& data,
                               at::IntArrayRef types, at::IntArrayRef rows, int64_t isa);

// moe_route_cpu.cpp: a router's (weights [T, K] float32, ids [T, K] int64), as model/moe.py's
// `route` computes them (the same ATen ops in the same order).  `routing` holds the values
// below, in this order (model/moe.py's routing_codes writes them).
enum RoutingValue { kScoring, kTopK, kRenormalize, kNumGroups, kTopKGroups, kNumRouting };
// routing[kScoring]: model/spec.py's Scoring.
enum ScoringCode { kSoftmax = 0, kSigmoid = 1, kTopKSoftmax = 2 };
std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router,
                                             const std::optional<at::Tensor>& router_bias,
                                             const std::optional<at::Tensor>& correction_bias,
                                             at::IntArrayRef routing, double scaling_factor);

// moe_cpu.cpp / moe_quant_cpu.cpp: the routed experts' sum for (expert_ids, expert_weights),
// float w13/w2, or a GGUF file's blocks (`types` their GGML codes, `isa` the kernel path).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids,
                       const at::Tensor& expert_weights, const at::Tensor& w13,
                       const at::Tensor& w2, const std::optional<at::Tensor>& b13,
                       const std::optional<at::Tensor>& b2, double swiglu_alpha,
                       double swiglu_limit);
at::Tensor moe_experts_gguf(const at::Tensor& x, const at::Tensor& expert_ids,
                            const at::Tensor& expert_weights, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& down, at::IntArrayRef types,
                            int64_t isa, const std::optional<at::Tensor>& b13,
                            const std::optional<at::Tensor>& b2, double swiglu_alpha,
                            double swiglu_limit);

}  // namespace genserve_ops
