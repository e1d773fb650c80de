// How the kernels split work between threads: a small work-sharing pool of their own, or torch's
// OpenMP threads (at::parallel_for).
//
// Why a pool: on a machine whose cores are shared with other processes, an OpenMP region ends
// only when every thread has run its static share, so whenever a core is busy elsewhere each
// region waits for our worker to get a time slice (milliseconds), 150 times per decode step
// (measured: a step 2-2.6x slower with 2 threads than with 1). Here work is split into chunks
// claimed one at a time from a shared counter; the calling thread claims chunks too, so if a
// worker is descheduled the caller simply does the work and waits only for chunks a worker
// actually started. Idle workers spin briefly (the next kernel call usually follows within
// microseconds), then sleep on a futex.
//
// Why not always: after each of torch's own parallel regions (a sampler's softmax over the
// vocabulary, say) libgomp's worker spins for milliseconds, on the very core our pool's worker
// needs; the two then share it, and multi-token steps lose up to 1.6x. So the pool is used when
// OMP_WAIT_POLICY=passive is in the environment (libgomp then sleeps at once; it reads the
// variable when torch is imported, so it must be set before that), and torch's OpenMP threads
// otherwise; SPECULANT_POOL=1 / 0 forces either. Both run the same chunks.
//
// Results never depend on which thread runs a chunk: every kernel computes each output element
// with the same instructions whoever computes it, so dynamic claiming keeps batch invariance.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace speculant {

using ChunkFn = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs fn(ctx, b, e) over [0, n) in chunks [i * chunk, min(n, (i + 1) * chunk)) (with torch's
// OpenMP threads, fn may get several consecutive chunks in one call), on the caller and up to
// at::get_num_threads() - 1 workers, and returns when all are done. Runs inline when called from
// inside a chunk or while another thread is using the pool. An exception thrown by a chunk is
// rethrown here (the other chunks still run).
void run_chunks(int64_t n, int64_t chunk, ChunkFn fn, const void* ctx);

// Number of threads a parallel_for may use (the caller included): at::get_num_threads().
int pool_threads();

// Who runs run_chunks' chunks in this process: "pool" (this file's work-sharing pool) or
// "openmp" (torch's OpenMP threads), decided once from the environment (see above).
std::string thread_team();

// Starts the pool's workers reading one byte of every cache line of `tensors` (contiguous, on
// the CPU; held until the job ends), in the background: returns at once, and the next parallel
// job (or warm) first ends what is left of it. So memory that a burst of kernel calls is about
// to read (a drafter head's weights, out of cache after the target's forward) comes into the
// caches while the calling thread runs other code. False (nothing started) without the pool,
// with one thread, inside a chunk, or while another thread uses the pool.
bool pool_warm(at::TensorList tensors);

template <typename F>
void parallel_for(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(chunk, 1);
  if (n <= chunk) {
    f(int64_t{0}, n);
    return;
  }
  run_chunks(
      n, chunk,
      [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); }, &f);
}

// A chunk size for `n` items that gives each of the pool's threads a few chunks to balance
// with, but never chunks smaller than `min_chunk` items (the cost of one claim is ~0.1 us).
inline int64_t balanced_chunk(int64_t n, int64_t min_chunk, int chunks_per_thread = 4) {
  const int64_t parts = int64_t{pool_threads()} * chunks_per_thread;
  return std::max<int64_t>(min_chunk, (n + parts - 1) / parts);
}

}  // namespace speculant
