#include "cpu/parallel.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <new>
#include <system_error>
#include <thread>
#include <vector>

namespace dualkv::detail::cpu {

int32_t worker_count(int32_t requested) {
  const int32_t cores = static_cast<int32_t>(std::max(1u, std::thread::hardware_concurrency()));
  return requested > 0 ? std::min(requested, cores) : cores;
}

void parallel_for(int64_t n, int32_t threads, const std::function<void(int64_t)>& fn) {
  const int64_t workers = std::min<int64_t>(worker_count(threads), n);
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto body = [&]() noexcept {
    try {
      for (int64_t i = next.fetch_add(1); i < n && !failed.load(); i = next.fetch_add(1)) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex);
      if (!error) error = std::current_exception();
      failed = true;
    }
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(static_cast<size_t>(workers - 1));
    for (int64_t w = 1; w < workers; ++w) pool.emplace_back(body);
  } catch (const std::system_error&) {
    // Out of threads or of memory for a stack: run with the threads created so far.
  } catch (const std::bad_alloc&) {
  }
  body();
  for (std::thread& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace dualkv::detail::cpu
