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

}  // namespace genserve_ops
