// The (token, choice) pairs of a mixture-of-experts step grouped by expert, shared by the float
// expert op (moe_cpu.cpp) and the GGUF-block one (moe_quant_cpu.cpp): each expert's rows become
// one contiguous block of "slots", so its weights are read once for all of them.
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

namespace genserve_moe {

struct ExpertGroups {
  std::vector<int64_t> counts;   // [E] pairs routed to each expert
  std::vector<int64_t> starts;   // [E + 1] first slot of each expert's block
  std::vector<int64_t> slot_of;  // [T * K] the slot of pair i (token i / K, choice i % K)
  std::vector<int64_t> token_of; // [T * K] the token of each slot
};

// Pairs `id` [T * K] (expert ids, checked against E) grouped by expert, tokens in order within
// each; `op` names the caller in the error.
inline ExpertGroups group_by_expert(const int64_t* id, int64_t T, int64_t K, int64_t E,
                                    const char* op) {
  ExpertGroups g{std::vector<int64_t>(E, 0), std::vector<int64_t>(E + 1, 0),
                 std::vector<int64_t>(T * K), std::vector<int64_t>(T * K)};
  for (int64_t i = 0; i < T * K; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < E, op, ": expert id ", id[i], " out of range");
    ++g.counts[id[i]];
  }
  for (int64_t e = 0; e < E; ++e) g.starts[e + 1] = g.starts[e] + g.counts[e];
  std::vector<int64_t> next(g.starts.begin(), g.starts.end() - 1);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t s = next[id[i]]++;
    g.slot_of[i] = s;
    g.token_of[s] = i / K;
  }
  return g;
}

}  // namespace genserve_moe
