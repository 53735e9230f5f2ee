// A mixture-of-experts router in one op: float32 logits, scoring, top-k and the weights, for
// every routing kind model/spec.py's RouterSpec describes (model/moe.py's `route`).
//
// Why ATen calls and not a hand-written loop: the result must be bit-identical to the Python
// router's (model/moe.py), which is the reference every test and the per-op path use.  torch's
// softmax and sigmoid are vectorised with their own exp, and its GEMM sums in its own order;
// a hand-written exp or dot would differ in the last bit now and then, and near a top-k tie
// that is a different expert.  So this file calls the same ATen ops in the same order on the
// same tensors; what goes away is their Python (at one stream ~6 ops a layer, each ~10-20 µs
// of interpreter and dispatch around a few µs of work).  decode_layer_cpu.cpp's
// decode_moe_layer calls it between the attention half and the experts.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>

#include "genserve_ops.h"

namespace genserve_ops {

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x, const at::Tensor& router,
                                             const std::optional<at::Tensor>& router_bias,
                                             const std::optional<at::Tensor>& correction_bias,
                                             at::IntArrayRef routing, double scaling_factor) {
  TORCH_CHECK(routing.size() == kNumRouting, "moe_route: routing must hold ", kNumRouting,
              " values (scoring, top_k, renormalize, num_groups, topk_groups)");
  TORCH_CHECK(x.dim() == 2 && router.dim() == 2 && x.size(1) == router.size(1) &&
                  router.scalar_type() == at::kFloat,
              "moe_route: x [tokens, hidden] and a float32 router [experts, hidden] expected");
  const int64_t scoring = routing[kScoring], top_k = routing[kTopK];
  const bool renormalize = routing[kRenormalize] != 0;
  const int64_t num_groups = routing[kNumGroups], topk_groups = routing[kTopKGroups];
  TORCH_CHECK(top_k >= 1 && top_k <= router.size(0), "moe_route: top-", top_k, " of ",
              router.size(0), " experts");
  // F.linear(x.float(), router, bias): .float() is x itself when x is float32 already.
  const at::Tensor logits = at::linear(x.to(at::kFloat), router, router_bias);
  at::Tensor weights, ids;
  if (scoring == kTopKSoftmax) {
    std::tie(weights, ids) = at::topk(logits, top_k, -1);
    weights = at::softmax(weights, -1);
  } else if (scoring == kSoftmax) {
    const auto probs = at::softmax(logits, -1);
    std::tie(weights, ids) = at::topk(probs, top_k, -1);
    if (renormalize) weights = weights / weights.sum(-1, /*keepdim=*/true);
  } else {
    TORCH_CHECK(scoring == kSigmoid, "moe_route: unknown scoring ", scoring);
    const auto scores = logits.sigmoid();
    auto choice = correction_bias.has_value() ? scores + *correction_bias : scores;
    if (num_groups > 1) {
      const int64_t tokens = logits.size(0);
      TORCH_CHECK(logits.size(1) % num_groups == 0 && topk_groups <= num_groups,
                  "moe_route: ", logits.size(1), " experts in ", num_groups, " groups");
      const auto grouped = choice.view({tokens, num_groups, -1});
      const auto group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);  // [tokens, groups]
      const auto best = std::get<1>(at::topk(group_scores, topk_groups, -1, true, false));
      auto keep = at::zeros_like(group_scores).scatter_(1, best, 1.0).to(at::kBool);
      keep = keep.unsqueeze(-1).expand_as(grouped).reshape({tokens, -1});
      choice = choice.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
    }
    ids = std::get<1>(at::topk(choice, top_k, -1, true, false));
    weights = scores.gather(1, ids);
    if (renormalize) weights = weights / (weights.sum(-1, /*keepdim=*/true) + 1e-20);
  }
  if (scaling_factor != 1.0) weights = weights * scaling_factor;
  return {weights, ids};
}

}  // namespace genserve_ops

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("moe_route(Tensor x, Tensor router, Tensor? router_bias, Tensor? correction_bias, "
        "int[] routing, float scaling_factor) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(genserve, CPU, m) { m.impl("moe_route", &genserve_ops::moe_route); }
