// Hopper forward kernel (sm_90a): one persistent CTA per SM, a producer warpgroup and two consumer
// warpgroups (three at D = 64 without a window: Sm90FwdConfig::kConsumerWGs).
//
//   warpgroup 0 (producer, 40 registers): one thread takes (query tile, head) items from the plan
//     through the atomic counter (with grouped-query attention, in fwd_packs_query_heads's kernels,
//     an item is a sub-range of the tile's tokens for all query heads of one KV head: fwd_item_order.h
//     fwd_item_rows, the params' pack_shift), hands each to the consumers through a 2-slot ring in
//     smem, and issues the TMA loads: the item's first K tile, its Q tile (kBlockM rows; at D 64 into the
//     other of two Q buffers, so it loads while the previous item still runs), then the rest of
//     the K and V tiles of the KV ranges the tile sees (ancestors from the parent to the root,
//     full; then its own segment up to its last query), into a kStages-deep ring completing on
//     mbarriers: K_j then V_j per tile; at D 256 and in the short-walk builds K_{j+1} before V_j
//     (kKAhead).
//   warpgroups 1, 2 [, 3] (consumers, 232 registers; 160 with three): 64 query rows each. Per KV tile j:
//     S_j = Q K_j^T (wgmma, both operands in smem), issued together with O += P_{j-1} V_{j-1}
//     (wgmma, P from registers, V in smem read N-major), so that the softmax of tile j overlaps
//     the P V product of tile j-1. Online softmax in fp32 with exp2; the scale is folded in.
//     Epilogue (D <= 128): O normalised into the warpgroup's smem box and stored by TMA (one thread
//     issues, the warpgroup goes on to its next item); ragged boxes and D 256 store per thread.
//   Masks: columns past the end of the KV range (a tile may overlap the next segment or run past
//   T, where TMA fills zeros), and the causal diagonal inside the query's own segment.
//
// Barriers (all mbarriers in smem):
//   item_full[2] / item_empty[2]   work item hand-off (producer -> consumers -> producer)
//   q_full[b] / q_empty[b]         Q buffer b loaded / every consumer warp done reading it (one
//                                  buffer, two at D 64: Sm90FwdConfig::kQBuffers; item n uses
//                                  buffer n % kQBuffers, its use n / kQBuffers of that buffer)
//   k_full[S], v_full[S] / kv_empty[S]   KV stage loaded / every consumer warp done with it
//   k_empty[S]                     every consumer warp done with the K tile of a stage: released
//                                  once S = Q K^T completes, so the next K load has a whole
//                                  iteration of slack (measured +24-37% against releasing K with
//                                  V after P V, H200, hdim 128); kv_empty guards V alone
//   named barrier kOBarrier + cw    consumer warpgroup cw's O staging box: free (its previous TMA
//                                  store has read it) / written and fenced (the store may go)
// Phases follow running counters kept identically by producer and consumers.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>
#include <stdint.h>

#include <type_traits>

#include "convert.cuh"
#include "dualkv/mask.h"
#include "kernel_params.h"
#include "modifiers.cuh"
#include "plan_reader.cuh"
#include "sm90/ptx.cuh"
#include "sm90/wgmma_ops.cuh"
#include "tile_size.h"

namespace dualkv::cuda::sm90 {

// ---- Kernels per walk length (issue 23) ----
// Some kernels are built twice, and the launcher runs the long-walk one for plans whose KV walks
// are long (FwdArgs::long_kv_walks, the plan key's bit, tile_size.h fwd_long_kv_walks):
// - Wide KV tiles (change #7; docs/notes/2026-12-02-fwd-long-layouts.md): the D-128 default kernel
//   (no modifiers, no external prefix) walks its KV ranges in tiles of sm90_fwd_block_n(D, wide) =
//   160 rows instead of 128 (tile_size.h says why 160; FA3 takes 176 for non-causal D 128, without
//   an O buffer), the D-256 one 80 instead of 64 (FA3 / FA4's width there). The modifier, window and
//   external-prefix kernels keep 128 / 64: their walks are short (window) or their registers are
//   tight.
// - Hidden tiles skipped (fwd_skips_hidden_tiles): the D-64 and D-256 kernels without softcap,
//   window or external prefix, for short walks, stop each warpgroup at the first own KV tile past
//   its rows (the kernel says how). Measured 2026-12-03 (H200, D 64, forward kernel time against
//   computing every tile, 5 rounds): small groups 0.888-0.896 (mean walk 0.5K), trees 0.907-0.941,
//   N16 P4K R1K 0.952-0.956 (4.2K), N64 P1K R512 0.943-0.953 (1.3K), N8 P256 R4K 0.979-0.981 (2.4K),
//   tiny responses 0.979-0.981, long responses 0.997-1.006, but N8 P2K R8K 1.067 (6.1K) and N8 P16K
//   R2K 1.038 (12.9K): its loop is slower where it skips nearly nothing, so long walks compute every
//   tile. With sinks 0.893-0.951 on 4 of those; with a 1,024-key window 0.998-1.053 (slower on 3 of
//   4), so not there. At D 256 (2026-12-04, 64-row tiles, two runs) small groups 0.956-0.976, the
//   tree 1.005-1.006 (1.7K) and 1.036-1.097 on the seven longer walks; with 80-row tiles 1.037-1.086
//   (ptxas spills 20 bytes there): so only its short-walk build (64-row tiles, walks under 1,024 keys,
//   tile_size.h). At D 128 0.968-1.036 (slower on 6 of 9 layouts); in the D-64 softcap kernels ptxas
//   spilled 40 bytes; external-prefix plans walk their prompts (long).
template <int D, typename Mods, bool kPrefix>
constexpr bool fwd_wide_tiles() {
  return (D == 128 || D == 256) && std::is_same_v<Mods, NoModifiers> && !kPrefix;
}
template <int D, typename Mods, bool kPrefix>
constexpr bool fwd_skips_hidden_tiles() {
  return (D == 64 || D == 256) && !Mods::kSoftcap && !Mods::kWindow && !kPrefix;
}
// Whether the kernel has a long-walk build that differs from its short-walk one.
template <int D, typename Mods, bool kPrefix>
constexpr bool fwd_has_long_walk_kernel() {
  return fwd_wide_tiles<D, Mods, kPrefix>() || fwd_skips_hidden_tiles<D, Mods, kPrefix>();
}

// kWindow: the sliding-window kernels, which run plans cut to a window (tile_size.h fwd_block_m).
// kLongWalks: the build for plans whose KV walks are long (wide KV tiles at D 128, above).
template <int D, bool kLongWalks = false, bool kWindow = false>
struct Sm90FwdConfig {
  static constexpr int kBlockM = fwd_block_m(D, TileFamily::kSm90, kWindow);  // query rows per tile (the plan's)
  // Consumer warpgroups, 64 query rows each: 3 at D = 64 without a window (192-row tiles, FA3/FA4's
  // D-64 forward: a 128-key tile's exponentials take as long as its two GEMMs there, so a third
  // warpgroup's softmax keeps the tensor cores busy while two take turns), 2 otherwise.
  static constexpr int kConsumerWGs = kBlockM / 64;
  static constexpr int kBlockN = sm90_fwd_block_n(D, kLongWalks);  // KV rows per tile
  static constexpr int kStages = 2;
  static constexpr int kBox = 64;                      // columns per TMA box (128 B of 16-bit)
  static constexpr int kBoxes = D / kBox;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // 384 threads: 232 / 40 (the launch's 168 each); 512: FA3's 160 / 32 (the launch's 128 each; the
  // softcap kernels spill 52 bytes there and still took 0.90-1.00x the two-warpgroup time).
  static constexpr int kConsumerRegs = kConsumerWGs == 3 ? 160 : 232;
  static constexpr int kProducerRegs = kConsumerWGs == 3 ? 32 : 40;
  static_assert(setmaxnreg_split_fits(kThreads, kProducerRegs, kConsumerRegs),
                "sm90: the consumers' setmaxnreg.inc would wait for registers the producer never returns");
  static constexpr uint32_t kQBytes = kBlockM * D * 2;
  static constexpr uint32_t kKVBytes = kBlockN * D * 2;  // one K (or V) tile
  static constexpr uint32_t kQBoxBytes = kBlockM * 128;
  static constexpr uint32_t kKVBoxBytes = kBlockN * 128;
  // Q buffers: two at D 64, so that the producer loads the next item's Q while this item's last
  // tiles run (docs/notes/2026-12-04-d64-fwd-q-double-buffer.md). With one, the next item's Q load
  // could only start once every consumer warp had retired the item's last S = Q K^T (q_empty), and
  // the next item's first S waited for the load's whole latency at every item transition. The
  // second buffer costs 24 KiB at D 64 (16 KiB in the window kernels' 128-row tiles): 140,448 B of
  // shared memory (115,872 B with a window), one CTA per SM as before. Above D 64 one: at D 256 and
  // in the D-128 kernels of 160-row KV tiles a second Q does not fit (230,528 B of 232,448 already);
  // the D-128 kernels of 128-row KV tiles would just fit (230,528 B) but stay single-buffered: at
  // D 64 the two buffers alone measured 0.993-1.000 of the forward kernel's time (2026-12-04); what
  // they buy there is the softmax before the walk (kSoftmaxBeforeWalk), which D 128 has already.
  static constexpr int kQBuffers = D == 64 ? 2 : 1;
  // smem: Q[buffers] | K[stages] | V[stages] | O (D <= 128) | barriers + item slots. Tiles 1024-byte
  // aligned (every Q buffer is a multiple of 1024 bytes: 64-row boxes of 128 bytes).
  static constexpr uint32_t kOffK = kQBuffers * kQBytes;
  static constexpr uint32_t kOffV = kOffK + kStages * kKVBytes;
  // The O epilogue through smem and a TMA store (issue 23, FA3's epilogue): a consumer warpgroup
  // stages its 64 normalised rows and hands them to the TMA engine instead of storing from
  // registers. Its own buffer, not Q's: the producer may be loading the next item's Q by then. At D
  // 256 the 64 KiB buffer does not fit next to Q, K, V (263 KB > 227 KB): per-thread stores there.
  static constexpr bool kOStaged = D <= 128;
  static constexpr uint32_t kOBytes = kOStaged ? kBlockM * D * 2 : 0;
  static constexpr uint32_t kOWgBytes = kOBytes / kConsumerWGs;  // one consumer warpgroup's 64 rows
  // Named barriers: 1 .. kConsumerWGs the consumers' turn-taking, then one per warpgroup's O box.
  static constexpr uint32_t kOBarrier = 1 + kConsumerWGs;
  static constexpr uint32_t kOBoxBytes = 64 * 128;      // 64 rows x 64 columns, 128B swizzle
  static constexpr uint32_t kOffO = kOffV + kStages * kKVBytes;
  static constexpr uint32_t kOffBar = kOffO + kOBytes;
  // k_full, v_full, kv_empty, k_empty per stage; q_full, q_empty; item_full[2], item_empty[2]; the
  // item slots (16 bytes); with two Q buffers their q_full[2], q_empty[2] after k_empty (Sm90Barriers).
  static constexpr uint32_t kBarBytes = 8 * (4 * kStages + 2 + 4) + 16 + (kQBuffers == 2 ? 32 : 0);
  static constexpr uint32_t kSmemBytes = kOffBar + kBarBytes + 1024;  // + alignment slack
  static_assert(D % 64 == 0, "head dim must be a multiple of 64");
  static_assert(kQBuffers == 1 || kQBuffers == 2, "one or two Q buffers");
  static_assert(kQBytes % 1024 == 0, "every Q buffer starts 1024-byte aligned (128B swizzle)");
  static_assert(kBlockM % 64 == 0 && (kConsumerWGs == 2 || kConsumerWGs == 3), "64 query rows per consumer warpgroup");
  static_assert(kOBarrier + kConsumerWGs <= 16, "named barriers 0..15");
  static_assert(kSmemBytes <= kSm90SmemOptinBytes,
                "sm90 forward: Q, the K / V stages and O do not fit in shared memory");
};

template <int D>
struct Sm90FwdParams {
  FwdArgs a;
  CUtensorMap tq, tk, tv;
  int32_t tile_window;  // decode_fwd_item (fwd_item_order.h): tiles per window, clamped to the plan's
  int32_t head_run;     // decode_fwd_item: query heads per run, divides H (the launcher checks)
  // fwd_item_rows (fwd_item_order.h): log2 of the query heads packed into one item's tile rows (0:
  // one head per item); tq's box is then 2^pack_shift heads by kBlockM >> pack_shift tokens, to's
  // 2^pack_shift heads by 64 >> pack_shift tokens.
  int32_t pack_shift;
  CUtensorMap tpk, tpv;  // external prefix (issue 17): the prefix K / V buffers (prefix kernels only)
  // The O epilogue's TMA store (Sm90FwdConfig::kOStaged): the output's map, boxes of 64 rows, and
  // whether it could be made (o_tma = 0: out is not TMA-aligned, every tile stores per thread).
  CUtensorMap to;
  int32_t o_tma;
  // The per-thread O epilogue's 16-byte stores (kernels without kOStaged, D 256; fwd_o_row_stg128):
  // whether out's base and strides are 16-byte aligned (otherwise the 4-byte pair stores).
  int32_t o_vec16;
};

// Which kernels pack query heads (Sm90FwdParams::pack_shift; the launcher sets 0 for the others, and
// they fold it away as a constant): every kernel at D 64 and 128; at D 256 only the short-walk build of
// the kernels that have a long-walk one (fwd_has_long_walk_kernel: no softcap, window or external
// prefix), which runs the plans of short walks. Measured 2026-12-07 (one H100, forward kernel time
// against the unpacked kernels, A/A beside; docs/notes/2026-12-07-fwd-packed-query-heads.md): D 128
// 0.862-0.998 and D 64 0.858-0.975 on six layouts; at D 256 small groups 0.884 (0.877 with sinks), but
// every form of the long-walk build lost 2-11% on long walks (§4, §6 there), and the window kernels,
// which walk long plans too, took 1.02-1.03 packed and 1.09-1.16 with the packing code left in and one
// head per item (§7). The D-64 / 128 window kernels pack only where the plan's query tiles are ragged
// (tile_size.h fwd_ragged_tiles); elsewhere their unpacked build runs (below; §8 there).
template <int D, typename Mods, bool kPrefix, bool kLongWalks>
constexpr bool fwd_packs_query_heads() {
  return D <= 128 || (!kLongWalks && fwd_has_long_walk_kernel<D, Mods, kPrefix>());
}
// The kernels with an unpacked build (the kernel's kUnpacked: no packing code, one query head per
// item): the window kernels that pack. Their launches on full tiles or with a group that does not
// pack run it: measured 2026-12-07 (one H100, 5 rounds, A/A beside; the note §8), the packed D-64
// window + sinks kernel with pack_shift 0 took 1.017 / 1.020 of the pre-packing kernel's time on long
// responses / N8 P16K R2K (gpt-oss's sliding layers on full tiles), the unpacked build 0.998 / 0.997.
template <int D, typename Mods, bool kPrefix>
constexpr bool fwd_has_unpacked_kernel() {
  return Mods::kWindow && !kPrefix && fwd_packs_query_heads<D, Mods, kPrefix, false>();
}
template <bool kPacks, int D>
__device__ __forceinline__ int32_t fwd_pack_shift(const Sm90FwdParams<D>& p) {
  if constexpr (kPacks) return p.pack_shift;
  return 0;
}

// Tokens between a thread's two fragment rows g and g + 8 (8 rows): 8 >> pack_shift with packed
// query heads (G = 2^pack_shift <= 16 divides 8 rows, or at 16 both rows are one token's). Computed
// where it is used, from the parameter (volatile, so that ptxas does not keep the second row's token
// in a register through the KV loop; the measured form, a plain shift was not measured).
template <bool kPacks, int D>
__device__ __forceinline__ int32_t fwd_row_step(const Sm90FwdParams<D>& p) {
  if constexpr (!kPacks) return 8;
  int32_t step;
  asm volatile("shr.s32 %0, 8, %1;\n" : "=r"(step) : "r"(p.pack_shift));
  return step;
}
// Query heads between them: none when G divides 8, else (G = 16) 8.
template <bool kPacks, int D>
__device__ __forceinline__ int32_t fwd_row_head_step(const Sm90FwdParams<D>& p) {
  return 8 & ((1 << fwd_pack_shift<kPacks>(p)) - 1);
}

struct Sm90Barriers {
  uint64_t* k_full;
  uint64_t* v_full;
  uint64_t* kv_empty;
  uint64_t* k_empty;
  uint64_t* q_full;   // [kQBuffers]: Q buffer b loaded
  uint64_t* q_empty;  // [kQBuffers]: every consumer warp done reading Q buffer b
  uint64_t* item_full;
  uint64_t* item_empty;
  // The 2-slot ring's items. In the short-walk builds (kDecodedItems) the producer decodes them: slot i
  // holds items[i], the plan index of the item's tile (its kFwdItemInts ints; -1 after the last
  // item), and items[2 + i], its head. The long-walk builds hand over the claimed item index in
  // items[i], which their consumers decode.
  int32_t* items;
};

// ---- The O epilogue through smem and a TMA store (Sm90FwdConfig::kOStaged, issue 23) ----
// Per consumer warpgroup cw: its 64 rows in kOWgBytes of smem (D / 64 boxes of 64 rows x 128 B,
// 128B swizzle: row r's 16-byte chunk c at chunk c ^ (r % 8)), named barrier kOBarrier + cw, and
// the warpgroup's first thread issues the TMA stores (one bulk group per item) and waits for them.
// Addresses are 32-bit smem addresses, and every per-thread value is derived from the thread index
// read afresh in the epilogue: nothing new stays live through the KV loop (per-thread values the
// compiler hoisted out of the item loop made the softcap kernels spill, 16 bytes).

__device__ __forceinline__ bool fwd_o_store_thread() { return thread_index_x() % 128 == 0; }

// Before staging: the warpgroup's previous store has finished reading its smem (issued an item
// ago, so this rarely waits).
__device__ __forceinline__ void fwd_o_staging_acquire(uint32_t bar) {
  if (fwd_o_store_thread()) bulk_wait_group_read<0>();
  named_bar_sync(bar, 128);
}

// Row r (0: row g, 1: row g + 8 of the warp's 16-row slice) of the accumulator fragment, times inv,
// as element pairs. `thread`: the thread's index in the warpgroup, from thread_index_x() read in the
// epilogue, so that the per-thread addresses are computed here and not hoisted out of the item loop.
// Row `row` has row % 8 == g, so chunk c lands at ((c ^ g) * 16) = (g * 16) ^ (c * 16) within the
// row (the row's base has bits 4-6 clear). Per store instruction the warp's 8 rows x 4 pairs land in
// 32 distinct banks.
template <typename T, int D>
__device__ __forceinline__ void fwd_o_stage_row(uint32_t sOw, const float (&o)[D / 2], int r, float inv,
                                                uint32_t thread) {
  const uint32_t lane = thread % 32, g = lane / 4, t4 = lane % 4;
  const uint32_t row = (thread / 32) * 16 + g + r * 8;
  const uint32_t srow = (sOw + row * 128 + 4 * t4) | (g * 16);
#pragma unroll
  for (int j = 0; j < D / 8; ++j)
    st_shared_u32((srow ^ ((j % 8) * 16)) + (j / 8) * (64 * 128),
                  Convert<T>::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv));
}

// After staging: every thread's writes made visible to the async proxy, then one thread stores the
// warpgroup's boxes (columns b * 64, head h, tokens [row0, row0 + 64)).
template <int D>
__device__ __forceinline__ void fwd_o_staging_release(const CUtensorMap* to, uint32_t sOw, uint32_t bar, int h,
                                                      int32_t row0) {
  fence_proxy_async_smem();
  named_bar_sync(bar, 128);
  if (fwd_o_store_thread()) {
#pragma unroll
    for (int b = 0; b < D / 64; ++b) tma_store_3d(to, sOw + b * (64 * 128), b * 64, h, row0);
    bulk_commit_group();
  }
}

// The steady loop's count (fwd_sm90_kernel, kSteadyLoop): the tiles from the walk's current one on
// that are full, unmasked and not their range's last. Those that end before the range does (so the
// walk stays in it: next() only steps pos += BN) and, in an own range, end at or before the tile's
// first row q0 (no causal mask for any row: mask_scores' diagonal test; a tile of siblings has none,
// its own ranges start at or after q0). Both bounds only shrink along a range, so the steady tiles
// are a prefix of the rest of it, and the tile after them is a range's last, the diagonal's first,
// or (count 0) any other. The count is at most (rest - 1) / BN, so before the k-th of c steady tiles
// (k from 0) the range holds rest >= (c - k) BN + 1 > BN keys, and after its step >= 1: the steady
// tile's schedule boundaries test exactly that, false whatever the plan and the offsets hold.
// The shuffle says the count is warp-uniform (the walk is the same in every lane), as drain_walk's
// does for kv_iter; in ptxas 13.0's SASS it is gone: the walk sits in uniform registers, and so does
// the count.
template <int BN>
__device__ __forceinline__ int32_t fwd_steady_tiles(const KvWalk<BN>& kv, int32_t q0) {
  int32_t steady = (kv.rest() - 1) / BN;
  if (kv.own) steady = min(steady, max(q0 + 1 - kv.pos, 0) / BN);
  return __shfl_sync(0xffffffffu, steady, 0);
}

// ---- The per-thread O epilogue in 16-byte stores (kernels without kOStaged: D 256) ----
// The accumulator fragment gives lane (g, t4) of a warp the pair of columns 8 j + 2 t4 of its rows g
// and g + 8, for every 8-column chunk j: stored as they are, each STG.32 of a warp covers 8 rows x
// 16 B (half a sector per row), 64 of them per thread at D 256 (note 2026-12-04-d256-fwd-ncu §2.6).
// Here the quad of lanes sharing a row trades its pairs so that lane t4 holds the whole chunk
// 4 k + t4 (its four pairs, from lanes 0..3 in column order): one STG.128 per chunk, 16 per thread,
// each warp store 8 rows x 64 B (two full sectors per row). The values are the same packed pairs
// (same products, same conversion), only moved between lanes: O is bit for bit the same.
//
// A 4 x 4 transpose of 32-bit words across the quad, in three SHFLs: v[x] (after the first
// permutation) = a[x ^ t4] goes to lane t4 ^ x, which receives a_{t4 ^ x}[t4], the pair lane t4 ^ x
// holds of the chunk lane t4 is to store; the second permutation puts it at word t4 ^ x. A register
// array cannot be indexed by the lane, so each permutation by t4 is two conditional swap steps
// (bit 0, then bit 1 of t4: eight selects).
__device__ __forceinline__ void quad_xor_permute(uint32_t (&v)[4], uint32_t t4) {
  uint32_t w[4];
#pragma unroll
  for (int x = 0; x < 4; ++x) w[x] = (t4 & 1) ? v[x ^ 1] : v[x];
#pragma unroll
  for (int x = 0; x < 4; ++x) v[x] = (t4 & 2) ? w[x ^ 2] : w[x];
}

// One 16-byte global store, if `store`. In PTX with the predicate inside: NVVM splits a plain
// uint4 store of the first chunk (offset t4 * 16 from the row) into four 4-byte stores,
// __builtin_assume_aligned or not, and a C++ `if` around an asm store became a branch per chunk.
// Volatile keeps it in order with the other asm; no "memory" clobber: nothing in the kernel reads
// O back.
__device__ __forceinline__ void st_global_v4_if(void* p, const uint32_t (&v)[4], bool store) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %5, 0;\n@p st.global.v4.b32 [%0], {%1, %2, %3, %4};\n}\n" ::"l"(p),
               "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]), "r"(static_cast<uint32_t>(store)));
}

// The sliding window (issue 16) on a warpgroup's S fragment (n8 blocks, rows of tokens qi0 and
// qi0 + qstep of the thread (fragment rows g and g + 8: qstep 8, or fwd_row_step with packed query
// heads), columns from kpos), on the tiles whose farthest pair (the warpgroup's last token q_last) it
// hides: pos(q) - pos(k) = (q - k) + shift for the walk's range. The forward's mask_scores and the dQ
// kernel's.
template <int N>
__device__ __forceinline__ void fwd_window_mask(float (&s)[N], int32_t kpos, int32_t q_last, int32_t qi0, int32_t qstep,
                                                int32_t t4, int32_t shift, int32_t window) {
  if (!SegmentMask::window_tile(q_last, kpos, shift, window)) return;
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int32_t qi = qi0 + (e >> 1) * qstep;
      if (SegmentMask::window_hidden(kpos + j * 8 + 2 * t4 + (e & 1), qi, shift, window)) s[4 * j + e] = -CUDART_INF_F;
    }
  }
}

// Row r (0: row g, 1: row g + 8) of the accumulator fragment, times inv, in 16 B stores to `orow`
// (the row's first element, 16-byte aligned). The SHFLs run on every lane (full mask: the caller
// calls this outside any per-lane branch); `store` (row inside the item, the same for the quad's
// four lanes) masks only the stores, so a ragged tile's rows past the item's end stay unwritten.
template <typename T, int D>
__device__ __forceinline__ void fwd_o_row_stg128(T* orow, const float (&o)[D / 2], int r, float inv, uint32_t t4,
                                                 bool store) {
  T* const chunk0 = orow + t4 * 8;  // this lane's chunk for k = 0; for k it lies 32 k elements (64 k B) on
#pragma unroll
  for (int k = 0; k < D / 32; ++k) {
    uint32_t v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int j = 4 * k + i;  // chunk j: columns 8 j + 2 t4, 8 j + 2 t4 + 1 (as the STG.32 path)
      v[i] = Convert<T>::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
    quad_xor_permute(v, t4);  // v[x] = a[x ^ t4]: the word for lane t4 ^ x
#pragma unroll
    for (int x = 1; x < 4; ++x) v[x] = __shfl_xor_sync(0xffffffffu, v[x], x);  // v[x] = a_{t4 ^ x}[t4]
    quad_xor_permute(v, t4);  // v[s] = a_s[t4]: chunk 4 k + t4's pairs in column order
    st_global_v4_if(chunk0 + k * 32, v, store);
  }
}

// Whether a [T, H, D] output (16-bit elements, strides in elements) allows fwd_o_row_stg128's 16-byte
// row stores: base, token stride and head stride 16-byte aligned. The forward's out (and, with
// positive strides, its TMA store), the dQ kernel's dq.
inline bool rows_allow_stg128(const void* base, int64_t token_stride, int64_t head_stride, int H) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && token_stride % 8 == 0 && (H == 1 || head_stride % 8 == 0);
}

// Ping-pong: the two consumer warpgroups take turns issuing their wgmma batches (named barriers 1
// and 2), so that one's softmax runs while the other's matrix products occupy the tensor cores.
// Mods: the mask modifiers compiled in (modifiers.cuh); NoModifiers is the default kernel.
// kPrefix (external prefix, issue 17): the walk may enter an external root's prefix rows; the
// producer loads those tiles through the prefix buffers' tensor maps (one uniform choice per tile)
// and the consumers mask them as ancestor tiles (never diagonal); instantiated with NoModifiers
// only. The default instantiation is the kernel as it was before either.
// kLongWalks: the build for plans of long KV walks (fwd_has_long_walk_kernel says which kernels
// have one: 160-row KV tiles, or every tile computed instead of skipping the hidden ones).
// kUnpacked: the build without packed query heads (fwd_has_unpacked_kernel says which kernels have one).
template <typename T, int D, typename Mods = NoModifiers, bool kPrefix = false, bool kLongWalks = false,
          bool kUnpacked = false>
__global__ void __launch_bounds__(Sm90FwdConfig<D, false, Mods::kWindow>::kThreads, 1)
fwd_sm90_kernel(const __grid_constant__ Sm90FwdParams<D> p) {
  static_assert(!kLongWalks || fwd_has_long_walk_kernel<D, Mods, kPrefix>(),
                "sm90 forward: no long-walk build of this kernel");
  static_assert(!kUnpacked || fwd_has_unpacked_kernel<D, Mods, kPrefix>(),
                "sm90 forward: no unpacked build of this kernel");
  using C = Sm90FwdConfig<D, kLongWalks, Mods::kWindow>;
  constexpr int BN = C::kBlockN, S = C::kStages;
  // Packed query heads (fwd_item_order.h fwd_item_rows): whether this kernel reads the params' pack_shift.
  constexpr bool kPacks = !kUnpacked && fwd_packs_query_heads<D, Mods, kPrefix, kLongWalks>();
  // D 256, and the short-walk builds of D 64 / 128: the producer loads each tile's K before the
  // previous tile's V (FA3 / FA4's producer order), so that K_{j+1}'s load waits only for K_{j-1}'s
  // release (both warpgroups' S_{j-1} retired) instead of also for V_{j-2}'s (their P V_{j-2}, a
  // softmax later), and it leaves ahead of V_j instead of behind it. Nsight Compute on long
  // responses (D 256, 80-row tiles, H200, 2026-12-04; docs/notes/2026-12-04-d256-fwd-ncu.md): the
  // consumers' wait for K at the loop top held 7% of all warp samples (89K long-scoreboard samples
  // at one branch, 19.3 samples per warp and tile with the loop top against FA4's 9.6 for its K and
  // V waits together), V's 0.6%.
  // At D 64 / 128 it pays only with the late V wait (kLateVWait, below; K ahead alone: 0.996-1.035),
  // and only in the short-walk builds: forward kernel time (H200, profiler, 11 rounds, 2026-12-04;
  // docs/notes/2026-12-04-fwd-k-ahead-d64-d128.md) 0.975-0.985 at D 64 and 0.990-0.997 at D 128 on
  // seven short-walk layouts; in the long-walk builds (N8 P16K, N8 P2K R8K) 1.000-1.027 over two
  // runs, within this size's run-to-run spread, so they keep the old order.
  constexpr bool kKAhead = D == 256 || !kLongWalks;
  // The short-walk builds' producer decodes each item and hands over its tile's plan index and its
  // head (Sm90Barriers::items), so their consumers keep no plan value live and skip the decode's
  // divisions (small groups 0.982 / 0.985 / 0.996 of the kernel's time at D 64 / 128 / 256, one
  // H100, session 62). The long-walk builds hand over the claimed index: with decoded items ptxas
  // scheduled the D-256 kernel's O rescale after the V wait instead of under QK^T (N8 P16K R2K
  // 1.04; D 64 1.09 there).
  constexpr bool kDecodedItems = !kLongWalks;
  // Walk-to-rows (below, at the walk's start) in the long-walk builds at D 128 and 256. Not D 64:
  // its long-walk loop grew from 690 to 697 instructions with it (R2UR +7).
  constexpr bool kWalkToRows = kLongWalks && D != 64;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t pad = (1024u - (smem_u32(smem_raw) & 1023u)) & 1023u;
  uint8_t* smem = smem_raw + pad;
  uint8_t* sQ = smem;
  uint8_t* sK = smem + C::kOffK;
  uint8_t* sV = smem + C::kOffV;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + C::kOffBar);
  Sm90Barriers B;
  B.k_full = bars;
  B.v_full = bars + S;
  B.kv_empty = bars + 2 * S;
  B.q_full = bars + 3 * S;
  B.q_empty = bars + 3 * S + 1;
  B.item_full = bars + 3 * S + 2;
  B.item_empty = bars + 3 * S + 4;
  B.items = reinterpret_cast<int32_t*>(bars + 3 * S + 6);
  B.k_empty = bars + 3 * S + 8;
  if constexpr (C::kQBuffers == 2) {
    // Two per array, after k_empty (kBarBytes counts them); the single-buffer slots above stay
    // unused, so the one-buffer kernels' barrier addresses are as they were.
    B.q_full = bars + 4 * S + 8;
    B.q_empty = bars + 4 * S + 10;
  }

  const FwdArgs& a = p.a;
  const LayoutPtrs& L = a.layout;
  const int32_t* plan = a.plan;
  if (!plan_matches(plan, L)) return;
  const int32_t n_tiles = plan[kHdrNumFwd];
  const int32_t* items = plan + plan[kHdrFwdOffset];
  const int H = a.num_heads;
  const int group = H / a.num_kv_heads;
  const int32_t n_items = n_tiles * H;
  const int32_t window = clamp_fwd_window(p.tile_window, n_tiles);

  constexpr uint32_t kConsumerWarps = 4 * C::kConsumerWGs;
  if (threadIdx.x == 0) {
    for (int i = 0; i < S; ++i) {
      mbar_init(&B.k_full[i], 1);
      mbar_init(&B.v_full[i], 1);
      mbar_init(&B.kv_empty[i], kConsumerWarps);
      mbar_init(&B.k_empty[i], kConsumerWarps);
    }
    for (int b = 0; b < C::kQBuffers; ++b) {
      mbar_init(&B.q_full[b], 1);
      mbar_init(&B.q_empty[b], kConsumerWarps);
    }
    for (int i = 0; i < 2; ++i) {
      mbar_init(&B.item_full[i], 1);
      mbar_init(&B.item_empty[i], kConsumerWarps * kArrivalsPerWarp);
    }
    mbar_fence_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ------------------------------------------------------------------ producer
    setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x != 0) return;
    tma_prefetch_desc(&p.tq);
    tma_prefetch_desc(&p.tk);
    tma_prefetch_desc(&p.tv);
    if constexpr (kPrefix) {
      tma_prefetch_desc(&p.tpk);
      tma_prefetch_desc(&p.tpv);
    }
    uint32_t q_iter = 0, kv_iter = 0;
    for (uint32_t n = 0;; ++n) {
      const uint32_t slot = n & 1, ph = (n >> 1) & 1;
      mbar_wait(&B.item_empty[slot], ph ^ 1);
      const int32_t item = atomicAdd(a.counter, 1);
      int32_t tile = -1;  // past the last item
      int h = 0;
      if constexpr (kDecodedItems) {
        if (item < n_items) decode_fwd_item(item, n_tiles, H, window, p.head_run, tile, h);
        B.items[slot] = tile < 0 ? -1 : static_cast<int32_t>(items - plan) + tile * kFwdItemInts;
        B.items[2 + slot] = h;
        mbar_arrive(&B.item_full[slot]);
        if (tile < 0) break;
      } else {
        B.items[slot] = item;
        mbar_arrive(&B.item_full[slot]);
        if (item >= n_items) break;
        decode_fwd_item(item, n_tiles, H, window, p.head_run, tile, h);
      }
      // The item's rows (packed query heads: a sub-range of the tile's tokens for G heads), as the
      // consumers take them; an empty sub-range (past a ragged tile's end) is no work for anyone.
      const FwdItemRows rows =
          fwd_item_rows(items[tile * kFwdItemInts + 0], items[tile * kFwdItemInts + 1],
                        items[tile * kFwdItemInts + 2], L.offsets, h, fwd_pack_shift<kPacks>(p), C::kBlockM);
      if (kPacks && rows.q0 >= rows.q1) continue;
      const int32_t seg = rows.seg, q0 = rows.q0, q1 = rows.q1, qh = rows.head0;
      const int hk = qh / group;  // (the item's heads are one KV head's)

      KvWalk<BN> kv;
      // The sliding window (mask modifiers, issue 16): the walk from the tile's first position on,
      // as the consumers walk it.
      int32_t first_pos = 0;
      if constexpr (kPrefix) {
        kv.init(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets, seg, q1);
      } else if constexpr (Mods::kWindow) {
        first_pos = SegmentMask::window_first_position(L.offsets, L.position_offset, seg, q0, a.window);
        kv.init_windowed(L.offsets, L.parent, L.position_offset, seg, q1, first_pos);
      } else {
        kv.init(L.offsets, L.parent, seg, q1);
      }
      if constexpr (kKAhead) {
        // K one tile ahead of V (kKAhead, above): K_0, Q, then per tile j the next tile's K_{j+1}
        // before this tile's V_j. The stage and barrier arithmetic is the other loop's: tile j's K
        // and V go to stage j % S; each wait is for the release of the same buffer's previous use.
        const auto load_k = [&](uint32_t it) {
          const uint32_t st = it % S, kph = (it / S) & 1;
          const CUtensorMap* tk = kPrefix && kv.prefix ? &p.tpk : &p.tk;
          mbar_wait(&B.k_empty[st], kph ^ 1);
          mbar_arrive_expect_tx(&B.k_full[st], C::kKVBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load_3d(sK + st * C::kKVBytes + b * C::kKVBoxBytes, tk, &B.k_full[st], b * 64, hk, kv.pos);
        };
        load_k(kv_iter);
        {
          // Q after the first K tile, as in the other loop (whose comment says why its q_empty wait
          // is safe; with K ahead the argument is the same: this wait still follows the first K
          // load's stage wait, and the next tile's K load comes after it). Written out in both
          // loops: shared as a lambda, ptxas reorders register moves in the D-64 / D-128 window
          // kernels (8 each, same instruction count; tried 2026-12-04), whose SASS stays main's.
          const uint32_t qb = q_iter % C::kQBuffers, q_use = q_iter / C::kQBuffers;
          mbar_wait(&B.q_empty[qb], (q_use & 1) ^ 1);
          mbar_arrive_expect_tx(&B.q_full[qb], C::kQBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load_3d(sQ + qb * C::kQBytes + b * C::kQBoxBytes, &p.tq, &B.q_full[qb], b * 64, qh, q0);
          ++q_iter;
        }
        bool more;
        do {
          // This tile's V: its row and tensor map, read before the walk moves on.
          const int32_t vpos = kv.pos;
          const CUtensorMap* tv = kPrefix && kv.prefix ? &p.tpv : &p.tv;
          more = kPrefix          ? kv.next(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets)
                 : Mods::kWindow ? kv.next_windowed(L.offsets, L.parent, L.position_offset, first_pos)
                                 : kv.next(L.offsets, L.parent);
          if (more) load_k(kv_iter + 1);
          const uint32_t st = kv_iter % S, kph = (kv_iter / S) & 1;
          mbar_wait(&B.kv_empty[st], kph ^ 1);
          mbar_arrive_expect_tx(&B.v_full[st], C::kKVBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load_3d(sV + st * C::kKVBytes + b * C::kKVBoxBytes, tv, &B.v_full[st], b * 64, hk, vpos);
          ++kv_iter;
        } while (more);
        continue;
      }
      bool q_issued = false;
      do {
        const uint32_t st = kv_iter % S, kph = (kv_iter / S) & 1;
        // The tile's tensor maps: the layout's K / V, or the prefix buffers' for prefix rows.
        const CUtensorMap* tk = kPrefix && kv.prefix ? &p.tpk : &p.tk;
        const CUtensorMap* tv = kPrefix && kv.prefix ? &p.tpv : &p.tv;
        mbar_wait(&B.k_empty[st], kph ^ 1);
        mbar_arrive_expect_tx(&B.k_full[st], C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b)
          tma_load_3d(sK + st * C::kKVBytes + b * C::kKVBoxBytes, tk, &B.k_full[st], b * 64, hk, kv.pos);
        if (!q_issued) {
          // Q after the first K tile, so the K load of a new item is not held up by the
          // consumers still reading a previous Q.
          // Item q_iter's Q goes to buffer qb = q_iter % kQBuffers, as use u = q_iter / kQBuffers of
          // that buffer: q_full[qb] completes its phase u when the load lands (the consumers wait
          // for parity u & 1), and q_empty[qb] its phase u when all consumer warps have retired
          // their last S of that item (its 12 or 8 arrivals). Before use u the producer waits for
          // phase u - 1 of q_empty[qb] (parity (u & 1) ^ 1; for u = 0 the wait for the phase before
          // a fresh barrier's first returns at once), so a load never overwrites a buffer a
          // consumer's wgmma may still read: a consumer warp arrives on q_empty only after the
          // wgmma wait that retires its last S = Q K^T of the item (the S group is committed before
          // that tile's P V group, so wait_group 1 retires it). The parities are unambiguous: each
          // waiter is at most one phase behind (its wait for the buffer's previous use saw the phase
          // before complete) and the barrier cannot run a phase ahead of it (phase u of q_empty[qb]
          // needs use u's load, issued after this wait; phase u + 1 of q_full[qb], which a consumer
          // waiting for phase u must not see, needs that consumer's own release of use u).
          // With two buffers (D 64) the wait is for the item before the previous one, released
          // long before: where the previous item walks two tiles or more, the K stage waited for
          // just above held one of its tiles, and every consumer warp arrives on the older item's
          // q_empty before any k_empty of the previous item (the consumers go in item order);
          // where it walks one tile, that stage held the older item's last K, and each warp
          // arrives on q_empty right after its k_empty for it. So this item's Q load starts with
          // its first K load, while the previous item's last tiles run, instead of after every
          // consumer warpgroup's last S of the previous item. (With two K stages that first K load
          // already waits for a K tile that every warp released after retiring the older item's
          // last S, so q_empty orders nothing more there; it keeps the protocol correct with more
          // stages or Q loaded first: tests/models/protocol_model.py checks both.)
          const uint32_t qb = q_iter % C::kQBuffers, q_use = q_iter / C::kQBuffers;
          mbar_wait(&B.q_empty[qb], (q_use & 1) ^ 1);
          mbar_arrive_expect_tx(&B.q_full[qb], C::kQBytes);
#pragma unroll
          for (int b = 0; b < C::kBoxes; ++b)
            tma_load_3d(sQ + qb * C::kQBytes + b * C::kQBoxBytes, &p.tq, &B.q_full[qb], b * 64, qh, q0);
          ++q_iter;
          q_issued = true;
        }
        mbar_wait(&B.kv_empty[st], kph ^ 1);
        mbar_arrive_expect_tx(&B.v_full[st], C::kKVBytes);
#pragma unroll
        for (int b = 0; b < C::kBoxes; ++b)
          tma_load_3d(sV + st * C::kKVBytes + b * C::kKVBoxBytes, tv, &B.v_full[st], b * 64, hk, kv.pos);
        ++kv_iter;
      } while (kPrefix           ? kv.next(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets)
               : Mods::kWindow ? kv.next_windowed(L.offsets, L.parent, L.position_offset, first_pos)
                               : kv.next(L.offsets, L.parent));
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  setmaxnreg_inc<C::kConsumerRegs>();
  using Mma = Wgmma<T, BN>;
  using MmaO = Wgmma<T, D>;
  // Consumer warpgroup: rows [64 cw, 64 cw + 64) of the tile. It is made warp-uniform through a
  // shuffle (wg is the same in every lane but derived from the thread index), so that the wgmma
  // descriptors built from it live in uniform registers, and each operand's descriptor is built
  // once and advanced per k16 slice (ptx.cuh desc_advance, operand_desc below), as in the backward.
  // D 64: 0.968-0.982 of the forward kernel's time on 8 GRPO layouts and classes (H200,
  // 2026-12-03). D 128 and 256 only with kSoftmaxBeforeWalk (below): alone it measured 0.97-1.03 on
  // GRPO layouts and up to 1.09 on short-walk classes at D 128 (session 22, docs/decisions.md).
  // The softmax of a KV tile before the walk advances (walk_next), where it runs under the previous
  // tile's P V: with walk_next()'s branches between the two waits, ptxas put the P V wait
  // (wait_group 0) at the top of the softmax's block, and none of the exponentials overlapped P V
  // (static SASS, D 128; docs/notes/2026-12-03-fwd-sass-comparison.md). Measured (H200, forward
  // kernel time against main's kernels, 5 rounds, outputs bit for bit equal): D 128 with the uniform
  // descriptors 0.979-0.999 on 9 GRPO layouts and classes in one run, 0.986-0.994 on 5 in another;
  // alone 0.985-1.118. D 256 with the next one (alone 0.979-1.014, trees slower). D 64 with one Q
  // buffer: 1.02-1.035 on 9 of 9 layouts (session 24; each warp's q_empty arrive then came after the
  // last tile's softmax and delayed the next item's Q). With two Q buffers (measured 2026-12-04, H200,
  // 5 rounds, against main's one-buffer kernels; docs/notes/2026-12-04-d64-fwd-q-double-buffer.md):
  // 0.971-0.991 on the 6 short-walk layouts of mean walks 1.3K-4.2K keys (3 runs), but 1.010-1.013 on small groups
  // (0.5K) and 1.014 / 1.027 on the long-walk build's layouts (12.9K / 6.1K); softcap 0.984-0.995 on 4
  // layouts, but the window kernels (128-row tiles, two warpgroups) 1.013-1.021 with window 128 +
  // sinks: the short-walk build without a window only.
  constexpr bool kSoftmaxBeforeWalk = D >= 128 || (D == 64 && !kLongWalks && !Mods::kWindow);
  // D 256 (FA3 / FA4's order there, docs/notes/2026-12-03-fa4-d256-forward-comparison.md): O is
  // rescaled by the previous tile's factors right after this tile's QK^T is issued, under it,
  // instead of after the P V wait, so a warpgroup's chain from its own P V's end to its next issue
  // holds only the P conversion (306 SASS instructions after the wait before, 23 after). The same
  // products in the same order: O bit for bit. With the softmax before the walk and the uniform
  // descriptors, measured (H200, forward kernel time, 5 rounds, 2026-12-03): 0.958-0.961 on long
  // responses, trees, tiny responses and the P 4K-16K GRPO layouts, 0.982 N64 P1K R512, 0.999 small
  // groups, 1.005 N8 P256 R4K. Without the warpgroups' turn-taking (FA3 / FA4 take turns only up to
  // D 128) 0.952-1.004 and the softcap + sinks kernels spilled 20 bytes: the ring stays.
  constexpr bool kRescaleBeforePv = D == 256;
  // With kKAhead (FA3 / FA4's consumer order): a tile's wait for the previous tile's V comes after
  // its QK^T (and, at D 256, the O rescale) is issued, just before the P V that reads it, instead of
  // at the loop top with K's: V_j, now the later load of the pair that tile j + 1 needs, gets the
  // QK^T issue's time as slack, and QK^T no longer waits for it.
  constexpr bool kLateVWait = kKAhead;
  // D 64 with the softmax before the walk: the steady tile's control flow after walk_next() without
  // branches on its path. Nsight Compute (long responses, H200, against FA4 dense; docs/notes/
  // 2026-12-04-d64-fwd-ncu.md) had two of them among the loop's costs: the branch around the
  // q_empty arrive (taken on every tile but an item's last: a fetch bubble after it), and the
  // loop's test at the bottom, after O's rescale and P's conversion, which ptxas rebuilt there from
  // uniform registers (wg_last: VIADDMNMX, ISETP and the back branch waiting on them, ~2% of the
  // loop's samples). FA4's steady loop has one branch, at its end, on a ready predicate. So the
  // arrive is predicated (every warp's __syncwarp() on every tile, lane 0 arriving on the last) and
  // the test is taken right after walk_next(), under P V. Control only: the same arithmetic in the
  // same order (O and lse bit for bit), the same arrivals after the same waits.
  constexpr bool kEarlyLoopTest = D == 64 && kSoftmaxBeforeWalk;
  // D 128's long-walk build (FA4's D-128 order; docs/notes/2026-12-04-d128-fwd-order.md): in the
  // steady loop the P V wait comes after the mask, the row max and the factors (and K's release),
  // and the exponentials come after it, each pair packed into P's fragment right after it, with the
  // row sums and the O rescale in one block. ncu had main's order (all exponentials under P V, then
  // 64 rescale FMULs and 40 conversions in one run after the wait) 7.9% per key behind FA4's loop,
  // the conversions at 0.32 stall units each against FA4's 0.09
  // (docs/notes/2026-12-04-d128-fwd-ncu.md). Same products, sums and packs: bit for bit.
  constexpr bool kExpAfterPvWait = D == 128 && kLongWalks;
  // The steady loop (docs/notes/2026-12-04-d128-fwd-steady-loop.md for D 128's long-walk build,
  // docs/notes/2026-12-04-fwd-steady-loop-all.md for the others): the tiles of a range that are
  // full, unmasked and not its last run in an inner loop without the mask test, the walk's range
  // test and the q_empty test (and, with kEarlyLoopTest or kSkipHidden, the loop's test). ncu had
  // these tests and their taken branches at 6.2 of 139.7 stall units per 128 keys at D 128
  // (docs/notes/2026-12-04-d128-fwd-ncu.md), ~4.5 of ~100 per tile at D 64 and 7.2 of 155 at D 256
  // (docs/notes/2026-12-04-d64-fwd-ncu.md, 2026-12-04-d256-fwd-ncu.md), against FA4, whose steady
  // loop has none. Every kernel without modifiers and external prefix: its walk is the plain
  // next(), which inside a range only steps by pos += BN, as the inner loop does, and its mask is
  // mask_scores' ragged / diagonal test alone. Not D 64's long-walk build: there it measured
  // 1.011-1.034 of the general loop's time on the three long layouts (session 34, H200, 9 rounds,
  // A/A 0.994-1.010; its general tile waits for P V before the softmax, so the steady tile had no
  // softmax boundary and ptxas scheduled it on its own), against 0.988-0.997 for the short-walk build.
  constexpr bool kSteadyLoop = std::is_same_v<Mods, NoModifiers> && !kPrefix && !(D == 64 && kLongWalks);
  const int cw = __shfl_sync(0xffffffffu, wg - 1, 0);
  const int tid = threadIdx.x & 127;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int row_in_tile = cw * 64 + warp * 16 + g;  // rows row_in_tile and row_in_tile + 8
  const float sl2 = Mods::score_log2(a);
  const uint32_t q_base = smem_u32(sQ) + cw * 64 * 128;
  const uint32_t k_base = smem_u32(sK);
  const uint32_t v_base = smem_u32(sV);
  // Turn-taking between the consumer warpgroups: warpgroup c waits on barrier 1 + c before issuing
  // and then lets the next one (c + 1, cyclically) go. Warpgroup 0 starts.
  constexpr int W = C::kConsumerWGs;
  auto turn_wait = [&]() {
    named_bar_sync(1 + cw, 256);
  };
  auto turn_pass = [&]() {
    named_bar_arrive(1 + (W == 2 ? cw ^ 1 : cw + 1 == W ? 0 : cw + 1), 256);
  };
  if (cw == W - 1) named_bar_arrive(1, 256);

  uint32_t q_iter = 0, kv_iter = 0;
  for (uint32_t n = 0;; ++n) {
    const uint32_t slot = n & 1, ph = (n >> 1) & 1;
    mbar_wait(&B.item_full[slot], ph);
    const int32_t slot_item = B.items[slot];  // kDecodedItems: the plan index of its tile's ints
    int h = kDecodedItems ? B.items[2 + slot] : 0;
    __syncwarp();
    if (kPerThreadRelease || lane == 0) mbar_arrive(&B.item_empty[slot]);
    const int32_t* tile_ints;
    if constexpr (kDecodedItems) {
      if (slot_item < 0) break;
      tile_ints = a.plan + slot_item;
    } else if constexpr (!kWalkToRows) {
      // D 64's long-walk build: the plan values kept from the kernel's start (the header read below
      // measured 1.02 of its time on its layouts, session 63: docs/decisions.md).
      if (slot_item >= n_items) break;
      int32_t tile;
      decode_fwd_item(slot_item, n_tiles, H, window, p.head_run, tile, h);
      tile_ints = items + tile * kFwdItemInts;
    } else {
      // The plan's header read again per item (z: a zero the compiler cannot hoist the loads by):
      // kept from the kernel's start, these values and the items' base were ptxas's 20 bytes of
      // spill in the D-256 long-walk kernel once kWalkToRows's drain was in it.
      const uint32_t z = opaque_zero();
      const int32_t nt = __ldg(plan + (kHdrNumFwd | z)), off = __ldg(plan + (kHdrFwdOffset | z));
      if (slot_item >= nt * H) break;
      int32_t tile;
      decode_fwd_item(slot_item, nt, H, clamp_fwd_window(p.tile_window, nt), p.head_run, tile, h);
      tile_ints = plan + off + tile * kFwdItemInts;
    }
    // The item's rows (fwd_item_rows: with packed query heads (fwd_pack_shift(p)) a sub-range of the
    // tile's tokens, row t G + i of it token q0 + t and head head0 + i; else the tile of head h).
    const FwdItemRows rows =
        fwd_item_rows(tile_ints[0], tile_ints[1], tile_ints[2], L.offsets, h, fwd_pack_shift<kPacks>(p), C::kBlockM);
    if (kPacks && rows.q0 >= rows.q1) continue;  // the producer skips it too
    const int32_t seg = rows.seg, q0 = rows.q0, q1 = rows.q1, q_diag = rows.q_diag;
    // Query token of rows r = 0 (qi0) and r = 1 (qi0 + fwd_row_step(p)): fragment rows g and g + 8.
    const int32_t qi0 = q0 + (row_in_tile >> fwd_pack_shift<kPacks>(p));
    // The item's Q buffer and its use of it, as the producer counts them (its comment at the Q load
    // says why this protocol is safe). This warpgroup's 64 rows of it start at q_item.
    const uint32_t qb = q_iter % C::kQBuffers, q_use = q_iter / C::kQBuffers;
    const uint32_t q_item = q_base + qb * C::kQBytes;
    // This warpgroup's rows of the item, [wg_first, wg_last]; none (a phantom warpgroup of a ragged
    // last tile) when wg_first >= q1. A KV tile of an own range that starts after wg_last hides every
    // key from all of them (a row sees its own range's keys up to itself). The walk ends with its
    // own ranges in token order, so such tiles are a suffix of it: the warpgroup computes up to
    // them, then only waits, arrives and takes its ring turns for the rest (drain_walk below), with
    // no wgmma, so ptxas sees the loop's wgmmas unconditional as before. A hidden tile leaves m, l
    // and O bit for bit as they were (alpha exactly 1, or the state still empty; P = 0): the
    // output is the same. Only in the short-walk builds of fwd_skips_hidden_tiles's kernels (why:
    // above). The long-walk builds stop the same way, but by their walk's end (kWalkToRows): the
    // warpgroup walks its own range up to wg_last only (KvWalk::init at wg_last + 1), so its loop is
    // the one that walks every tile, test for test, and after the last P V it resumes the item's
    // walk (KvWalk::resume) and drains the tiles past its rows. With the seen() test in the loop
    // the D-256 long-walk kernel's wgmma descriptors left the uniform registers (+39 R2UR, 463 ->
    // 539 instructions per steady tile) and ptxas spilled 20 bytes.
    constexpr bool kSkipHidden = fwd_skips_hidden_tiles<D, Mods, kPrefix>() && !kLongWalks;
    const int32_t wg_first = q0 + ((cw * 64) >> fwd_pack_shift<kPacks>(p));
    const int32_t wg_last = min(q1, wg_first + (64 >> fwd_pack_shift<kPacks>(p))) - 1;
    const bool live = !(kSkipHidden || kWalkToRows) || wg_first < q1;

    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {-CUDART_INF_F, -CUDART_INF_F};
    float l[2] = {0.f, 0.f};
    float s[BN / 2];
    uint32_t pf[BN / 4];

    KvWalk<BN> kv;
    int32_t first_pos = 0;  // the sliding window (issue 16): as the producer's walk
    if constexpr (kPrefix) {
      kv.init(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets, seg, q1);
    } else if constexpr (Mods::kWindow) {
      first_pos = SegmentMask::window_first_position(L.offsets, L.position_offset, seg, q0, a.window);
      kv.init_windowed(L.offsets, L.parent, L.position_offset, seg, q1, first_pos);
    } else {
      kv.init(L.offsets, L.parent, seg, kWalkToRows ? wg_last + 1 : q1);
    }
    auto seen = [&]() { return !kSkipHidden || !(kv.own && kv.pos > wg_last); };  // the walk's current tile
    // The walk's next tile (a prefix tile's `own` is false: it is masked as an ancestor's).
    auto walk_next = [&]() {
      if constexpr (kPrefix) return kv.next(L.offsets, L.parent, L.seg_prefix, L.prefix_offsets);
      else if constexpr (Mods::kWindow) return kv.next_windowed(L.offsets, L.parent, L.position_offset, first_pos);
      else return kv.next(L.offsets, L.parent);
    };

    // An operand's descriptor at byte offset `off` from its base: the base's descriptor advanced.
    auto operand_desc = [&](uint64_t base_desc, uint32_t off) { return desc_advance(base_desc, off); };
    // S = Q K^T for the stage `st` into s.
    auto issue_qk = [&](uint32_t st) {
      const uint32_t kb = k_base + st * C::kKVBytes;
      const uint64_t dq = make_desc_sw128(q_item, 16, 1024), dk = make_desc_sw128(kb, 16, 1024);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t box = kk / 4, within = (kk % 4) * 32;
        Mma::ss(s, operand_desc(dq, box * C::kQBoxBytes + within), operand_desc(dk, box * C::kKVBoxBytes + within),
                kk > 0 ? 1 : 0);
      }
    };
    // O += P V for the stage `st`.
    auto issue_pv = [&](uint32_t st) {
      const uint32_t vb = v_base + st * C::kKVBytes;
      const uint64_t dv = make_desc_sw128(vb, C::kKVBoxBytes, 1024);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        MmaO::rs(o, &pf[4 * kk], operand_desc(dv, kk * 16 * 128), 1);
    };
    // Mask (and softcap) of s; krem: the keys left in the walk's range from kpos on
    // (KvWalk::rest(), SegmentMask's forward part); kcur: the segment of the tile's keys (the walk's
    // cur; the window's shift, issue 16).
    auto mask_scores = [&](int32_t kpos, int32_t krem, bool own, int32_t kcur) {
      if constexpr (Mods::kSoftcap) softcap_scores(s, a);  // mask modifiers (issue 16): before the mask
      // Ragged or diagonal (SegmentMask::fwd_tile_kind, against the item's first row q_diag and
      // last q1 - 1). In a tile of siblings every own range starts at or after q_diag (the tile's
      // first token, fwd_item_rows), so the diagonal test holds for it without fwd_diagonal's
      // q_last >= kpos + krem term (which a tile of one segment never meets: its own range ends at q1).
      if (krem < BN || (own && kpos + BN - 1 > q_diag)) {
        const int32_t cols[2] = {SegmentMask::fwd_visible_cols(kpos, krem, own, qi0),
                                 SegmentMask::fwd_visible_cols(kpos, krem, own, qi0 + fwd_row_step<kPacks>(p))};
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (j * 8 + 2 * t4 + (e & 1) >= cols[e >> 1]) s[4 * j + e] = -CUDART_INF_F;
          }
        }
      }
      if constexpr (Mods::kWindow) {
        const int32_t shift = SegmentMask::window_shift(L.offsets, L.position_offset, seg, kcur);
        fwd_window_mask(s, kpos, q0 + ((cw * 64 + 63) >> fwd_pack_shift<kPacks>(p)), qi0, fwd_row_step<kPacks>(p), t4,
                        shift, a.window);
      }
    };
    // Row r's new max after the mask (m[r] updated) and its rescale factor alpha[r]; returns the
    // max in the exponent's scale (0 for a row the tile hides whole).
    auto row_max = [&](int r, float* alpha) {
      float mx = m[r];
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float ms = mx == -CUDART_INF_F ? 0.f : mx * sl2;
      // (old max - new max) * sl2: exactly 0, so alpha exactly 1, when the max stays (the
      // contracted m * sl2 - ms need not be 0): a tile that hides the whole row (a later
      // sibling's range) then leaves the row to the same bits.
      alpha[r] = fast_exp2((m[r] - (mx == -CUDART_INF_F ? 0.f : mx)) * sl2);
      m[r] = mx;
      return ms;
    };
    // Online softmax of the masked s (in place: s becomes P in fp32); returns the rescale factors.
    auto softmax_rows = [&](float* alpha) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float ms = row_max(r, alpha);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const float p0 = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -ms));
          const float p1 = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -ms));
          s[4 * j + 2 * r] = p0;
          s[4 * j + 2 * r + 1] = p1;
          sum += p0 + p1;
        }
        l[r] = l[r] * alpha[r] + sum;
      }
    };
    // Mask, online softmax of s; returns the rescale factors.
    auto softmax = [&](int32_t kpos, int32_t krem, bool own, int32_t kcur, float* alpha) {
      mask_scores(kpos, krem, own, kcur);
      softmax_rows(alpha);
    };
    // kExpAfterPvWait's exponentials after the P V wait (exp_after_pv_tile; the mask and the rows'
    // max before it, with row_max): each pair packed into its P fragment right after it (pf[2 j + r]
    // is to_pf()'s pack of s[4 j + 2 r], s[4 j + 2 r + 1]; s is not written), and the row sums.
    auto exp_pack = [&](const float* ms, const float* alpha) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
          const float p0 = fast_exp2(fmaf(s[4 * j + 2 * r], sl2, -ms[r]));
          const float p1 = fast_exp2(fmaf(s[4 * j + 2 * r + 1], sl2, -ms[r]));
          pf[2 * j + r] = Convert<T>::pack(p0, p1);
          sum += p0 + p1;
        }
        l[r] = l[r] * alpha[r] + sum;
      }
    };
    auto to_pf = [&]() {
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pf[4 * kk + 0] = Convert<T>::pack(s[8 * kk + 0], s[8 * kk + 1]);
        pf[4 * kk + 1] = Convert<T>::pack(s[8 * kk + 2], s[8 * kk + 3]);
        pf[4 * kk + 2] = Convert<T>::pack(s[8 * kk + 4], s[8 * kk + 5]);
        pf[4 * kk + 3] = Convert<T>::pack(s[8 * kk + 6], s[8 * kk + 7]);
      }
    };

    // The walk's tiles from the current one on, without computing: per tile, the K stage's wait and
    // release, the previous tile's V (prev_v: its stage counter, from the second tile on) and one
    // ring turn; then the last tile's V and the final turn (the slot of the last P V). turn_taken:
    // the current tile's turn was spent on the previous tile's P V already.
    auto drain_walk = [&](bool turn_taken, bool release_q) {
      bool more_tiles = true, have_prev_v = false;
      uint32_t prev_v = 0;
      for (bool first = true; more_tiles; first = false) {
        const uint32_t kst = kv_iter % S;
        mbar_wait(&B.k_full[kst], (kv_iter / S) & 1);
        if (have_prev_v) mbar_wait(&B.v_full[prev_v % S], (prev_v / S) & 1);
        if (!(first && turn_taken)) {
          turn_wait();
          turn_pass();
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&B.k_empty[kst]);
        more_tiles = walk_next();
        if (release_q && !more_tiles) {  // no S read the Q buffer here: its release keeps the item's count
          __syncwarp();
          if (lane == 0) mbar_arrive(&B.q_empty[qb]);
        }
        if (have_prev_v) {
          __syncwarp();
          if (lane == 0) mbar_arrive(&B.kv_empty[prev_v % S]);
        }
        have_prev_v = true;
        prev_v = kv_iter;
        ++kv_iter;
      }
      mbar_wait(&B.v_full[prev_v % S], (prev_v / S) & 1);
      turn_wait();
      turn_pass();
      __syncwarp();
      if (lane == 0) mbar_arrive(&B.kv_empty[prev_v % S]);
      // The same in every lane (the walk is), but ptxas cannot tell after this data-dependent loop:
      // without the shuffle the next item's wgmma descriptors, built from kv_iter's stage, left the
      // uniform registers (59 more R2UR in the D-128 kernel's SASS).
      kv_iter = __shfl_sync(0xffffffffu, kv_iter, 0);
    };

    mbar_wait(&B.q_full[qb], q_use & 1);
    ++q_iter;
    if constexpr (kSkipHidden || kWalkToRows) {
      if (!live) {  // every tile hidden (the first tile of a live warpgroup's walk never is; a phantom
        drain_walk(false, true);  // warpgroup's walk, wg_last + 1 = q1 for kWalkToRows, is the item's)
        continue;
      }
    }

    // First KV tile: S, softmax, P.
    uint32_t st = kv_iter % S;
    mbar_wait(&B.k_full[st], (kv_iter / S) & 1);
    turn_wait();
    wgmma_fence();
    issue_qk(st);
    wgmma_commit();
    turn_pass();
    wgmma_wait<0>();
    fence_regs(s);
    __syncwarp();
    if (lane == 0) mbar_arrive(&B.k_empty[st]);
    int32_t kpos = kv.pos, krem = kv.rest(), kcur = kv.cur;
    bool own = kv.own;
    bool more = walk_next();
    if (!more) {  // the item's only S retired (wait_group 0 above): its Q buffer may be reloaded
      __syncwarp();
      if (lane == 0) mbar_arrive(&B.q_empty[qb]);
    }
    {
      float alpha[2];
      softmax(kpos, krem, own, kcur, alpha);
    }
    to_pf();
    uint32_t prev = kv_iter;
    ++kv_iter;
    // kRescaleBeforePv: the factors O still owes (the first tile's are not needed: O is zero).
    float alpha_o[2] = {1.f, 1.f};
    auto rescale_o = [&](const float* f) {
#pragma unroll
      for (int j = 0; j < D / 8; ++j) {
        o[4 * j + 0] *= f[0];
        o[4 * j + 1] *= f[0];
        o[4 * j + 2] *= f[1];
        o[4 * j + 3] *= f[1];
      }
    };

    // kExpAfterPvWait's pins (pinned_after); ptxas 13.0 sees through it (RZ in the SASS) but keeps
    // the LOP3s and their reads, which is all the pins need.
    const uint32_t pin_zero = kExpAfterPvWait ? opaque_zero() : 0u;
    bool go = more && seen();  // kEarlyLoopTest's form of the loop's test
    // kExpAfterPvWait's tile after the first. kSteady (kSteadyLoop's inner loop): the tile is full,
    // unmasked and not its range's last, so there is no mask test, the walk only steps (pos += BN:
    // what next() does inside a range) and more stays true (no q_empty test: the item's last tile is
    // a range's last). The arithmetic is the general tile's: on such a tile mask_scores changes
    // nothing, and row_max keeps its -inf guards, so O and lse are the same bits.
    auto exp_after_pv_tile = [&](auto steady) {
      constexpr bool kSteady = decltype(steady)::value;
      static_assert(!kExpAfterPvWait || (!kLateVWait && !kRescaleBeforePv), "the long-walk D-128 order: V waited for at the top");
      const int32_t tkpos = kv.pos, tkrem = kv.rest(), tkcur = kv.cur;
      const bool town = kv.own;
      const uint32_t tst = kv_iter % S;
      mbar_wait(&B.k_full[tst], (kv_iter / S) & 1);
      const uint32_t pst = prev % S;
      mbar_wait(&B.v_full[pst], (prev / S) & 1);
      turn_wait();
      wgmma_fence();
      issue_qk(tst);
      wgmma_commit();
      issue_pv(pst);
      wgmma_commit();
      turn_pass();
      wgmma_wait<1>();  // S of this tile is ready; P V of the previous one may still run
      fence_regs(s);
      float alpha[2], ms[2];
      if constexpr (!kSteady) mask_scores(tkpos, tkrem, town, tkcur);
#pragma unroll
      for (int r = 0; r < 2; ++r) ms[r] = row_max(r, alpha);
      // K's release after the max (in the long-walk build K_{j+2} waits for V_{j+1}'s slot, which
      // is released just below, earlier than before). ptxas keeps the P V wait below this arrive
      // but hoisted the arrive itself above row 1's max: its address reads row 1's max.
      __syncwarp();
      if (lane == 0) mbar_arrive_at(pinned_after(smem_u32(&B.k_empty[tst]), __float_as_uint(m[1]), pin_zero));
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pf);
      __syncwarp();
      if (lane == 0) mbar_arrive(&B.kv_empty[pst]);
      // Without the pin ptxas issued all 82 exponentials above the wait again, and the 40
      // conversions in one run after it (main's SASS): the exponents read O's first register.
#pragma unroll
      for (int r = 0; r < 2; ++r) ms[r] = pinned_after(ms[r], o[0], pin_zero);
      exp_pack(ms, alpha);
      rescale_o(alpha);
      if constexpr (kSteady) {
        kv.pos += BN;
      } else {
        more = walk_next();
        if (!more) {  // the item's last S retired (wait_group 1 above): its Q buffer may be reloaded
          __syncwarp();
          if (lane == 0) mbar_arrive(&B.q_empty[qb]);
        }
      }
      prev = kv_iter;
      ++kv_iter;
    };
    if constexpr (kExpAfterPvWait) {
      while (more) {
        for (int32_t steady = fwd_steady_tiles(kv, q_diag); steady > 0; --steady) exp_after_pv_tile(std::true_type{});
        exp_after_pv_tile(std::false_type{});
      }
    } else if constexpr (kSteadyLoop) {
      // Every other kernel's tile after the first: the statements of the loop below (which the
      // other kernels run), in the same order. kSteady (the inner loop), as in exp_after_pv_tile: no
      // mask test (softmax_rows without mask_scores), the walk only steps, and more (and
      // kEarlyLoopTest's go) stays true, so neither the q_empty arrive's test nor the loop's test
      // runs. Defined here, in the steady kernels only: as an unused closure next to the other
      // lambdas it changed the other kernels' SASS (register moves, a branch in the epilogue).
      auto plain_tile = [&](auto steady) {
        constexpr bool kSteady = decltype(steady)::value;
        // kSteadyLoop leaves out D 64's long-walk build, the one unmodified kernel without it.
        static_assert(kSoftmaxBeforeWalk, "the steady tile runs the softmax before the walk");
        if constexpr (!kSteady) {
          kpos = kv.pos; krem = kv.rest(); own = kv.own; kcur = kv.cur;
        }
        st = kv_iter % S;
        mbar_wait(&B.k_full[st], (kv_iter / S) & 1);
        const uint32_t pst = prev % S;
        if constexpr (!kLateVWait) mbar_wait(&B.v_full[pst], (prev / S) & 1);
        turn_wait();
        wgmma_fence();
        issue_qk(st);
        wgmma_commit();
        if constexpr (kRescaleBeforePv) {
          fence_regs(o);
          rescale_o(alpha_o);
          if constexpr (kLateVWait) {
            fence_regs(o);  // the rescale stays under QK^T, ahead of the wait
            mbar_wait(&B.v_full[pst], (prev / S) & 1);
          }
          wgmma_fence();  // O's registers were written since the fence above
        } else if constexpr (kLateVWait) {
          mbar_wait(&B.v_full[pst], (prev / S) & 1);
        }
        issue_pv(pst);
        wgmma_commit();
        turn_pass();
        wgmma_wait<1>();  // S of this tile is ready; P V of the previous one may still run
        fence_regs(s);
        __syncwarp();
        if (lane == 0) mbar_arrive(&B.k_empty[st]);
        // A steady tile has no branch after K's release (the general tile has the mask test's), and
        // ptxas sank the arrive 90-140 instructions into the softmax: the boundary keeps it here.
        // Its condition is false on every steady tile whatever the plan holds: the count
        // (fwd_steady_tiles) leaves more than BN keys in the range before each steady tile.
        if constexpr (kSteady) schedule_boundary(kv.rest() <= BN);
        float alpha[2];  // softmax() reads only what was captured above, not the walk's state
        if constexpr (kSteady) softmax_rows(alpha);
        else softmax(kpos, krem, own, kcur, alpha);
        if constexpr (kSteady) {
          kv.pos += BN;
        } else {
          more = walk_next();
          // !more: the item's last S retired (wait_group 1 above): its Q buffer may be reloaded.
          if constexpr (kEarlyLoopTest) {
            __syncwarp();
            if (lane == 0 && !more) mbar_arrive(&B.q_empty[qb]);
            go = more && seen();  // the walk's state is final for this tile
          } else if (!more) {
            __syncwarp();
            if (lane == 0) mbar_arrive(&B.q_empty[qb]);
          }
        }
        // Nor is there a branch (the general tile has the walk's) between the softmax and the P V
        // wait, and ptxas hoisted the wait above a third to two thirds of the exponentials (at D
        // 256 they would then lengthen the chain from P V's end to the next issue that
        // kRescaleBeforePv shortened). The boundary holds the row sums, so every exponential,
        // above it; its condition is false for the same reason as the first's (a steady tile
        // leaves keys in the range after it).
        if constexpr (kSteady) schedule_boundary(kv.rest() <= 0, l[0] + l[1]);
        wgmma_wait<0>();
        fence_regs(o);
        fence_regs(pf);
        __syncwarp();
        if (lane == 0) mbar_arrive(&B.kv_empty[pst]);
        if constexpr (kRescaleBeforePv) {
          alpha_o[0] = alpha[0];
          alpha_o[1] = alpha[1];
        } else {
          rescale_o(alpha);
        }
        to_pf();
        prev = kv_iter;
        ++kv_iter;
      };
      while (kEarlyLoopTest ? go : more && seen()) {
        // Every steady tile is seen() (kSkipHidden): it ends at or before q_diag <= wg_last, and the
        // tile after it starts at or before q_diag + 1 and inside the range, so at or before wg_last.
        for (int32_t steady = fwd_steady_tiles(kv, q_diag); steady > 0; --steady) plain_tile(std::true_type{});
        plain_tile(std::false_type{});
      }
    }
    while (!kSteadyLoop && (kEarlyLoopTest ? go : more && seen())) {
      kpos = kv.pos; krem = kv.rest(); own = kv.own; kcur = kv.cur;
      st = kv_iter % S;
      mbar_wait(&B.k_full[st], (kv_iter / S) & 1);
      const uint32_t pst = prev % S;
      if constexpr (!kLateVWait) mbar_wait(&B.v_full[pst], (prev / S) & 1);
      turn_wait();
      wgmma_fence();
      issue_qk(st);
      wgmma_commit();
      if constexpr (kRescaleBeforePv) {
        fence_regs(o);
        rescale_o(alpha_o);
        if constexpr (kLateVWait) {
          fence_regs(o);  // the rescale stays under QK^T, ahead of the wait
          mbar_wait(&B.v_full[pst], (prev / S) & 1);
        }
        wgmma_fence();  // O's registers were written since the fence above
      } else if constexpr (kLateVWait) {
        mbar_wait(&B.v_full[pst], (prev / S) & 1);
      }
      issue_pv(pst);
      wgmma_commit();
      turn_pass();
      wgmma_wait<1>();  // S of this tile is ready; P V of the previous one may still run
      fence_regs(s);
      __syncwarp();
      if (lane == 0) mbar_arrive(&B.k_empty[st]);
      float alpha[2];  // softmax() reads only what was captured above, not the walk's state
      if constexpr (kSoftmaxBeforeWalk) softmax(kpos, krem, own, kcur, alpha);
      more = walk_next();
      // !more: the item's last S retired (wait_group 1 above): its Q buffer may be reloaded.
      if constexpr (kEarlyLoopTest) {
        __syncwarp();
        if (lane == 0 && !more) mbar_arrive(&B.q_empty[qb]);
        go = more && seen();  // the walk's state is final for this tile
      } else if (!more) {
        __syncwarp();
        if (lane == 0) mbar_arrive(&B.q_empty[qb]);
      }
      if constexpr (!kSoftmaxBeforeWalk) softmax(kpos, krem, own, kcur, alpha);
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pf);
      __syncwarp();
      if (lane == 0) mbar_arrive(&B.kv_empty[pst]);
      if constexpr (kRescaleBeforePv) {
        alpha_o[0] = alpha[0];
        alpha_o[1] = alpha[1];
      } else {
        rescale_o(alpha);
      }
      to_pf();
      prev = kv_iter;
      ++kv_iter;
    }
    {
      const uint32_t pst = prev % S;
      mbar_wait(&B.v_full[pst], (prev / S) & 1);
      turn_wait();
      if constexpr (kRescaleBeforePv) rescale_o(alpha_o);
      wgmma_fence();
      issue_pv(pst);
      wgmma_commit();
      turn_pass();
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pf);
      __syncwarp();
      if (lane == 0) mbar_arrive(&B.kv_empty[pst]);
    }
    // The tiles past this warpgroup's rows; the last P V above took the first one's turn.
    if constexpr (kSkipHidden) {
      if (more) drain_walk(true, true);
    }
    // kWalkToRows: the item's tiles after this warpgroup's walk (its Q buffer released at its last S).
    if constexpr (kWalkToRows) {
      if (kv.resume(L.offsets, q1)) drain_walk(true, false);
    }

    // Epilogue: normalise, store O (input dtype) and the natural-log LSE.
    T* og = static_cast<T*>(a.out);
    // O through smem and a TMA store when every row of this warpgroup's box is the item's or lies
    // past the tensor's end (TMA clips only there): rows past q1 inside T belong to the next
    // segment or another item, so a ragged box stores per thread as before.
    // Everything per thread here derives from a fresh read of the thread index (ocw: cw again): the
    // compiler cannot hoist it out of the item loop, where each value kept live through the KV loop
    // would cost a register there (the softcap kernels spilled).
    const uint32_t o_thread_x = thread_index_x();
    const int ocw = static_cast<int>(o_thread_x / 128) - 1;
    const uint32_t o_thread = o_thread_x % 128;
    // This warpgroup's first token (its 64 rows: 64 >> pack_shift tokens of G heads each), from the
    // thread's first row token qi0 (q0 is not kept live through the KV loop; G divides 64).
    const int32_t o_row0 =
        qi0 - static_cast<int32_t>(((o_thread / 32) * 16 + (o_thread % 32) / 4) >> fwd_pack_shift<kPacks>(p));
    // The same for the whole warpgroup; the vote tells the compiler so (as a per-thread branch
    // around the named barriers it cost the all-modifier kernels 16 bytes of spills).
    const bool o_staged =
        C::kOStaged && p.o_tma != 0 &&
        __all_sync(0xffffffffu,
                   o_row0 + (64 >> fwd_pack_shift<kPacks>(p)) <= q1 || (q1 >= L.num_tokens && o_row0 < q1));
    // This warpgroup's O box, from an address the loop keeps live (K's).
    const uint32_t o_box = k_base - C::kOffK + C::kOffO + ocw * C::kOWgBytes;
    if (o_staged) fwd_o_staging_acquire(C::kOBarrier + ocw);
    // Without the staged epilogue (D 256): 16-byte stores (fwd_o_row_stg128) where out is 16-byte
    // aligned (the launcher's o_vec16, one value for the grid), else the element pairs below.
    const bool o_vec16 = !C::kOStaged && p.o_vec16 != 0;
    // The query head of fragment row g (packed heads: the item's first head h - j, j = h % G, plus
    // the row's place among its token's G rows; the warp's first row is a multiple of 16 >= G).
    const int head_mask = (1 << fwd_pack_shift<kPacks>(p)) - 1;
    const int head0 = h - (h & head_mask);
    const int hg = head0 + (static_cast<int>((o_thread % 32) / 4) & head_mask);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float tot = l[r];
      tot += __shfl_xor_sync(0xffffffffu, tot, 1);
      tot += __shfl_xor_sync(0xffffffffu, tot, 2);
      float inv = tot > 0.f ? 1.f / tot : 0.f;
      const int hr = hg + r * fwd_row_head_step<kPacks>(p);
      float sink_lse = 0.f;
      if constexpr (Mods::kSinks)  // mask modifiers (issue 16): the sink joins the row's softmax
        inv = fold_sink_epilogue(m[r], tot, Mods::score_scale(a), a.sinks[hr], &sink_lse);
      if constexpr (C::kOStaged) {
        if (o_staged) fwd_o_stage_row<T, D>(o_box, o, r, inv, o_thread);
      }
      const int32_t qi = qi0 + r * fwd_row_step<kPacks>(p);
      if constexpr (!C::kOStaged) {
        // The quad's SHFLs need all 32 lanes: outside the row test, which masks the stores only.
        if (o_vec16)
          fwd_o_row_stg128<T, D>(og + static_cast<int64_t>(qi) * a.o_ts + static_cast<int64_t>(hr) * a.o_hs, o, r,
                                 inv, static_cast<uint32_t>(t4), qi < q1);
      }
      if (qi < q1) {
        T* orow = og + static_cast<int64_t>(qi) * a.o_ts + static_cast<int64_t>(hr) * a.o_hs;
        if (!o_staged && !o_vec16) {
#pragma unroll
          for (int j = 0; j < D / 8; ++j)
            *reinterpret_cast<uint32_t*>(orow + j * 8 + 2 * t4) =
                Convert<T>::pack(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
        }
        if (a.lse != nullptr && t4 == 0)
          a.lse[static_cast<int64_t>(hr) * a.lse_hs + qi] =
              Mods::kSinks ? sink_lse : tot > 0.f ? m[r] * Mods::score_scale(a) + logf(tot) : CUDART_INF_F;
      }
    }
    if constexpr (C::kOStaged) {
      if (o_staged) fwd_o_staging_release<D>(&p.to, o_box, C::kOBarrier + ocw, head0, o_row0);
    }
  }
  // The last TMA stores of O still read smem: the issuing thread waits for them before the CTA ends.
  if constexpr (C::kOStaged) {
    if (fwd_o_store_thread()) bulk_wait_group<0>();
  }
}

}  // namespace dualkv::cuda::sm90
