// Paged decode attention on CPU: one query token per sequence, keys and values read in place
// from the KV block pool.
//
// The portable torch path gathers every decode's blocks into a padded [heads, seqs, context,
// head_dim] copy, then runs two batched matmuls and a softmax: on the default model at 32
// decodes that costs as much as all of a layer's linear layers together (measured), mostly in
// the gather copy, the padding to the longest context and the small-matmul overheads.  Here
// each (sequence, KV head) pair is one task: its query heads' scores against the context,
// a float32 softmax, and the weighted sum of values, touching each cached row once.
//
// Head sizes 64 and 128 (a multiple of the vector width) take attend_vectorised: rows read in
// place, a block's kLanes scores reduced together, the next block prefetched (default model,
// 2 AVX-512 cores, float32: 32 sequences x 72 positions 306 -> 207 us a layer, x 2048
// 9.2 -> 7.1 ms; huge pages for the pool take another ~15% at 2048, worker/model_runner.py),
// each value row loaded once for several query heads and a context's last rows scored as a
// whole vector (the step of 32 float32 decodes of 40-104 positions: 50.8 -> 46.4 ms; with the
// weights streaming between layers the kernel's arithmetic does not overlap its memory
// reads, so cutting instructions cuts time even though the rows come from DRAM).
// Other head sizes stage each run as float32 rows and reduce one score at a time.  When
// there are fewer (sequence, KV head) tasks than threads can share evenly, long contexts
// are split in parts combined by their softmax statistics (split_attention: one stream,
// 2048 positions, 118 -> 105 us a layer, at the memory's bandwidth).
//
// Cache layout (TorchPagedAttention): [2, num_kv_heads, num_blocks, block_size, head_dim].
// Scores, softmax and accumulation are float32 whatever the storage dtype.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "genserve_ops.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "matvec_core.h"
#include "vec_math.h"

namespace {

inline void to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, sizeof(float) * n);
}

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  // bfloat16 is the high half of a float32: a shift, which the compiler vectorises.
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n) {
  // c10's conversions round to nearest even, as a torch .to(dtype) does.
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// Walks positions [first, context) of one KV head through the block table, one run of rows
// per block: converts the run to float32 into ``rows`` and calls visit(run_start - first, n).
template <typename scalar_t, typename Visit>
inline void for_each_run(const scalar_t* head, const int64_t* blocks, int64_t first,
                         int64_t context, int64_t block_size, int64_t head_dim, float* rows,
                         Visit&& visit) {
  for (int64_t pos = first; pos < context;) {
    const int64_t block = blocks[pos / block_size];
    const int64_t offset = pos % block_size;
    const int64_t n = std::min(block_size - offset, context - pos);
    to_float(head + (block * block_size + offset) * head_dim, rows, n * head_dim);
    visit(pos - first, n);
    pos += n;
  }
}

namespace vec = genserve_vec;

// Each of the `rows` rows of scores ([rows, span]) replaced by its softmax; with `peaks` and
// `totals`, each row's maximum and its sum of exp(score - maximum) are written there too.
// softcap > 0 first caps each (already scaled) score to softcap * tanh(score / softcap), as
// Gemma 2 does before its softmax.  sinks (or nullptr): row g's denominator also holds
// exp(sinks[g] - maximum), a key whose value is zero (gpt-oss's attention sinks).
inline void softmax_rows(float* scores, int64_t rows, int64_t span, float* peaks = nullptr,
                         float* totals = nullptr, float softcap = 0.0f,
                         const float* sinks = nullptr) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * span;
    if (softcap > 0.0f) {
      const float inv_cap = 1.0f / softcap;
      for (int64_t j = 0; j < span; ++j) s[j] = softcap * std::tanh(s[j] * inv_cap);
    }
    float peak = -std::numeric_limits<float>::infinity();
    // Lane-wise maxima first: one chain of compares along the row would wait on each other.
    int64_t j = 0;
    if (span >= vec::kLanes) {
      vec::f32v lanes = vec::load16(s);
      for (j = vec::kLanes; j + vec::kLanes <= span; j += vec::kLanes) {
        const vec::f32v x = vec::load16(s + j);
        lanes = lanes < x ? x : lanes;  // std::max's choice, lane by lane
      }
      for (int64_t i = 0; i < vec::kLanes; ++i) peak = std::max(peak, lanes[i]);
    }
    for (; j < span; ++j) peak = std::max(peak, s[j]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < span; ++j) {
      s[j] = genserve::exp_approx(s[j] - peak);
      total += s[j];
    }
    // std::exp: a sink far above the scores gives inf, and the weights 0, as it should.
    const float inv = 1.0f / (sinks == nullptr ? total : total + std::exp(sinks[g] - peak));
    for (int64_t j = 0; j < span; ++j) s[j] *= inv;
    if (peaks != nullptr) {
      peaks[g] = peak;
      totals[g] = total;
    }
  }
}

inline vec::f32v load_vec(const float* p) { return vec::load16(p); }
inline vec::f32v load_vec(const c10::BFloat16* p) { return vec::load16(p); }
inline vec::f32v load_vec(const c10::Half* p) { return vec::load_f16(p); }

// out[i] = the sum of the lanes of v[i], for kLanes vectors: a tree of pairwise shuffles
// and adds (each level halves the lanes a row still spans), ~3 instructions a row where
// reducing each vector on its own takes ~8.
inline vec::f32v sum_lanes_of_each(const vec::f32v* v) {
  using vec::f32v;
#if defined(__AVX512F__)
  f32v a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                   22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                   22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
#elif defined(__AVX2__)
  f32v a[4], b[2];
  for (int i = 0; i < 4; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  for (int i = 0; i < 2; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#else
  const f32v a0 = __builtin_shufflevector(v[0], v[1], 0, 1, 4, 5) +
                  __builtin_shufflevector(v[0], v[1], 2, 3, 6, 7);
  const f32v a1 = __builtin_shufflevector(v[2], v[3], 0, 1, 4, 5) +
                  __builtin_shufflevector(v[2], v[3], 2, 3, 6, 7);
  return __builtin_shufflevector(a0, a1, 0, 2, 4, 6) + __builtin_shufflevector(a0, a1, 1, 3, 5, 7);
#endif
}

// Asks for the KV block `block` of a head (its block_elems values) ahead of its use: the
// blocks of a sequence are scattered over the pool, so the prefetchers, which stop at page
// boundaries, cannot run ahead of the walk on their own.
template <typename scalar_t>
inline void prefetch_block(const scalar_t* head, int64_t block, int64_t block_elems) {
  const char* at = reinterpret_cast<const char*>(head + block * block_elems);
  for (int64_t b = 0; b < block_elems * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
    __builtin_prefetch(at + b);
  }
}

// Query heads whose value sums one pass over a block's value rows accumulates: their
// kHeadDim / kLanes vectors each stay in registers (at most 16 of the 32 AVX-512 ones, 8 of
// AVX2's 16), so each value row is loaded once for all of them and the heads' FMA chains run
// side by side instead of one head's chain of n rows after another's.
template <int64_t kHeadDim>
constexpr int64_t value_heads_at_once() {
  constexpr int64_t vecs = kHeadDim / vec::kLanes;
  constexpr int64_t budget = vec::kLanes == 16 ? 16 : 8;
  return vecs >= budget ? 1 : budget / vecs;
}

// acc[h] += sum over r < n of p[h * span + r] * rows[r], for kHeads query heads h.
template <typename scalar_t, int64_t kHeadDim, int64_t kHeads>
inline void add_values(const scalar_t* rows, int64_t n, const float* p, int64_t span,
                       float* acc) {
  constexpr int64_t kVecs = kHeadDim / vec::kLanes;
  vec::f32v a[kHeads][kVecs];
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t c = 0; c < kVecs; ++c)
      a[h][c] = vec::load16(acc + h * kHeadDim + c * vec::kLanes);
  for (int64_t r = 0; r < n; ++r) {
    vec::f32v v[kVecs];
    for (int64_t c = 0; c < kVecs; ++c) v[c] = load_vec(rows + r * kHeadDim + c * vec::kLanes);
    for (int64_t h = 0; h < kHeads; ++h) {
      const vec::f32v weight = vec::f32v{} + p[h * span + r];
      for (int64_t c = 0; c < kVecs; ++c) a[h][c] += weight * v[c];
    }
  }
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t c = 0; c < kVecs; ++c)
      std::memcpy(acc + h * kHeadDim + c * vec::kLanes, &a[h][c], sizeof(a[h][c]));
}

// add_values for the last `heads` (< kHeads) query heads of a group.
template <typename scalar_t, int64_t kHeadDim, int64_t kHeads>
inline void add_values_tail(int64_t heads, const scalar_t* rows, int64_t n, const float* p,
                            int64_t span, float* acc) {
  if constexpr (kHeads > 0) {
    if (heads == kHeads) return add_values<scalar_t, kHeadDim, kHeads>(rows, n, p, span, acc);
    add_values_tail<scalar_t, kHeadDim, kHeads - 1>(heads, rows, n, p, span, acc);
  }
}

// One (sequence, KV head) task with a head size fixed at compile time and a multiple of the
// vector width: keys and values are read where they lie in the pool (no float32 staging
// copy), each key or value row is loaded once for all `group` query heads that share it, and
// the next block is prefetched while one is processed.  qf: the group's queries, scaled
// ([group, kHeadDim]); scores: [group, span] scratch; acc: [group, kHeadDim] output; peaks
// and totals (or nullptr): each query head's softmax statistics (softmax_rows); sinks (or
// nullptr): the group's sink logits.
template <typename scalar_t, int64_t kHeadDim>
void attend_vectorised(const float* qf, int64_t group, const scalar_t* k_head,
                       const scalar_t* v_head, const int64_t* blocks, int64_t first,
                       int64_t context, int64_t block_size, float* scores, float* acc,
                       float* peaks = nullptr, float* totals = nullptr, float softcap = 0.0f,
                       const float* sinks = nullptr) {
  constexpr int64_t kVecs = kHeadDim / vec::kLanes;
  const int64_t span = context - first;
  const int64_t block_elems = block_size * kHeadDim;
  // Calls visit(rows of the run, its first position - first, n, room) for each run of
  // positions [first, context) within one block, prefetching the next run's block of
  // `head`; room (>= n) is the rows from the run's first to the end of its block.
  const auto runs = [&](const scalar_t* head, auto&& visit) {
    for (int64_t pos = first; pos < context;) {
      const int64_t offset = pos % block_size;
      const int64_t n = std::min(block_size - offset, context - pos);
      if (pos + n < context) prefetch_block(head, blocks[(pos + n) / block_size], block_elems);
      visit(head + blocks[pos / block_size] * block_elems + offset * kHeadDim, pos - first, n,
            block_size - offset);
      pos += n;
    }
  };
  runs(k_head, [&](const scalar_t* rows, int64_t start, int64_t n, int64_t room) {
    int64_t r = 0;
    // kLanes rows: scores as one vector.  A run's last rows take this path too where its
    // block holds kLanes rows from there (the last block of a context: the rows past the
    // context are allocated, their scores computed and dropped, each lane being one row's
    // own sum), instead of one reduction per row and query head.
    for (; r < n && r + vec::kLanes <= room; r += vec::kLanes) {
      const int64_t m = std::min<int64_t>(vec::kLanes, n - r);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qf + g * kHeadDim;
        vec::f32v qv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) qv[c] = vec::load16(q + c * vec::kLanes);
        vec::f32v dots[vec::kLanes];
        for (int64_t i = 0; i < vec::kLanes; ++i) {
          const scalar_t* row = rows + (r + i) * kHeadDim;
          vec::f32v dot = qv[0] * load_vec(row);
          for (int64_t c = 1; c < kVecs; ++c) dot += qv[c] * load_vec(row + c * vec::kLanes);
          dots[i] = dot;
        }
        const vec::f32v sums = sum_lanes_of_each(dots);
        std::memcpy(scores + g * span + start + r, &sums, m * sizeof(float));
      }
    }
    for (; r < n; ++r) {
      vec::f32v k[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) k[c] = load_vec(rows + r * kHeadDim + c * vec::kLanes);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qf + g * kHeadDim;
        vec::f32v dot = vec::load16(q) * k[0];
        for (int64_t c = 1; c < kVecs; ++c) dot += vec::load16(q + c * vec::kLanes) * k[c];
        scores[g * span + start + r] = vec::hsum(dot);
      }
    }
  });

  softmax_rows(scores, group, span, peaks, totals, softcap, sinks);

  for (int64_t i = 0; i < group * kHeadDim; ++i) acc[i] = 0.0f;
  runs(v_head, [&](const scalar_t* rows, int64_t start, int64_t n, int64_t) {
    constexpr int64_t kHeads = value_heads_at_once<kHeadDim>();
    int64_t g = 0;
    for (; g + kHeads <= group; g += kHeads) {
      add_values<scalar_t, kHeadDim, kHeads>(rows, n, scores + g * span + start, span,
                                             acc + g * kHeadDim);
    }
    add_values_tail<scalar_t, kHeadDim, kHeads - 1>(group - g, rows, n,
                                                    scores + g * span + start, span,
                                                    acc + g * kHeadDim);
  });
}


// Few sequences with long contexts give fewer (sequence, KV head) tasks than threads can
// share evenly (one stream of a model with 3 KV heads on 2 threads: 2 tasks on one, 1 on the
// other).  Their contexts are then split in parts of at least kMinPartLen positions, each
// part attended on its own, and the parts' results combined by their softmax statistics
// (flash-decoding's split-K).  Returns the parts per task, 1 when no split is worth it.
constexpr int64_t kMinPartLen = 256;
constexpr int64_t kTasksPerThread = 4;

inline int64_t split_count(const int64_t* lens, int64_t num_seqs, int64_t num_kv_heads,
                           int64_t window) {
  // The split depends on the batch and the thread count: batch-invariant mode keeps each
  // sequence's context in one part.
  if (genserve_ops::batch_invariant()) return 1;
  const int64_t tasks = num_seqs * num_kv_heads;
  const int64_t wanted = kTasksPerThread * at::get_num_threads();
  if (tasks >= wanted) return 1;
  int64_t longest = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    longest = std::max(longest, window > 0 ? std::min(lens[s], window) : lens[s]);
  }
  const int64_t by_threads = (wanted + tasks - 1) / tasks;
  const int64_t by_length = longest / kMinPartLen;
  return std::max<int64_t>(1, std::min(by_threads, by_length));
}

template <typename scalar_t, int64_t kHeadDim>
void split_attention(const scalar_t* q_ptr, int64_t q_stride, const scalar_t* cache_ptr,
                     const int64_t* table_ptr, const int64_t* lens_ptr, int64_t num_seqs,
                     int64_t num_heads, int64_t num_kv_heads, int64_t num_blocks,
                     int64_t block_size, int64_t max_blocks, float fscale, int64_t window,
                     float softcap, const float* sinks_ptr, int64_t parts, scalar_t* out_ptr) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t block_elems = block_size * kHeadDim;
  const int64_t v_offset = num_kv_heads * num_blocks * block_elems;
  const int64_t tasks = num_seqs * num_kv_heads;
  // Per (task, part): each query head's peak and total, then its [kHeadDim] normalised sum.
  const int64_t stride = group * (kHeadDim + 2);
  std::vector<float> partial(tasks * parts * stride);
  const auto bounds = [&](int64_t seq, int64_t part) {
    const int64_t context = lens_ptr[seq];
    const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
    // Parts of whole blocks' length: a block's rows stay in one part when first is aligned.
    const int64_t part_len = ((context - first + parts - 1) / parts + block_size - 1) /
                             block_size * block_size;
    const int64_t lo = std::min(context, first + part * part_len);
    return std::pair<int64_t, int64_t>{lo, std::min(context, lo + part_len)};
  };
  at::parallel_for(0, tasks * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * kHeadDim);
    std::vector<float> scores;
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t task = unit / parts, part = unit % parts;
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      float* peaks = partial.data() + unit * stride;
      float* totals = peaks + group;
      float* acc = totals + group;
      const auto [lo, hi] = bounds(seq, part);
      if (lo >= hi) {  // a short context has fewer parts: this one weighs nothing
        for (int64_t g = 0; g < group; ++g) totals[g] = 0.0f;
        continue;
      }
      to_float(q_ptr + seq * q_stride + kv_head * group * kHeadDim, qf.data(),
               group * kHeadDim);
      for (auto& x : qf) x *= fscale;
      scores.assign(group * (hi - lo), 0.0f);
      const scalar_t* k_head = cache_ptr + kv_head * num_blocks * block_elems;
      attend_vectorised<scalar_t, kHeadDim>(qf.data(), group, k_head, k_head + v_offset,
                                            table_ptr + seq * max_blocks, lo, hi, block_size,
                                            scores.data(), acc, peaks, totals, softcap);
    }
  });
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum(kHeadDim);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const float* first_part = partial.data() + task * parts * stride;
      for (int64_t g = 0; g < group; ++g) {
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < parts; ++p) {
          const float* unit = first_part + p * stride;
          if (unit[group + g] > 0.0f) peak = std::max(peak, unit[g]);
        }
        // Part p's normalised sum weighs total_p e^(peak_p - peak) over all parts' weights.
        float weight_sum = 0.0f;
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t p = 0; p < parts; ++p) {
          const float* unit = first_part + p * stride;
          if (unit[group + g] <= 0.0f) continue;
          const float weight = unit[group + g] * genserve::exp_approx(unit[g] - peak);
          weight_sum += weight;
          const float* acc = unit + 2 * group + g * kHeadDim;
          for (int64_t i = 0; i < kHeadDim; ++i) sum[i] += weight * acc[i];
        }
        // A sink joins the denominator once, after the parts (see softmax_rows).
        const float sink = sinks_ptr == nullptr
                               ? 0.0f
                               : std::exp(sinks_ptr[kv_head * group + g] - peak);
        const float inv = 1.0f / (weight_sum + sink);
        for (int64_t i = 0; i < kHeadDim; ++i) sum[i] *= inv;
        from_float(sum.data(), out_ptr + (seq * num_heads + kv_head * group + g) * kHeadDim,
                   kHeadDim);
      }
    }
  });
}

// kHeadDim > 0 fixes the head size at compile time (the common 64 and 128), which lets the
// compiler keep a row's dot products in registers; 0 reads it from the tensors.
template <typename scalar_t, int64_t kHeadDim>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& context_lens,
                             double scale, int64_t window, float softcap,
                             const float* sinks_ptr, at::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const int64_t q_stride = q.stride(0);  // q's rows may be a slice of a wider tensor
  const scalar_t* cache_ptr = kv_cache.data_ptr<scalar_t>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t block_elems = block_size * head_dim;
  const int64_t v_offset = num_kv_heads * num_blocks * block_elems;  // cache[1] - cache[0]
  const float fscale = static_cast<float>(scale);

  if constexpr (kHeadDim > 0 && kHeadDim % genserve_vec::kLanes == 0) {
    const int64_t parts = split_count(lens_ptr, num_seqs, num_kv_heads, window);
    if (parts > 1) {
      split_attention<scalar_t, kHeadDim>(q_ptr, q_stride, cache_ptr, table_ptr, lens_ptr,
                                          num_seqs, num_heads, num_kv_heads, num_blocks,
                                          block_size, max_blocks, fscale, window, softcap,
                                          sinks_ptr, parts, out_ptr);
      return;
    }
  }

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim);
    std::vector<float> acc(group * head_dim);
    std::vector<float> rows(block_elems);
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads;
      const int64_t kv_head = task % num_kv_heads;
      const int64_t context = lens_ptr[seq];
      // HF's sliding window keeps keys with q_pos - k_pos < window (q_pos = context - 1).
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      const int64_t span = context - first;
      const int64_t* blocks = table_ptr + seq * max_blocks;
      const scalar_t* k_head = cache_ptr + kv_head * num_blocks * block_elems;
      const scalar_t* v_head = k_head + v_offset;
      const scalar_t* q_seq = q_ptr + seq * q_stride + kv_head * group * head_dim;
      const float* sinks = sinks_ptr == nullptr ? nullptr : sinks_ptr + kv_head * group;
      to_float(q_seq, qf.data(), group * head_dim);
      for (auto& x : qf) x *= fscale;

      scores.assign(group * span, 0.0f);
      if constexpr (kHeadDim > 0 && kHeadDim % genserve_vec::kLanes == 0) {
        attend_vectorised<scalar_t, kHeadDim>(qf.data(), group, k_head, v_head, blocks, first,
                                              context, block_size, scores.data(), acc.data(),
                                              nullptr, nullptr, softcap, sinks);
        from_float(acc.data(), out_ptr + (seq * num_heads + kv_head * group) * head_dim,
                   group * head_dim);
        continue;
      }
      const auto runs = [&](const scalar_t* head, auto&& visit) {
        for_each_run(head, blocks, first, context, block_size, head_dim, rows.data(), visit);
      };
      runs(k_head, [&](int64_t start, int64_t n) {
        // Restated inside the lambda: a captured variable is not a compile-time constant.
        const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
        for (int64_t g = 0; g < group; ++g) {
          const float* q_row = qf.data() + g * head_dim;
          float* s = scores.data() + g * span + start;
          for (int64_t r = 0; r < n; ++r) {
            const float* k_row = rows.data() + r * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < head_dim; ++i) dot += q_row[i] * k_row[i];
            s[r] = dot;
          }
        }
      });

      softmax_rows(scores.data(), group, span, nullptr, nullptr, softcap, sinks);

      std::fill(acc.begin(), acc.end(), 0.0f);
      runs(v_head, [&](int64_t start, int64_t n) {
        for (int64_t g = 0; g < group; ++g) {
          const float* p = scores.data() + g * span + start;
          if constexpr (kHeadDim > 0) {
            // A fixed-size local accumulator lives in registers across the block's rows
            // (through acc it would be loaded and stored back for every row).
            float a[kHeadDim];
            std::copy_n(acc.data() + g * kHeadDim, kHeadDim, a);
            for (int64_t r = 0; r < n; ++r) {
              const float* v_row = rows.data() + r * kHeadDim;
#pragma omp simd
              for (int64_t i = 0; i < kHeadDim; ++i) a[i] += p[r] * v_row[i];
            }
            std::copy_n(a, kHeadDim, acc.data() + g * kHeadDim);
          } else {
            const int64_t head_dim = q.size(2);
            float* a = acc.data() + g * head_dim;
            for (int64_t r = 0; r < n; ++r) {
              const float* v_row = rows.data() + r * head_dim;
#pragma omp simd
              for (int64_t i = 0; i < head_dim; ++i) a[i] += p[r] * v_row[i];
            }
          }
        }
      });
      from_float(acc.data(), out_ptr + (seq * num_heads + kv_head * group) * head_dim,
                 group * head_dim);
    }
  });
}

template <typename scalar_t>
void dispatch_head_dim(int64_t head_dim, const at::Tensor& q, const at::Tensor& kv_cache,
                       const at::Tensor& block_table, const at::Tensor& context_lens,
                       double scale, int64_t window, float softcap, const float* sinks,
                       at::Tensor& out) {
  if (head_dim == 64) {
    decode_attention_kernel<scalar_t, 64>(q, kv_cache, block_table, context_lens, scale, window,
                                          softcap, sinks, out);
  } else if (head_dim == 128) {
    decode_attention_kernel<scalar_t, 128>(q, kv_cache, block_table, context_lens, scale,
                                           window, softcap, sinks, out);
  } else {
    decode_attention_kernel<scalar_t, 0>(q, kv_cache, block_table, context_lens, scale, window,
                                         softcap, sinks, out);
  }
}

}  // namespace

// Entry points, also called directly by decode_layer_cpu.cpp (genserve_ops.h).
namespace genserve_ops {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& context_lens,
                                  double scale, int64_t window, double softcap,
                                  const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(softcap >= 0.0, "softcap must be >= 0 (0: none)");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->dim() == 1 &&
                                     sinks->size(0) == q.size(1)),
              "sinks must be float32 [num_heads]");
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "kv_cache must be [2, num_kv_heads, num_blocks, block_size, head_dim]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(q.size(2) == kv_cache.size(4), "head_dim of q and kv_cache differ");
  TORCH_CHECK(q.size(1) % kv_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens must be int64");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) &&
                  context_lens.dim() == 1 && context_lens.size(0) == q.size(0),
              "block_table [num_seqs, max_blocks] and context_lens [num_seqs] expected");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  // decode_layer passes the Q heads of the rotated [tokens, Q + K heads, head_dim].
  const auto q_c = rows_in_place(q);
  const auto table_c = block_table.contiguous();
  const auto lens_c = context_lens.contiguous();
  // Out-of-range reads would be silent memory errors: check the table against the pool.
  const int64_t block_size = kv_cache.size(3);
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s) {
    TORCH_CHECK(lens[s] >= 1 && (lens[s] + block_size - 1) / block_size <= table_c.size(1),
                "context length ", lens[s], " of sequence ", s, " does not fit its block table");
  }
  const int64_t* table = table_c.data_ptr<int64_t>();
  for (int64_t i = 0; i < table_c.numel(); ++i) {
    TORCH_CHECK(table[i] >= 0 && table[i] < kv_cache.size(2), "block id ", table[i],
                " out of range [0, ", kv_cache.size(2), ")");
  }
  auto out = at::empty(q.sizes(), q.options());
  const int64_t head_dim = q.size(2);
  const auto cap = static_cast<float>(softcap);
  const at::Tensor sinks_c = sinks.has_value() ? sinks->contiguous() : at::Tensor();
  const float* sk = sinks.has_value() ? sinks_c.data_ptr<float>() : nullptr;
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(head_dim, q_c, kv_cache, table_c, lens_c, scale, window, cap, sk,
                               out);
      break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(head_dim, q_c, kv_cache, table_c, lens_c, scale, window,
                                       cap, sk, out);
      break;
    case at::kHalf:
      dispatch_head_dim<c10::Half>(head_dim, q_c, kv_cache, table_c, lens_c, scale, window, cap,
                                   sk, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

void set_batch_invariant(bool on) { g_batch_invariant.store(on, std::memory_order_relaxed); }

}  // namespace genserve_ops

TORCH_LIBRARY(genserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, "
      "Tensor context_lens, float scale, int window, float softcap=0.0, Tensor? sinks=None) "
      "-> Tensor");
  // No tensor argument to dispatch on: one kernel for every backend.
  m.def("set_batch_invariant(bool on) -> ()", &genserve_ops::set_batch_invariant);
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("paged_decode_attention", &genserve_ops::paged_decode_attention);
}
