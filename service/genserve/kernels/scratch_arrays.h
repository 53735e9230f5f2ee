// Per-call scratch arrays of the integer kernels (int_dot_cpu.cpp, kquant_cpu.cpp: a call's
// quantized activations).  Why: at one decode row each projection's three or four small
// at::empty allocations (and their frees) were a measurable part of its fixed cost at 135M
// sizes, where a layer's four projections take ~100 us; a buffer the calling thread keeps from
// call to call costs nothing after the first.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace genserve_scratch {

// Arrays up to this size come from the thread's kept buffers; larger ones (prefill-sized
// inputs) get a tensor of their own, so that no thread holds a prompt-sized buffer after the
// call.
constexpr int64_t kKeptBytes = int64_t{1} << 20;

// n values of T for the duration of one call: the calling thread's kept buffer number `Slot`
// (one per array a call uses at once), or `own`, set to a new tensor of `dtype`.
template <class T, int Slot>
T* array(int64_t n, at::Tensor& own, at::ScalarType dtype) {
  if (n * static_cast<int64_t>(sizeof(T)) <= kKeptBytes) {
    thread_local std::vector<T> kept;
    if (static_cast<int64_t>(kept.size()) < n) kept.resize(n);
    return kept.data();
  }
  own = at::empty({n}, at::TensorOptions().dtype(dtype));
  return own.data_ptr<T>();
}

}  // namespace genserve_scratch
