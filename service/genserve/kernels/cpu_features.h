// CPU features genserve's kernels may be told to treat as absent (GENSERVE_CPU_FEATURES_MASK,
// read by config.py, passed in by kernels/cpu.py through `set_hidden_cpu_features`), so that a
// machine with AVX-512 runs and measures the paths an AVX2-only CPU (AMD Zen 3) or an AVX-512
// CPU without VNNI / bfloat16 would take.  Testing and benchmarking only: nothing hidden by
// default, and hiding a feature can only remove paths, never add one the CPU cannot run.
//
// Every run-time choice of an instruction set asks GENSERVE_CPU_SUPPORTS(name) instead of
// __builtin_cpu_supports(name) (which needs a string literal, hence the macro).
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

namespace genserve_cpu {

// One bit per feature that can be hidden; the names are GCC's __builtin_cpu_supports names.
struct HideableFeature {
  const char* name;
  uint32_t bit;
};
inline constexpr HideableFeature kHideable[] = {
    {"avx512f", 1u << 0},   {"avx512bw", 1u << 1},    {"avx512vl", 1u << 2},
    {"avx512vnni", 1u << 3}, {"avx512bf16", 1u << 4}, {"avxvnni", 1u << 5},
    {"amx-tile", 1u << 6},  {"amx-int8", 1u << 7},    {"amx-bf16", 1u << 8},
    {"gfni", 1u << 9},
};

inline std::atomic<uint32_t> g_hidden{0};

// The bit of `name` (0 when it is not a hideable feature).
inline uint32_t feature_bit(const char* name) {
  for (const HideableFeature& f : kHideable) {
    if (std::strcmp(f.name, name) == 0) return f.bit;
  }
  return 0;
}

inline bool hidden(const char* name) {
  const uint32_t mask = g_hidden.load(std::memory_order_relaxed);
  return mask != 0 && (mask & feature_bit(name)) != 0;
}

}  // namespace genserve_cpu

#define GENSERVE_CPU_SUPPORTS(feature) \
  (__builtin_cpu_supports(feature) && !genserve_cpu::hidden(feature))

namespace genserve_cpu {

// What the plain AVX2 paths need (x86-64-v3's AVX2, FMA and F16C), after the mask.
inline bool has_avx2_fma_f16c() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  return GENSERVE_CPU_SUPPORTS("avx2") && GENSERVE_CPU_SUPPORTS("fma") &&
         GENSERVE_CPU_SUPPORTS("f16c");
#else
  return false;
#endif
}

}  // namespace genserve_cpu
