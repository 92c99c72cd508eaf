// Host helpers shared by every arch's launchers.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "per_device.h"

namespace dualkv::cuda {

// The current device (DeviceGuard in dispatch.cu selected the call's): the key of the per-device
// caches below. -1 if the runtime cannot say (the caller then asks the runtime directly).
inline int current_device() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= detail::kMaxCachedDevices) return -1;
  return device;
}

// Opts `Kernel` into `smem` bytes of dynamic shared memory on the current device: once per
// (kernel, device), as the attribute belongs to the kernel in that device's context and never
// changes (a failure, e.g. more than the device has, is the same every time and is kept too).
// Each instantiation passes the one size its kernel launches with.
template <auto Kernel>
cudaError_t opt_in_smem(size_t smem) {
  const auto set = [smem](int) {
    return cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  };
  static detail::PerDevice<cudaError_t> opted;
  const int device = current_device();
  return device >= 0 ? opted.get(device, set) : set(device);
}

// Blocks of `Kernel` that fit one SM of the current device with `smem` bytes of dynamic shared
// memory (at least 1), opted into first.
template <auto Kernel>
int occupancy_blocks(int threads, size_t smem) {
  opt_in_smem<Kernel>(smem);
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, threads, smem) != cudaSuccess || n < 1) n = 1;
  return n;
}

// Launches `Kernel` as a persistent grid: every SM, as many blocks per SM as its `smem` bytes of
// dynamic shared memory let run (computed once per kernel and device).
template <auto Kernel, typename Args>
cudaError_t launch_on_sms(int threads, size_t smem, int sms, const Args& args, cudaStream_t stream) {
  static detail::PerDevice<int> blocks_per_sm;
  const int device = current_device();
  const auto count = [threads, smem](int) { return occupancy_blocks<Kernel>(threads, smem); };
  const int blocks = device >= 0 ? blocks_per_sm.get(device, count) : count(device);
  if (cudaError_t err = opt_in_smem<Kernel>(smem); err != cudaSuccess) return err;
  Kernel<<<sms * blocks, threads, smem, stream>>>(args);
  return cudaGetLastError();
}

// A persistent launch of `Kernel` with one block per SM (the Hopper kernels: one CTA fills an SM),
// `smem` bytes of dynamic shared memory opted into first.
template <auto Kernel, typename Args>
cudaError_t launch_persistent(size_t smem, int threads, int sms, const Args& args, cudaStream_t stream) {
  if (cudaError_t err = opt_in_smem<Kernel>(smem); err != cudaSuccess) return err;
  Kernel<<<sms, threads, smem, stream>>>(args);
  return cudaGetLastError();
}

// Shared memory a block may opt into on the current device (the device attribute, read once per
// device). DUALKV_CUDA_SMEM_LIMIT (bytes) lowers it: tests use it to run a kernel's
// small-shared-memory configuration on a device that fits the large one (read at each call: a test
// sets it in a running process).
inline size_t device_smem_limit() {
  const auto read = [](int dev) {
    int bytes = 0;
    if (dev < 0 && cudaGetDevice(&dev) != cudaSuccess) return 0;
    if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
    return bytes;
  };
  static detail::PerDevice<int> optin_bytes;
  const int device = current_device();
  const int bytes = device >= 0 ? optin_bytes.get(device, read) : read(device);
  if (bytes == 0) return 0;
  size_t limit = static_cast<size_t>(bytes);
  if (const char* env = std::getenv("DUALKV_CUDA_SMEM_LIMIT")) {
    const long long v = std::atoll(env);
    if (v > 0) limit = std::min(limit, static_cast<size_t>(v));
  }
  return limit;
}

}  // namespace dualkv::cuda
