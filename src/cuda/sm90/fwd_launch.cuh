// Host side of the Hopper forward: TMA descriptors, shared-memory opt-in, one persistent CTA per SM.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include "launch.h"
#include "sm90/arch.h"
#include "sm90/fwd_kernel.cuh"
#include "sm90/tma.h"

namespace dualkv::cuda::sm90 {

// One persistent CTA per SM of `Kernel` (launch.h), its work counter zeroed on `stream` first.
template <auto Kernel, int D, bool kLongWalks, bool kWindow>
cudaError_t launch_fwd(const Sm90FwdParams<D>& p, int sms, cudaStream_t stream) {
  using C = Sm90FwdConfig<D, kLongWalks, kWindow>;
  if (cudaError_t err = cudaMemsetAsync(p.a.counter, 0, sizeof(int32_t), stream); err != cudaSuccess) return err;
  return launch_persistent<Kernel>(C::kSmemBytes, C::kThreads, sms, p, stream);
}

template <int D, typename T, typename Mods>
cudaError_t run_fwd(const FwdArgs& args, int sms, cudaStream_t stream) {
  using C = Sm90FwdConfig<D, false, Mods::kWindow>;
  // The plan's forward items are query tiles of the Hopper family's rows (fwd_tiles_ok: the
  // dispatcher sends a plan cut for the portable kernels to them); the kernel holds one tile per CTA.
  static_assert(fwd_block_m(D, TileFamily::kSm90, Mods::kWindow) == C::kBlockM,
                "sm90 forward: plan query tiles must be kBlockM rows");
  const int T_ = args.layout.num_tokens;
  const int H = args.num_heads, Hk = args.num_kv_heads;
  Sm90FwdParams<D> p;
  p.a = args;
  // The item order (fwd_item_order.h): KV-head-major over the whole plan.
  const FwdItemOrder order = choose_fwd_item_order(H, Hk);
  p.tile_window = order.window;
  p.head_run = order.head_run;
  // The long-walk build (fwd_has_long_walk_kernel, issue 23) of the kernel without an external
  // prefix, where the plan's KV walks are long; its K / V boxes are its tiles (wider at D 128).
  constexpr bool kHasLong = fwd_has_long_walk_kernel<D, Mods, false>();
  const bool long_walks = kHasLong && args.prefix_k == nullptr && args.long_kv_walks != 0;
  // Packed query heads (fwd_item_order.h fwd_item_rows): a KV head's G heads share an item's rows, in
  // the kernels that pack (fwd_packs_query_heads: at D 256 the short-walk builds only).
  const bool prefix = args.prefix_k != nullptr;
  const bool kernel_packs = long_walks ? fwd_packs_query_heads<D, Mods, false, true>()
                            : prefix   ? fwd_packs_query_heads<D, Mods, true, false>()
                                       : fwd_packs_query_heads<D, Mods, false, false>();
  // The window kernels pack only where the plan's query tiles are ragged (tile_size.h fwd_ragged_tiles);
  // their unpacked build runs the other launches, below.
  const bool packs = kernel_packs && (!Mods::kWindow || args.ragged_tiles != 0);
  p.pack_shift = packs ? choose_fwd_pack_shift(H, Hk) : 0;
  const int box_heads = 1 << p.pack_shift;
  const int kv_box_rows = long_walks ? Sm90FwdConfig<D, true, Mods::kWindow>::kBlockN : C::kBlockN;
  if (!make_map(&p.tq, kTmaType<T>, args.q, D, H, T_, args.q_hs, args.q_ts, C::kBlockM >> p.pack_shift, box_heads) ||
      !make_map(&p.tk, kTmaType<T>, args.k, D, Hk, T_, args.k_hs, args.k_ts, kv_box_rows) ||
      !make_map(&p.tv, kTmaType<T>, args.v, D, Hk, T_, args.v_hs, args.v_ts, kv_box_rows))
    return cudaErrorNotSupported;
  // The O epilogue's TMA store (Sm90FwdConfig::kOStaged): only where out is TMA-aligned (16-byte
  // base and strides); otherwise the kernel stores every tile per thread (fwd_args_ok asks pairs only).
  p.o_tma = 0;
  // Without kOStaged (D 256) the per-thread epilogue stores 16 bytes where out's base and strides
  // allow them (fwd_o_row_stg128), else element pairs. Calls through the C API always allow them
  // (dispatch.cu's check_rows refuses an out without 16-byte rows, tests/gpu/test_sm90_fwd.py), as
  // they always allow the TMA store above; the pair stores keep run_fwd correct without that check.
  p.o_vec16 = 0;
  if constexpr (!C::kOStaged) {
    p.o_vec16 = rows_allow_stg128(args.out, args.o_ts, args.o_hs, H) ? 1 : 0;
  }
  if constexpr (C::kOStaged) {
    const bool aligned =
        rows_allow_stg128(args.out, args.o_ts, args.o_hs, H) && args.o_ts > 0 && (H == 1 || args.o_hs > 0);
    p.o_tma =
        aligned && make_map(&p.to, kTmaType<T>, args.out, D, H, T_, args.o_hs, args.o_ts, 64 >> p.pack_shift, box_heads)
            ? 1
            : 0;
  }
  if (args.prefix_k != nullptr) {  // external prefix (issue 17): instantiated without modifiers only
    if constexpr (std::is_same_v<Mods, NoModifiers>) {
      // The prefix buffers' tensor maps (rows: the prefix buffers').
      if (!make_map(&p.tpk, kTmaType<T>, args.prefix_k, D, Hk, args.prefix_rows, args.pk_hs, args.pk_ts, C::kBlockN) ||
          !make_map(&p.tpv, kTmaType<T>, args.prefix_v, D, Hk, args.prefix_rows, args.pv_hs, args.pv_ts, C::kBlockN))
        return cudaErrorNotSupported;
      return launch_fwd<fwd_sm90_kernel<T, D, Mods, true, false>, D, false, false>(p, sms, stream);
    } else {
      return cudaErrorNotSupported;  // api.cpp refuses a modifier with external prefixes first
    }
  }
  if constexpr (kHasLong) {
    if (long_walks) return launch_fwd<fwd_sm90_kernel<T, D, Mods, false, true>, D, true, Mods::kWindow>(p, sms, stream);
  }
  if constexpr (fwd_has_unpacked_kernel<D, Mods, false>()) {
    if (p.pack_shift == 0)
      return launch_fwd<fwd_sm90_kernel<T, D, Mods, false, false, true>, D, false, Mods::kWindow>(p, sms, stream);
  }
  return launch_fwd<fwd_sm90_kernel<T, D, Mods, false, false>, D, false, Mods::kWindow>(p, sms, stream);
}

}  // namespace dualkv::cuda::sm90
