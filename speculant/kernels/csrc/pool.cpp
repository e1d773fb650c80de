// The kernels' thread pool (see pool.h for why it exists).
//
// Protocol. A job is published by writing its descriptor (fn, ctx, sizes) and then the claim word
// claim = generation << 32 | next_chunk, and finally bumping `generation`, which workers watch.
// Any thread claims chunk i by a CAS of claim from (g, i) to (g, i + 1), so a chunk runs once, and
// only while job g is open. When all chunks are done the caller closes the job (claim =
// (g, kClosed)) before it writes the next descriptor, with a release fence in between: a late
// worker that reads a descriptor field of a later job necessarily sees the job closed at its
// CAS, so it never runs a chunk with a mixed-up descriptor.
#include "pool.h"

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <pthread.h>
#include <strings.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace speculant {
namespace {

constexpr uint64_t kClosed = 0xFFFFFFFFu;
// Idle workers spin this long before sleeping: covers the gaps between the kernel calls of a
// forward (a few to tens of microseconds of Python), not the gaps between engine steps.
constexpr auto kSpin = std::chrono::microseconds(200);

thread_local bool in_chunk = false;  // nested parallel_for calls run inline

struct Pool {
  alignas(64) std::atomic<uint64_t> claim{kClosed};
  alignas(64) std::atomic<int64_t> done{0};
  alignas(64) std::atomic<uint32_t> generation{0};
  std::atomic<int> sleepers{0};
  // the job's descriptor; atomics because a late worker may read them while they are rewritten
  std::atomic<ChunkFn> fn{nullptr};
  std::atomic<const void*> ctx{nullptr};
  std::atomic<int64_t> n{0}, chunk{1}, num_chunks{0};
  std::atomic<int> num_workers{0};  // workers with index < num_workers take part in the job
  std::mutex caller;  // one job at a time; other callers run inline
  std::mutex error_mutex;
  std::exception_ptr error;
  int num_started = 0;  // worker threads created (guarded by `caller`)
  // A background job (`pool_warm`): its generation while it may still run (0: none), and the
  // memory it reads, as [begin, end) byte ranges with their running offsets (guarded by
  // `caller`; workers read them while the job runs, and it is closed before they change).
  uint32_t background = 0;
  std::vector<std::pair<const char*, int64_t>> warm_regions;
  std::vector<int64_t> warm_offsets;  // warm_offsets[i]: bytes of the regions before region i
  std::vector<at::Tensor> warm_tensors;  // the regions' owners, held while the job may run
};

// Claims and runs chunks of job `gen` until none is left.
void work(Pool& p, uint32_t gen) {
  const ChunkFn fn = p.fn.load(std::memory_order_acquire);
  const void* ctx = p.ctx.load(std::memory_order_acquire);
  const int64_t n = p.n.load(std::memory_order_acquire);
  const int64_t chunk = p.chunk.load(std::memory_order_acquire);
  const uint64_t num_chunks = static_cast<uint64_t>(p.num_chunks.load(std::memory_order_acquire));
  uint64_t c = p.claim.load(std::memory_order_acquire);
  for (;;) {
    if ((c >> 32) != gen || (c & kClosed) >= num_chunks) return;
    if (!p.claim.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel)) continue;
    const int64_t begin = static_cast<int64_t>(c & kClosed) * chunk;
    in_chunk = true;
    try {
      fn(ctx, begin, std::min(n, begin + chunk));
    } catch (...) {
      std::lock_guard<std::mutex> lock(p.error_mutex);
      if (!p.error) p.error = std::current_exception();
    }
    in_chunk = false;
    p.done.fetch_add(1, std::memory_order_acq_rel);
    c = p.claim.load(std::memory_order_acquire);
  }
}

void worker_loop(Pool& p, int index) {
  uint32_t seen = p.generation.load(std::memory_order_acquire);
  for (;;) {
    uint32_t gen = p.generation.load(std::memory_order_acquire);
    const auto spin_end = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0; gen == seen; ++i) {
      _mm_pause();
      if ((i & 63) == 63 && std::chrono::steady_clock::now() > spin_end) {
        p.sleepers.fetch_add(1, std::memory_order_seq_cst);
        p.generation.wait(seen, std::memory_order_seq_cst);
        p.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      }
      gen = p.generation.load(std::memory_order_acquire);
    }
    seen = gen;
    if (index < p.num_workers.load(std::memory_order_acquire)) work(p, gen);
  }
}

Pool* instance = nullptr;

Pool* pool() {
  // Never destroyed: detached workers may still be waiting on it at exit. A forked child has no
  // workers (threads do not survive fork), so it starts a fresh pool.
  static const bool registered = [] {
    instance = new Pool;
    pthread_atfork(nullptr, nullptr, [] { instance = new Pool; });
    return true;
  }();
  (void)registered;
  return instance;
}

void start_workers(Pool& p, int wanted) {
  for (; p.num_started < wanted; ++p.num_started) {
    std::thread(worker_loop, std::ref(p), p.num_started).detach();
  }
}

// Ends the background job, if one is open (the caller holds `caller`): chunks not yet claimed
// are dropped, and chunks under way (a few microseconds each) are waited for, so that the next
// job's descriptor is written after no worker reads this one's.
void close_background(Pool& p) {
  if (p.background == 0) return;
  const uint64_t c = p.claim.exchange((uint64_t{p.background} << 32) | kClosed,
                                      std::memory_order_acq_rel);
  const int64_t claimed = (c >> 32) == p.background
                              ? std::min<int64_t>(static_cast<int64_t>(c & kClosed),
                                                  p.num_chunks.load(std::memory_order_relaxed))
                              : 0;
  for (int i = 0; p.done.load(std::memory_order_acquire) < claimed; ++i) {
    if (i >= 2000) std::this_thread::yield();
    _mm_pause();
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  p.background = 0;
  p.warm_tensors.clear();  // no worker reads them any more
}

// Publishes a job (the caller holds `caller`, and the job before is closed): its descriptor,
// then the open claim word, then the generation the workers watch; returns that generation.
uint32_t publish(Pool& p, ChunkFn fn, const void* ctx, int64_t n, int64_t chunk,
                 int64_t num_chunks, int num_workers) {
  const uint32_t gen = p.generation.load(std::memory_order_relaxed) + 1;
  p.fn.store(fn, std::memory_order_relaxed);
  p.ctx.store(ctx, std::memory_order_relaxed);
  p.n.store(n, std::memory_order_relaxed);
  p.chunk.store(chunk, std::memory_order_relaxed);
  p.num_chunks.store(num_chunks, std::memory_order_relaxed);
  p.num_workers.store(num_workers, std::memory_order_relaxed);
  p.done.store(0, std::memory_order_relaxed);
  p.claim.store(uint64_t{gen} << 32, std::memory_order_release);
  p.generation.store(gen, std::memory_order_seq_cst);
  if (p.sleepers.load(std::memory_order_seq_cst) > 0) p.generation.notify_all();
  return gen;
}

constexpr int64_t kWarmChunkBytes = 64 * 1024;

// Reads one byte of every cache line of bytes [begin, end) of the warm regions (taken one
// after the other), so that they are in this core's caches and, evicted from there, in the
// shared last-level cache.
void warm_chunk(const void* ctx, int64_t begin, int64_t end) {
  const Pool& p = *static_cast<const Pool*>(ctx);
  const auto& offsets = p.warm_offsets;
  size_t r = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
  unsigned sink = 0;
  for (int64_t at = begin; at < end && r < p.warm_regions.size(); ++r) {
    const auto& [base, size] = p.warm_regions[r];
    const int64_t lo = at - offsets[r], hi = std::min<int64_t>(size, end - offsets[r]);
    for (int64_t i = lo; i < hi; i += 64) sink += static_cast<unsigned char>(base[i]);
    at = offsets[r] + hi;
  }
  static std::atomic<unsigned> keep{0};  // the loads must happen: their sum goes somewhere
  keep.fetch_add(sink, std::memory_order_relaxed);
}

// The pool, or torch's OpenMP threads (see pool.h): decided once, from the environment.
bool use_pool() {
  static const bool use = [] {
    if (const char* v = std::getenv("SPECULANT_POOL")) return std::string_view(v) != "0";
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy != nullptr && strcasecmp(policy, "passive") == 0;
  }();
  return use;
}

}  // namespace

int pool_threads() { return std::max(1, at::get_num_threads()); }

std::string thread_team() { return use_pool() ? "pool" : "openmp"; }

bool pool_warm(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
                "speculant::pool_warm: tensors must be contiguous CPU tensors");
  }
  const int threads = pool_threads();
  if (!use_pool() || threads == 1 || in_chunk || tensors.empty()) return false;
  Pool& p = *pool();
  std::unique_lock<std::mutex> lock(p.caller, std::try_to_lock);
  if (!lock.owns_lock()) return false;
  close_background(p);
  start_workers(p, threads - 1);
  p.warm_tensors.assign(tensors.begin(), tensors.end());
  p.warm_regions.clear();
  p.warm_offsets.assign(1, 0);
  for (const at::Tensor& t : p.warm_tensors) {
    if (t.nbytes() == 0) continue;
    p.warm_regions.emplace_back(static_cast<const char*>(t.data_ptr()), t.nbytes());
    p.warm_offsets.push_back(p.warm_offsets.back() + static_cast<int64_t>(t.nbytes()));
  }
  const int64_t n = p.warm_offsets.back();
  p.warm_offsets.pop_back();
  const int64_t num_chunks = (n + kWarmChunkBytes - 1) / kWarmChunkBytes;
  if (num_chunks == 0 || num_chunks >= int64_t{kClosed}) {
    p.warm_tensors.clear();
    return false;
  }
  // published as run_chunks publishes a job, but the caller neither takes part nor waits: the
  // workers read while the caller goes on, and the next job closes this one (close_background)
  p.background = publish(p, &warm_chunk, &p, n, kWarmChunkBytes, num_chunks, threads - 1);
  return true;
}

void run_chunks(int64_t n, int64_t chunk, ChunkFn fn, const void* ctx) {
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  if (!use_pool()) {
    // torch's OpenMP threads, statically split round-robin: thread i runs chunks i, i + T, ...
    // Callers list their costliest chunks first or mix costs along the range (attention puts a
    // 1-token run's partitions next to an 8-token run's); at::parallel_for's contiguous blocks
    // would give one thread all of the dear half (a 9-row verification step at context 3500:
    // attention 2x as long as 8 rows).
    const int64_t threads = std::min<int64_t>(pool_threads(), num_chunks);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t c = t; c < num_chunks; c += threads) {
          fn(ctx, c * chunk, std::min(n, (c + 1) * chunk));
        }
      }
    });
    return;
  }
  const int threads = pool_threads();
  if (threads == 1 || in_chunk || num_chunks >= int64_t{kClosed}) {
    fn(ctx, 0, n);
    return;
  }
  Pool& p = *pool();
  std::unique_lock<std::mutex> lock(p.caller, std::try_to_lock);
  if (!lock.owns_lock()) {
    fn(ctx, 0, n);
    return;
  }
  close_background(p);
  start_workers(p, threads - 1);
  // 1) publish
  const uint32_t gen = publish(p, fn, ctx, n, chunk, num_chunks, threads - 1);
  // 2) take part, then wait only for chunks that workers have claimed
  work(p, gen);
  for (int i = 0; p.done.load(std::memory_order_acquire) < num_chunks; ++i) {
    // a worker was descheduled in the middle of a chunk: let anything sharing our core run
    if (i >= 2000) std::this_thread::yield();
    _mm_pause();
  }
  // 3) close the job before the next descriptor can be written (see the protocol above)
  p.claim.store((uint64_t{gen} << 32) | kClosed, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (p.error) {
    std::exception_ptr error = p.error;
    p.error = nullptr;
    std::rethrow_exception(error);
  }
}

}  // namespace speculant
