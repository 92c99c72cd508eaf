// Host helpers shared by every arch's launchers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>

namespace dualkv::cuda {

// Blocks of `kernel` that fit one SM with `smem` bytes of dynamic shared memory (at least 1).
template <typename Kernel>
int occupancy_blocks(Kernel kernel, int threads, size_t smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
  return n;
}

// Shared memory a block may opt into on the current device. DUALKV_CUDA_SMEM_LIMIT (bytes) lowers
// it: tests use it to run a kernel's small-shared-memory configuration on a device that fits the
// large one.
inline size_t device_smem_limit() {
  int dev = 0, bytes = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return 0;
  size_t limit = static_cast<size_t>(bytes);
  if (const char* env = std::getenv("DUALKV_CUDA_SMEM_LIMIT")) {
    const long long v = std::atoll(env);
    if (v > 0) limit = std::min(limit, static_cast<size_t>(v));
  }
  return limit;
}

}  // namespace dualkv::cuda
