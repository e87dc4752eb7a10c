// Dynamic work division for the CPU kernels: parallel_for_dynamic (issue 54).
//
// at::parallel_for splits [begin, end) statically: with T threads, thread t gets the t-th of T
// equal ranges. When another process takes one of the cores, the thread on it falls behind and
// every other thread finishes its share and then waits for it at the end of the region: the
// slowest thread sets the time of each of a forward's hundreds of regions. Here the threads
// instead take chunks of a few items from an atomic counter (as llama.cpp hands out its work): a
// thread that has its core takes more chunks, one that lost it takes fewer.
//
// The chunks run on a small persistent pool of our own (WorkerPool below), not in an OpenMP
// region: an OpenMP region ends at an implicit barrier, so even when one thread did every chunk
// it still waited there for the thread that lost its core to be scheduled again (a time slice,
// ms) before the region could end. In the pool the caller returns as soon as every CHUNK is done;
// a worker that wakes after the work is gone finds nothing to claim and goes back to sleep. Each
// region bumps a generation packed into the 64-bit chunk counter, and a worker claims a chunk by
// compare-and-swap only while the generation is the one it read, so a late worker never touches
// a finished region's state.
//
// Converting an at::parallel_for call:
//
//     at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) { ... });
//  -> radixserve::parallel_for_dynamic(n, grain, [&](int64_t begin, int64_t end) { ... });
//
// The body is then called once per CHUNK (several times per thread) rather than once per thread:
// per-thread scratch (std::vector) allocated at the top of the body is allocated per chunk. That
// is cheap next to a chunk of attention or GEMM work; for very light items raise `grain`.
// at::get_thread_num() inside the body is a distinct id in [0, at::get_num_threads()) per
// running thread (0 the caller), as with at::parallel_for. The body must not depend on which
// thread runs which items (an item's result must not depend on the thread), which also keeps
// results independent of the thread count and of the division.
//
// The division is chosen at run time (set_division, exposed to Python as
// cpu_kernels.set_parallel_division), so one process can time them in turns:
//   pool    the worker pool (default on Linux);
//   omp     the same chunks inside `#pragma omp parallel` (the previous division, kept to compare);
//   static  at::parallel_for (also RADIXSERVE_PARALLEL_STATIC=1, as before).
// RADIXSERVE_PARALLEL_DIVISION=pool|omp|static sets the initial one.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __linux__
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#define RADIXSERVE_HAVE_POOL 1
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RADIXSERVE_CPU_RELAX() _mm_pause()
#else
#define RADIXSERVE_CPU_RELAX() std::this_thread::yield()
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

// ---- which division --------------------------------------------------------------------------
enum class Division : int { kPool = 0, kOmp = 1, kStatic = 2 };

inline Division initial_division() {
  const char* st = std::getenv("RADIXSERVE_PARALLEL_STATIC");
  if (st != nullptr && st[0] != '\0' && st[0] != '0') return Division::kStatic;
  const char* v = std::getenv("RADIXSERVE_PARALLEL_DIVISION");
  if (v != nullptr && std::strcmp(v, "omp") == 0) return Division::kOmp;
  if (v != nullptr && std::strcmp(v, "static") == 0) return Division::kStatic;
#ifdef RADIXSERVE_HAVE_POOL
  return Division::kPool;
#else
  return Division::kOmp;  // no futex: the OpenMP division
#endif
}

// One per loaded module (an inline function's static: the translation units of one .so share it).
inline std::atomic<int>& division_state() {
  static std::atomic<int> d{static_cast<int>(initial_division())};
  return d;
}
inline Division division() { return static_cast<Division>(division_state().load(std::memory_order_relaxed)); }
inline void set_division(Division d) {
#ifndef RADIXSERVE_HAVE_POOL
  if (d == Division::kPool) d = Division::kOmp;
#endif
  division_state().store(static_cast<int>(d), std::memory_order_relaxed);
}
// Kept for callers of the old name: whether the static division is in use.
inline bool static_division() { return division() == Division::kStatic; }

// ---- a test-only stall: thread `id` blocks on entering its next region until released -------
// Lets a test stall one thread the way a lost core does, in either division (the pool's worker
// wakes and stalls before claiming a chunk; an OpenMP team member stalls at the region's start).
struct TestHold {
  std::atomic<int> armed_id{-1};
  std::atomic<int> armed_division{0};  // only that division's thread `id` stalls
  std::atomic<bool> held{false};
  std::atomic<bool> released{true};
};
inline TestHold& test_hold() {
  static TestHold h;
  return h;
}
inline void test_hold_thread(int id) {
  test_hold().released.store(false);
  test_hold().armed_division.store(static_cast<int>(division()));
  test_hold().armed_id.store(id);
}
inline void test_release_thread() {
  test_hold().armed_id.store(-1);
  test_hold().released.store(true);
}
inline bool test_thread_held() { return test_hold().held.load(); }
inline void test_hold_point(int id, Division d) {
  TestHold& h = test_hold();
  int expected = id;
  if (h.armed_id.load(std::memory_order_relaxed) != id || h.armed_division.load() != static_cast<int>(d) ||
      !h.armed_id.compare_exchange_strong(expected, -1))
    return;
  h.held.store(true);
  while (!h.released.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  h.held.store(false);
}

// Set while a thread runs a chunk of a region of ours: a nested parallel_for_dynamic runs serially.
inline bool& in_region_flag() {
  static thread_local bool in_region = false;
  return in_region;
}

#ifdef RADIXSERVE_HAVE_POOL
// ---- the worker pool ---------------------------------------------------------------------------
class WorkerPool {
 public:
  // The process's pool (per loaded module). Never destroyed: its workers are detached and sleep
  // in the kernel at exit, so there is nothing to join and no destructor racing them at teardown.
  // A forked child gets a fresh, empty pool (the parent's workers do not exist there).
  static WorkerPool& instance() {
    static std::atomic<WorkerPool*>& slot = init_slot();
    return *slot.load(std::memory_order_acquire);
  }

  // fn(begin, end) over [0, n) in `chunks` chunks of `chunk` items, on the caller (thread id 0)
  // and workers 1..nthreads-1. False when the pool cannot take the region (another thread's
  // region is running, or a worker could not be started): the caller divides it another way.
  template <typename F>
  bool run(int64_t n, int64_t chunk, int64_t chunks, int nthreads, const F& fn) {
    if (chunks >= kClosed) return false;
    std::unique_lock<std::mutex> lock(region_mutex_, std::try_to_lock);
    if (!lock.owns_lock() || !ensure_workers(nthreads - 1)) return false;
    struct Ctx {
      int64_t n, chunk;
      const F* fn;
    } ctx{n, chunk, &fn};
    const ChunkFn thunk = [](const void* p, int64_t c) {
      const Ctx& x = *static_cast<const Ctx*>(p);
      (*x.fn)(c * x.chunk, std::min(x.n, (c + 1) * x.chunk));
    };
    const uint32_t g = ++generation_;
    // Close the counter under the new generation BEFORE rewriting the region's fields: a worker
    // that reads any new field value then fails its compare-and-swap against an old generation.
    next_.store(pack(g, kClosed), std::memory_order_relaxed);
    fn_.store(thunk, std::memory_order_release);
    ctx_.store(&ctx, std::memory_order_release);
    chunks_.store(static_cast<uint32_t>(chunks), std::memory_order_release);
    active_.store(nthreads, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    failed_.store(false, std::memory_order_relaxed);
    error_ = nullptr;
    next_.store(pack(g, 0), std::memory_order_release);  // open: chunks may be claimed
    wake_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex_wake_all(&wake_);
    work(0);
    wait_done(static_cast<uint32_t>(chunks));
    if (failed_.load(std::memory_order_acquire)) std::rethrow_exception(error_);
    return true;
  }

 private:
  using ChunkFn = void (*)(const void*, int64_t);
  static constexpr uint32_t kClosed = 0xFFFFFFFFu;
  // Spin this long before sleeping on the futex: a region that follows at once (the next layer's
  // kernel) finds its workers awake, while an idle pool leaves the cores to torch's own threads.
  static constexpr auto kSpin = std::chrono::microseconds(50);

  static uint64_t pack(uint32_t g, uint32_t idx) { return (static_cast<uint64_t>(g) << 32) | idx; }

  static std::atomic<WorkerPool*>& init_slot() {
    static std::atomic<WorkerPool*> slot{[] {
      pthread_atfork(nullptr, nullptr, [] { init_slot().store(new WorkerPool(), std::memory_order_release); });
      return new WorkerPool();
    }()};
    return slot;
  }

  static void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
  }
  static void futex_wake_all(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
  }

  bool ensure_workers(int wanted) {
    try {
      // A new worker starts from the last published generation, so it takes part in the region
      // about to be published (its thread may start after the publish).
      const uint32_t seen = wake_.load(std::memory_order_relaxed);
      while (nworkers_ < wanted) {
        const int id = ++nworkers_;  // workers are 1..nworkers_
        std::thread([this, id, seen] { worker_main(id, seen); }).detach();
      }
    } catch (const std::system_error&) {  // no more threads: this region goes elsewhere
      --nworkers_;
      return false;
    }
    return true;
  }

  // Claim and run chunks of the open region until none is left (or this thread is not one of
  // its nthreads). A claim is a compare-and-swap of (generation, next chunk): it succeeds only
  // while the region whose fields were read is the open one, so the fields are valid and the
  // region cannot end before this chunk is counted done.
  void work(int id) {
    for (;;) {
      uint64_t cur = next_.load(std::memory_order_acquire);
      const ChunkFn fn = fn_.load(std::memory_order_acquire);
      const void* ctx = ctx_.load(std::memory_order_acquire);
      const uint32_t chunks = chunks_.load(std::memory_order_acquire);
      const int active = active_.load(std::memory_order_acquire);
      const uint32_t g = static_cast<uint32_t>(cur >> 32), idx = static_cast<uint32_t>(cur);
      if (idx >= chunks || id >= active) return;
      if (!next_.compare_exchange_weak(cur, cur + 1, std::memory_order_acq_rel, std::memory_order_relaxed)) continue;
      uint32_t finished = 1;
      {
        at::internal::ThreadIdGuard tid_guard(id);
        in_region_flag() = true;
        try {
          fn(ctx, idx);
        } catch (...) {
          if (!failed_.exchange(true, std::memory_order_acq_rel)) error_ = std::current_exception();
          finished += cancel(g, chunks);
        }
        in_region_flag() = false;
      }
      // The last increment ends the region: after it this thread touches nothing of the region
      // (the caller's ctx may be gone), only the pool's own words.
      const uint32_t done = done_.fetch_add(finished, std::memory_order_seq_cst) + finished;
      if (done == chunks && caller_asleep_.load(std::memory_order_seq_cst) != 0) futex_wake_all(&done_);
    }
  }

  // After a chunk threw: take the rest of the region's chunks unrun, so the others stop at their
  // next claim. Returns how many were taken (they count as done).
  uint32_t cancel(uint32_t g, uint32_t chunks) {
    uint64_t cur = next_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t idx = static_cast<uint32_t>(cur);
      if (static_cast<uint32_t>(cur >> 32) != g || idx >= chunks) return 0;
      if (next_.compare_exchange_weak(cur, pack(g, chunks), std::memory_order_acq_rel, std::memory_order_acquire))
        return chunks - idx;
    }
  }

  // The caller, its own claims over: wait for the chunks other threads hold (not for the threads).
  void wait_done(uint32_t chunks) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0; done_.load(std::memory_order_acquire) < chunks; ++i) {
      if ((i & 63) != 63 || std::chrono::steady_clock::now() < until) {
        RADIXSERVE_CPU_RELAX();
        continue;
      }
      caller_asleep_.store(1, std::memory_order_seq_cst);
      const uint32_t d = done_.load(std::memory_order_seq_cst);
      if (d < chunks) futex_wait(&done_, d);
      caller_asleep_.store(0, std::memory_order_relaxed);
    }
  }

  void worker_main(int id, uint32_t seen) {
    for (;;) {
      seen = wait_wake(seen);
      test_hold_point(id, Division::kPool);
      work(id);
    }
  }

  // Spin for kSpin, then sleep on the futex, until a region newer than `seen` is published.
  uint32_t wait_wake(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
      const uint32_t w = wake_.load(std::memory_order_acquire);
      if (w != seen) return w;
      if ((i & 63) != 63 || std::chrono::steady_clock::now() < until) {
        RADIXSERVE_CPU_RELAX();
        continue;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (wake_.load(std::memory_order_seq_cst) == seen) futex_wait(&wake_, seen);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex region_mutex_;         // one region at a time; held by its caller
  uint32_t generation_ = 0;         // under region_mutex_
  int nworkers_ = 0;                // under region_mutex_
  std::atomic<uint64_t> next_{pack(0, kClosed)};  // [generation:32 | next chunk:32]
  std::atomic<ChunkFn> fn_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<uint32_t> chunks_{0};
  std::atomic<int> active_{0};      // the region's thread count: workers with id >= it sit out
  std::atomic<uint32_t> done_{0};   // chunks finished (futex word of a sleeping caller)
  std::atomic<uint32_t> wake_{0};   // the last published generation (futex word of sleeping workers)
  std::atomic<uint32_t> sleepers_{0};
  std::atomic<uint32_t> caller_asleep_{0};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;        // the first exception, set by whoever sets failed_
};
#endif  // RADIXSERVE_HAVE_POOL

// The previous division: the same chunks inside an OpenMP region (which ends at its barrier).
template <typename F>
void omp_dynamic(int64_t n, int64_t chunk, int64_t chunks, const F& fn) {
#ifdef _OPENMP
  std::atomic<int64_t> next{0};
  std::atomic_flag err_flag = ATOMIC_FLAG_INIT;
  std::exception_ptr eptr;
  // No num_threads clause, as at::internal::invoke_parallel (torch issue 32008: GOMP's pool).
#pragma omp parallel
  {
    at::internal::ThreadIdGuard tid_guard(omp_get_thread_num());
    test_hold_point(omp_get_thread_num(), Division::kOmp);
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
#else
  (void)chunk;
  (void)chunks;
  fn(0, n);
#endif
}

// fn(begin, end) over [0, n) in chunks taken from an atomic counter by at::get_num_threads()
// threads. Serial (one call, fn(0, n)) with one thread, one chunk, or inside a parallel region.
template <typename F>
void parallel_for_dynamic(int64_t n, int64_t grain, const F& fn) {
  if (n <= 0) return;
  const Division div = division();
  if (div == Division::kStatic) {
    at::parallel_for(0, n, grain, fn);
    return;
  }
  const int64_t nthreads = at::get_num_threads();
  const int64_t chunk = dynamic_chunk(n, grain, nthreads);
  const int64_t chunks = (n + chunk - 1) / chunk;
  if (nthreads <= 1 || chunks <= 1 || in_region_flag() || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
#ifdef RADIXSERVE_HAVE_POOL
  if (div == Division::kPool && WorkerPool::instance().run(n, chunk, chunks, static_cast<int>(nthreads), fn)) return;
#endif
  omp_dynamic(n, chunk, chunks, fn);
}

}  // namespace radixserve
