// Host helpers shared by every arch's launchers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

namespace dualkv::cuda {

// Blocks of `kernel` that fit one SM with `smem` bytes of dynamic shared memory (at least 1).
template <typename Kernel>
int occupancy_blocks(Kernel kernel, int threads, size_t smem) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
  return n;
}

// Launches `Kernel` as a persistent grid: every SM, as many blocks per SM as its `smem` bytes of
// dynamic shared memory let run (computed once per kernel).
template <auto Kernel, typename Args>
cudaError_t launch_on_sms(int threads, size_t smem, int sms, const Args& args, cudaStream_t stream) {
  static const int blocks_per_sm = occupancy_blocks(Kernel, threads, smem);
  cudaError_t err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  Kernel<<<sms * blocks_per_sm, threads, smem, stream>>>(args);
  return cudaGetLastError();
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
