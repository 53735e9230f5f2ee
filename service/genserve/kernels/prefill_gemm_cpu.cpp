// Many-row products on GGUF K-quant weights (a prompt chunk's projections): the super-blocks
// decoded to bfloat16 in panels of weight rows, each panel multiplied by torch's bfloat16 GEMM
// (oneDNN: VDPBF16PS on AVX512-BF16, AMX-BF16 tiles where present).
//
// Why (issue #28, measured on AMD EPYC Zen 4, AVX512-BF16/VNNI, 2 threads, 512 rows of
// Llama-3.2-1B's shapes): kquant_cpu.cpp's integer path multiplies each decoded block by one
// activation row at a time (its inner loop is bound by loads and VPMULLD, 73-82 GMAC/s), where
// oneDNN's bfloat16 GEMM runs at ~214 GMAC/s on the same shapes; decoding a weight to bfloat16
// costs a fraction of a cycle, paid once per matmul for all of its rows.  Only worth it where
// the CPU multiplies bfloat16 natively (AVX512-BF16 / AMX-BF16: `bf16_gemm_native`), and only
// for enough rows to amortise the decode (model/kquants.py chooses).
//
// Numerics: each weight is gguf-py's float32 value (d·sc, then ·q, then − dmin·m: two
// roundings, no FMA) rounded to the nearest bfloat16 (ties to even), as
// `KQuantWeight.dequantize().to(torch.bfloat16)`; activations are rounded to bfloat16; sums are
// oneDNN's (float32 accumulation).  Not the integer path's numbers: its own tests bound it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_features.h"
#include "kquant_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using genserve_kquant::block_bytes_of;
using genserve_kquant::kQ4K;
using genserve_kquant::kQ5K;
using genserve_kquant::kQ6K;

using Segment = genserve_kquant::KSegment;

using DecodeRows = void (*)(const Segment*, int64_t, int64_t, int64_t, int64_t, uint16_t*);

}  // namespace

#if defined(__x86_64__)
// ---- the decode, AVX-512 (F + BW), chosen from cpuid ----------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
namespace kq_bf16_avx512 {
namespace {
#include "kquant_decode.inc"

// 16 weights: (factor · (q − offset)) − min, rounded once per operation as numpy does, then to
// the nearest bfloat16, ties to even (the float32 bits + 0x7FFF + the kept bit's lowest, >> 16).
inline void group_to_bf16(const uint8_t* q, int offset, float factor, float min, uint16_t* out) {
  const __m512i qi = _mm512_sub_epi32(
      _mm512_cvtepu8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q))),
      _mm512_set1_epi32(offset));
  __m512 p = _mm512_mul_ps(_mm512_set1_ps(factor), _mm512_cvtepi32_ps(qi));
  __asm__("" : "+v"(p));  // no FMA contraction: gguf-py rounds the product before subtracting
  const __m512i u = _mm512_castps_si512(_mm512_sub_ps(p, _mm512_set1_ps(min)));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

inline void block_to_bf16(int64_t type, const uint8_t* p, uint16_t* out) {
  alignas(64) uint8_t q[256];
  kq_quants(type, p, q);
  if (type == kQ6K) {
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = kq_half(p + 208);
    for (int g = 0; g < 16; ++g) {
      group_to_bf16(q + 16 * g, 32, d * static_cast<float>(sc[g]), 0.0f, out + 16 * g);
    }
    return;
  }
  uint8_t sc[8], m[8];
  kq_scale_min(p + 4, sc, m);
  const float d = kq_half(p), dmin = kq_half(p + 2);
  for (int g = 0; g < 16; ++g) {
    group_to_bf16(q + 16 * g, 0, d * static_cast<float>(sc[g / 2]),
                  dmin * static_cast<float>(m[g / 2]), out + 16 * g);
  }
}

// Weight rows [n0, n1) of the matrix (segments) into out [n1 - n0, K], row by row.
void decode_rows(const Segment* segments, int64_t num_segments, int64_t K, int64_t n0, int64_t n1,
                 uint16_t* out) {
  int64_t s = 0;
  for (int64_t n = n0; n < n1; ++n) {
    while (s + 1 < num_segments && n >= segments[s + 1].row0) ++s;
    while (s > 0 && n < segments[s].row0) --s;
    const Segment& seg = segments[s];
    const uint8_t* row = seg.data + (n - seg.row0) * seg.row_bytes;
    uint16_t* dst = out + (n - n0) * K;
    for (int64_t b = 0; b < K / 256; ++b) {
      __builtin_prefetch(row + (b + 2) * seg.block_bytes, 0, 0);
      __builtin_prefetch(row + (b + 2) * seg.block_bytes + 64, 0, 0);
      __builtin_prefetch(row + (b + 2) * seg.block_bytes + 128, 0, 0);
      block_to_bf16(seg.type, row + b * seg.block_bytes, dst + b * 256);
    }
  }
}

// 16 values: the nearest bfloat16 of each float32 (ties to even), stored.
inline void store_bf16(__m512 v, uint16_t* out) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

// scale · q (+ min): the product rounded before the sum, as the torch reference computes it.
inline __m512 scaled(__m512i q, __m512 scale, const __m512* min) {
  __m512 p = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q));
  if (min == nullptr) return p;
  __asm__("" : "+v"(p));
  return _mm512_add_ps(p, *min);
}

// Panels [p0, p1) of model/int_dot_panels.py's layout (8-bit: data [P, Kp/4, 128], byte q + 128;
// 4-bit: [P, Kp/4, 64], byte 4c + s holds feature c (low nibble) and c + 16 (high) at input s
// of the quad; float16 scales and mins [P, Kp/32, 32]) into Wᵀ: out [Kp, ld] bfloat16, panel p
// at columns 32 (p − p0) ..  Transposed because the quads are: one 64-byte load holds 16
// features' 4 inputs, and shifting it by 8 s bits leaves input s of all 16 in the low bytes.
void panels_to_bf16(const uint8_t* data, const uint16_t* scales, const uint16_t* mins, int64_t bits,
                    int64_t Kp, int64_t p0, int64_t p1, int64_t ld, uint16_t* out) {
  const int64_t quad_bytes = bits == 8 ? 128 : 64, quads = Kp / 4, blocks = Kp / 32;
  const __m512i byte = _mm512_set1_epi32(0xFF), nibble = _mm512_set1_epi32(0x0F);
  const __m512i offset = _mm512_set1_epi32(128);
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* d = data + p * quads * quad_bytes;
    uint16_t* col = out + (p - p0) * 32;
    for (int64_t kb = 0; kb < blocks; ++kb) {
      const uint16_t* sc = scales + (p * blocks + kb) * 32;
      const __m512 s_lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc)));
      const __m512 s_hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + 16)));
      __m512 m_lo = _mm512_setzero_ps(), m_hi = _mm512_setzero_ps();
      if (mins != nullptr) {
        const uint16_t* mn = mins + (p * blocks + kb) * 32;
        m_lo = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn)));
        m_hi = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + 16)));
      } else if (bits == 4) {  // Q4_0 stores no mins: m = -8 d (int_dot_cpu.cpp)
        m_lo = _mm512_mul_ps(s_lo, _mm512_set1_ps(-8.0f));
        m_hi = _mm512_mul_ps(s_hi, _mm512_set1_ps(-8.0f));
      }
      const bool has_min = mins != nullptr || bits == 4;
      const __m512* ml = has_min ? &m_lo : nullptr;
      const __m512* mh = has_min ? &m_hi : nullptr;
      for (int64_t kq = 0; kq < 8; ++kq) {
        const uint8_t* qd = d + (kb * 8 + kq) * quad_bytes;
        __builtin_prefetch(qd + 8 * quad_bytes, 0, 0);
        const __m512i a = _mm512_loadu_si512(qd);
        const __m512i b = bits == 8 ? _mm512_loadu_si512(qd + 64) : a;
        for (int s = 0; s < 4; ++s) {
          uint16_t* row = col + (kb * 32 + kq * 4 + s) * ld;
          __m512i lo, hi;
          if (bits == 8) {
            lo = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(a, 8 * s), byte), offset);
            hi = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 8 * s), byte), offset);
          } else {
            lo = _mm512_and_si512(_mm512_srli_epi32(a, 8 * s), nibble);
            hi = _mm512_and_si512(_mm512_srli_epi32(a, 8 * s + 4), nibble);
          }
          store_bf16(scaled(lo, s_lo, ml), row);
          store_bf16(scaled(hi, s_hi, mh), row + 16);
        }
      }
    }
  }
}
}  // namespace
DecodeRows run() { return &decode_rows; }
using PanelsToBf16 = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t,
                              int64_t, int64_t, int64_t, uint16_t*);
PanelsToBf16 run_panels() { return &panels_to_bf16; }
}  // namespace kq_bf16_avx512
#pragma GCC pop_options
#endif  // __x86_64__

namespace {

bool has_avx512_decode() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return GENSERVE_CPU_SUPPORTS("avx512f") && GENSERVE_CPU_SUPPORTS("avx512bw") &&
         GENSERVE_CPU_SUPPORTS("avx512vl") && GENSERVE_CPU_SUPPORTS("avx2") &&
         GENSERVE_CPU_SUPPORTS("fma") && GENSERVE_CPU_SUPPORTS("f16c");
#else
  return false;
#endif
}

// Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16's VDPBF16PS, or AMX-BF16
// tiles), so that oneDNN's bfloat16 GEMM is not an emulation, and the decode above can run.
bool bf16_gemm_native() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return has_avx512_decode() &&
         (GENSERVE_CPU_SUPPORTS("avx512bf16") || GENSERVE_CPU_SUPPORTS("amx-bf16"));
#else
  return false;
#endif
}

DecodeRows decoder() {
#if defined(__x86_64__)
  if (has_avx512_decode()) return kq_bf16_avx512::run();
#endif
  return nullptr;
}

// Rows [n0, n1) decoded into buf (bfloat16 [n1 - n0, K]), split over torch's threads.
void decode_panel(DecodeRows decode, const std::vector<Segment>& segments, int64_t K, int64_t n0,
                  int64_t n1, at::Tensor& buf) {
  uint16_t* out = reinterpret_cast<uint16_t*>(buf.data_ptr<at::BFloat16>());
  const int64_t count = static_cast<int64_t>(segments.size());
  at::parallel_for(n0, n1, 16, [&](int64_t begin, int64_t end) {
    decode(segments.data(), count, K, begin, end, out + (begin - n0) * K);
  });
}

// W [N, K] as bfloat16 (for tests, and for a whole-matrix panel).
at::Tensor kquant_to_bf16(const at::Tensor& data, at::IntArrayRef types, at::IntArrayRef rows,
                          int64_t K) {
  const std::vector<Segment> segments =
      genserve_kquant::segments_of(data, types, rows, K, "kquant bf16");
  const DecodeRows decode = decoder();
  TORCH_CHECK(decode != nullptr, "kquant_to_bf16: this CPU lacks AVX-512 (F, BW, VL)");
  const int64_t N = segments.back().row0 + segments.back().rows;
  auto buf = at::empty({N, K}, data.options().dtype(at::kBFloat16));
  if (N > 0) decode_panel(decode, segments, K, 0, N, buf);
  return buf;
}

// The default panel: weight rows of about this many bytes as bfloat16.  A panel that stays in
// the caches is read back from them by the GEMM instead of from memory; a larger one pays
// fewer GEMM calls (each repacks x).  Measured on AMD EPYC Zen 4 (1 MiB L2 per core, 32 MiB
// L3), 512 rows of Llama-3.2-1B's shapes: see docs/cpu/prefill.md.
constexpr int64_t kPanelBytes = int64_t{4} << 20;

// The panel buffer, kept per thread between calls: a fresh allocation of this size is fresh
// pages from the kernel each call, whose first-touch faults cost as much as the decode.
at::Tensor& panel_buffer(int64_t rows, int64_t K) {
  thread_local at::Tensor buf;
  if (!buf.defined() || buf.numel() < rows * K) buf = at::empty({rows * K}, at::kBFloat16);
  return buf;
}

// y = x Wᵀ (+ b) in x's dtype: W decoded to bfloat16 `panel_rows` rows at a time (0: about
// kPanelBytes) and each panel multiplied by at::linear on bfloat16 x.
at::Tensor kquant_linear_bf16(const at::Tensor& x, const at::Tensor& data, at::IntArrayRef types,
                              at::IntArrayRef rows, const c10::optional<at::Tensor>& bias,
                              int64_t panel_rows) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "kquant_linear_bf16: CPU x [M, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "kquant_linear_bf16: float32, bfloat16 or float16 x expected");
  TORCH_CHECK(panel_rows >= 0, "kquant_linear_bf16: panel_rows must be >= 0");
  const int64_t K = x.size(1);
  const std::vector<Segment> segments =
      genserve_kquant::segments_of(data, types, rows, K, "kquant bf16");
  const DecodeRows decode = decoder();
  TORCH_CHECK(decode != nullptr, "kquant_linear_bf16: this CPU lacks AVX-512 (F, BW, VL)");
  const int64_t N = segments.back().row0 + segments.back().rows;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "kquant_linear_bf16: bias must be [N]");
    b = bias->to(at::kBFloat16).contiguous();
  }
  const auto xb = x.to(at::kBFloat16).contiguous();
  const int64_t auto_rows = std::max<int64_t>(64, kPanelBytes / (2 * K) / 64 * 64);
  const int64_t step = std::max<int64_t>(1, std::min(N, panel_rows == 0 ? auto_rows : panel_rows));
  if (N == 0) return at::zeros({x.size(0), 0}, x.options());
  at::Tensor& buf = panel_buffer(step, K);
  if (step == N) {
    auto w = buf.narrow(0, 0, N * K).view({N, K});
    decode_panel(decode, segments, K, 0, N, w);
    return at::linear(xb, w, b).to(x.scalar_type());
  }
  auto out = at::empty({x.size(0), N}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += step) {
    const int64_t n1 = std::min(N, n0 + step);
    auto panel = buf.narrow(0, 0, (n1 - n0) * K).view({n1 - n0, K});
    decode_panel(decode, segments, K, n0, n1, panel);
    const c10::optional<at::Tensor> pb =
        b.defined() ? c10::optional<at::Tensor>(b.narrow(0, n0, n1 - n0)) : c10::nullopt;
    out.narrow(1, n0, n1 - n0).copy_(at::linear(xb, panel, pb));
  }
  return out;
}

// The same for model/int_dot_panels.py's 8-/4-bit block layout (Q8_0, Q4_0, Q4_1, --quantize):
// panels decoded to Wᵀ bfloat16 about kPanelBytes at a time, x Wᵀ by at::matmul.
at::Tensor int_dot_linear_bf16(const at::Tensor& x, const at::Tensor& data,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& mins,
                               int64_t bits, int64_t N, const c10::optional<at::Tensor>& bias,
                               int64_t panel_cols) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, "int_dot_linear_bf16: CPU x [M, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kHalf,
              "int_dot_linear_bf16: float32, bfloat16 or float16 x expected");
  TORCH_CHECK(bits == 8 || bits == 4, "int_dot_linear_bf16: 8 or 4 bits");
  TORCH_CHECK(data.scalar_type() == at::kByte && data.dim() == 3 && data.is_contiguous() &&
                  data.size(2) == (bits == 8 ? 128 : 64),
              "int_dot_linear_bf16: data [P, Kp/4, 128 (8-bit) or 64 (4-bit)] uint8 expected");
  const int64_t P = data.size(0), Kp = data.size(1) * 4, K = x.size(1);
  TORCH_CHECK(Kp % 32 == 0 && K <= Kp && K > Kp - 32 && N <= 32 * P && N > 32 * (P - 1),
              "int_dot_linear_bf16: x's K or N does not match the panels");
  auto param_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == P &&
           t.size(1) == Kp / 32 && t.size(2) == 32;
  };
  TORCH_CHECK(param_ok(scales), "int_dot_linear_bf16: float16 scales [P, Kp/32, 32] expected");
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(!has_mins || param_ok(*mins), "int_dot_linear_bf16: float16 mins like scales");
  TORCH_CHECK(panel_cols >= 0, "int_dot_linear_bf16: panel_cols must be >= 0");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "int_dot_linear_bf16: bias must be [N]");
    b = bias->to(at::kBFloat16).contiguous();
  }
#if defined(__x86_64__)
  TORCH_CHECK(has_avx512_decode(), "int_dot_linear_bf16: this CPU lacks AVX-512 (F, BW, VL)");
  const auto decode = kq_bf16_avx512::run_panels();
#else
  TORCH_CHECK(false, "int_dot_linear_bf16: x86-64 only");
  void (*decode)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t,
                 int64_t, int64_t, uint16_t*) = nullptr;
#endif
  const auto xb = x.to(at::kBFloat16).contiguous();
  const int64_t auto_panels = std::max<int64_t>(1, kPanelBytes / (2 * Kp) / 32);
  const int64_t step = std::min(P, panel_cols == 0 ? auto_panels : std::max<int64_t>(1, panel_cols / 32));
  at::Tensor& buf = panel_buffer(step * 32, Kp);
  const uint8_t* qd = data.data_ptr<uint8_t>();
  const uint16_t* sc = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>());
  const uint16_t* mn = has_mins ? reinterpret_cast<const uint16_t*>(mins->data_ptr<at::Half>()) : nullptr;
  auto out = at::empty({x.size(0), N}, x.options());
  for (int64_t p0 = 0; p0 < P; p0 += step) {
    const int64_t p1 = std::min(P, p0 + step), ld = 32 * (p1 - p0);
    const int64_t n0 = 32 * p0, n1 = std::min(N, 32 * p1);
    auto wt = buf.narrow(0, 0, Kp * ld).view({Kp, ld});
    uint16_t* dst = reinterpret_cast<uint16_t*>(wt.data_ptr<at::BFloat16>());
    at::parallel_for(p0, p1, 1, [&](int64_t begin, int64_t end) {
      decode(qd, sc, mn, bits, Kp, begin, end, ld, dst + 32 * (begin - p0));
    });
    auto y = at::matmul(xb, wt.narrow(0, 0, K).narrow(1, 0, n1 - n0));
    if (b.defined()) y.add_(b.narrow(0, n0, n1 - n0));
    out.narrow(1, n0, n1 - n0).copy_(y);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("kquant_linear_bf16(Tensor x, Tensor data, int[] types, int[] rows, Tensor? bias, "
        "int panel_rows=0) -> Tensor");
  m.def("kquant_to_bf16(Tensor data, int[] types, int[] rows, int k) -> Tensor");
  m.def("int_dot_linear_bf16(Tensor x, Tensor data, Tensor scales, Tensor? mins, int bits, int n, "
        "Tensor? bias, int panel_cols=0) -> Tensor");
  m.def("bf16_gemm_native() -> bool", &bf16_gemm_native);
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("kquant_linear_bf16", &kquant_linear_bf16);
  m.impl("kquant_to_bf16", &kquant_to_bf16);
  m.impl("int_dot_linear_bf16", &int_dot_linear_bf16);
}
