// The portable kernels (mma.sync + cp.async, sm_80 and later): their entry points and when the
// dispatcher (dispatch.cu) may use them. They take every input the C ABI accepts on CUDA (rows
// 16-byte aligned, checked by the dispatcher for every arch), so they are the fallback of any arch.
#pragma once

#include <cuda_runtime_api.h>

#include "kernel_params.h"
#include "tile_size.h"

namespace dualkv::cuda::sm80 {

constexpr const char* kKernelName = "sm80 mma";  // DUALKV_LOG_KERNELS
constexpr const char* kFwdDisableEnv = nullptr;  // no switch: nothing to fall back to
constexpr const char* kBwdDisableEnv = nullptr;
constexpr const char* kDeviceMismatch = "device is older than sm_80";
constexpr const char* kArgsMismatch = "";
inline bool runs_on(int major, int /*minor*/) { return major >= 8; }
inline bool fwd_args_ok(const FwdArgs&, int /*head_dim*/) { return true; }
inline bool bwd_args_ok(const BwdArgs&, int /*head_dim*/) { return true; }
// The forward and the deterministic dQ kernel are built for both families' query tiles (config.h):
// they run the Hopper forward's fallbacks on the plans it was given.
constexpr TileFamily kTiles = TileFamily::kPortable;
inline bool fwd_tiles_ok(int head_dim, bool windowed, int fwd_block_m) {
  return fwd_block_m == dualkv::fwd_block_m(head_dim, TileFamily::kPortable, windowed) ||
         fwd_block_m == dualkv::fwd_block_m(head_dim, TileFamily::kSm90, windowed);
}
// The backward computes dQ query-outer (the deterministic dQ kernel) only in deterministic mode: the
// main kernel's atomic dQ is the faster one here.
inline bool bwd_dq_query_outer(int /*head_dim*/, bool /*prefixed*/) {
  return false;
}

// `sms`: the device's multiprocessor count (persistent grids).
// Mods: the mask modifiers compiled in (modifiers.cuh: Modifiers<softcap, sinks>; the backward's
// are Modifiers<softcap, false>, its sinks' gradient being arch-neutral).
template <int D, typename T, typename Mods>
cudaError_t run_fwd(const FwdArgs& args, int sms, cudaStream_t stream);
template <int D, typename T, typename Mods>
cudaError_t run_bwd(const BwdArgs& args, int sms, cudaStream_t stream);

}  // namespace dualkv::cuda::sm80
