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

// kHeadDim > 0 fixes the head size at compile time (the common 64 and 128), which lets the
// compiler keep a row's dot products in registers; 0 reads it from the tensors.
template <typename scalar_t, int64_t kHeadDim>
void decode_attention_kernel(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& block_table, const at::Tensor& context_lens,
                             double scale, int64_t window, at::Tensor& out) {
  const int64_t num_seqs = q.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : q.size(2);
  const int64_t num_kv_heads = kv_cache.size(1);
  const int64_t num_blocks = kv_cache.size(2);
  const int64_t block_size = kv_cache.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);

  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* cache_ptr = kv_cache.data_ptr<scalar_t>();
  const int64_t* table_ptr = block_table.data_ptr<int64_t>();
  const int64_t* lens_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t block_elems = block_size * head_dim;
  const int64_t v_offset = num_kv_heads * num_blocks * block_elems;  // cache[1] - cache[0]
  const float fscale = static_cast<float>(scale);

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
      const scalar_t* q_seq = q_ptr + (seq * num_heads + kv_head * group) * head_dim;
      to_float(q_seq, qf.data(), group * head_dim);
      for (auto& x : qf) x *= fscale;

      scores.assign(group * span, 0.0f);
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

      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * span;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < span; ++j) peak = std::max(peak, s[j]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < span; ++j) {
          s[j] = genserve::exp_approx(s[j] - peak);
          total += s[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < span; ++j) s[j] *= inv;
      }

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
                       double scale, int64_t window, at::Tensor& out) {
  if (head_dim == 64) {
    decode_attention_kernel<scalar_t, 64>(q, kv_cache, block_table, context_lens, scale, window,
                                          out);
  } else if (head_dim == 128) {
    decode_attention_kernel<scalar_t, 128>(q, kv_cache, block_table, context_lens, scale,
                                           window, out);
  } else {
    decode_attention_kernel<scalar_t, 0>(q, kv_cache, block_table, context_lens, scale, window,
                                         out);
  }
}

}  // namespace

// Entry points, also called directly by decode_layer_cpu.cpp (genserve_ops.h).
namespace genserve_ops {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& block_table, const at::Tensor& context_lens,
                                  double scale, int64_t window) {
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
  const auto q_c = q.contiguous();
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
  auto out = at::empty_like(q_c);
  const int64_t head_dim = q.size(2);
  switch (q.scalar_type()) {
    case at::kFloat:
      dispatch_head_dim<float>(head_dim, q_c, kv_cache, table_c, lens_c, scale, window, out);
      break;
    case at::kBFloat16:
      dispatch_head_dim<c10::BFloat16>(head_dim, q_c, kv_cache, table_c, lens_c, scale, window,
                                       out);
      break;
    case at::kHalf:
      dispatch_head_dim<c10::Half>(head_dim, q_c, kv_cache, table_c, lens_c, scale, window, out);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
  return out;
}

}  // namespace genserve_ops

TORCH_LIBRARY(genserve, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, "
      "Tensor context_lens, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) {
  m.impl("paged_decode_attention", &genserve_ops::paged_decode_attention);
}
