// A mixture-of-experts layer's routed experts with their weights kept in a GGUF file's
// quantized blocks (model/moe_gguf.py):
//
//   out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]
//
// or, for gpt-oss (optional b13 [E, 2L], b2 [E, H], swiglu_limit > 0), the clamped SwiGLU on
// the biased projections, as moe_cpu.cpp computes it: gate = min(gate_e(x) + b_gate, limit),
// up = clamp(up_e(x) + b_up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate), and
// down_e(.) + b2[e] weighted.  The bias add and clamp sit in the activation pass and the
// down bias in the weighted sum: the row kernels are the same for both.
//
// gate and up are [E, L, row bytes] and down [E, H, row bytes] uint8: each expert's rows as
// llama.cpp stacks them in ffn_{gate,up,down}_exps, bytes untouched.  A projection's type is
// one of Q8_0, Q4_0 and MXFP4 (blocks of 32; MXFP4 in moe_mxfp4_row.inc) or Q4_K, Q5_K and Q6_K (super-blocks of 256: Q4_K_M
// mixes them, Q6_K for some layers' down projection), or genserve's own kQ8_0R16: Q8_0 rows
// repacked in groups of 16 (moe_q8_r16_row.inc, packed by moe_pack_q8_0_r16 when the experts
// are served on the AVX512-VNNI path; same bytes, rearranged).
//
// Why one op: at one decode row a Qwen3-30B-A3B layer reads top-8 of 128 experts, so the cost
// is streaming those experts' blocks once; a Python loop of per-expert matmuls would pay an
// op call and a thread fork per expert and projection.  As in moe_cpu.cpp the step's
// (token, choice) pairs are grouped by expert, each expert's rows gathered, and all (expert,
// band of weight rows) tasks of a projection go to one parallel loop; each weight row is
// decoded once and applied to every row of that expert (a tile of up to 32 at a time).
//
// Two paths, as the dense quantized kernels (kernels/int_dot.py's --cpu-int-dot, `isa`):
//  * float (isa = -1): blocks dequantized as gguf-py does, products with the float32
//    activations;
//  * integer: activations quantized per block to int8 (Q8_0 per 32 inputs for Q8_0/Q4_0
//    weights, Q8_K per 256 for K-quants, as llama.cpp does) and multiplied with VPDPBUSD
//    (AVX512-VNNI) or VPMADDUBSW (AVX2); K-quant rows run kquant_cpu.cpp's own row kernels.
// Each output depends only on its own activation row and weight row: batch-invariant.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "cpu_features.h"
#include "genserve_ops.h"
#include "int_dot.h"
#include "kquant_rows.h"
#include "moe_grouping.h"
#include "vec_math.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

using genserve_kquant::KRowJob;
using genserve_kquant::KSegment;
using genserve_kquant::RunRows;

namespace {

// GGML type codes (gguf's GGMLQuantizationType).
constexpr int64_t kQ4_0 = 2;
constexpr int64_t kQ8_0 = 8;
constexpr int64_t kMXFP4 = 39;
// Not a GGML code: Q8_0 rows interleaved in groups of 16 (moe_q8_r16_row.inc).
constexpr int64_t kQ8_0R16 = 1008;
constexpr int64_t kR16Rows = 16;
constexpr int64_t kTileRows = 32;  // activation rows per pass over a weight row

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

struct Format {
  int64_t block = 0, bytes = 0;  // weights and bytes per block (0: not a type this op runs)
  bool k_quant = false;
  bool r16 = false;  // kQ8_0R16: whole groups of 16 rows, AVX512-VNNI only
};

Format format_of(int64_t type) {
  switch (type) {
    case kQ4_0:
      return {32, 18, false};
    case kQ8_0:
      return {32, 34, false};
    case kQ8_0R16:
      return {32, 34, false, true};
    case kMXFP4:
      return {32, 17, false};
    case 12:
      return {256, 144, true};  // Q4_K
    case 13:
      return {256, 176, true};  // Q5_K
    case 14:
      return {256, 210, true};  // Q6_K
    default:
      return {};
  }
}

// ---- Q8_0 / Q4_0 / MXFP4, float path ------------------------------------------------------
// One block of 32 weights dequantized into w[32] as gguf-py computes it, per format; the
// row loop below (float_rows) is the same for all of them.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

// Q8_0: w = d * q.
struct DecodeQ8_0 {
  static void block(const uint8_t* p, float* w) {
    const float d = half_at(p);
    const int8_t* q = reinterpret_cast<const int8_t*>(p + 2);
    for (int i = 0; i < 32; ++i) w[i] = d * static_cast<float>(q[i]);
  }
};

// Q4_0: w = d * (q - 8), low nibbles the first 16 weights, high nibbles the next 16.
struct DecodeQ4_0 {
  static void block(const uint8_t* p, float* w) {
    const float d = half_at(p);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * static_cast<float>((p[2 + i] & 0x0F) - 8);
      w[i + 16] = d * static_cast<float>((p[2 + i] >> 4) - 8);
    }
  }
};

// MXFP4: w = 2^(e - 128) * doubled e2m1 value, e the block's scale byte (e < 2: the
// subnormal scales 2^-128, 2^-127, built from their bits).
struct DecodeMxfp4 {
  static void block(const uint8_t* p, float* w) {
    static constexpr float kValues[16] = {0,  1,  2,  3,  4,  6,  8,  12,
                                          0, -1, -2, -3, -4, -6, -8, -12};
    const uint32_t e = p[0];
    const uint32_t bits = e < 2 ? (uint32_t{0x00200000} << e) : ((e - 1) << 23);
    float d;
    std::memcpy(&d, &bits, 4);
    for (int i = 0; i < 16; ++i) {
      w[i] = d * kValues[p[1 + i] & 0x0F];
      w[i + 16] = d * kValues[p[1 + i] >> 4];
    }
  }
};

// Weight rows [n0, n1) of j's one segment against its float activations, tiles of up to
// kTileRows activation rows per pass over a row: each block decoded once per tile (by
// Decode, a template argument so the decode inlines into the loop), its 32 weights
// multiplied into 16-lane accumulators, the lanes summed in order at the end.
template <typename Decode>
void float_rows(const KRowJob& j, int64_t n0, int64_t n1) {
  const KSegment& s = j.segments[0];
  const int64_t nb = j.k / 32;
  alignas(64) float w[32];
  v16 acc[kTileRows];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = s.data + n * s.row_bytes;
    for (int64_t m0 = 0; m0 < j.m; m0 += kTileRows) {
      const int64_t rows = std::min<int64_t>(kTileRows, j.m - m0);
      for (int64_t m = 0; m < rows; ++m) acc[m] = v16{};
      for (int64_t b = 0; b < nb; ++b) {
        Decode::block(row + b * s.block_bytes, w);
        const v16 w0 = *reinterpret_cast<const v16*>(w);
        const v16 w1 = *reinterpret_cast<const v16*>(w + 16);
        for (int64_t m = 0; m < rows; ++m) {
          const float* x = j.xf + (m0 + m) * j.k + b * 32;
          acc[m] += w0 * *reinterpret_cast<const v16u*>(x) +
                    w1 * *reinterpret_cast<const v16u*>(x + 16);
        }
      }
      for (int64_t m = 0; m < rows; ++m) {
        float sum = 0.0f;
        for (int i = 0; i < 16; ++i) sum += acc[m][i];
        j.store(m0 + m, n, sum);
      }
    }
  }
}

// The float rows of a block-of-32 type (Q8_0, Q4_0, MXFP4), or nullptr.
RunRows float_rows_for(int64_t type) {
  switch (type) {
    case kQ8_0:
      return &float_rows<DecodeQ8_0>;
    case kQ4_0:
      return &float_rows<DecodeQ4_0>;
    case kMXFP4:
      return &float_rows<DecodeMxfp4>;
    default:
      return nullptr;
  }
}

}  // namespace

#if defined(__x86_64__)

// ---- Q8_0 / Q4_0, integer path -------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")
namespace moeq_avx512vnni {
namespace {
inline __m256i dot32(__m256i w, __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}
#include "moe_quant_row.inc"
#include "moe_mxfp4_row.inc"
#include "moe_q8_r16_row.inc"
}  // namespace
RunRows run() { return &q_int_rows; }
RunRows run_mxfp4() { return &mxfp4_int_rows; }
RunRows run_r16() { return &r16_rows; }
}  // namespace moeq_avx512vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace moeq_avx2 {
namespace {
// u8 x s8 pairs in int16 (2 * 128 * 127 < 2^15: no saturation), then pairs of int16 in int32.
inline __m256i dot32(__m256i w, __m256i x) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
#include "moe_quant_row.inc"
#include "moe_mxfp4_row.inc"
}  // namespace
RunRows run() { return &q_int_rows; }
RunRows run_mxfp4() { return &mxfp4_int_rows; }
}  // namespace moeq_avx2
#pragma GCC pop_options

#endif  // __x86_64__

namespace {

bool has_avx512vnni() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return GENSERVE_CPU_SUPPORTS("avx512f") && GENSERVE_CPU_SUPPORTS("avx512bw") &&
         GENSERVE_CPU_SUPPORTS("avx512vl") && GENSERVE_CPU_SUPPORTS("avx512vnni");
#else
  return false;
#endif
}

bool has_avx2() { return genserve_cpu::has_avx2_fma_f16c(); }

// The Q8_0/Q4_0 (or, with `mxfp4`, MXFP4) integer rows for `isa` (int_dot.h's codes;
// AVX-VNNI runs the AVX2 code).
RunRows q_int_path(int64_t isa, bool mxfp4 = false) {
#if defined(__x86_64__)
  const bool vnni = has_avx512vnni();
  if ((isa == genserve_ops::kIntDotAuto || isa == genserve_ops::kIntDotAvx512Vnni ||
       isa == genserve_ops::kIntDotVnni256Evex) && vnni)
    return mxfp4 ? moeq_avx512vnni::run_mxfp4() : moeq_avx512vnni::run();
  if (isa != genserve_ops::kIntDotNone && has_avx2())
    return mxfp4 ? moeq_avx2::run_mxfp4() : moeq_avx2::run();
#endif
  (void)isa;
  (void)mxfp4;
  return nullptr;
}

// One projection's activations as its weight type's rows read them.
struct Acts {
  at::Tensor f;              // float32 [slots, K]
  at::Tensor q, d, sums;     // the integer path's int8 rows, scales, int16 sums of the q
  at::Tensor q_nibbles;      // K-quants: q in the AVX512-VNNI path's nibble order
  int64_t per_scale = 0;     // inputs per scale (32: Q8_0, 256: Q8_K)
  int64_t per_sum = 0;       // inputs per sum (32: Q8_0, for kQ8_0R16; 16: Q8_K)
};

// x [M, K] float32 as Q8_0 activations: per 32 inputs d = max|x| / 127, q = round(x / d),
// and Σq (kQ8_0R16's rows take their weights' + 128 back with it).
void quantize_q8_0(const at::Tensor& x, Acts& a) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  a.q = at::empty({M, K}, x.options().dtype(at::kChar));
  a.d = at::empty({M, nb}, x.options());
  a.sums = at::empty({M, nb}, x.options().dtype(at::kShort));
  a.per_scale = 32;
  a.per_sum = 32;
  const float* src = x.data_ptr<float>();
  int8_t* q = a.q.data_ptr<int8_t>();
  float* d = a.d.data_ptr<float>();
  int16_t* sums = a.sums.data_ptr<int16_t>();
  at::parallel_for(0, M * nb, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* v = src + t * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.0f;
      const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        q[t * 32 + i] = static_cast<int8_t>(
            std::min(127.0f, std::max(-127.0f, std::nearbyint(v[i] * inv))));
        sum += q[t * 32 + i];
      }
      d[t] = scale;
      sums[t] = static_cast<int16_t>(sum);  // |Σq| ≤ 32 · 127
    }
  });
}

Acts activations(const at::Tensor& x, const Format& f, bool integer) {
  Acts a;
  a.f = x;
  if (!integer) return a;
  if (f.k_quant) {
    std::tie(a.q, a.d, a.sums) = genserve_kquant::quantize_rows_q8k(x);
    // once per call here, not per task (m · K bytes; made whichever integer path runs)
    a.q_nibbles = genserve_kquant::nibble_ordered(a.q);
    a.per_scale = 256;
    a.per_sum = 16;
  } else {
    quantize_q8_0(x, a);
  }
  return a;
}

// Per-token activations `a` [T, ...] as per-slot ones: row s is token `slot_token[s]`'s.
Acts by_slot(const Acts& a, const at::Tensor& slot_token) {
  Acts out;
  out.per_scale = a.per_scale;
  out.per_sum = a.per_sum;
  out.f = a.f.index_select(0, slot_token);
  if (a.q.defined()) out.q = a.q.index_select(0, slot_token);
  if (a.q_nibbles.defined()) out.q_nibbles = a.q_nibbles.index_select(0, slot_token);
  if (a.d.defined()) out.d = a.d.index_select(0, slot_token);
  if (a.sums.defined()) out.sums = a.sums.index_select(0, slot_token);
  return out;
}

RunRows runner_for(int64_t type, const Format& f, int64_t isa) {
  if (f.r16) {  // packed for the AVX512-VNNI path only (moe_pack_q8_0_r16)
#if defined(__x86_64__)
    if ((isa == genserve_ops::kIntDotAuto || isa == genserve_ops::kIntDotAvx512Vnni) &&
        has_avx512vnni())
      return moeq_avx512vnni::run_r16();
#endif
    return nullptr;
  }
  if (isa == genserve_ops::kIntDotNone)
    return f.k_quant ? genserve_kquant::float_runner() : float_rows_for(type);
  return f.k_quant ? genserve_kquant::int_runner(isa) : q_int_path(isa, type == kMXFP4);
}

// One projection of every expert: weights [E, N, row bytes], its activations, its output.
struct Projection {
  const uint8_t* data;
  Format fmt;
  int64_t type, N, K, row_bytes;
  const Acts* acts;
  float* out;            // [slots, out_stride], this projection's first column
  int64_t out_stride;
  RunRows run;
};

struct Task {
  int proj;
  int64_t expert, n0, n1;
};

void add_tasks(std::vector<Task>& tasks, int proj, const Projection& p,
               const std::vector<int64_t>& counts) {
  // Each task streams ~64 KiB of one expert's blocks, in a whole number of the integer
  // path's groups of four weight rows (moe_quant_row.inc).
  // kQ8_0R16 rows come in whole groups of 16, ~192 KiB a task: with one group (34 KiB at
  // Qwen3-30B-A3B's width) a task, a one-row layer read its experts ~7% slower (the same
  // microbenchmark as moe_q8_r16_row.inc's prefetch; 8-9 tasks an expert and projection
  // still split a one-row step's 8 experts evenly over the threads).
  const int64_t unit = p.fmt.r16 ? kR16Rows : 4;
  const int64_t task_bytes = p.fmt.r16 ? int64_t{3} << 16 : int64_t{1} << 16;
  const int64_t rows = task_bytes / std::max<int64_t>(1, p.row_bytes);
  const int64_t band = std::max<int64_t>(unit, rows / unit * unit);
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0) continue;
    for (int64_t n = 0; n < p.N; n += band) tasks.push_back({proj, e, n, std::min(p.N, n + band)});
  }
}

void run_tasks(const std::vector<Task>& tasks, const Projection* projs,
               const std::vector<int64_t>& counts, const std::vector<int64_t>& starts) {
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Task& t = tasks[i];
      const Projection& p = projs[t.proj];
      const int64_t s = starts[t.expert];
      const Acts& a = *p.acts;
      const KSegment seg{p.data + t.expert * p.N * p.row_bytes, p.type, 0, p.N, p.fmt.bytes,
                         p.row_bytes};
      KRowJob job{};
      if (a.q.defined()) {
        job.xq = a.q.data_ptr<int8_t>() + s * p.K;
        if (a.q_nibbles.defined()) job.xq_nibble_order = a.q_nibbles.data_ptr<int8_t>() + s * p.K;
        job.xd = a.d.data_ptr<float>() + s * (p.K / a.per_scale);
        job.xsums = a.sums.defined() ? a.sums.data_ptr<int16_t>() + s * (p.K / a.per_sum) : nullptr;
      }
      job.xf = a.f.data_ptr<float>() + s * p.K;
      job.k = p.K;
      job.m = counts[t.expert];
      job.n = p.out_stride;
      job.segments = &seg;
      job.num_segments = 1;
      job.type = p.type;
      job.block_bytes = p.fmt.bytes;
      job.bias = nullptr;
      job.out = p.out + s * p.out_stride;
      p.run(job, t.n0, t.n1);
    }
  });
}

Format checked_format(const at::Tensor& w, int64_t type, int64_t K, const char* what) {
  const Format f = format_of(type);
  TORCH_CHECK(f.block > 0, "moe_experts_gguf: ", what, " has GGML type ", type,
              ", not Q8_0, Q4_0, MXFP4, Q4_K, Q5_K, Q6_K or packed Q8_0 (", kQ8_0R16,
              ")");
  TORCH_CHECK(K % f.block == 0, "moe_experts_gguf: ", what, "'s input width ", K,
              " is not a multiple of its block (", f.block, ")");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.size(2) == K / f.block * f.bytes,
              "moe_experts_gguf: ", what, " must be contiguous uint8 [E, N, ", K / f.block * f.bytes,
              "] for GGML type ", type);
  TORCH_CHECK(!f.r16 || w.size(1) % kR16Rows == 0, "moe_experts_gguf: ", what,
              " packed in groups of 16 rows has ", w.size(1), " rows");
  return f;
}

}  // namespace

namespace genserve_ops {

at::Tensor moe_experts_gguf(const at::Tensor& x, const at::Tensor& expert_ids,
                            const at::Tensor& expert_weights, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& down, at::IntArrayRef types,
                            int64_t isa, const std::optional<at::Tensor>& b13,
                            const std::optional<at::Tensor>& b2, double swiglu_alpha,
                            double swiglu_limit) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "moe_experts_gguf: x must be [tokens, hidden]");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0),
              "moe_experts_gguf: expert_ids must be [tokens, top_k]");
  TORCH_CHECK(expert_weights.sizes() == expert_ids.sizes(),
              "moe_experts_gguf: expert_weights must match expert_ids");
  TORCH_CHECK(types.size() == 3, "moe_experts_gguf: one GGML type per projection (gate, up, down)");
  TORCH_CHECK(gate.dim() == 3 && up.dim() == 3 && down.dim() == 3,
              "moe_experts_gguf: gate/up [E, L, bytes] and down [E, H, bytes] expected");
  const int64_t T = x.size(0), K = expert_ids.size(1), E = gate.size(0), H = x.size(1);
  const int64_t L = gate.size(1);
  TORCH_CHECK(up.size(0) == E && down.size(0) == E && up.size(1) == L && down.size(1) == H,
              "moe_experts_gguf: weight shapes do not match x");
  TORCH_CHECK(!b13.has_value() || b13->sizes() == at::IntArrayRef({E, 2 * L}),
              "moe_experts_gguf: b13 must be [E, 2L]");
  TORCH_CHECK(!b2.has_value() || b2->sizes() == at::IntArrayRef({E, H}),
              "moe_experts_gguf: b2 must be [E, H]");
  TORCH_CHECK(swiglu_limit >= 0.0,
              "moe_experts_gguf: swiglu_limit must be >= 0 (0: SiLU-gated)");
  const Format fg = checked_format(gate, types[0], H, "gate");
  const Format fu = checked_format(up, types[1], H, "up");
  const Format fd = checked_format(down, types[2], L, "down");
  const bool integer = isa != genserve_ops::kIntDotNone;
  const RunRows run_g = runner_for(types[0], fg, isa), run_u = runner_for(types[1], fu, isa),
                run_d = runner_for(types[2], fd, isa);
  TORCH_CHECK(run_g != nullptr && run_u != nullptr && run_d != nullptr,
              "moe_experts_gguf: this CPU has no integer path ", isa,
              " (or Q8_0 packed in groups of 16 on a path other than AVX512-VNNI)");

  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const at::Tensor wts = expert_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // Group the (token, choice) pairs by expert, tokens in order within each.
  const genserve_moe::ExpertGroups groups = genserve_moe::group_by_expert(id, T, K, E, "moe_experts_gguf");
  const std::vector<int64_t>& counts = groups.counts;
  const std::vector<int64_t>& starts = groups.starts;
  const std::vector<int64_t>& slot_of = groups.slot_of;
  const std::vector<int64_t>& token_of = groups.token_of;
  const int64_t slots = T * K;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor gu = at::empty({slots, 2 * L}, f32);
  at::Tensor act = at::empty({slots, L}, f32);
  at::Tensor ys = at::empty({slots, H}, f32);

  // gate | up: gu [slots, 2L].  Each token's input is quantized once (not once per expert it
  // chose: at one decode row that is 8 times the same row) and its rows then copied to the
  // token's slots; gate and up share them when their formats agree.
  const at::Tensor slot_token =
      at::from_blob(const_cast<int64_t*>(token_of.data()), {slots}, at::kLong);
  const Acts a_g = by_slot(activations(xf, fg, integer), slot_token);
  const Acts a_u =
      fu.k_quant == fg.k_quant ? a_g : by_slot(activations(xf, fu, integer), slot_token);
  const Projection gate_up[2] = {
      {gate.data_ptr<uint8_t>(), fg, types[0], L, H, gate.size(2), &a_g, gu.data_ptr<float>(),
       2 * L, run_g},
      {up.data_ptr<uint8_t>(), fu, types[1], L, H, up.size(2), &a_u, gu.data_ptr<float>() + L,
       2 * L, run_u}};
  std::vector<Task> tasks;
  add_tasks(tasks, 0, gate_up[0], counts);
  add_tasks(tasks, 1, gate_up[1], counts);
  run_tasks(tasks, gate_up, counts, starts);

  // act = silu(gate) * up, or gpt-oss's clamped SwiGLU on the biased gate/up: [slots, L]
  const at::Tensor b13f = b13.has_value() ? b13->to(at::kFloat).contiguous() : at::Tensor();
  const float* b13p = b13.has_value() ? b13f.data_ptr<float>() : nullptr;
  std::vector<int64_t> expert_of;
  if (b13p != nullptr) {
    expert_of.resize(slots);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t s = starts[e]; s < starts[e] + counts[e]; ++s) expert_of[s] = e;
  }
  const float lim = static_cast<float>(swiglu_limit), alpha = static_cast<float>(swiglu_alpha);
  float* gup = gu.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  at::parallel_for(0, slots, 16, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      float* g = gup + r * 2 * L;
      const float* u = g + L;
      float* a = ap + r * L;
      if (b13p != nullptr) {
        const float* bias = b13p + expert_of[r] * 2 * L;
        for (int64_t j = 0; j < 2 * L; ++j) g[j] += bias[j];
      }
      if (lim > 0.0f) {
        for (int64_t j = 0; j < L; ++j) {
          const float gj = std::min(g[j], lim);
          const float uj = std::min(std::max(u[j], -lim), lim);
          a[j] = (uj + 1.0f) * (gj / (1.0f + genserve::exp_approx(-alpha * gj)));
        }
        continue;
      }
      for (int64_t j = 0; j < L; ++j) a[j] = g[j] / (1.0f + genserve::exp_approx(-g[j])) * u[j];
    }
  });

  // down: ys [slots, H]
  const Acts a_d = activations(act, fd, integer);
  const Projection down_p[1] = {
      {down.data_ptr<uint8_t>(), fd, types[2], H, L, down.size(2), &a_d, ys.data_ptr<float>(), H,
       run_d}};
  tasks.clear();
  add_tasks(tasks, 0, down_p[0], counts);
  run_tasks(tasks, down_p, counts, starts);

  // out[t] = sum over k, in k order, of weights[t, k] * (ys[slot of (t, k)] + b2[expert])
  const at::Tensor b2f = b2.has_value() ? b2->to(at::kFloat).contiguous() : at::Tensor();
  const float* b2p = b2.has_value() ? b2f.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({T, H}, f32);
  float* op = out.data_ptr<float>();
  const float* yp = ys.data_ptr<float>();
  const float* wp = wts.data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* o = op + t * H;
      for (int64_t h = 0; h < H; ++h) o[h] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float w = wp[t * K + k];
        const float* y = yp + slot_of[t * K + k] * H;
        if (b2p != nullptr) {
          const float* bias = b2p + id[t * K + k] * H;
          for (int64_t h = 0; h < H; ++h) o[h] += w * (y[h] + bias[h]);
          continue;
        }
        for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
      }
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// Q8_0 expert rows [E, N, nb * 34] to kQ8_0R16's groups of 16 rows (moe_q8_r16_row.inc), or
// back with `unpack`: a permutation of the same bytes (quants + 128 when packed).
//
// Why words: the layout moves each row's quants in runs of 4 bytes (one quad of inputs), so
// the pack is a transpose of 32-bit words, [16 rows][8 quads] -> [8 quads][16 rows] per
// block, with the + 128 one XOR of 0x80808080 per word; a byte at a time it took ~10 s for
// a 4-layer Qwen3-30B-A3B file's 3 GB at load.  Each group's packed bytes are written in
// order (the 16 rows are 16 sequential read streams).
at::Tensor moe_pack_q8_0_r16(const at::Tensor& blocks, bool unpack) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
                  blocks.size(2) % 34 == 0 && blocks.size(1) % kR16Rows == 0,
              "moe_pack_q8_0_r16: blocks must be contiguous uint8 [E, N, nb * 34], N a "
              "multiple of 16");
  const int64_t groups = blocks.size(0) * blocks.size(1) / kR16Rows;
  const int64_t row_bytes = blocks.size(2), nb = row_bytes / 34;
  const int64_t group_bytes = kR16Rows * row_bytes;
  at::Tensor out = at::empty_like(blocks);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  constexpr uint32_t kFlip = 0x80808080u;  // q <-> q + 128 in each byte of a word
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* in = src + g * group_bytes;
      uint8_t* o = dst + g * group_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        // Packed: block b's 512 quant bytes (quad t, row r at 64 t + 4 r), then its 16 scales.
        uint8_t* packed_q = (unpack ? const_cast<uint8_t*>(in) : o) + b * 512;
        uint8_t* packed_d = (unpack ? const_cast<uint8_t*>(in) : o) + nb * 512 + b * 32;
        for (int64_t r = 0; r < kR16Rows; ++r) {
          // Plain: row r's block b, a float16 d then 32 quants.
          uint8_t* plain = (unpack ? o : const_cast<uint8_t*>(in)) + r * row_bytes + b * 34;
          uint32_t w[8];
          if (unpack) {
            std::memcpy(plain, packed_d + 2 * r, 2);
            for (int t = 0; t < 8; ++t) std::memcpy(&w[t], packed_q + 64 * t + 4 * r, 4);
            for (int t = 0; t < 8; ++t) w[t] ^= kFlip;
            std::memcpy(plain + 2, w, 32);
          } else {
            std::memcpy(packed_d + 2 * r, plain, 2);
            std::memcpy(w, plain + 2, 32);
            for (int t = 0; t < 8; ++t) w[t] ^= kFlip;
            for (int t = 0; t < 8; ++t) std::memcpy(packed_q + 64 * t + 4 * r, &w[t], 4);
          }
        }
      }
    }
  });
  return out;
}

}  // namespace genserve_ops

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("moe_experts_gguf(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor gate, "
        "Tensor up, Tensor down, int[] types, int isa=-1, Tensor? b13=None, Tensor? b2=None, "
        "float swiglu_alpha=0.0, float swiglu_limit=0.0) -> Tensor");
  m.def("moe_pack_q8_0_r16(Tensor blocks, bool unpack=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("moe_experts_gguf", &genserve_ops::moe_experts_gguf);
  m.impl("moe_pack_q8_0_r16", &genserve_ops::moe_pack_q8_0_r16);
}
