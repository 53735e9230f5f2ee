// Tasks [0, n) spread over the OpenMP threads as shares that an idle thread helps finish.
//
// Why not at::parallel_for's static split: a decode step's matvec gives each of T threads one
// contiguous 1/T of the weight rows and ends at a join, so the slowest thread sets its time.
// On a serving machine a thread is often slower: the gRPC and engine threads run on the same
// few cores and preempt an OpenMP worker for tens to hundreds of microseconds, and the rows
// of a fused projection differ in cost (Q4_K_M's QKV: Q4_K q/k rows, 144 bytes a block, then
// Q6_K v rows, 210).  The other threads then spin at the join while memory idles.  Here each
// thread still owns one contiguous share and walks it front to back in chunks (so, when
// nothing disturbs it, each streams the same band of W as with the static split), but a
// thread that finishes its share takes the remaining chunks of the others' (llama.cpp's
// matmul claims chunks from a shared counter the same way).
//
// Which thread computes a task never changes its result: the callers' tasks are independent
// output rows whose arithmetic does not depend on the range they are run in.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace genserve_shares {

// One thread's share: chunks [next, end) not yet claimed (its own cache line: the owner and
// a helper update it, the other shares' owners never touch it).
struct alignas(64) Share {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

// f(begin, end) over [0, n) in chunks of `chunk` tasks (the last one shorter); runs inline
// on one thread, or when called inside a parallel region.
template <class F>
void parallel_shares(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  const std::unique_ptr<Share[]> shares(new Share[threads]);
  for (int64_t t = 0; t < threads; ++t) {
    shares[t].next.store(t * chunks / threads, std::memory_order_relaxed);
    shares[t].end = (t + 1) * chunks / threads;
  }
  // grain 1 over [0, threads): each OpenMP thread gets one index, its share's.
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t self = first; self < last; ++self) {
      for (int64_t k = 0; k < threads; ++k) {  // its own share first, then the others'
        Share& s = shares[(self + k) % threads];
        for (int64_t c = s.next.fetch_add(1, std::memory_order_relaxed); c < s.end;
             c = s.next.fetch_add(1, std::memory_order_relaxed)) {
          f(c * chunk, std::min(n, (c + 1) * chunk));
        }
      }
    }
  });
}

}  // namespace genserve_shares
