// Host side of the portable backward: preprocess, the main kernel (step rows and Q stages chosen by
// the device's shared memory), the deterministic dQ kernel or nothing, postprocess.
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
constexpr size_t kSm8xSmemBytes[] = {99 * 1024, 163 * 1024, kSm90SmemOptinBytes};

template <int D, typename T, int kQStages, int kStepM>
constexpr size_t bwd_kv_smem() {
  return sizeof(BwdSmem<D, T, kQStages, kStepM>) + sizeof(BwdItemWindowed);  // the larger item
}

// The kernel's step rows: sm80_bwd_block_m (128 at D = 64 without softcap) on every device class
// whose shared memory holds that kernel, the plan's 64 rows on the classes below it (D = 64 on
// sm_86/89: the 128-row kernel needs 159 KiB). kBelow: the device classes a kStepM-row kernel
// serves are those with less shared memory than kBelow (all of them for the widest step).
constexpr size_t kAllClasses = ~size_t{0};

// Whether the one-Q-buffer kernel fits a device class the two-buffer one does not (D = 64 at 64-row
// steps on sm_86/89, D = 256 on A100, D = 512 on Hopper): only then is it instantiated.
template <int D, typename T, int kStepM, size_t kBelow>
constexpr bool one_q_buffer_fits_more() {
  for (size_t limit : kSm8xSmemBytes)
    if (limit < kBelow && bwd_kv_smem<D, T, 1, kStepM>() <= limit && bwd_kv_smem<D, T, 2, kStepM>() > limit)
      return true;
  return false;
}
// Whether any device class holds two Q buffers (not at D = 512: 266 KB; not sm_86/89 at D = 64):
// otherwise the two-buffer kernel is not instantiated.
template <int D, typename T, int kStepM, size_t kBelow>
constexpr bool two_q_buffers_fit_some() {
  for (size_t limit : kSm8xSmemBytes)
    if (limit < kBelow && bwd_kv_smem<D, T, 2, kStepM>() <= limit) return true;
  return false;
}
// The smallest instantiation of the kStepM-row kernel the launcher can pick.
template <int D, typename T, int kStepM, size_t kBelow>
constexpr size_t bwd_kv_steps_min_smem() {
  if constexpr (two_q_buffers_fit_some<D, T, kStepM, kBelow>() && !one_q_buffer_fits_more<D, T, kStepM, kBelow>())
    return bwd_kv_smem<D, T, 2, kStepM>();
  return bwd_kv_smem<D, T, 1, kStepM>();
}
// The step rows a (D, T, Mods) backward can launch with: the wide step (sm80_bwd_block_m) and the
// smallest of its instantiations, and whether the plan's 64-row steps are instantiated next to it
// (only where they serve a device class the wide kernel does not fit).
template <int D, typename T, typename Mods>
struct BwdSteps {
  static constexpr int kWide = sm80_bwd_block_m(D, Mods::kSoftcap);
  static constexpr int kPlan = plan_tiles(D).bwd_block_m;
  static constexpr size_t kWideSmem = bwd_kv_steps_min_smem<D, T, kWide, kAllClasses>();
  // (No early return on kWide == kPlan: nvcc then warns that the loop is unreachable, #128-D.)
  static constexpr bool kPlanSteps = [] {
    bool serves_a_class = false;
    for (size_t limit : kSm8xSmemBytes)
      serves_a_class = serves_a_class || (limit < kWideSmem && bwd_kv_smem<D, T, 1, kPlan>() <= limit);
    return kWide != kPlan && serves_a_class;
  }();
};

template <int D, typename T, bool kAtomicDq, int kQStages, int kStepM, typename Mods>
cudaError_t launch_bwd_kv(const BwdArgs& args, int sms, cudaStream_t stream) {
  constexpr size_t kSmem = sizeof(BwdSmem<D, T, kQStages, kStepM>);
  if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
    if constexpr (std::is_same_v<Mods, NoModifiers>)
      return launch_on_sms<bwd_kv_kernel<D, T, kAtomicDq, kQStages, kStepM, Mods, true>>(BwdConfig<D>::kThreads,
                                                                                           kSmem, sms, args, stream);
    else
      return cudaErrorNotSupported;  // api.cpp refuses a modifier with external prefixes first
  }
  return launch_on_sms<bwd_kv_kernel<D, T, kAtomicDq, kQStages, kStepM, Mods, false>>(BwdConfig<D>::kThreads, kSmem,
                                                                                        sms, args, stream);
}

// kStepM-row steps: two Q buffers where the device's shared memory holds them (every head dim on
// Hopper; up to 192 on A100), else one where that fits.
template <int D, typename T, bool kAtomicDq, int kStepM, size_t kBelow, typename Mods>
cudaError_t launch_bwd_kv_steps(const BwdArgs& args, int sms, cudaStream_t stream) {
  if constexpr (!two_q_buffers_fit_some<D, T, kStepM, kBelow>()) {
    return launch_bwd_kv<D, T, kAtomicDq, 1, kStepM, Mods>(args, sms, stream);
  } else {
    if constexpr (one_q_buffer_fits_more<D, T, kStepM, kBelow>()) {
      if (bwd_kv_smem<D, T, 2, kStepM>() > device_smem_limit())
        return launch_bwd_kv<D, T, kAtomicDq, 1, kStepM, Mods>(args, sms, stream);
    }
    return launch_bwd_kv<D, T, kAtomicDq, 2, kStepM, Mods>(args, sms, stream);
  }
}

// The wide step (sm80_bwd_block_m) where the device holds it, else the plan's 64 rows.
template <int D, typename T, bool kAtomicDq, typename Mods>
cudaError_t launch_bwd_kv(const BwdArgs& args, int sms, cudaStream_t stream) {
  using S = BwdSteps<D, T, Mods>;
  if constexpr (S::kPlanSteps) {
    if (S::kWideSmem > device_smem_limit())
      return launch_bwd_kv_steps<D, T, kAtomicDq, S::kPlan, S::kWideSmem, Mods>(args, sms, stream);
  }
  return launch_bwd_kv_steps<D, T, kAtomicDq, S::kWide, kAllClasses, Mods>(args, sms, stream);
}

// Shared memory the backward needs on the device, per mode: the main kernel's smallest instantiation
// the launcher can pick and, in deterministic mode, also the dQ kernel's. Where it exceeds what the
// device lets a block opt into, run_bwd declines before launching anything (the dispatcher reports
// DUALKV_ERROR_UNSUPPORTED): D = 512 needs Hopper's 202 KB in both modes; at D = 256 the
// deterministic dQ kernel needs 168,960 B, above A100's 163 KiB, while the default mode's one-Q-buffer
// main kernel (150 KB) runs there; sm_86/89 (99 KB) run the backward at D = 64 only (64-row steps,
// one Q buffer: 92,720 B).
template <int D, typename T, typename Mods>
constexpr size_t bwd_kv_min_smem() {
  using S = BwdSteps<D, T, Mods>;
  if constexpr (S::kPlanSteps)
    return bwd_kv_steps_min_smem<D, T, S::kPlan, S::kWideSmem>();
  else
    return S::kWideSmem;
}
template <int D, typename T, typename Mods>
size_t bwd_min_smem(bool deterministic, int fwd_block_m) {
  const size_t kv = bwd_kv_min_smem<D, T, Mods>(), dq = bwd_dq_smem<D, T>(fwd_block_m);
  return deterministic && dq > kv ? dq : kv;
}

template <int D, typename T, typename Mods>
cudaError_t run_bwd(const BwdArgs& args, int sms, cudaStream_t stream) {
  if (bwd_min_smem<D, T, Mods>(args.deterministic, args.fwd_block_m) > device_smem_limit())
    return cudaErrorNotSupported;
  cudaError_t err;
  if ((err = launch_bwd_preprocess<D, T>(args, sms, stream)) != cudaSuccess) return err;
  err = args.deterministic ? launch_bwd_kv<D, T, false, Mods>(args, sms, stream)
                           : launch_bwd_kv<D, T, true, Mods>(args, sms, stream);
  if (err != cudaSuccess) return err;
  if (args.deterministic && (err = launch_bwd_dq<D, T, Mods>(args, sms, stream)) != cudaSuccess) return err;
  return launch_bwd_postprocess<D, T, Mods::kWindow, true>(args, sms, stream);  // dQ in quad order
}

}  // namespace dualkv::cuda::sm80
