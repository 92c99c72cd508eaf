// Hopper backward main kernel for head dim 256 (sm_90a): KV-tile-outer, wgmma + TMA + warp
// specialisation.
//
// Same contract as bwd_sm90_kernel (bwd_kernel.cuh) and the portable bwd_kv_kernel: the plan's
// backward items (seg, k0, k1, qa, qb, slot) with plan_tiles(256).bwd_block_n = 64 KV rows, the same
// workspace, the same outputs (dK * scale and dV for unsplit items; unscaled fp32 partials
// [slot, Hk, 2, 64, 256] for split items; dS K added into dq_accum [T, H, 256] by bulk reduce unless
// deterministic).
//
// Why not the D <= 128 scheme (each consumer warpgroup owns half of the KV rows and keeps their dK
// and dV): 64 KV rows x 256 columns of dK plus dV are 2 x 64 x 256 fp32 = 256 registers per thread
// of one warpgroup. Here the two consumer warpgroups split the work by role instead, each keeping
// one 64 x 256 fp32 accumulator (128 registers per thread) for the whole item:
//
//   warpgroup 1 ("P" role, owns dV):           warpgroup 2 ("dS" role, owns dK):
//     S^T  = K Q^T        (SS m64n64, k 256)     dP^T = V dO^T        (SS m64n64, k 256)
//     P^T  = exp2(S^T scale log2e - lse log2e), masked (kv row >= klen, or kv > q)
//     P^T -> smem (fp32 accumulator fragments, thread-linear), named barrier 2 (arrive)
//                                                 named barrier 2 (sync), P^T <- smem
//                                                 dS^T = P^T (dP^T - delta)
//     dV += P^T dO        (RS m64n256, k 64)     dK += dS^T Q         (RS m64n256, k 64)
//                                                 dS^T -> smem as dS [q][kv] (stmatrix.trans,
//                                                 128B swizzle; dQ-computing kernel only)
//     named barrier 1 (both warpgroups; dQ-computing kernel only)
//     dQ[:, 0..128)   = dS K[:, 0..128)          dQ[:, 128..256) = dS K[:, 128..256)  (SS m64n128,
//                                                 B N-major), staged and bulk-reduced (below)
//
// so the tensor work per query tile is the useful 5 x (2 x 64 x 64 x 256) FLOP, 2.5 units per
// warpgroup (no recomputation of S^T or dP^T), the softmax numerators cross between the warpgroups
// once per step as 16 KiB of fp32 (so dS^T = P^T (dP^T - delta) is computed from the same fp32 P^T
// as in the D <= 128 kernel), and dS crosses once as there.
//
// Issue order: the dS warpgroup issues dP^T after the P warpgroup's
// S^T retired (named barrier 3: P warpgroup arrives, dS warpgroup syncs), so the tensor work runs
// S^T | dP^T (overlapping the exponentials) | dV, dK | dQ instead of S^T + dP^T together, then
// the exponentials with the tensor cores idle.
//
// Buffers for P^T and dS are single: the dS warpgroup rewrites dS of step s+1 only after the P
// barrier of step s+1, which the P warpgroup reaches after its dQ wgmma of step s retired; the P
// warpgroup rewrites P^T of step s+1 only after the step-s barrier 1, which the dS warpgroup
// reaches after it loaded P^T of step s. The deterministic kernel computes no dQ and stores no dS;
// barrier 1 stays as the step's end (the dS warpgroup arrives, the P warpgroup syncs) for the
// P^T buffer. The producer warp, the item ring, K/V (one buffer per item, kv_full / kv_empty) and
// the Q/dO/lse/delta ring (2 stages, qdo_full / qdo_empty) are those of bwd_sm90_kernel. The CPU
// model of this protocol: tests/models/bwd_protocol_model.py --d256.
//
// dQ by bulk reduce (the dQ-computing kernel, template flag kAtomicDq; the build switches that
// kept 16-byte atomics are gone): there is no room for
// the D <= 128 kernel's separate 2 x 64 KiB staging buffers, but after barrier 1 the step's Q and dO
// stage (2 x 32 KiB) is dead: S^T, dP^T, dV and dK, its only readers, have retired in both
// warpgroups. So each warpgroup stages its fp32 dQ half (64 x 128 = four 32 x 64 boxes of
// 8 KiB, 128B swizzle) into that stage, the P warpgroup into the Q buffer, the dS warpgroup into the
// dO buffer (rows >= qb as 0), fences the stores for the async proxy and arrives on dq_full[stage]
// (one arrival per warp); the dQ writer (thread 32, idle before) follows the items and steps, waits
// dq_full, issues the 8 TMA reduce-adds into dq_accum, waits until they have read smem and only
// then releases the stage to the producer (qdo_empty, its single arrival). The consumers no longer
// arrive on qdo_empty, and their math warps issue no global atomics. The CPU model: --d256 --bulk.
#pragma once

#include "sm90/bwd_kernel.cuh"

namespace dualkv::cuda::sm90 {

struct Sm90BwdConfigD256 {
  static constexpr int D = 256;
  static constexpr int kBlockM = 64;  // query rows per step
  static constexpr int kBlockN = 64;  // KV rows per item (= the plan's bwd_block_n)
  static constexpr int kThreads = 384;
  static constexpr int kConsumerRegs = 232;
  static constexpr int kProducerRegs = 40;
  static_assert(setmaxnreg_split_fits(kThreads, kProducerRegs, kConsumerRegs),
                "sm90: the consumers' setmaxnreg.inc would wait for registers the producer never returns");
  static constexpr int kBoxes = D / 64;  // TMA boxes of 64 columns (128 B of 16-bit)
  static constexpr uint32_t kQBoxBytes = kBlockM * 128;
  static constexpr uint32_t kQBytes = kBlockM * D * 2;  // one Q (or dO) stage: 32 KiB
  static constexpr uint32_t kKVBoxBytes = kBlockN * 128;
  static constexpr uint32_t kKVBytes = kBlockN * D * 2;  // K (or V): 32 KiB
  static constexpr uint32_t kPBytes = kBlockM * kBlockN * 4;  // P^T fp32 fragments: 16 KiB
  static constexpr uint32_t kDSBytes = kBlockM * kBlockN * 2;  // dS [q][kv], one swizzled box
  static constexpr int kDqN = D / 2;  // dQ columns per consumer warpgroup
  // smem: K | V | Q[2] | dO[2] | P^T | dS | lse[2][64] | delta[2][64] | barriers + item slots.
  static constexpr uint32_t kOffK = 0;
  static constexpr uint32_t kOffV = kOffK + kKVBytes;
  static constexpr uint32_t kOffQ = kOffV + kKVBytes;
  static constexpr uint32_t kOffDO = kOffQ + 2 * kQBytes;
  static constexpr uint32_t kOffP = kOffDO + 2 * kQBytes;
  static constexpr uint32_t kOffDS = kOffP + kPBytes;
  static constexpr uint32_t kOffLse = kOffDS + kDSBytes;
  static constexpr uint32_t kOffDelta = kOffLse + 2 * kBlockM * 4;
  static constexpr uint32_t kOffBar = kOffDelta + 2 * kBlockM * 4;
  // 10 mbarriers + 2 item slots, then dq_full[2] (used by the dQ-computing kernel only).
  static constexpr uint32_t kBarBytes = 8 * 10 + 16 + 8 * 2;
  // dQ staging boxes of the bulk-dQ kernel (kBwdDqBoxBytes: 32 rows x 64 fp32 columns), 2 x 2 per
  // warpgroup half (row block major), in the step's Q (columns 0..127) or dO (128..255) stage.
  static constexpr int kDqBoxCols = D / 2 / 64;  // boxes per 32-row block of a half
  static_assert(kBlockM / 32 * kDqBoxCols * kBwdDqBoxBytes == kQBytes, "a dQ half fills one Q (or dO) stage exactly");
  static constexpr uint32_t kSmemBytes = kOffBar + kBarBytes + 1024;  // + alignment slack
  // 221,184 (K, V, 2 x Q, 2 x dO: 192 KiB; P^T 16 KiB; dS 8 KiB) + 1,024 (lse/delta) + 96 (barriers,
  // item slots) + 1,024 (alignment slack) = 223,328 of 232,448 B.
  static_assert(kSmemBytes <= kSm90SmemOptinBytes, "sm90 backward d256: over the 227 KiB opt-in smem limit");
  static_assert(kOffP % 1024 == 0 && kOffDS % 1024 == 0, "swizzled buffers need 1 KiB alignment");
};

constexpr uint32_t kBwdPBarrier = 2;  // named barrier: P^T of the step stored by the P warpgroup
// Named barrier: S^T of the step retired. The dS warpgroup issues dP^T only then, so S^T has the
// tensor cores to itself and the exponentials of P^T overlap dP^T instead of following both products.
constexpr uint32_t kBwdSBarrier = 3;

__device__ __forceinline__ void bwd_st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ uint4 bwd_ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Mods: the mask modifiers compiled in (modifiers.cuh: only kSoftcap changes this kernel).
// kPrefix (external prefix, issue 17): prefix items as in bwd_sm90_kernel (bwd_kernel.cuh);
// instantiated with NoModifiers only.
template <typename T, bool kAtomicDq, typename Mods = NoModifiers, bool kPrefix = false>
__global__ void __launch_bounds__(Sm90BwdConfigD256::kThreads, 1)
bwd_sm90_kernel_d256(const __grid_constant__ Sm90BwdParams<256> p) {
  using C = Sm90BwdConfigD256;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, D = C::D;
  constexpr bool kBulk = kAtomicDq;  // dQ by bulk reduce from the dead Q/dO stage

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  float* s_lse = reinterpret_cast<float*>(smem + C::kOffLse);
  float* s_delta = reinterpret_cast<float*>(smem + C::kOffDelta);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kOffBar);
  Sm90BwdBarriers B;
  B.item_full = bars;
  B.item_empty = bars + 2;
  B.kv_full = bars + 4;
  B.kv_empty = bars + 5;
  B.qdo_full = bars + 6;
  B.qdo_empty = bars + 8;
  B.items = reinterpret_cast<int32_t*>(bars + 10);
  if constexpr (kBulk) B.dq_full = bars + 12;

  const BwdArgs& a = p.a;
  const LayoutPtrs& L = a.layout;
  const int32_t* plan = a.plan;
  if (!plan_matches(plan, L)) return;
  const int32_t n_work = plan[kHdrNumBwd];
  const int32_t* witems = plan + plan[kHdrBwdOffset];
  const int H = a.num_heads, Hk = a.num_kv_heads;
  const int group = H / Hk;
  const int32_t n_items = n_work * Hk;

  if (threadIdx.x == 0) {
    for (int i = 0; i < 2; ++i) {
      mbar_init(&B.item_full[i], 1);
      mbar_init(&B.item_empty[i], kBwdConsumerWarps * kArrivalsPerWarp + (kBulk ? 1 : 0));
      mbar_init(&B.qdo_full[i], kBwdQdoFullCount);
      // kBulk: the writer alone releases a stage, once its reduces have read the dQ staged there.
      mbar_init(&B.qdo_empty[i], kBulk ? 1 : kBwdQdoEmptyCount);
      if constexpr (kBulk) mbar_init(&B.dq_full[i], kBwdDqFullCount);
    }
    mbar_init(B.kv_full, 1);
    mbar_init(B.kv_empty, kBwdConsumerWarps);
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer (warp 0)
    setmaxnreg_dec<C::kProducerRegs>();
    if constexpr (kBulk) {
      if (threadIdx.x == 32) {
        // ---------------------------------------------------------------- dQ writer (warp 1)
        // Follows the consumers' items and steps; per step, once both warpgroups staged their dQ
        // halves in the step's Q/dO stage (dq_full), adds the 64 x 256 tile to dq_accum[qt.., h, :]
        // with one TMA reduce per 32 x 64 box (rows past T clipped by TMA; rows in [qb, qt + 64)
        // were staged as 0), waits until the reduces have read smem and releases the stage to the
        // producer (qdo_empty). The global adds complete asynchronously (waited for before exit).
        tma_prefetch_desc(&p.tdq);
        uint32_t step = 0;
        for (uint32_t n = 0;; ++n) {
          const uint32_t slot = n & 1, ph = (n >> 1) & 1;
          mbar_wait(&B.item_full[slot], ph);
          const int32_t item = B.items[slot];
          mbar_arrive(&B.item_empty[slot]);
          if (item >= n_items) break;
          const int32_t w = item / Hk;
          const int hk = item - w * Hk;
          const int32_t* wi = witems + w * kBwdItemInts;
          const int32_t qa = wi[3], qb = wi[4];
          // The consumers' step order (head-major, then 64-row query tiles), without their divisions;
          // not unrolled: unrolled, the loop spilled 8 B on the producer warpgroup's 40 registers.
#pragma unroll 1
          for (int h = hk * group; h < (hk + 1) * group; ++h) {
#pragma unroll 1
            for (int32_t qt = qa; qt < qb; qt += BM, ++step) {
              const uint32_t st = step & 1;
              mbar_wait(&B.dq_full[st], (step >> 1) & 1);
              // The Q stage holds columns 0..127, the dO stage 128..255.
              const uint8_t* const stages[2] = {smem + C::kOffQ + st * C::kQBytes, smem + C::kOffDO + st * C::kQBytes};
              bwd_reduce_dq_stage<BM, C::kDqBoxCols>(&p.tdq, stages, h, qt, qb);
              bulk_commit_group();
              bulk_wait_group_read<0>();
              mbar_arrive(&B.qdo_empty[st]);
            }
          }
        }
        // The smem sources are read already; wait for the adds themselves before the CTA retires.
        bulk_wait_group<0>();
        return;
      }
    }
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    if (lane == 0) {
      tma_prefetch_desc(&p.tq);
      tma_prefetch_desc(&p.tk);
      tma_prefetch_desc(&p.tv);
      tma_prefetch_desc(&p.tdo);
      if constexpr (kPrefix) {
        tma_prefetch_desc(&p.tpk);
        tma_prefetch_desc(&p.tpv);
      }
    }
    const int64_t T_ = L.num_tokens;
    uint32_t kv_iter = 0, step = 0;
    for (uint32_t n = 0;; ++n) {
      const uint32_t slot = n & 1, ph = (n >> 1) & 1;
      mbar_wait(&B.item_empty[slot], ph ^ 1);
      int32_t item = 0;
      if (lane == 0) {
        item = bwd_claim_item(p, n_work, Hk);
        B.items[slot] = item;
        mbar_arrive(&B.item_full[slot]);
      }
      item = __shfl_sync(0xffffffffu, item, 0);
      if (item >= n_items) break;
      const int32_t w = item / Hk;
      const int hk = item - w * Hk;
      const int32_t* wi = witems + w * kBwdItemInts;
      const int32_t k0 = wi[1], qa = wi[3], qb = wi[4];
      if (lane == 0) {
        // The item's tensor maps: the layout's K / V, or the prefix buffers' for a prefix item.
        const bool pre = kPrefix && is_prefix_item(L, wi[0]);
        const CUtensorMap* tk = pre ? &p.tpk : &p.tk;
        const CUtensorMap* tv = pre ? &p.tpv : &p.tv;
        mbar_wait(B.kv_empty, (kv_iter & 1) ^ 1);
        mbar_arrive_expect_tx(B.kv_full, 2 * C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b) {
          tma_load_3d(smem + C::kOffK + b * C::kKVBoxBytes, tk, B.kv_full, b * 64, hk, k0);
          tma_load_3d(smem + C::kOffV + b * C::kKVBoxBytes, tv, B.kv_full, b * 64, hk, k0);
        }
      }
      ++kv_iter;
      const int32_t tiles = (qb - qa + BM - 1) / BM;
      const int32_t n_steps = tiles * group;
      for (int32_t s = 0; s < n_steps; ++s, ++step) {
        const int h = hk * group + s / tiles;
        const int32_t qt = qa + (s % tiles) * BM;
        const uint32_t st = step & 1;
        mbar_wait(&B.qdo_empty[st], ((step >> 1) & 1) ^ 1);
        if (lane == 0) {
          mbar_arrive_expect_tx(&B.qdo_full[st], 2 * C::kQBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b) {
            tma_load_3d(smem + C::kOffQ + st * C::kQBytes + b * C::kQBoxBytes, &p.tq, &B.qdo_full[st], b * 64, h,
                        qt);
            tma_load_3d(smem + C::kOffDO + st * C::kQBytes + b * C::kQBoxBytes, &p.tdo, &B.qdo_full[st], b * 64,
                        h, qt);
          }
        }
        bwd_stage_lse_delta<BM>(a, T_, h, qt, qb, lane, s_lse + st * BM, s_delta + st * BM);
        mbar_arrive(&B.qdo_full[st]);
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<C::kConsumerRegs>();
  using MmaS = Wgmma<T, BM>;         // S^T, dP^T: m64 (kv) x n64 (q), k = d
  using MmaKV = Wgmma<T, D>;         // dV, dK: m64 (kv) x n256, k = q, A from registers
  using MmaQ = WgmmaTB<T, C::kDqN>;  // dQ half: m64 (q) x n128, k = kv
  const int cw = wg - 1;             // 0: P role (S, P, dV); 1: dS role (dP, dS, dK)
  const bool p_role = cw == 0;
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const float sl2 = a.scale_log2;
  // First product's A operand: K (P role) or V (dS role), all 64 KV rows.
  const uint32_t a_rows = smem_u32(smem + (p_role ? C::kOffK : C::kOffV));
  // dQ: B = K[:, 128 cw .. +128) read N-major: boxes 2 cw and 2 cw + 1.
  const uint32_t k_dq = smem_u32(smem + C::kOffK) + (cw * C::kDqN / 64) * C::kKVBoxBytes;
  const uint32_t q_smem = smem_u32(smem + C::kOffQ);
  const uint32_t do_smem = smem_u32(smem + C::kOffDO);
  const uint32_t ds_buf = smem_u32(smem + C::kOffDS);
  const uint32_t p_thread = smem_u32(smem + C::kOffP) + tid * 16;  // + i * 2048: floats 4i .. 4i+3
  const int kv_row0 = warp * 16 + g;  // tile-local KV row of accumulator rows (+8 for e >= 2)

  uint32_t kv_iter = 0, step = 0;
  for (uint32_t n = 0;; ++n) {
    const uint32_t slot = n & 1, ph = (n >> 1) & 1;
    mbar_wait(&B.item_full[slot], ph);
    const int32_t item = B.items[slot];
    __syncwarp();
    if (kPerThreadRelease || lane == 0) mbar_arrive(&B.item_empty[slot]);
    if (item >= n_items) break;
    const int32_t w = item / Hk;
    const int hk = item - w * Hk;
    const int32_t* wi = witems + w * kBwdItemInts;
    const int32_t k0 = wi[1], k1 = wi[2], qa = wi[3], qb = wi[4], pslot = wi[5];
    const int klen = k1 - k0;
    const bool prefix_item = kPrefix && is_prefix_item(L, wi[0]);  // k0, k1: prefix rows
    // The sliding window (mask modifiers, issue 16): the item's distance bias (plan_format.h).
    int32_t bias = 0;
    if constexpr (Mods::kWindow) bias = plan[plan[kHdrBwdBiasOffset] + w];
    const int32_t tiles = (qb - qa + BM - 1) / BM;
    const int32_t n_steps = tiles * group;
    const bool tail = klen < BN;  // the tile's KV range ends inside it (TMA loaded further tokens)

    float acc[D / 2];  // dV (P role) or dK (dS role): 64 x 256 fp32
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;

    mbar_wait(B.kv_full, kv_iter & 1);
    ++kv_iter;

    for (int32_t s = 0; s < n_steps; ++s, ++step) {
      const int32_t qt = qa + (s % tiles) * BM;
      const uint32_t st = step & 1;
      const uint32_t qb_s = q_smem + st * C::kQBytes;
      const uint32_t dob_s = do_smem + st * C::kQBytes;
      mbar_wait(&B.qdo_full[st], (step >> 1) & 1);

      // S^T = K Q^T (P role) or dP^T = V dO^T (dS role).
      const uint32_t b_first = p_role ? qb_s : dob_s;
      float sacc[BM / 2];
      if (!p_role) named_bar_sync(kBwdSBarrier, 256);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t box = kk / 4, within = (kk % 4) * 32;
        MmaS::ss(sacc, make_desc_sw128(a_rows + box * C::kKVBoxBytes + within, 16, 1024),
                 make_desc_sw128(b_first + box * C::kQBoxBytes + within, 16, 1024), kk > 0 ? 1 : 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(sacc);
      // The racecheck build syncs here too. With bar.arrive here, racecheck reported WAR hazards on P^T
      // (the dS role's read of step s against the P role's write of step s + 1, which barrier 1 orders) in 3
      // of 6 runs, softcap kernels in deterministic mode (session 45, one H100): whether this arrive is what
      // misleads it is the next racecheck run's question (docs/notes/2026-12-06-d256-bwd-racecheck.md).
      if (p_role) bwd_handoff(kBwdSBarrier, 256, /*signal=*/true);

      // A fragments (m = kv, k = q) of P^T (P role) or dS^T (dS role).
      uint32_t frag[BM / 4];
      if (p_role) {
        const float* lse_s = s_lse + st * BM;
        // The sliding window (issue 16): the step's farthest pair (last query, first KV row) hidden.
        bool win = false;
        if constexpr (Mods::kWindow) win = SegmentMask::window_tile(qt + BM - 1, k0, bias, a.window);
        if constexpr (Mods::kSoftcap) {
          static_assert(!kPrefix, "sm90 backward d256: prefix items are instantiated without modifiers");
          // Mask modifiers (issue 16): as bwd_softmax_p from the capped scores; the dS role gets P^T
          // times the cap's derivative (dS^T = that (dP^T - delta)), stored as each 4 are known,
          // and this role keeps P^T in sacc for dV (A fragments below).
          const bool mask = tail || qt < k0 + BN - 1 || win;
#pragma unroll
          for (int j = 0; j < BM / 8; ++j) {
            const int c = j * 8 + 2 * t4;
            const float2 l2 = *reinterpret_cast<const float2*>(lse_s + c);
            float pg[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const SoftcapFromExp cap = softcap_of(sacc[4 * j + e], a);
              float pv = fast_exp2(fmaf(cap.score(a.softcap), 1.4426950408889634f, -((e & 1) ? l2.y : l2.x)));
              if (mask) {
                const int r = kv_row0 + (e >> 1) * 8;
                if (r >= klen || k0 + r > qt + c + (e & 1)) pv = 0.f;
                if constexpr (Mods::kWindow) {
                  if (SegmentMask::window_hidden(k0 + r, qt + c + (e & 1), bias, a.window)) pv = 0.f;
                }
              }
              sacc[4 * j + e] = pv;
              pg[e] = pv * cap.grad();
            }
            bwd_st_shared_v4(p_thread + j * 2048, __float_as_uint(pg[0]), __float_as_uint(pg[1]),
                             __float_as_uint(pg[2]), __float_as_uint(pg[3]));
          }
        } else {
        if (prefix_item)  // every query of the range sees every row: only a ragged end is masked
          bwd_softmax_p<BM / 2, false>(sacc, lse_s, sl2, t4, kv_row0, klen, k0, qt, tail);
        else
          bwd_softmax_p<BM / 2, true, Mods::kWindow>(sacc, lse_s, sl2, t4, kv_row0, klen, k0, qt,
                                                     tail || qt < k0 + BN - 1 || win, bias, a.window);
#pragma unroll
        for (int i = 0; i < BM / 8; ++i)
          bwd_st_shared_v4(p_thread + i * 2048, __float_as_uint(sacc[4 * i]), __float_as_uint(sacc[4 * i + 1]),
                           __float_as_uint(sacc[4 * i + 2]), __float_as_uint(sacc[4 * i + 3]));
        }
        bwd_handoff(kBwdPBarrier, 256, /*signal=*/true);
      } else {
        named_bar_sync(kBwdPBarrier, 256);
        const float* delta_s = s_delta + st * BM;
#pragma unroll
        for (int j = 0; j < BM / 8; ++j) {
          const uint4 pq = bwd_ld_shared_v4(p_thread + j * 2048);
          const float pv[4] = {__uint_as_float(pq.x), __uint_as_float(pq.y), __uint_as_float(pq.z),
                               __uint_as_float(pq.w)};
          const float2 d2 = *reinterpret_cast<const float2*>(delta_s + j * 8 + 2 * t4);
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[4 * j + e] = pv[e] * (sacc[4 * j + e] - ((e & 1) ? d2.y : d2.x));
        }
      }
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
#pragma unroll
        for (int i = 0; i < 4; ++i) frag[4 * kk + i] = Convert<T>::pack(sacc[8 * kk + 2 * i], sacc[8 * kk + 2 * i + 1]);
      }

      // dV += P^T dO (P role) or dK += dS^T Q (dS role): B = dO / Q [q][d] read N-major.
      const uint32_t b_kv = p_role ? dob_s : qb_s;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk)
        MmaKV::rs(acc, &frag[4 * kk], make_desc_sw128(b_kv + kk * 16 * 128, C::kQBoxBytes, 1024), 1);
      wgmma_commit();

      if constexpr (kAtomicDq) {
        if (!p_role) {
          // dS^T (kv x q fragments) -> dS [q][kv], one 128B-swizzled box of 64 kv columns.
          const int m = lane >> 3;
          const int kvl = warp * 16 + (m & 1) * 8;
          const uint32_t chunk = static_cast<uint32_t>(kvl / 8);
#pragma unroll
          for (int kk = 0; kk < BM / 16; ++kk) {
            const uint32_t q = kk * 16 + (m >> 1) * 8 + (lane & 7);
            bwd_stmatrix_x4_trans(ds_buf + q * 128 + ((chunk ^ (q & 7)) << 4), frag[4 * kk + 0], frag[4 * kk + 1],
                                  frag[4 * kk + 2], frag[4 * kk + 3]);
          }
          bwd_fence_proxy_async();
        }
        // Retire dV / dK first: their A fragments then die before the dQ accumulators live (with
        // both, 128 + 16 + 64 registers, ptxas serialises the wgmmas).
        wgmma_wait<0>();
        fence_regs(acc);
        fence_regs(frag);
        // Q, dO, lse and delta of the stage are no longer read (dQ reads only dS and K); the stage
        // is released by the dQ writer, after the dQ staged in it has been read.
        named_bar_sync(kBwdDsBarrier, 256);  // dS of the step written
        float dq[C::kDqN / 2];
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          MmaQ::ss(dq, make_desc_sw128(ds_buf + kk * 32, 16, 1024),
                   make_desc_sw128(k_dq + kk * 16 * 128, C::kKVBoxBytes, 1024), kk > 0 ? 1 : 0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_regs(dq);
        // Stage this warpgroup's dQ half in the step's Q (P role) or dO (dS role) stage: rows
        // r0 = 16 warp + g and r0 + 8 (one 32-row block), its 128 columns in two boxes
        // (bwd_stage_dq_fragment: conflict-free per half-warp). Both warpgroups passed barrier 1 after
        // retiring dV and dK, so no wgmma reads either buffer any more. Rows >= qb as 0: the reduce
        // box always covers 32 rows.
        const int r0 = warp * 16 + g;
        const bool v0 = qt + r0 < qb, v1 = qt + r0 + 8 < qb;
        const uint32_t row_base = bwd_dq_row_base(p_role ? qb_s : dob_s, C::kDqBoxCols, r0, 0, t4);
        bwd_stage_dq_fragment(row_base, dq, g, t4, /*col0=*/0, v0, v1);
        // Generic-proxy stores before the writer's async-proxy (TMA) reads.
        bwd_fence_proxy_async();
        __syncwarp();
        if (kBwdDqFullCount != kBwdConsumerWarps || lane == 0) mbar_arrive(&B.dq_full[st]);
      } else {
        wgmma_wait<0>();
        fence_regs(acc);
        fence_regs(frag);
        __syncwarp();
        if (kBwdQdoEmptyCount != kBwdConsumerWarps || lane == 0) mbar_arrive(&B.qdo_empty[st]);
        // The dS warpgroup has loaded P^T of this step; the P warpgroup may rewrite it next step.
        bwd_handoff(kBwdDsBarrier, 256, /*signal=*/!p_role);
      }
    }
    // K and V are free: the producer may load the next item's tile during the epilogue.
    __syncwarp();
    if (lane == 0) mbar_arrive(B.kv_empty);

    // Epilogue: dK scaled by the softmax scale (dS role) and dV (P role), or fp32 partials
    // (unscaled, all 64 rows) for a split item: [slot][hk][0] = dK, [1] = dV.
    // The role's gradient (dK scaled, dV) in T for the tile's valid rows: added into the external
    // prefix's gradients (kAdd) or stored to dk / dv. The fields of `a` are read where they are used
    // (the stores may alias them for the compiler: passing them in as values changed the machine code).
    auto store_role_grad = [&](auto add) {
      constexpr bool kAdd = decltype(add)::value;
      const bool is_dk = !p_role;
      T* base = is_dk ? static_cast<T*>(kAdd ? a.prefix_dk : a.dk) +
                            static_cast<int64_t>(k0) * (kAdd ? a.pdk_ts : a.dk_ts) +
                            static_cast<int64_t>(hk) * (kAdd ? a.pdk_hs : a.dk_hs)
                      : static_cast<T*>(kAdd ? a.prefix_dv : a.dv) +
                            static_cast<int64_t>(k0) * (kAdd ? a.pdv_ts : a.dv_ts) +
                            static_cast<int64_t>(hk) * (kAdd ? a.pdv_hs : a.dv_hs);
      const int64_t ts = is_dk ? (kAdd ? a.pdk_ts : a.dk_ts) : (kAdd ? a.pdv_ts : a.dv_ts);
      const float sc = is_dk ? a.scale : 1.f;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = kv_row0 + hr * 8;
        if (r < klen) {
#pragma unroll
          for (int j = 0; j < D / 8; ++j) {
            const int col = j * 8 + 2 * t4;
            if constexpr (kAdd) {
              uint32_t* dst = reinterpret_cast<uint32_t*>(base + static_cast<int64_t>(r) * ts + col);
              const float2 old = Convert<T>::unpack(*dst);
              *dst = Convert<T>::pack(old.x + acc[4 * j + 2 * hr] * sc, old.y + acc[4 * j + 2 * hr + 1] * sc);
            } else {
              *reinterpret_cast<uint32_t*>(base + static_cast<int64_t>(r) * ts + col) =
                  Convert<T>::pack(acc[4 * j + 2 * hr] * sc, acc[4 * j + 2 * hr + 1] * sc);
            }
          }
        }
      }
    };
    if (prefix_item && pslot < 0) {
      // external prefix (issue 17): added into the prefix rows' gradients (one item per row).
      store_role_grad(std::true_type{});
    } else if (pslot < 0) {
      store_role_grad(std::false_type{});
    } else {
      float* base = a.partials + ((static_cast<int64_t>(pslot) * Hk + hk) * 2 + (p_role ? 1 : 0)) * BN * D;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        const int r = kv_row0 + hr * 8;
#pragma unroll
        for (int j = 0; j < D / 8; ++j) {
          const int col = j * 8 + 2 * t4;
          *reinterpret_cast<float2*>(base + r * D + col) = make_float2(acc[4 * j + 2 * hr], acc[4 * j + 2 * hr + 1]);
        }
      }
    }
  }
}

}  // namespace dualkv::cuda::sm90
