// float32 matmul on weights packed in column panels: y = x Wᵀ (+ b) for any number of rows.
//
// A decode step of 32 streams multiplies 32 rows by every weight matrix.  Dot products over
// W's rows (matvec_cpu.cpp) then spend their time on horizontal sums and on re-reading x, and
// top out near 160 GFLOP/s on two AVX-512 cores; the BLAS-style micro-kernel reaches the FMA
// units instead: W is stored once, at load time, as panels of 32 output columns laid out
// k-major ([P, K, 32]: panel p is W[32p : 32p + 32, :]ᵀ), so that one k step is a contiguous
// 128-byte load of the 32 weights, broadcast-multiplied by x[r, k] into a block of rows whose
// accumulators stay in registers (12 rows × 2 vectors with AVX-512, 3 × 4 with AVX2).
//
// The weights stream from memory once per step: each panel is walked in chunks of kKChunk
// k-steps small enough for L1, the first row block pulls a chunk in and the other row blocks
// of the step reuse it from L1; their partial sums wait in a per-task scratch of kRowBlock ×
// 32 floats.  A software prefetch into L2 runs a fixed distance ahead of the chunk, spread
// evenly over all the row blocks' loops (see Ahead).  One row (single-stream decode) is a
// pure stream: four k-segments of the panel are read at once so that each core keeps enough
// cache-line fills in flight to run at the memory's bandwidth.
//
// The same layout serves prefill (hundreds of rows) at about MKL's rate, so a float32 model
// keeps a single copy of its weights.  Sums are float32, in k order within each segment.
//
// Quantized weights (--quantize, model/quantization.py) use the same panels with their
// values still quantized ("qpanels", packed by QuantizedPanels.pack): 8-bit as int8
// [P, K, 32], 4-bit as uint8 [P, K, 16] (byte c of a k-step: column c in its low nibble,
// column c + 16 in its high one), float16 scales (and mins) [P, K / group, 32].  A chunk is
// dequantized into an L1 scratch once and every row block runs the float tile over it, so
// past a few rows the step is as compute-bound as float32 while reading 4-8x fewer bytes;
// one row dequantizes in registers.  A weight is rebuilt exactly as the reference does
// (scale * q + min, exact products of small integers and float16 values), so results differ
// from a float32 matmul on the dequantized matrix only in the order of float32 sums.
//
// Float16 panels ([P, K, 32] float16, kBits 16): a float32 model whose weights are all
// float16 values (an F16 GGUF served in float32 where the CPU has no native bfloat16, e.g.
// AVX2-only parts) keeps them at half the bytes.  One row widens them in registers (F16C);
// more rows too, in every row tile's registers on x86 (reg_chunk_rows: tiles of 6 rows × 16
// columns on AVX2, up to 12 rows × 32 on AVX-512; decode-size steps read x from a k-major
// copy, pack_x_k_major), elsewhere a chunk at a time into an L1 scratch the row tiles read;
// widening is exact, so every sum is the float32 panels' own, in the same order: the same
// results at half the memory traffic (weight_panels.pack_half_exact;
// docs/benchmarks/cpu-avx2.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "genserve_ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "matvec_core.h"

namespace {

using genserve_vec::f32v;
using genserve_vec::kLanes;
using genserve_vec::i32v;
using genserve_vec::load16;
using genserve_vec::load_f16;
using genserve_vec::load_i8;
using genserve_vec::load_u8;

constexpr int64_t kPanel = 32;                 // output columns per panel
constexpr int kVecs = kPanel / kLanes;         // vector registers per panel row
constexpr int64_t kKChunk = 128;               // k-steps per L1-resident chunk (16 KB)
constexpr int64_t kAheadSteps = 2 * kKChunk;   // k-steps the L2 prefetch runs ahead (32 KB)
constexpr int64_t kRowBlock = 128;             // rows whose partial sums one task keeps
#if defined(__AVX512F__)
constexpr int kTileRows = 12;  // 24 accumulators + 2 weight vectors + broadcast of 32 zmm
#elif defined(__AVX2__)
constexpr int kTileRows = 3;   // 12 accumulators + broadcast of 16 ymm (weights from memory)
#else
constexpr int kTileRows = 1;
#endif

inline void store(float* p, f32v v) { std::memcpy(p, &v, sizeof(v)); }

// How many k-steps ahead a streamed row prefetches its panel, per segment: float32 (128
// bytes a k-step); float16 panels none (0).  Float16 was 32 k-steps (2 KiB a segment), set by
// reasoning; swept on a Zen 4 (2 threads, the AVX2 build, the 1B shape's matrices from
// memory: docs/cpu-avx2.md), no software prefetch streamed 1.13x faster than 32 k-steps
// (16: 1.07x, 64: 1.05x, 128: 0.98x): four sequential line-per-k-step streams per core are
// what the hardware prefetchers follow best, and the extra loads only compete with them.
// Not measured on other CPUs.
constexpr int64_t kStreamAheadSteps = 16;
constexpr int64_t kHalfStreamAheadSteps = 0;

// The L2 prefetch of a float32 panel's weights, a cursor kAheadSteps k-steps ahead of the
// chunk being multiplied.  Each of a chunk's `every` row tiles walks the chunk's k-steps, so
// the cursor moves one k-step (128 bytes) every `every` k-steps of those loops: the fills
// are spread evenly over the whole chunk's arithmetic instead of bunched into the first row
// tile's, so a core keeps a steady number of lines in flight and its FMAs overlap them.
// Bunched (prefetching only in the first tile, as before) it ran 205 GFLOP/s at 32 rows on
// the default model's shapes with weights from DRAM; spread, 230-235 (2 AVX-512 cores).
// The cursor runs on past the panel into the next one, which is the next task's (a thread's
// panels are contiguous); past the band's end it touches nothing (prefetches do not fault).
struct Ahead {
  const char* next;   // the next k-step to prefetch
  int64_t fire;       // loop index of the current tile at which it is prefetched
  int64_t every;      // row tiles per chunk
};

// Rows [0, R) of x (row stride ldx; k-major when kPackedX) against k-steps [k0, k1) of a
// panel chunk of T (float32, or float16 widened in registers; chunk[0] is k-step k0), its
// columns [col0, col0 + kCols) (kCols 32, or 16 for a half-panel tile), accumulated into acc
// (R rows, row stride kPanel); `first` starts the sums from zero; kFetchBytes (the bytes of a
// k-step of the weights in memory: 128 for float32 panels, 64 for float16 ones; 0: none)
// advances `ahead`.  One FMA chain per row and column, in k order.
template <typename T, int R, int kCols, int kFetchBytes, bool kPackedX>
inline void tile(const float* x, int64_t ldx, int64_t k0, int64_t k1, const T* chunk, int col0,
                 float* acc_out, bool first, Ahead* ahead) {
  constexpr bool kFetchAhead = kFetchBytes > 0;
  constexpr int kV = kCols / kLanes;
  f32v acc[R][kV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kV; ++j)
      acc[r][j] = first ? f32v{} : load16(acc_out + r * kPanel + col0 + j * kLanes);
  int64_t fire = kFetchAhead ? ahead->fire : 0;
  const char* next = kFetchAhead ? ahead->next : nullptr;
  for (int64_t k = k0; k < k1; ++k) {
    const T* wk = chunk + (k - k0) * kPanel + col0;
    if (kFetchAhead && k - k0 == fire) {
      for (int b = 0; b < kFetchBytes; b += 64) __builtin_prefetch(next + b, 0, 2);
      next += kFetchBytes;
      fire += ahead->every;
    }
    f32v w[kV];
    for (int j = 0; j < kV; ++j) w[j] = load16(wk + j * kLanes);  // float16: widened
    for (int r = 0; r < R; ++r) {
      const f32v b = f32v{} + (kPackedX ? x[k * ldx + r] : x[r * ldx + k]);
      for (int j = 0; j < kV; ++j) acc[r][j] += b * w[j];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < kV; ++j) store(acc_out + r * kPanel + col0 + j * kLanes, acc[r][j]);
  if (kFetchAhead) {
    ahead->next = next;
    ahead->fire = fire - (k1 - k0);  // relative to the next tile's loop
  }
}

// The last rows of a block, fewer than kTileRows, in one full-panel tile: R chosen at run
// time.
template <typename T, int R, int kFetchBytes, bool kPackedX>
void tail_tile(int rows, const float* x, int64_t ldx, int64_t k0, int64_t k1, const T* chunk,
               float* acc, bool first, Ahead* ahead) {
  if constexpr (R > 0) {
    if (rows == R) {
      return tile<T, R, kPanel, kFetchBytes, kPackedX>(x, ldx, k0, k1, chunk, 0, acc, first,
                                                       ahead);
    }
    tail_tile<T, R - 1, kFetchBytes, kPackedX>(rows, x, ldx, k0, k1, chunk, acc, first, ahead);
  }
}

// Register tiles (reg_*, over tile()).  Float16 panels on x86: every row tile widens the k-steps it
// multiplies in registers (VCVTPH2PS) straight from the panel, so no widened copy is stored
// and read back.
// AVX2: with 16 ymm registers a tile of 32 columns holds 3 rows (12 accumulators) and has to
// take its weights as FMA memory operands (15 loads a k-step for 12 FMAs); a half-panel tile
// of 6 rows × 16 columns keeps its 2 widened weight vectors in registers (12 accumulators +
// 2 + a broadcast: 8 loads and 2 conversions for 12 FMAs), the shape of BLIS's Haswell sgemm
// kernel.  Rows come 6 at a time as two half tiles, the 1-5 left over as one tile of 32
// columns (1-2 rows) or two half tiles (3-5).  The AVX2 build's 8-row product of the 1B
// shape's layer matrices ran ~12% faster than with the first 3-row tile widening into an
// L1 copy that the others read (98 → 109 GFLOP/s with [2048, 2048] from L3, 1 thread).
// AVX-512 (32 zmm): the float32 panels' tiles of up to 12 rows × 32 columns, each widening
// its own 2 vectors a k-step, where a pass of its own had widened each chunk into that copy
// first.  (AMD EPYC Zen 4, 2026-11-27; not measured on other CPUs:
// docs/benchmarks/cpu-avx2.md.)  Every sum is tile()'s: one FMA chain per row and column, in
// k order, so the results are the float32 panels' bit for bit.
// Float32 panels on AVX2 take the same tiles (without the conversion), where the 3-row tiles
// with their weights as memory operands ran the 8- and 32-row products at ~97 GFLOP/s on 2
// cores (the same layer matrices from memory, 2026-11-27).
#if defined(__AVX2__)
constexpr bool kHalfRegTiles = true;
#else
constexpr bool kHalfRegTiles = false;
#endif
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kFloatRegTiles = true;
#else
constexpr bool kFloatRegTiles = false;
#endif
constexpr int kHalfTileRows = 6;

// Both half tiles of R rows.
template <typename T, int R, bool kPackedX>
inline void reg_halves(const float* x, int64_t ldx, int64_t k0, int64_t k1, const T* src,
                       float* acc, bool first, Ahead* ahead) {
  constexpr int kFetch = kPanel * sizeof(T);
  tile<T, R, kPanel / 2, kFetch, kPackedX>(x, ldx, k0, k1, src, 0, acc, first, ahead);
  tile<T, R, kPanel / 2, kFetch, kPackedX>(x, ldx, k0, k1, src, kPanel / 2, acc, first, ahead);
}

// The tile passes over one chunk for `rows` rows (what Ahead::every counts).
inline int64_t reg_tile_passes(int64_t rows) {
#if defined(__AVX512F__)
  return (rows + kTileRows - 1) / kTileRows;
#else
  const int64_t left = rows % kHalfTileRows;
  return 2 * (rows / kHalfTileRows) + (left == 0 ? 0 : left <= 2 ? 1 : 2);
#endif
}

// Rows [0, rows) (row r of x at xrow(r)) against one chunk of T, in the tiles above.
template <typename T, bool kPackedX, class XRow>
void reg_chunk_rows(int64_t rows, const XRow& xrow, int64_t ldx, int64_t k0, int64_t k1,
                    const T* src, float* acc, bool first, Ahead* ahead) {
  constexpr int kFetch = kPanel * sizeof(T);  // the panel is the stream
  int64_t r = 0;
#if defined(__AVX512F__)
  for (; r + kTileRows <= rows; r += kTileRows) {
    tile<T, kTileRows, kPanel, kFetch, kPackedX>(xrow(r), ldx, k0, k1, src, 0, acc + r * kPanel,
                                                 first, ahead);
  }
  if (r < rows) {
    tail_tile<T, kTileRows - 1, kFetch, kPackedX>(static_cast<int>(rows - r), xrow(r), ldx, k0,
                                                  k1, src, acc + r * kPanel, first, ahead);
  }
#else
  for (; r + kHalfTileRows <= rows; r += kHalfTileRows) {
    reg_halves<T, kHalfTileRows, kPackedX>(xrow(r), ldx, k0, k1, src, acc + r * kPanel, first,
                                           ahead);
  }
  const float* xr = xrow(r);
  float* ar = acc + r * kPanel;
  switch (rows - r) {
    case 1:
      return tile<T, 1, kPanel, kFetch, kPackedX>(xr, ldx, k0, k1, src, 0, ar, first, ahead);
    case 2:
      return tile<T, 2, kPanel, kFetch, kPackedX>(xr, ldx, k0, k1, src, 0, ar, first, ahead);
    case 3: return reg_halves<T, 3, kPackedX>(xr, ldx, k0, k1, src, ar, first, ahead);
    case 4: return reg_halves<T, 4, kPackedX>(xr, ldx, k0, k1, src, ar, first, ahead);
    case 5: return reg_halves<T, 5, kPackedX>(xr, ldx, k0, k1, src, ar, first, ahead);
    default: return;
  }
#endif
}

// One row: four k-segments streamed side by side, four independent accumulator sets.  T:
// float (float32 panels) or c10::Half (float16 panels, widened exactly by load16: the
// same sums in the same order).
template <typename T>
inline void stream_row(const float* x, int64_t K, const T* panel, float* out) {
  constexpr int kSegments = 4;
  constexpr bool kHalf = sizeof(T) == 2;
  constexpr int64_t kAhead = kHalf ? kHalfStreamAheadSteps : kStreamAheadSteps;
  f32v acc[kSegments][kVecs];
  for (int s = 0; s < kSegments; ++s)
    for (int j = 0; j < kVecs; ++j) acc[s][j] = f32v{};
  const int64_t seg = K / kSegments;
  for (int64_t k = 0; k < seg; ++k) {
    for (int s = 0; s < kSegments; ++s) {
      const int64_t kk = s * seg + k;
      if constexpr (kAhead > 0) __builtin_prefetch(panel + (kk + kAhead) * kPanel);
      if constexpr (!kHalf) __builtin_prefetch(panel + (kk + kAhead) * kPanel + 16);
      const f32v b = f32v{} + x[kk];
      for (int j = 0; j < kVecs; ++j) acc[s][j] += b * load16(panel + kk * kPanel + j * kLanes);
    }
  }
  for (int64_t k = kSegments * seg; k < K; ++k) {
    const f32v b = f32v{} + x[k];
    for (int j = 0; j < kVecs; ++j) acc[0][j] += b * load16(panel + k * kPanel + j * kLanes);
  }
  for (int j = 0; j < kVecs; ++j)
    store(out + j * kLanes, (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]));
}

// Quantized panels (see the top of this file); P panels of K k-steps.
struct QPanels {
  const void* data;
  const c10::Half* scales;  // [P, groups, 32]
  const c10::Half* mins;    // like scales, or nullptr (w = scale * q)
  int64_t bits, group, K, groups;
};

// kBits: 8 (int8, w = scale * q) or 4 (w = scale * q + min); 0 stands for float32 panels,
// 16 for float16 panels (no scales: the values are the weights, read by tile / stream_row).
template <int kBits>
constexpr int64_t bytes_per_k() {
  return kBits == 0 ? kPanel * 4 : kPanel * kBits / 8;
}

template <int kBits>
inline const uint8_t* q_at(const QPanels& q, int64_t p, int64_t k) {
  return static_cast<const uint8_t*>(q.data) + (p * q.K + k) * bytes_per_k<kBits>();
}

// The 32 float weights of one k-step (its bytes at `at`), given its group's scale and min.
// kScaled false: 8-bit values as they are (one scale per row, applied to the sums instead).
template <int kBits, bool kScaled = true>
inline void weights(const uint8_t* at, const f32v* scale, const f32v* min, f32v* w) {
  if constexpr (kBits == 8) {
    for (int j = 0; j < kVecs; ++j) {
      w[j] = load_i8(reinterpret_cast<const int8_t*>(at) + j * kLanes);
      if constexpr (kScaled) w[j] *= scale[j];
    }
  } else {
    const i32v low_mask = i32v{} + 0x0F;
    // Columns [16h + b, 16h + b + kLanes) are nibble h of bytes [b, b + kLanes).
    for (int b = 0; b < 16; b += kLanes) {
      const i32v packed = load_u8(at + b);
      const int lo = b / kLanes, hi = (16 + b) / kLanes;
      w[lo] = __builtin_convertvector(packed & low_mask, f32v) * scale[lo] + min[lo];
      w[hi] = __builtin_convertvector(packed >> 4, f32v) * scale[hi] + min[hi];
    }
  }
}

template <int kBits>
inline void group_params(const QPanels& q, int64_t p, int64_t g, f32v* scale, f32v* min) {
  const int64_t at = (p * q.groups + g) * kPanel;
  for (int j = 0; j < kVecs; ++j) {
    scale[j] = load_f16(q.scales + at + j * kLanes);
    if constexpr (kBits == 4) min[j] = load_f16(q.mins + at + j * kLanes);
  }
}

// k-steps [k0, k1) of panel p as float32 into dst ([k1 - k0, 32]).
template <int kBits>
inline void dequant_chunk(const QPanels& q, int64_t p, int64_t k0, int64_t k1, float* dst) {
  const uint8_t* next = q_at<kBits>(q, p, k1);
  for (int64_t b = 0; b < (k1 - k0) * bytes_per_k<kBits>(); b += 64) __builtin_prefetch(next + b);
  f32v scale[kVecs], min[kVecs];
  for (int64_t k = k0; k < k1;) {
    const int64_t g = k / q.group, end = std::min(k1, (g + 1) * q.group);
    group_params<kBits>(q, p, g, scale, min);
    const uint8_t* at = q_at<kBits>(q, p, k);
    for (; k < end; ++k, at += bytes_per_k<kBits>()) {
      f32v w[kVecs];
      weights<kBits>(at, scale, min, w);
      for (int j = 0; j < kVecs; ++j) store(dst + (k - k0) * kPanel + j * kLanes, w[j]);
    }
  }
}

// One quantized row, dequantized in registers: the panel is read in order (its bytes per
// k-step are few enough for one stream per core to keep up), four k-steps at a time into
// four accumulator sets so that FMA latency is hidden.  kScaled false (8-bit, one scale per
// row): the sums of x * q are scaled once at the end.
template <int kBits, bool kScaled>
inline void stream_row_q(const float* x, const QPanels& q, int64_t p, float* out) {
  constexpr int kUnroll = 4;
  constexpr int64_t kAheadBytes = 2048;
  const int64_t K = q.K;
  f32v acc[kUnroll][kVecs];
  for (int u = 0; u < kUnroll; ++u)
    for (int j = 0; j < kVecs; ++j) acc[u][j] = f32v{};
  f32v scale[kVecs], min[kVecs];
  const uint8_t* at = q_at<kBits>(q, p, 0);
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t g = k0 / q.group, k1 = std::min(K, (g + 1) * q.group);
    group_params<kBits>(q, p, g, scale, min);
    int64_t k = k0;
    for (; k + kUnroll <= k1; k += kUnroll) {
      __builtin_prefetch(at + kAheadBytes);
      if constexpr (bytes_per_k<kBits>() * kUnroll > 64) __builtin_prefetch(at + kAheadBytes + 64);
      for (int u = 0; u < kUnroll; ++u, at += bytes_per_k<kBits>()) {
        f32v w[kVecs];
        weights<kBits, kScaled>(at, scale, min, w);
        const f32v b = f32v{} + x[k + u];
        for (int j = 0; j < kVecs; ++j) acc[u][j] += b * w[j];
      }
    }
    for (; k < k1; ++k, at += bytes_per_k<kBits>()) {
      f32v w[kVecs];
      weights<kBits, kScaled>(at, scale, min, w);
      const f32v b = f32v{} + x[k];
      for (int j = 0; j < kVecs; ++j) acc[0][j] += b * w[j];
    }
    k0 = k1;
  }
  for (int j = 0; j < kVecs; ++j) {
    f32v sum = (acc[0][j] + acc[1][j]) + (acc[2][j] + acc[3][j]);
    if constexpr (!kScaled) sum *= scale[j];
    store(out + j * kLanes, sum);
  }
}

// Rows [m0, m0 + rows) of x against panel p (float32 `panel`, or `quant` when not null),
// written (with the bias) to out's columns [col0, col0 + cols), or added to what out holds
// there when `accumulate` (out += x Wᵀ + b, the residual add after a layer's last projection).
// xt: null, or x copied k-major (xt[k * ldt + m], float16 panels on AVX2 only: see
// pack_x_k_major), which the row tiles then read instead of x.
template <int kBits>
void panel_rows(const float* x, int64_t K, int64_t m0, int64_t rows, const float* panel,
                const QPanels* quant, int64_t p, const float* bias, float* out, int64_t N,
                int64_t col0, int64_t cols, float* scratch, float* wchunk, bool accumulate,
                const float* xt, int64_t ldt) {
  // One row streamed sums in another order than the row tiles: batch-invariant mode tiles it.
  if (rows == 1 && !genserve_ops::batch_invariant()) {
    if constexpr (kBits == 8) {
      if (quant->groups == 1) {
        stream_row_q<8, false>(x + m0 * K, *quant, p, scratch);
      } else {
        stream_row_q<8, true>(x + m0 * K, *quant, p, scratch);
      }
    } else if constexpr (kBits == 4) {
      stream_row_q<4, true>(x + m0 * K, *quant, p, scratch);
    } else if constexpr (kBits == 16) {  // the float32 row's order of sums, widened loads
      stream_row(x + m0 * K, K, static_cast<const c10::Half*>(quant->data) + p * K * kPanel,
                 scratch);
    } else {
      stream_row(x + m0 * K, K, panel, scratch);
    }
  } else {
    // Float32 and float16 panels are prefetched by the row tiles (quantized ones by
    // dequant_chunk, a chunk ahead).  On x86 each row tile widens its own float16 k-steps
    // (reg_chunk_rows; AVX2's 6-row half tiles keep them in registers, where 3-row tiles of 32
    // columns doing so had measured 1.4-1.8x slower than one widened copy per chunk);
    // elsewhere they are widened once per chunk into wchunk, shared by every row tile.
    constexpr int kFetchBytes = kBits == 0 ? kPanel * 4 : kBits == 16 ? kPanel * 2 : 0;
    const c10::Half* half = nullptr;
    const char* stream = reinterpret_cast<const char*>(panel);
    if constexpr (kBits == 16) {
      half = static_cast<const c10::Half*>(quant->data) + p * K * kPanel;
      stream = reinterpret_cast<const char*>(half);
    }
    constexpr bool kRegTiles = (kBits == 16 && kHalfRegTiles) || (kBits == 0 && kFloatRegTiles);
    const int64_t passes = kRegTiles ? reg_tile_passes(rows) : (rows + kTileRows - 1) / kTileRows;
    Ahead ahead{kFetchBytes > 0 ? stream + kAheadSteps * kFetchBytes : nullptr, 0, passes};
    // kP: the tiles read xt (row r of the block at xr + r, k-steps ld apart), else x.
    const auto row_tiles = [&](auto packed) {
      constexpr bool kP = decltype(packed)::value;
      const float* xr = kP ? xt + m0 : x + m0 * K;
      const int64_t ld = kP ? ldt : K;
      const auto xrow = [&](int64_t r) { return kP ? xr + r : xr + r * K; };
      for (int64_t k0 = 0; k0 < K; k0 += kKChunk) {
        const int64_t k1 = std::min(K, k0 + kKChunk);
        if constexpr (kBits == 16 && kHalfRegTiles) {
          reg_chunk_rows<c10::Half, kP>(rows, xrow, ld, k0, k1, half + k0 * kPanel, scratch,
                                        k0 == 0, &ahead);
          continue;
        } else if constexpr (kBits == 0 && kFloatRegTiles) {
          reg_chunk_rows<float, kP>(rows, xrow, ld, k0, k1, panel + k0 * kPanel, scratch,
                                    k0 == 0, &ahead);
          continue;
        }
        const float* chunk = wchunk;
        int64_t r = 0;
        if constexpr (kBits == 0) {
          chunk = panel + k0 * kPanel;
        } else if constexpr (kBits == 16) {
          const c10::Half* src = half + k0 * kPanel;
          for (int64_t i = 0; i < (k1 - k0) * kPanel; i += kLanes) {
            store(wchunk + i, load_f16(src + i));
          }
        } else {
          dequant_chunk<kBits>(*quant, p, k0, k1, wchunk);
        }
        for (; r + kTileRows <= rows; r += kTileRows) {
          tile<float, kTileRows, kPanel, kFetchBytes, kP>(xrow(r), ld, k0, k1, chunk, 0,
                                                         scratch + r * kPanel, k0 == 0, &ahead);
        }
        if (r < rows) {
          tail_tile<float, kTileRows - 1, kFetchBytes, kP>(static_cast<int>(rows - r), xrow(r),
                                                           ld, k0, k1, chunk, scratch + r * kPanel,
                                                           k0 == 0, &ahead);
        }
      }
    };
    if constexpr (kRegTiles) {
      if (xt != nullptr) {
        row_tiles(std::true_type{});
      } else {
        row_tiles(std::false_type{});
      }
    } else {
      row_tiles(std::false_type{});
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + (m0 + r) * N + col0;
    const float* src = scratch + r * kPanel;
    if (accumulate) {
      // out + (y + b): the order of torch's residual.add_(linear(x)).
      for (int64_t c = 0; c < cols; ++c) {
        dst[c] += bias != nullptr ? src[c] + bias[col0 + c] : src[c];
      }
    } else if (bias != nullptr) {
      for (int64_t c = 0; c < cols; ++c) dst[c] = src[c] + bias[col0 + c];
    } else {
      std::memcpy(dst, src, cols * sizeof(float));
    }
  }
}

// Every (row block, panel) task of y = x Wᵀ + b, over torch's threads.
template <int kBits>
void run_panels(const float* xp, int64_t M, int64_t K, int64_t P, int64_t N, const float* wp,
                const QPanels* quant, const float* bp, float* op, bool accumulate,
                const float* xt = nullptr) {
  // Tasks over (row block, panel) pairs, panel-major within a row block so that each thread
  // streams a contiguous band of W; each task moves >= ~128 KB of weights at one row.
  const int64_t row_blocks = (M + kRowBlock - 1) / kRowBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (K * bytes_per_k<kBits>()));
  at::parallel_for(0, row_blocks * P, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float scratch[kRowBlock * kPanel];
    alignas(64) float wchunk[kKChunk * kPanel];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = t / P, p = t % P;
      const int64_t m0 = block * kRowBlock, rows = std::min(kRowBlock, M - m0);
      panel_rows<kBits>(xp, K, m0, rows, wp == nullptr ? nullptr : wp + p * K * kPanel, quant, p, bp,
                 op, N, p * kPanel, std::min(kPanel, N - p * kPanel), scratch, wchunk,
                 accumulate, xt, M);
    }
  });
}

// Float16 panels on x86 and float32 ones on AVX2, steps of 2 .. kPackXMaxRows rows (decode
// batches): the row tiles read x from a k-major copy, xt[k * M + m].  Read in place, a
// tile's rows are K floats apart: at K = 2048 or 8192 every row's current line falls in the
// same set of a 32 KiB 8-way L1, which the panel also passes through (measured on AVX2);
// k-major, the whole step's activations for one k-step share one or two lines.  The copy is
// M × K floats once per call (64 KiB at 8 rows of 2,048).  Larger steps (prefill chunks) keep
// x in place:
// the 32-row bound is a choice, not a measurement (only 8 rows were timed, on a Zen 4).
constexpr int64_t kPackXMaxRows = 32;

std::vector<float> pack_x_k_major(const float* x, int64_t M, int64_t K) {
  std::vector<float> xt(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xt[k * M + m] = x[m * K + k];
  return xt;
}

// Past this many rows (a prefill step of several prompts) torch's GEMM runs a float32
// product on the panels laid out as Wᵀ [K, P * 32]: the copy costs ~5% of the multiply, and
// MKL's cache blocking beats the panel loop's (which re-reads W per 128-row block) by ~19% at
// 1280 rows; up to 256 rows the two measured equal.  Quantized weights stay on the panel loop
// at any size (dequantizing a band for the GEMM measured 1.4x slower at 1280 rows), and so do
// float16 panels (panel_linear_impl).
constexpr int64_t kGemmMinRows = 2 * kRowBlock;

// y = x Wᵀ (+ b) by torch's GEMM, W given as float32 panels [P, K, 32].
at::Tensor gemm_on_panels(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                          const at::Tensor& bias) {
  const int64_t K = panels.size(1), P = panels.size(0);
  auto out = at::mm(x, panels.permute({1, 0, 2}).reshape({K, P * kPanel}));
  if (N < P * kPanel) out = out.narrow(1, 0, N).contiguous();
  return bias.defined() ? out.add_(bias) : out;
}

}  // namespace

// Entry points, also called directly by decode_layer_cpu.cpp (genserve_ops.h).
namespace genserve_ops {

namespace {

// `into` is a float32 [M, N] contiguous tensor when the product is to be added to it.
bool can_accumulate(const at::Tensor* into, const at::Tensor& x, int64_t N) {
  if (into == nullptr) return false;
  TORCH_CHECK(into->scalar_type() == at::kFloat && into->is_contiguous() && into->dim() == 2 &&
                  into->size(0) == x.size(0) && into->size(1) == N,
              "panel_linear_add_: a contiguous float32 [M, N] accumulator expected");
  return true;
}

at::Tensor panel_linear_impl(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                             const c10::optional<at::Tensor>& bias, at::Tensor* into) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "panel_linear: CPU tensors only");
  const bool half = panels.scalar_type() == at::kHalf;
  TORCH_CHECK(x.scalar_type() == at::kFloat && (half || panels.scalar_type() == at::kFloat),
              "panel_linear: float32 x and float32 or float16 panels expected");
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3 && panels.size(2) == kPanel &&
                  panels.size(1) == x.size(1) && N <= panels.size(0) * kPanel &&
                  N > (panels.size(0) - 1) * kPanel,
              "panel_linear: x [M, K] and panels [ceil(N / 32), K, 32] expected");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  TORCH_CHECK(K > 0, "panel_linear: no input features");
  const auto xc = x.contiguous();
  const auto pc = panels.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "panel_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const bool accumulate = can_accumulate(into, x, N);
  // Float16 panels stay on the panel loop at any size: the GEMM needed a float32 copy of W
  // per call, and measured 86-89 GFLOP/s at 257 rows against the row tiles' 190-212 at 256
  // (the 1B shape's layer matrices, 2 threads, AVX2 and AVX-512 builds on a Zen 4 whose
  // bfloat16 was hidden, 2026-11-27).
  if (M > kGemmMinRows && !batch_invariant() && !half) {
    auto product = gemm_on_panels(xc, pc, N, b);
    return accumulate ? into->add_(product) : product;
  }
  auto out = accumulate ? *into : at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  if (half) {
    const QPanels q{pc.data_ptr(), nullptr, nullptr, 16, K, K, 1};
    std::vector<float> xt;
    if (kHalfRegTiles && M > 1 && M <= kPackXMaxRows) xt = pack_x_k_major(xp, M, K);
    run_panels<16>(xp, M, K, P, N, nullptr, &q, bp, op, accumulate,
                   xt.empty() ? nullptr : xt.data());
  } else {
    std::vector<float> xt;
    if (kFloatRegTiles && M > 1 && M <= kPackXMaxRows) xt = pack_x_k_major(xp, M, K);
    run_panels<0>(xp, M, K, P, N, pc.data_ptr<float>(), nullptr, bp, op, accumulate,
                  xt.empty() ? nullptr : xt.data());
  }
  return out;
}

at::Tensor qpanel_linear_impl(const at::Tensor& x, const at::Tensor& data,
                              const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                              int64_t bits, int64_t group, int64_t N,
                              const c10::optional<at::Tensor>& bias, at::Tensor* into) {
  TORCH_CHECK(x.device().is_cpu() && data.device().is_cpu(), "qpanel_linear: CPU tensors only");
  TORCH_CHECK(bits == 8 || bits == 4, "qpanel_linear: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                               x.scalar_type() == at::kHalf),
              "qpanel_linear: float32, bfloat16 or float16 x [M, K]");
  TORCH_CHECK(data.dim() == 3 && data.size(2) == (bits == 8 ? kPanel : kPanel / 2) &&
                  data.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "qpanel_linear: data [P, K, 32] int8 or [P, K, 16] uint8 expected");
  const int64_t M = x.size(0), K = x.size(1), P = data.size(0);
  TORCH_CHECK(data.size(1) == K && N <= P * kPanel && N > (P - 1) * kPanel,
              "qpanel_linear: x and data disagree on K or N");
  TORCH_CHECK(K > 0, "qpanel_linear: no input features");
  TORCH_CHECK(group > 0 && (group % 32 == 0 || group == K), "qpanel_linear: bad group size");
  const int64_t groups = (K + group - 1) / group;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == P &&
                  scales.size(1) == groups && scales.size(2) == kPanel,
              "qpanel_linear: float16 scales [P, groups, 32] expected");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(has_mins == (bits == 4), "qpanel_linear: 4-bit weights need mins, 8-bit none");
  if (has_mins) {
    TORCH_CHECK(mins->scalar_type() == at::kHalf && mins->sizes() == scales.sizes(),
                "qpanel_linear: mins like scales");
  }
  const auto xc = x.to(at::kFloat).contiguous();  // half-precision models: widened once
  const auto dc = data.contiguous();
  const auto sc = scales.contiguous();
  const auto mc = has_mins ? mins->contiguous() : at::Tensor();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "qpanel_linear: bias must be [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  const bool accumulate = can_accumulate(into, x, N);
  auto out = accumulate ? *into : at::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return out.to(x.scalar_type());
  const QPanels q{dc.data_ptr(), sc.data_ptr<c10::Half>(),
                  has_mins ? mc.data_ptr<c10::Half>() : nullptr, bits, group, K, groups};
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  if (bits == 8) {
    run_panels<8>(xc.data_ptr<float>(), M, K, P, N, nullptr, &q, bp, op, accumulate);
  } else {
    run_panels<4>(xc.data_ptr<float>(), M, K, P, N, nullptr, &q, bp, op, accumulate);
  }
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

}  // namespace

// x [M, K] float32, panels as weight_panels.pack_float lays them out, N the unpadded output
// width, bias [N] or None.
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N,
                        const c10::optional<at::Tensor>& bias) {
  return panel_linear_impl(x, panels, N, bias, nullptr);
}

// The quantized form of panel_linear: data, scales, mins as QuantizedPanels.pack lays
// them (see the top of this file).
at::Tensor qpanel_linear(const at::Tensor& x, const at::Tensor& data, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& mins, int64_t bits, int64_t group,
                         int64_t N, const c10::optional<at::Tensor>& bias) {
  return qpanel_linear_impl(x, data, scales, mins, bits, group, N, bias, nullptr);
}

// acc += panel_linear(x, ...) (float32 x and acc [M, N]), added as each output tile is
// stored: a decode layer's residual add without a pass of its own over [M, N].
at::Tensor& panel_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& panels,
                              int64_t N, const c10::optional<at::Tensor>& bias) {
  panel_linear_impl(x, panels, N, bias, &acc);
  return acc;
}

// acc += qpanel_linear(x, ...), float32 x and acc.
at::Tensor& qpanel_linear_add_(at::Tensor& acc, const at::Tensor& x, const at::Tensor& data,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               int64_t bits, int64_t group, int64_t N,
                               const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "qpanel_linear_add_: float32 x expected");
  qpanel_linear_impl(x, data, scales, mins, bits, group, N, bias, &acc);
  return acc;
}

}  // namespace genserve_ops

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("qpanel_linear(Tensor x, Tensor data, Tensor scales, Tensor? mins, int bits, int group, "
        "int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("panel_linear", &genserve_ops::panel_linear);
  m.impl("qpanel_linear", &genserve_ops::qpanel_linear);
}
