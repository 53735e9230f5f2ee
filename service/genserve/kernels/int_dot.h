// The entry points of int_dot_cpu.cpp (integer dot-product matmul on 8-/4-bit block weights),
// declared for decode_layer_cpu.cpp, which chains them in C++.
#pragma once

#include <ATen/ATen.h>

namespace genserve_ops {

// Instruction-set paths of int_dot_linear (its `isa` argument; kernels/int_dot.py names them).
constexpr int64_t kIntDotNone = -1;
constexpr int64_t kIntDotAuto = 0;        // the best this CPU has
constexpr int64_t kIntDotAvx2 = 1;        // VPMADDUBSW + VPMADDWD
constexpr int64_t kIntDotAvxVnni = 2;     // 256-bit VPDPBUSD (VEX)
constexpr int64_t kIntDotAvx512Vnni = 3;  // 512-bit VPDPBUSD
// The AVX-VNNI tile with AVX512-VNNI's 256-bit (EVEX) VPDPBUSD: never chosen by kIntDotAuto,
// it runs the AVX-VNNI path's code in tests on AVX-512 CPUs that lack AVX-VNNI.
constexpr int64_t kIntDotVnni256Evex = 4;

// y = x Wᵀ (+ b), x [M, K] float32/bfloat16 quantized per block of 32 to int8, W as
// model/int_dot_panels.py packs it (data, float16 scales, float16 mins for 4-bit), N its
// unpadded output width.
at::Tensor int_dot_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& mins, int64_t bits, int64_t N,
                          const c10::optional<at::Tensor>& bias, int64_t isa);
// acc += int_dot_linear(x, ...) on the best path (float32 x and acc [M, N]), added as each
// output tile is stored.
at::Tensor& int_dot_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& data,
                                const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                                int64_t bits, int64_t N, const c10::optional<at::Tensor>& bias);

}  // namespace genserve_ops
