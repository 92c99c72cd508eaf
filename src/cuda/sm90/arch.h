// The Hopper kernels (wgmma + TMA + warp specialisation, sm_90a code: compute capability 9.0
// exactly): their entry points and when the dispatcher (dispatch.cu) may use them.
#pragma once

#include <cuda_runtime_api.h>

#include "kernel_params.h"
#include "tile_size.h"

namespace dualkv::cuda::sm90 {

constexpr const char* kKernelName = "sm90 wgmma";  // DUALKV_LOG_KERNELS
// Set to force the portable kernels (comparisons, bisecting).
constexpr const char* kFwdDisableEnv = "DUALKV_DISABLE_SM90";
constexpr const char* kBwdDisableEnv = "DUALKV_DISABLE_SM90_BWD";
constexpr const char* kDeviceMismatch = "device is not sm_90";
constexpr const char* kArgsMismatch = "pointers/strides unsuitable for TMA";
inline bool runs_on(int major, int minor) { return major == 9 && minor == 0; }

// TMA needs every base pointer of q, k, v (and dout) 16-byte aligned and their token and head
// strides multiples of 16 bytes; the epilogues store element pairs from registers (out, dk, dv
// 4-byte aligned with even strides; the forward stores out by TMA where it is also TMA-aligned,
// fwd_launch.cuh); the backward's dQ accumulator is a TMA reduce target.
bool fwd_args_ok(const FwdArgs& args, int head_dim);
bool bwd_args_ok(const BwdArgs& args, int head_dim);
// The forward runs plans of its own family's query tiles (192 rows at D = 64 without a window:
// three consumer warpgroups); a plan cut for the portable kernels runs on them. The backward takes
// either.
constexpr TileFamily kTiles = TileFamily::kSm90;
inline bool fwd_tiles_ok(int head_dim, bool windowed, int fwd_block_m) {
  return fwd_block_m == dualkv::fwd_block_m(head_dim, TileFamily::kSm90, windowed);
}
// The Hopper dQ kernel (bwd_dq_kernel.cuh: query-outer, after a main kernel that computes no dQ) is
// built for these head dims, with every mask modifier, and the deterministic mode runs it there.
// Where bwd_dq_query_outer says so the backward computes dQ that way in every mode (dispatch.cu): at
// D 256 the two kernels took 0.68-0.85x the fwd+bwd time of the dQ-accumulating main kernel; at
// D 128 1.10-1.17x (its dQ-free main kernel 0.75x the accumulating one's, where the split pays only
// below ~0.55x), so D 128's default keeps the accumulating kernel and only its deterministic mode
// gains (0.73-0.77x the portable dQ's fwd+bwd time). H100, 2026-12-06 (docs/decisions.md). At D 64
// (three consumer warpgroups on the forward's 192-row tiles, two on the windowed plan's 128) it
// serves the deterministic mode as at D 128.
constexpr bool bwd_dq_kernel_built(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }
inline bool bwd_dq_query_outer(int head_dim, bool prefixed) {
  return head_dim == 256 && !prefixed;
}

// `sms`: the device's multiprocessor count (one persistent CTA per SM). cudaErrorNotSupported:
// nothing was launched (a TMA descriptor could not be made); the dispatcher falls back.
// Mods: the mask modifiers compiled in (modifiers.cuh: Modifiers<softcap, sinks>; the backward's
// are Modifiers<softcap, false>, its sinks' gradient being arch-neutral).
template <int D, typename T, typename Mods>
cudaError_t run_fwd(const FwdArgs& args, int sms, cudaStream_t stream);
template <int D, typename T, typename Mods>
cudaError_t run_bwd(const BwdArgs& args, int sms, cudaStream_t stream);

}  // namespace dualkv::cuda::sm90
