// Few-row bfloat16 projections on AMX tiles (matvec_amx_cpu.cpp), called by matvec_cpu.cpp.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <functional>

namespace genserve_ops {

// Activation rows the tiles take in one pass over W (two B tiles of 16).
inline constexpr int64_t kMatvecAmxPassRows = 32;
// Fewer rows stay on VDPBF16PS (matvec_cpu.cpp), which streams them as fast: 1B-shape
// matrices, 2 threads, Intel Xeon with AMX (docs/benchmarks/cpu.md, session 17): equal at 4
// rows, AMX 1.1-1.6x from 5 and 1.4-2.0x at 8.
inline constexpr int64_t kMatvecAmxMinRows = 5;

// Whether this CPU has AMX-TILE and AMX-BF16 (none hidden by the features mask) and Linux
// granted this process the tile state.
bool matvec_amx_available();

// Whether matvec_amx takes these shapes: K a multiple of 32 (the tiles read whole 64-byte
// pieces of each W row), at least 32 W rows.
bool matvec_amx_fits(int64_t M, int64_t K, int64_t N);

// W rows [begin, end) of the same product by another kernel: the rows past the last whole
// block of 32, which the tiles leave.
using MatvecTail = std::function<void(int64_t begin, int64_t end)>;

// out [M, N] float32 = x [M, K] . w [N, K]^T, both bfloat16 and contiguous, float32 sums on
// AMX tiles; W rows past N - N % 32 by `tail`.  Only where available and the shape fits.
void matvec_amx(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K,
                int64_t N, float* out, const MatvecTail& tail);

}  // namespace genserve_ops
