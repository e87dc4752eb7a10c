// Dynamic work division for the CPU kernels: parallel_for_dynamic (issue 54).
//
// at::parallel_for splits [begin, end) statically: with T threads, thread t gets the t-th of T
// equal ranges. When another process takes one of the cores, the thread on it falls behind and
// every other thread finishes its share and then waits (libgomp spins, then sleeps) for it at the
// end of the region: the slowest thread sets the time of each of a forward's hundreds of regions.
// Here the threads instead take chunks of a few items from an atomic counter (as llama.cpp hands
// out its work): a thread that has its core takes more chunks, one that lost it takes fewer, and
// the region ends about when the work is done.
//
// Converting an at::parallel_for call:
//
//     at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { ... });
//  -> radixserve::parallel_for_dynamic(n, grain, [&](int64_t begin, int64_t end) { ... });
//
// The body is then called once per CHUNK (several times per thread) rather than once per thread:
// per-thread scratch (std::vector) allocated at the top of the body is allocated per chunk. That
// is cheap next to a chunk of attention or GEMM work; for very light items raise `grain`.
// at::get_thread_num() inside the body is the OpenMP thread number, as with at::parallel_for.
// The body must not depend on which thread runs which items (an item's result must not
// depend on the thread), which also keeps results independent of the thread count.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>

#ifdef _OPENMP
#include <omp.h>
#endif

namespace radixserve {

// Chunks handed out per thread when there are items enough: a thread slowed to half speed then
// holds the region up by about one chunk (~1/kChunksPerThread of its share), not half of it.
constexpr int64_t kChunksPerThread = 8;

// The chunk size: at least `grain` items, and about kChunksPerThread chunks per thread.
inline int64_t dynamic_chunk(int64_t n, int64_t grain, int64_t nthreads) {
  const int64_t per = (n + nthreads * kChunksPerThread - 1) / (nthreads * kChunksPerThread);
  return std::max<int64_t>(std::max<int64_t>(grain, 1), per);
}

// RADIXSERVE_PARALLEL_STATIC=1 (read once) makes parallel_for_dynamic an at::parallel_for: the
// static division, for comparing the two (benchmarks/cpu/contention.py).
inline bool static_division() {
  static const bool on = [] {
    const char* v = std::getenv("RADIXSERVE_PARALLEL_STATIC");
    return v != nullptr && v[0] != '\0' && v[0] != '0';
  }();
  return on;
}

// fn(begin, end) over [0, n) in chunks taken from an atomic counter by torch's OpenMP threads.
// Serial (one call, fn(0, n)) with one thread, one chunk, or inside a parallel region already.
template <typename F>
void parallel_for_dynamic(int64_t n, int64_t grain, const F& fn) {
  if (n <= 0) return;
  if (static_division()) {
    at::parallel_for(0, n, grain, fn);
    return;
  }
  const int64_t nthreads = at::get_num_threads();
  const int64_t chunk = dynamic_chunk(n, grain, nthreads);
  const int64_t chunks = (n + chunk - 1) / chunk;
#ifdef _OPENMP
  if (nthreads > 1 && chunks > 1 && !at::in_parallel_region()) {
    std::atomic<int64_t> next{0};
    std::atomic_flag err_flag = ATOMIC_FLAG_INIT;
    std::exception_ptr eptr;
    // No num_threads clause, as at::internal::invoke_parallel (torch issue 32008: GOMP's pool).
#pragma omp parallel
    {
      at::internal::ThreadIdGuard tid_guard(omp_get_thread_num());
      try {
        for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
             c = next.fetch_add(1, std::memory_order_relaxed))
          fn(c * chunk, std::min(n, (c + 1) * chunk));
      } catch (...) {
        if (!err_flag.test_and_set()) eptr = std::current_exception();
        next.store(chunks, std::memory_order_relaxed);  // the others stop at their next chunk
      }
    }
    if (eptr) std::rethrow_exception(eptr);
    return;
  }
#endif
  fn(0, n);
}

}  // namespace radixserve
