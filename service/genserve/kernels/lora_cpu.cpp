// Multi-LoRA delta on CPU, BGMV style (punica): every row's delta in one op per projection.
//
//   lora_bgmv_(y, x, a, b, cols, row_slot)
//     for each row i with s = row_slot[i] >= 0:
//       v[k]  = sum_j a[s, k, j] * x[i, j]                    (shrink, k < R)
//       y[i, c] += sum_k v[k] * b[s, k, c]   for c in cols[s, k] = [lo, hi)   (expand)
//
// a: [S, R, in], b: [S, R, out] (B^T * scale, block-diagonal over the fused pieces, see
// genserve/model/lora.py), cols: [S, R, 2] int32 -- the non-zero columns of each rank row of
// b (lo == hi: an unused rank row, skipped in both halves), so q/k/v rows touch only their
// own columns and padding to the largest rank costs nothing.  x, y, a, b share one dtype
// (float32, bfloat16 or float16); sums are float32, y is rounded once per element.
//
// The torch path (gather, two bmm over padded segments, index_add) pays ~7 dispatched ops
// and a padded copy per projection; here a decode step's rows are one parallel loop, and
// each slot's A/B is read from cache once per row of that slot.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

template <typename T>
inline float to_f32(T x) {
  return static_cast<float>(x);
}

template <typename T>
void bgmv_rows(T* y, const T* x, const T* a, const T* b, const int32_t* cols,
               const int64_t* row_slot, int64_t rows, int64_t in, int64_t out, int64_t rank) {
  // One row is rank * (in + out) multiply-adds; a few rows per task keep small steps on one
  // thread (waking the pool costs more than it saves there).
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, rank * (in + out)));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in);
    std::vector<float> acc(out);
    std::vector<float> v(rank);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = row_slot[i];
      if (s < 0) continue;
      const T* xi = x + i * in;
      for (int64_t j = 0; j < in; ++j) xf[j] = to_f32(xi[j]);
      const T* as = a + s * rank * in;
      const T* bs = b + s * rank * out;
      const int32_t* cs = cols + s * rank * 2;
      int64_t lo_all = out, hi_all = 0;
      for (int64_t k = 0; k < rank; ++k) {
        v[k] = 0.0f;
        const int64_t lo = cs[2 * k], hi = cs[2 * k + 1];
        if (lo >= hi) continue;
        lo_all = std::min(lo_all, lo);
        hi_all = std::max(hi_all, hi);
        const T* ak = as + k * in;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < in; ++j) dot += to_f32(ak[j]) * xf[j];
        v[k] = dot;
      }
      if (lo_all >= hi_all) continue;  // this slot's adapter does not touch the projection
      for (int64_t c = lo_all; c < hi_all; ++c) acc[c] = 0.0f;
      for (int64_t k = 0; k < rank; ++k) {
        const int64_t lo = cs[2 * k], hi = cs[2 * k + 1];
        if (lo >= hi) continue;
        const float vk = v[k];
        const T* bk = bs + k * out;
#pragma omp simd
        for (int64_t c = lo; c < hi; ++c) acc[c] += vk * to_f32(bk[c]);
      }
      T* yi = y + i * out;
#pragma omp simd
      for (int64_t c = lo_all; c < hi_all; ++c) yi[c] = static_cast<T>(to_f32(yi[c]) + acc[c]);
    }
  });
}

at::Tensor lora_bgmv_(at::Tensor y, const at::Tensor& x, const at::Tensor& a,
                      const at::Tensor& b, const at::Tensor& cols, const at::Tensor& row_slot) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "lora_bgmv_: x/y rows");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(1) == b.size(1),
              "lora_bgmv_: a [S, R, in] and b [S, R, out]");
  TORCH_CHECK(a.size(2) == x.size(1) && b.size(2) == y.size(1), "lora_bgmv_: feature sizes");
  TORCH_CHECK(cols.scalar_type() == at::kInt && cols.dim() == 3 && cols.size(0) == a.size(0) &&
                  cols.size(1) == a.size(1) && cols.size(2) == 2,
              "lora_bgmv_: cols [S, R, 2] int32");
  TORCH_CHECK(row_slot.scalar_type() == at::kLong && row_slot.numel() == x.size(0),
              "lora_bgmv_: row_slot [rows] int64");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == y.scalar_type() &&
                  b.scalar_type() == y.scalar_type(),
              "lora_bgmv_: one dtype for x, y, a, b");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && a.is_contiguous() && b.is_contiguous() &&
                  cols.is_contiguous() && row_slot.is_contiguous(),
              "lora_bgmv_: contiguous tensors");
  const int64_t slots = a.size(0);
  const int64_t* rs = row_slot.data_ptr<int64_t>();
  for (int64_t i = 0; i < row_slot.numel(); ++i) {
    TORCH_CHECK(rs[i] < slots, "lora_bgmv_: row slot out of range");
  }
  const int64_t rows = x.size(0), in = x.size(1), out = y.size(1), rank = a.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "lora_bgmv_", [&] {
    bgmv_rows<scalar_t>(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
                        b.data_ptr<scalar_t>(), cols.data_ptr<int32_t>(), rs, rows, in, out,
                        rank);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("lora_bgmv_(Tensor(a!) y, Tensor x, Tensor a, Tensor b, Tensor cols, Tensor row_slot)"
        " -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("lora_bgmv_", &lora_bgmv_); }
