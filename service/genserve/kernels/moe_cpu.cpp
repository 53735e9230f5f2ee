// A mixture-of-experts layer's routed experts as one op (model/moe.py):
//
//   out[t] = sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, k]
//
// with each expert's [gate | up] rows stacked in w13 [E, 2L, H] and its down projection in
// w2 [E, H, L] (L: this shard's slice of the expert width), stored in float32, bfloat16 or
// float16, every product accumulated in float32.  gpt-oss's experts add biases b13 [E, 2L]
// and b2 [E, H] to the two projections and replace silu(gate) * up by the clamped SwiGLU
// (up + 1) * gate * sigmoid(alpha * gate), gate clamped to <= limit and up to [-limit, limit]
// (swiglu_limit > 0).
//
// A step's (token, choice) pairs are grouped by expert, each expert's rows gathered into one
// contiguous block, and only the experts some token chose are read: at one row that is top-k
// of E experts (8 of 128 for a Qwen3-30B-A3B layer), so the cost is streaming those
// experts' weights once.  Both projections are cut into tasks of a few dozen weight rows of
// one expert and all tasks of all experts go to one parallel_for, so a step that hits 8
// experts and one that hits 100 both keep every core streaming.  Within a task each block
// of weight rows (kept in L1) is applied to the expert's rows a few at a time
// (matvec_core.h's register-blocked dot products), so weights are read from memory once
// however many of the step's rows chose that expert.  An expert that many rows chose
// (a long prefill) goes to torch's GEMM instead, where blocking for the cache pays.
//
// Each row's sums are computed the same way whatever else the step holds (the GEMM path is
// skipped under --deterministic), and the top-k outputs are added in k order.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "genserve_ops.h"
#include "matvec_core.h"
#include "moe_grouping.h"
#include "vec_math.h"

namespace {

using namespace genserve_vec;

// Rows of x per register block (accumulators: kRows * kOuts + kRows vector registers of
// the 32 AVX-512 / 16 AVX2 ones).
constexpr int kRows = kLanes >= 16 ? 4 : 2;
constexpr int kOuts = 4;
// An expert chosen by at least this many rows of a step runs through torch's GEMM.
constexpr int64_t kGemmRows = 48;

struct Task {
  int64_t expert;
  int64_t n0, n1;  // the weight rows [n0, n1) this task computes
};

// out[m, n] = x[m] . w[n] for m < M, n in [n0, n1); x [M, K] float32, w [N, K], out [M, N].
// The band is walked as kOuts sub-bands side by side (more streams in flight per core).
template <typename W>
void apply_band(const float* x, int64_t M, const W* w, int64_t K, int64_t N, int64_t n0,
                int64_t n1, float* out) {
  const int64_t per = (n1 - n0) / kOuts;
  int64_t m = 0;
  auto rows = [&]<int R>(std::integral_constant<int, R>) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    for (int64_t i = 0; i < per; ++i) dot_block<R, kOuts>(xm, w, K, N, n0 + i, om, per);
    for (int64_t n = n0 + kOuts * per; n < n1; ++n) dot_block<R, 1>(xm, w, K, N, n, om);
  };
  for (; m + kRows <= M; m += kRows) rows(std::integral_constant<int, kRows>{});
  for (; m < M; ++m) rows(std::integral_constant<int, 1>{});
}

// Every (expert, band of rows) task of one projection; experts in `skip` are left out.
std::vector<Task> tasks_for(const std::vector<int64_t>& counts, const std::vector<bool>& skip,
                            int64_t N, int64_t K, int64_t elem_size) {
  // Each task streams ~128 KiB of weights (a multiple of kOuts rows).
  int64_t band = std::max<int64_t>(kOuts, (1 << 17) / std::max<int64_t>(1, K * elem_size));
  band = (band + kOuts - 1) / kOuts * kOuts;
  std::vector<Task> tasks;
  for (int64_t e = 0; e < static_cast<int64_t>(counts.size()); ++e) {
    if (counts[e] == 0 || skip[e]) continue;
    for (int64_t n = 0; n < N; n += band) tasks.push_back({e, n, std::min(N, n + band)});
  }
  return tasks;
}

// The activation's options: b13 (or nullptr) the gate/up biases [E, 2L]; limit > 0: the
// clamped SwiGLU with alpha.
struct Act {
  const float* b13;
  float alpha, limit;
};

template <typename W>
void run_experts(const float* xs, const std::vector<int64_t>& counts,
                 const std::vector<int64_t>& starts, const W* w13, const W* w2, int64_t H,
                 int64_t L, float* gu, float* act, float* ys, const at::Tensor& w13_t,
                 const at::Tensor& w2_t, const Act& how) {
  const int64_t E = static_cast<int64_t>(counts.size());
  std::vector<bool> gemm(E, false);
  if (!genserve_ops::batch_invariant())
    for (int64_t e = 0; e < E; ++e) gemm[e] = counts[e] >= kGemmRows;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);

  // gate | up of every chosen expert's rows: gu [slots, 2L]
  const auto up_tasks = tasks_for(counts, gemm, 2 * L, H, sizeof(W));
  at::parallel_for(0, static_cast<int64_t>(up_tasks.size()), 1, [&](int64_t b, int64_t e_) {
    for (int64_t i = b; i < e_; ++i) {
      const Task& t = up_tasks[i];
      const int64_t s = starts[t.expert];
      apply_band(xs + s * H, counts[t.expert], w13 + t.expert * 2 * L * H, H, 2 * L, t.n0,
                 t.n1, gu + s * 2 * L);
    }
  });
  for (int64_t e = 0; e < E; ++e) {
    if (!gemm[e]) continue;
    const int64_t s = starts[e], n = counts[e];
    auto x_e = at::from_blob(const_cast<float*>(xs + s * H), {n, H}, f32);
    auto gu_e = at::from_blob(gu + s * 2 * L, {n, 2 * L}, f32);
    at::mm_out(gu_e, x_e, w13_t[e].to(at::kFloat).t());
  }

  // act = silu(gate) * up (or the clamped SwiGLU, on the biased gate/up): [slots, L]
  const int64_t slots = starts[E];
  std::vector<int64_t> expert_of(slots);
  for (int64_t e = 0; e < E; ++e)
    std::fill(expert_of.begin() + starts[e], expert_of.begin() + starts[e + 1], e);
  at::parallel_for(0, slots, 16, [&](int64_t b, int64_t e_) {
    for (int64_t r = b; r < e_; ++r) {
      float* g = gu + r * 2 * L;
      float* u = g + L;
      float* a = act + r * L;
      if (how.b13 != nullptr) {
        const float* bias = how.b13 + expert_of[r] * 2 * L;
        for (int64_t j = 0; j < 2 * L; ++j) g[j] += bias[j];
      }
      if (how.limit > 0.0f) {
        const float lim = how.limit, alpha = how.alpha;
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
  const auto down_tasks = tasks_for(counts, gemm, H, L, sizeof(W));
  at::parallel_for(0, static_cast<int64_t>(down_tasks.size()), 1, [&](int64_t b, int64_t e_) {
    for (int64_t i = b; i < e_; ++i) {
      const Task& t = down_tasks[i];
      const int64_t s = starts[t.expert];
      apply_band(act + s * L, counts[t.expert], w2 + t.expert * H * L, L, H, t.n0, t.n1,
                 ys + s * H);
    }
  });
  for (int64_t e = 0; e < E; ++e) {
    if (!gemm[e]) continue;
    const int64_t s = starts[e], n = counts[e];
    auto a_e = at::from_blob(act + s * L, {n, L}, f32);
    auto y_e = at::from_blob(ys + s * H, {n, H}, f32);
    at::mm_out(y_e, a_e, w2_t[e].to(at::kFloat).t());
  }
}

}  // namespace

namespace genserve_ops {

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& expert_ids,
                       const at::Tensor& expert_weights, const at::Tensor& w13,
                       const at::Tensor& w2, const std::optional<at::Tensor>& b13,
                       const std::optional<at::Tensor>& b2, double swiglu_alpha,
                       double swiglu_limit) {
  TORCH_CHECK(x.dim() == 2, "moe_experts: x must be [tokens, hidden]");
  TORCH_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == x.size(0),
              "moe_experts: expert_ids must be [tokens, top_k]");
  TORCH_CHECK(expert_weights.sizes() == expert_ids.sizes(),
              "moe_experts: expert_weights must match expert_ids");
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0),
              "moe_experts: w13 [E, 2L, H] and w2 [E, H, L] expected");
  const int64_t T = x.size(0), K = expert_ids.size(1), E = w13.size(0), H = x.size(1);
  const int64_t L = w13.size(1) / 2;
  TORCH_CHECK(w13.size(1) == 2 * L && w13.size(2) == H && w2.size(1) == H && w2.size(2) == L,
              "moe_experts: weight shapes do not match x");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "moe_experts: w13 and w2 dtypes differ");
  const auto wt = w13.scalar_type();
  TORCH_CHECK(wt == at::kFloat || wt == at::kBFloat16 || wt == at::kHalf,
              "moe_experts: weights must be float32, bfloat16 or float16");
  TORCH_CHECK(!b13.has_value() || b13->sizes() == at::IntArrayRef({E, 2 * L}),
              "moe_experts: b13 must be [E, 2L]");
  TORCH_CHECK(!b2.has_value() || b2->sizes() == at::IntArrayRef({E, H}),
              "moe_experts: b2 must be [E, H]");
  TORCH_CHECK(swiglu_limit >= 0.0, "moe_experts: swiglu_limit must be >= 0 (0: SiLU-gated)");
  const at::Tensor b13f = b13.has_value() ? b13->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor b2f = b2.has_value() ? b2->to(at::kFloat).contiguous() : at::Tensor();
  const Act how{b13.has_value() ? b13f.data_ptr<float>() : nullptr,
                static_cast<float>(swiglu_alpha), static_cast<float>(swiglu_limit)};
  const at::Tensor w13c = w13.contiguous(), w2c = w2.contiguous();
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor ids = expert_ids.to(at::kLong).contiguous();
  const at::Tensor wts = expert_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();

  // Group the (token, choice) pairs by expert, tokens in order within each.
  const genserve_moe::ExpertGroups groups = genserve_moe::group_by_expert(id, T, K, E, "moe_experts");
  const std::vector<int64_t>& counts = groups.counts;
  const std::vector<int64_t>& starts = groups.starts;
  const std::vector<int64_t>& slot_of = groups.slot_of;
  const std::vector<int64_t>& token_of = groups.token_of;
  const int64_t slots = T * K;
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor xs = at::empty({slots, H}, f32);
  at::Tensor gu = at::empty({slots, 2 * L}, f32);
  at::Tensor act = at::empty({slots, L}, f32);
  at::Tensor ys = at::empty({slots, H}, f32);
  const float* xp = xf.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, slots, 64, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s)
      std::memcpy(xsp + s * H, xp + token_of[s] * H, H * sizeof(float));
  });

  if (wt == at::kFloat) {
    run_experts(xsp, counts, starts, w13c.data_ptr<float>(), w2c.data_ptr<float>(), H, L,
                gu.data_ptr<float>(), act.data_ptr<float>(), ys.data_ptr<float>(), w13c, w2c, how);
  } else if (wt == at::kBFloat16) {
    run_experts(xsp, counts, starts, w13c.data_ptr<c10::BFloat16>(),
                w2c.data_ptr<c10::BFloat16>(), H, L, gu.data_ptr<float>(),
                act.data_ptr<float>(), ys.data_ptr<float>(), w13c, w2c, how);
  } else {
    run_experts(xsp, counts, starts, w13c.data_ptr<c10::Half>(), w2c.data_ptr<c10::Half>(), H,
                L, gu.data_ptr<float>(), act.data_ptr<float>(), ys.data_ptr<float>(), w13c, w2c,
                how);
  }

  // out[t] = sum over k, in k order, of weights[t, k] * (ys[slot of (t, k)] + b2[e])
  at::Tensor out = at::empty({T, H}, f32);
  float* op = out.data_ptr<float>();
  const float* yp = ys.data_ptr<float>();
  const float* wp = wts.data_ptr<float>();
  const float* b2p = b2.has_value() ? b2f.data_ptr<float>() : nullptr;
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

}  // namespace genserve_ops

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("moe_experts(Tensor x, Tensor expert_ids, Tensor expert_weights, Tensor w13, "
        "Tensor w2, Tensor? b13=None, Tensor? b2=None, float swiglu_alpha=0.0, "
        "float swiglu_limit=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("moe_experts", &genserve_ops::moe_experts); }
