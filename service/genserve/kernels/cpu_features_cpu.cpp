// The ops that set and report the CPU features genserve's kernels treat as absent
// (cpu_features.h; kernels/cpu_features.py explains the mask).

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu_features.h"

namespace {

// Hide exactly `names` (an empty list: hide nothing).  An unknown name is refused, so a typo
// never silently measures the full CPU under an emulation's label.
void set_hidden_cpu_features(const std::vector<std::string>& names) {
  uint32_t mask = 0;
  for (const std::string& name : names) {
    const uint32_t bit = genserve_cpu::feature_bit(name.c_str());
    TORCH_CHECK(bit != 0, "set_hidden_cpu_features: ", name, " is not a feature that can be hidden");
    mask |= bit;
  }
  genserve_cpu::g_hidden.store(mask, std::memory_order_relaxed);
}

std::vector<std::string> hidden_cpu_features() {
  std::vector<std::string> names;
  const uint32_t mask = genserve_cpu::g_hidden.load(std::memory_order_relaxed);
  for (const auto& f : genserve_cpu::kHideable) {
    if (mask & f.bit) names.emplace_back(f.name);
  }
  return names;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(genserve, m) {
  m.def("set_hidden_cpu_features(str[] names) -> ()", &set_hidden_cpu_features);
  m.def("hidden_cpu_features() -> str[]", &hidden_cpu_features);
}
