// The CPU backend's thread pool for one call: a dynamically scheduled parallel loop.
#ifndef DUALKV_SRC_CPU_PARALLEL_H_
#define DUALKV_SRC_CPU_PARALLEL_H_

#include <cstdint>
#include <functional>

namespace dualkv::detail::cpu {

// Worker threads a call gets for `requested` (0 = all): capped at the hardware concurrency,
// since more threads than cores only add contention (the C ABI accepts any int32).
int32_t worker_count(int32_t requested);

// Runs fn(item) for item in [0, n) on up to worker_count(threads) threads, items handed out in
// order. Callers make every item write its own outputs, so results never depend on which thread
// ran an item nor on how many threads there were.
// - A thread that cannot be created (thread or memory limit) is not an error: the items run on
//   the threads that exist, the calling thread at least.
// - An exception thrown by fn stops the loop (items not yet started are skipped) and is rethrown
//   here once every thread has joined.
void parallel_for(int64_t n, int32_t threads, const std::function<void(int64_t)>& fn);

}  // namespace dualkv::detail::cpu

#endif  // DUALKV_SRC_CPU_PARALLEL_H_
