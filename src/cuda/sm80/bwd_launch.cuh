// Host side of the portable backward: preprocess, the main kernel (Q stages chosen by the device's
// shared memory), the deterministic dQ kernel or nothing, postprocess.
#pragma once

#include <cuda_runtime.h>

#include "bwd_prepost.cuh"
#include "launch.h"
#include "sm80/arch.h"
#include "sm80/bwd_dq_kernel.cuh"
#include "sm80/bwd_kernel.cuh"

namespace dualkv::cuda::sm80 {

// Opt-in shared memory per block of the devices the portable code runs on: sm_86/89, A100 and (the
// portable kernels compiled for sm_90a) H100 / H200.
constexpr size_t kSm8xSmemBytes[] = {99 * 1024, 163 * 1024, 227 * 1024};

template <int D, typename T, int kQStages>
constexpr size_t bwd_kv_smem() { return sizeof(BwdSmem<D, T, kQStages>) + sizeof(BwdItemWindowed); }  // the larger item

// Whether the one-Q-buffer kernel fits a device class the two-buffer one does not (D = 64 on
// sm_86/89, D = 256 on A100, D = 512 on Hopper): only then is it instantiated.
template <int D, typename T>
constexpr bool one_q_buffer_fits_more() {
  for (size_t limit : kSm8xSmemBytes)
    if (bwd_kv_smem<D, T, 1>() <= limit && bwd_kv_smem<D, T, 2>() > limit) return true;
  return false;
}
// Whether any device class holds two Q buffers (not at D = 512: 270 KB): otherwise the two-buffer
// kernel is not instantiated.
template <int D, typename T>
constexpr bool two_q_buffers_fit_some() {
  for (size_t limit : kSm8xSmemBytes)
    if (bwd_kv_smem<D, T, 2>() <= limit) return true;
  return false;
}

template <int D, typename T, bool kAtomicDq, int kQStages, typename Mods>
cudaError_t launch_bwd_kv(const BwdArgs& args, int sms, cudaStream_t stream) {
  if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
    if constexpr (std::is_same_v<Mods, NoModifiers>)
      return launch_on_sms<bwd_kv_kernel<D, T, kAtomicDq, kQStages, Mods, true>>(
          BwdConfig<D>::kThreads, sizeof(BwdSmem<D, T, kQStages>), sms, args, stream);
    else
      return cudaErrorNotSupported;  // api.cpp refuses a modifier with external prefixes first
  }
  return launch_on_sms<bwd_kv_kernel<D, T, kAtomicDq, kQStages, Mods, false>>(
      BwdConfig<D>::kThreads, sizeof(BwdSmem<D, T, kQStages>), sms, args, stream);
}

// Two Q buffers where the device's shared memory holds them (every head dim on Hopper; up to 192
// on A100), else one where that fits.
template <int D, typename T, bool kAtomicDq, typename Mods>
cudaError_t launch_bwd_kv(const BwdArgs& args, int sms, cudaStream_t stream) {
  if constexpr (!two_q_buffers_fit_some<D, T>()) {
    return launch_bwd_kv<D, T, kAtomicDq, 1, Mods>(args, sms, stream);
  } else {
    if constexpr (one_q_buffer_fits_more<D, T>()) {
      if (bwd_kv_smem<D, T, 2>() > device_smem_limit())
        return launch_bwd_kv<D, T, kAtomicDq, 1, Mods>(args, sms, stream);
    }
    return launch_bwd_kv<D, T, kAtomicDq, 2, Mods>(args, sms, stream);
  }
}

// Shared memory the backward needs on the device, per mode: the main kernel's smallest instantiation
// the launcher can pick and, in deterministic mode, also the dQ kernel's. Where it exceeds what the
// device lets a block opt into, run_bwd declines before launching anything (the dispatcher reports
// DUALKV_ERROR_UNSUPPORTED): D = 512 needs Hopper's 205 KB in both modes; at D = 256 the
// deterministic dQ kernel needs 168,960 B, above A100's 163 KiB, while the default mode's one-Q-buffer
// main kernel (154 KB) runs there; sm_86/89 (99 KB) run the backward at D = 64 only.
template <int D, typename T>
constexpr size_t bwd_kv_min_smem() {
  if constexpr (two_q_buffers_fit_some<D, T>() && !one_q_buffer_fits_more<D, T>()) return bwd_kv_smem<D, T, 2>();
  return bwd_kv_smem<D, T, 1>();
}
template <int D, typename T>
constexpr size_t bwd_min_smem(bool deterministic) {
  const size_t kv = bwd_kv_min_smem<D, T>(), dq = sizeof(DqSmemOf<D, T>);
  return deterministic && dq > kv ? dq : kv;
}

template <int D, typename T, typename Mods>
cudaError_t run_bwd(const BwdArgs& args, int sms, cudaStream_t stream) {
  if (bwd_min_smem<D, T>(args.deterministic) > device_smem_limit()) return cudaErrorNotSupported;
  cudaError_t err;
  if ((err = launch_bwd_preprocess<D, T>(args, sms, stream)) != cudaSuccess) return err;
  err = args.deterministic ? launch_bwd_kv<D, T, false, Mods>(args, sms, stream)
                           : launch_bwd_kv<D, T, true, Mods>(args, sms, stream);
  if (err != cudaSuccess) return err;
  if (args.deterministic && (err = launch_bwd_dq<D, T, Mods>(args, sms, stream)) != cudaSuccess) return err;
  return launch_bwd_postprocess<D, T, Mods::kWindow>(args, sms, stream);
}

}  // namespace dualkv::cuda::sm80
