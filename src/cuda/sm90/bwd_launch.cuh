// Host side of the Hopper backward: TMA descriptors, shared-memory opt-in, one persistent CTA per
// SM for the main kernel, between the arch-neutral preprocess and postprocess (bwd_prepost.cuh);
// where dQ is computed query-outer (args.deterministic: deterministic mode, and D 256 without external
// prefixes: dispatch.cu bwd_dq_query_outer) it comes from a dQ kernel after the main kernel: the Hopper
// one where it is built (sm90/bwd_dq_kernel.cuh), else the portable one (sm80/bwd_dq_kernel.cuh).
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "bwd_prepost.cuh"
#include "launch.h"
#include "sm80/bwd_dq_kernel.cuh"
#include "sm90/arch.h"
#include "sm90/bwd_dq_kernel.cuh"
#include "sm90/bwd_kernel.cuh"
#include "sm90/bwd_kernel_d256.cuh"
#include "sm90/tma.h"

namespace dualkv::cuda::sm90 {

// The parameters of one main-kernel launch: the argument check, the TMA maps of Q, dO (BlockM-row
// boxes), K, V (BlockN-row boxes) and, unless deterministic (no dQ), of the fp32 dQ accumulator.
// Its work counter (counters[2]) needs no launch of its own: launch_bwd_preprocess zeroed
// counters[0..3] on `stream` before (run_bwd), and nothing between reads or writes it.
// cudaErrorNotSupported: nothing was launched (the caller falls back to the sm80 kernel).
template <typename Element, int HeadDim, int BlockM, int BlockN>
cudaError_t prepare_bwd_params(const BwdArgs& args, int sms, Sm90BwdParams<HeadDim>* p) {
  constexpr CUtensorMapDataType dt = kTmaType<Element>;
  const int T = args.layout.num_tokens;
  const int H = args.num_heads, Hk = args.num_kv_heads;
  p->a = args;
  p->counter = args.counters + 2;
  // The order the producer claims the items in where bwd_claim_ordered(HeadDim) (bwd_kernel.cuh).
  const FwdItemOrder order = choose_bwd_item_order(sms, Hk);
  p->item_window = order.window;
  p->item_head_run = order.head_run;
  if (!make_map(&p->tq, dt, args.q, HeadDim, H, T, args.q_hs, args.q_ts, BlockM) ||
      !make_map(&p->tdo, dt, args.dout, HeadDim, H, T, args.do_hs, args.do_ts, BlockM) ||
      !make_map(&p->tk, dt, args.k, HeadDim, Hk, T, args.k_hs, args.k_ts, BlockN) ||
      !make_map(&p->tv, dt, args.v, HeadDim, Hk, T, args.v_hs, args.v_ts, BlockN))
    return cudaErrorNotSupported;
  // dQ reduce boxes of 32 rows x 64 columns (tma.h): a step reduces BlockM / 32 x HeadDim / 64 of them.
  static_assert(BlockM % 32 == 0 && HeadDim % 64 == 0, "sm90 backward: steps of whole dQ boxes");
  if (!args.deterministic && !make_dq_accum_map(&p->tdq, args.dq_accum, HeadDim, H, T))
    return cudaErrorNotSupported;
  // external prefix (issue 17): the prefix buffers' tensor maps (rows: the prefix buffers').
  if (args.prefix_k != nullptr &&
      (!make_map(&p->tpk, dt, args.prefix_k, HeadDim, Hk, args.prefix_rows, args.pk_hs, args.pk_ts, BlockN) ||
       !make_map(&p->tpv, dt, args.prefix_v, HeadDim, Hk, args.prefix_rows, args.pv_hs, args.pv_ts, BlockN)))
    return cudaErrorNotSupported;
  return cudaSuccess;
}

// Head dim 256 (bwd_sm90_kernel_d256.cuh): 64-row KV tiles, dQ by TMA reduce-adds from the dead Q/dO
// stage (the same dq_accum tensor map as the D <= 128 kernel, 64-row boxes).
template <typename Element, typename Mods>
cudaError_t run_bwd_main_d256(const BwdArgs& args, int sms, cudaStream_t stream) {
  using C = Sm90BwdConfigD256;
  static_assert(plan_tiles(256).bwd_block_n == C::kBlockN, "sm90 backward d256: plan KV tiles must be kBlockN rows");
  static_assert(plan_tiles(256).bwd_block_m == C::kBlockM, "sm90 backward d256: plan splits are multiples of kBlockM");
  Sm90BwdParams<256> p;
  cudaError_t err = prepare_bwd_params<Element, 256, C::kBlockM, C::kBlockN>(args, sms, &p);
  if (err != cudaSuccess) return err;
  if constexpr (std::is_same_v<Mods, NoModifiers>) {
    if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
      if (args.deterministic)
        return launch_persistent<bwd_sm90_kernel_d256<Element, false, Mods, true>>(C::kSmemBytes, C::kThreads, sms,
                                                                                   p, stream);
      return launch_persistent<bwd_sm90_kernel_d256<Element, true, Mods, true>>(C::kSmemBytes, C::kThreads, sms, p,
                                                                                stream);
    }
  }
  if (args.deterministic)
    return launch_persistent<bwd_sm90_kernel_d256<Element, false, Mods, false>>(C::kSmemBytes, C::kThreads, sms, p,
                                                                                stream);
  return launch_persistent<bwd_sm90_kernel_d256<Element, true, Mods, false>>(C::kSmemBytes, C::kThreads, sms, p,
                                                                             stream);
}

template <typename Element, int HeadDim, typename Mods>
cudaError_t run_bwd_main(const BwdArgs& args, int sms, cudaStream_t stream) {
  // external prefix (issue 17): instantiated without modifiers only (api.cpp refuses a modifier
  // with external prefixes first); declined before anything is prepared.
  if (!std::is_same_v<Mods, NoModifiers> && args.prefix_k != nullptr) return cudaErrorNotSupported;
  if constexpr (HeadDim == 256) {
    return run_bwd_main_d256<Element, Mods>(args, sms, stream);
  } else {
    constexpr int kStepRows = sm90_bwd_block_m(HeadDim, Mods::kSoftcap);
    using C = Sm90BwdConfig<HeadDim, false, kStepRows>;
    static_assert(plan_tiles(HeadDim).bwd_block_n == C::kBlockN, "sm90 backward: plan KV tiles must be kBlockN rows");
    // The plan's split lengths are multiples of its 64-row step; the kernel's step may be a multiple
    // of that (128 rows at D = 64: a piece of an odd number of 64-row blocks ends in a half step).
    static_assert(C::kBlockM % plan_tiles(HeadDim).bwd_block_m == 0,
                  "sm90 backward: kernel steps must be whole multiples of the plan's split granularity");
    Sm90BwdParams<HeadDim> p;
    cudaError_t err = prepare_bwd_params<Element, HeadDim, C::kBlockM, C::kBlockN>(args, sms, &p);
    if (err != cudaSuccess) return err;
    if constexpr (std::is_same_v<Mods, NoModifiers>) {
      if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
        if (args.deterministic)
          return launch_persistent<bwd_sm90_kernel<Element, HeadDim, false, Mods, true>>(C::kSmemBytes, C::kThreads,
                                                                                         sms, p, stream);
        return launch_persistent<bwd_sm90_kernel<Element, HeadDim, true, Mods, true>>(
            Sm90BwdConfig<HeadDim, true, kStepRows>::kSmemBytes, C::kThreads, sms, p, stream);
      }
    }
    if (args.deterministic)
      return launch_persistent<bwd_sm90_kernel<Element, HeadDim, false, Mods, false>>(C::kSmemBytes, C::kThreads, sms,
                                                                                      p, stream);
    // The dQ-computing kernel has dQ staging buffers on top.
    return launch_persistent<bwd_sm90_kernel<Element, HeadDim, true, Mods, false>>(
        Sm90BwdConfig<HeadDim, true, kStepRows>::kSmemBytes, C::kThreads, sms, p, stream);
  }
}

// The query-outer dQ by the Hopper kernel (bwd_dq_kernel.cuh), where it is built
// and the plan's forward tiles are its (a plan cut for the portable forward is not) and there is no
// external prefix; cudaErrorNotSupported (nothing launched) otherwise, and the portable kernel runs.
// Its work counter is counters[1], zeroed by the preprocess as for the portable kernel.
template <int D, typename T, typename Mods>
cudaError_t run_bwd_dq(const BwdArgs& args, int sms, cudaStream_t stream) {
  if constexpr (!bwd_dq_kernel_built(D)) {
    return cudaErrorNotSupported;
  } else {
    using C = Sm90DqConfig<D, Mods::kWindow>;
    if (args.prefix_k != nullptr || args.fwd_block_m != C::kBlockM) return cudaErrorNotSupported;
    const int T_ = args.layout.num_tokens;
    const int H = args.num_heads, Hk = args.num_kv_heads;
    constexpr CUtensorMapDataType dt = kTmaType<T>;
    Sm90DqParams<D> p;
    p.a = args;
    const FwdItemOrder order = choose_fwd_item_order(H, Hk);
    p.tile_window = order.window;
    p.head_run = order.head_run;
    if (!make_map(&p.tq, dt, args.q, D, H, T_, args.q_hs, args.q_ts, C::kBlockM) ||
        !make_map(&p.tdo, dt, args.dout, D, H, T_, args.do_hs, args.do_ts, C::kBlockM) ||
        !make_map(&p.tk, dt, args.k, D, Hk, T_, args.k_hs, args.k_ts, C::kBlockN) ||
        !make_map(&p.tv, dt, args.v, D, Hk, T_, args.v_hs, args.v_ts, C::kBlockN))
      return cudaErrorNotSupported;
    p.dq_vec16 = rows_allow_stg128(args.dq, args.dq_ts, args.dq_hs, H) ? 1 : 0;
    return launch_persistent<bwd_dq_sm90_kernel<T, D, Mods>>(C::kSmemBytes, C::kThreads, sms, p, stream);
  }
}

template <int D, typename T, typename Mods>
cudaError_t run_bwd(const BwdArgs& args, int sms, cudaStream_t stream) {
  cudaError_t err;
  if ((err = launch_bwd_preprocess<D, T>(args, sms, stream)) != cudaSuccess) return err;
  if ((err = run_bwd_main<T, D, Mods>(args, sms, stream)) != cudaSuccess) return err;
  if (args.deterministic) {
    err = run_bwd_dq<D, T, Mods>(args, sms, stream);
    if (err == cudaErrorNotSupported) err = sm80::launch_bwd_dq<D, T, Mods>(args, sms, stream);
    if (err != cudaSuccess) return err;
  }
  return launch_bwd_postprocess<D, T, Mods::kWindow, false>(args, sms, stream);
}

}  // namespace dualkv::cuda::sm90
