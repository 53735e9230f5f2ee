// The AVX512-BF16 decode matvec (matvec_bf16dot_cpu.cpp), called by matvec_cpu.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

namespace genserve_ops {

// Whether this CPU has AVX512-BF16 (with AVX512F/BW/VL) and none of them is hidden
// (cpu_features.h).
bool matvec_bf16dot_supported();

// out [M, N] float32 = x [M, K] . w [N, K]^T, both bfloat16 and contiguous, float32 sums by
// VDPBF16PS; any M (a block of W is reused for every x row).  Only where supported.
void matvec_bf16dot(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K,
                    int64_t N, float* out);

// The same product for W rows [begin, end) only, on the calling thread (a few rows another
// kernel leaves).
void matvec_bf16dot_rows(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K,
                         int64_t N, float* out, int64_t begin, int64_t end);

}  // namespace genserve_ops
