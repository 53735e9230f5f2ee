// Few-row bfloat16 x bfloat16 projections on AMX tiles (TDPBF16PS), for matvec_cpu.cpp.
//
// A decode step of a bfloat16 model with a few rows (2-16 streams) is a read of W, but on
// Intel CPUs VDPBF16PS (matvec_bf16dot_cpu.cpp) runs at about half an instruction a cycle:
// at 8 rows its 8 instructions per 64 bytes of W held a 1B-shape step to ~21 GB/s where one
// row streams at the memory's rate, so 8 streams cost 1.8x one stream.  One TDPBF16PS
// multiplies 16 W rows x 32 inputs by 16 activation rows' 32 inputs: the arithmetic for up
// to 16 rows is a few percent of the time it takes to read the W rows' bytes.
//
// The tiles read W where it is, row-major [N, K] (no repacked copy): tile A is 16 W rows x 32
// inputs (64 bytes of each row, stride K * 2 bytes), tile B is the activations' 32 inputs as
// 16 pairs x T rows (packed once per call, VNNI order: B[kk][t] = x[t][2kk], x[t][2kk + 1]),
// so C [16 W rows x T activation rows] += A . B, the output transposed.  Two A tiles (32 W
// rows) share each B tile, with one or two B tiles (up to 32 activation rows): at most 8
// tiles.  Measured on an Intel Xeon with AMX (2 vCPUs, 1B shape's [16384, 2048] and
// [2048, 8192] matrices, 8 rows): ~27 GB/s, the machine's streaming-read rate, against ~21
// for VDPBF16PS; software prefetches (256 bytes to 4 KB ahead, into L1 or L2) made it slower
// there, so there are none.
//
// Numerics: every product is exact in float32 (as VDPBF16PS's), the sums are float32 in the
// tile's order (pairs, then along K), so the results differ in the last bits from the
// VDPBF16PS kernel's: used only outside --deterministic (matvec_cpu.cpp), where each row's
// sums must not depend on the rows beside it.  Like VDPBF16PS, bf16 denormals count as zero.
//
// Chosen at run time (cpuid, the features mask); Linux hands a process the tile state only
// after it asks (arch_prctl ARCH_REQ_XCOMP_PERM), which available() does once.

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_features.h"
#include "matvec_amx.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define GENSERVE_AMX_BUILD 1
#endif

namespace {

constexpr int64_t kTileRows = 16;    // W rows per A tile, activation rows per B tile
constexpr int64_t kTileK = 32;       // inputs per tile step (64 bytes of bfloat16)
constexpr int64_t kBlockRows = 32;   // W rows per pass: two A tiles

}  // namespace

#if defined(GENSERVE_AMX_BUILD)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f")
namespace matvec_amx_bf16 {
namespace {

// The tile configuration ldtilecfg reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles: 0-1 C for B tile 0 (W rows 0-15, 16-31), 2-3 C for B tile 1, 4-5 A, 6-7 B.
void configure(int64_t t0, int64_t t1) {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette = 1;
  const int64_t cols[2] = {t0, t1};
  for (int b = 0; b < 2; ++b) {
    if (cols[b] == 0) continue;
    for (int h = 0; h < 2; ++h) {
      c.rows[2 * b + h] = kTileRows;
      c.colsb[2 * b + h] = static_cast<uint16_t>(cols[b] * 4);
    }
    c.rows[6 + b] = kTileRows;
    c.colsb[6 + b] = static_cast<uint16_t>(cols[b] * 4);
  }
  for (int a = 4; a < 6; ++a) {
    c.rows[a] = kTileRows;
    c.colsb[a] = kTileK * 2;
  }
  _tile_loadconfig(&c);
}

// C tile [16 W rows x t activation rows] (float32, stored row by row) into out[r, n0 + i].
inline void scatter(const float* c, int64_t t, int64_t r0, int64_t n0, int64_t N, float* out) {
  for (int64_t i = 0; i < kTileRows; ++i) {
    for (int64_t r = 0; r < t; ++r) out[(r0 + r) * N + n0 + i] = c[i * t + r];
  }
}

// W rows [begin, end) (whole blocks of 32) against activation rows [r0, r0 + t0 + t1): the B
// tiles' packed activations are xp0 (t0 rows) and xp1 (t1 rows, 0: none).
void run_blocks(const uint16_t* xp0, const uint16_t* xp1, int64_t t0, int64_t t1,
                const uint16_t* w, int64_t K, int64_t N, int64_t r0, float* out,
                int64_t begin, int64_t end) {
  configure(t0, t1);
  alignas(64) float c[kTileRows * kTileRows];
  const int64_t steps = K / kTileK;
  const int64_t stride = K * 2;  // bytes from one W row to the next
  for (int64_t n = begin; n < end; n += kBlockRows) {
    const uint16_t* w0 = w + n * K;
    const uint16_t* w1 = w0 + kTileRows * K;
    _tile_zero(0);
    _tile_zero(1);
    if (t1 > 0) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(4, w0 + s * kTileK, stride);
      _tile_loadd(5, w1 + s * kTileK, stride);
      _tile_loadd(6, xp0 + s * kTileK * t0, t0 * 4);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (t1 > 0) {
        _tile_loadd(7, xp1 + s * kTileK * t1, t1 * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, c, t0 * 4);
    scatter(c, t0, r0, n, N, out);
    _tile_stored(1, c, t0 * 4);
    scatter(c, t0, r0, n + kTileRows, N, out);
    if (t1 > 0) {
      _tile_stored(2, c, t1 * 4);
      scatter(c, t1, r0 + t0, n, N, out);
      _tile_stored(3, c, t1 * 4);
      scatter(c, t1, r0 + t0, n + kTileRows, N, out);
    }
  }
  _tile_release();
}

}  // namespace
}  // namespace matvec_amx_bf16
#pragma GCC pop_options
#endif  // GENSERVE_AMX_BUILD

namespace {

// x rows [r0, r0 + t) as B tiles: [K / 32 steps][16 pairs][t rows][2], each pair of bf16 one
// 32-bit word, so this is a transpose of 32-bit words [t][K / 2] -> [K / 2][t].
void pack_rows(const uint16_t* x, int64_t K, int64_t r0, int64_t t, uint16_t* xp) {
  const auto* src = reinterpret_cast<const uint32_t*>(x + r0 * K);
  auto* dst = reinterpret_cast<uint32_t*>(xp);
  const int64_t pairs = K / 2;
  for (int64_t r = 0; r < t; ++r) {
    for (int64_t p = 0; p < pairs; ++p) dst[p * t + r] = src[r * pairs + p];
  }
}

}  // namespace

namespace genserve_ops {

bool matvec_amx_available() {
#if defined(GENSERVE_AMX_BUILD)
  // The kernel's permission to use the tile data (asked once per process; granted to every
  // thread).  Without it the first tile instruction would kill the process.
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  __builtin_cpu_init();
  return granted && GENSERVE_CPU_SUPPORTS("amx-tile") && GENSERVE_CPU_SUPPORTS("amx-bf16") &&
         GENSERVE_CPU_SUPPORTS("avx512f");
#else
  return false;
#endif
}

bool matvec_amx_fits(int64_t M, int64_t K, int64_t N) {
  return M >= 1 && K % kTileK == 0 && K > 0 && N >= kBlockRows;
}

void matvec_amx(const c10::BFloat16* x, const c10::BFloat16* w, int64_t M, int64_t K,
                int64_t N, float* out, const MatvecTail& tail) {
#if defined(GENSERVE_AMX_BUILD)
  TORCH_CHECK(matvec_amx_available() && matvec_amx_fits(M, K, N),
              "matvec_amx: no AMX here, or a shape it does not take");
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* ws = reinterpret_cast<const uint16_t*>(w);
  const int64_t blocks = N / kBlockRows;
  // Each task streams >= 256 KiB of W, so a small matrix stays on one thread.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(1, kBlockRows * K * 2));
  std::vector<uint16_t> xp(static_cast<size_t>(std::min(M, kMatvecAmxPassRows) * K));
  // Up to 32 activation rows per pass over W (two B tiles); more rows (an LM head's many
  // sequences) read W once per 32.
  for (int64_t r0 = 0; r0 < M; r0 += kMatvecAmxPassRows) {
    const int64_t t = std::min(kMatvecAmxPassRows, M - r0);
    const int64_t t0 = std::min(t, kTileRows), t1 = t - t0;
    pack_rows(xs, K, r0, t0, xp.data());
    if (t1 > 0) pack_rows(xs, K, r0 + t0, t1, xp.data() + t0 * K);
    const uint16_t* xp1 = t1 > 0 ? xp.data() + t0 * K : nullptr;
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
      matvec_amx_bf16::run_blocks(xp.data(), xp1, t0, t1, ws, K, N, r0, out,
                                  begin * kBlockRows, end * kBlockRows);
    });
  }
  if (blocks * kBlockRows < N) tail(blocks * kBlockRows, N);
#else
  (void)x, (void)w, (void)M, (void)K, (void)N, (void)out, (void)tail;
  TORCH_CHECK(false, "matvec_amx: x86-64 Linux only");
#endif
}

}  // namespace genserve_ops
