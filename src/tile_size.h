// The tile-size table: every tile size of every kernel, as a function of the head dim, in one
// place. Host code (the planner) and device code (the kernels' configs) read the same constexpr
// functions, so a plan and the kernels that consume it cannot disagree.
//
// Which head dims exist is not decided here (src/cuda/CMakeLists.txt holds that list); these are
// rules over D, each with the reason for its threshold.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DUALKV_TILE_FN __host__ __device__ constexpr
#else
#define DUALKV_TILE_FN constexpr
#endif

namespace dualkv {

// ---- the work plan (every arch takes the plan's items as they are) ----
// The kernel family a plan is cut for: its forward query tiles are the family's forward kernel's
// (they differ at D = 64 only); the backward's tiles are the same in both. The values are the C
// ABI's (dualkv_plan_request.tiles, DUALKV_PLAN_TILES_*).
enum class TileFamily : int { kPortable = 1, kSm90 = 2 };

// Query rows of a forward (and deterministic dQ) work item: 128 up to D = 256; 192 at D = 64 for
// the Hopper forward (three consumer warpgroups of 64 rows, FA3 / FA4's D-64 forward: a 128-key
// tile's exponentials take as long as its two GEMMs there, so a third warpgroup's softmax keeps the
// tensor cores busy while two take turns; measured 0.84-0.97x the forward time of 128-row tiles,
// 2026-12-03), except in a plan cut to a sliding window (`windowed`): a 192-row tile walks its
// window's keys for all three warpgroups, whose rows see different keys, and at gpt-oss's window
// of 128 that made the forward 1.06-1.12x the time of 128-row tiles. The portable kernels keep 128
// rows (192-row tiles ran 1.16-1.31x their time) and are also built for 192 (sm80/config.h): the
// Hopper forward falls back to them at launch.
// Above D = 256 (D = 512): 64 rows (the portable forward's Q tile, 64 x 512 at 16 bits = 64 KiB of
// shared memory, and the deterministic dQ kernel's Q and dO tiles, 128 KiB, next to their K/V
// steps).
DUALKV_TILE_FN int fwd_block_m(int head_dim, TileFamily family, bool windowed) {
  return head_dim == 64 && family == TileFamily::kSm90 && !windowed ? 192 : head_dim <= 256 ? 128 : 64;
}

// The backward's tiles, the same in every family's plan.
struct PlanTiles {
  int bwd_block_n;  // KV rows of a backward work item
  int bwd_block_m;  // query rows of a backward step; backward split lengths are multiples of it
};
// Backward KV tiles of 128 rows up to D = 128 (each tile's dQ traffic covers twice the work of a
// 64-row tile), 64 above (the dK/dV accumulators of 128 rows do not fit the registers), and 32 rows
// above D = 256 (dK and dV of 32 x 512 in fp32 over the backward's 8 warps = 128 registers per
// thread, as 64 rows are at D = 256).
DUALKV_TILE_FN PlanTiles plan_tiles(int head_dim) {
  return head_dim <= 128 ? PlanTiles{128, 64} : head_dim <= 256 ? PlanTiles{64, 64} : PlanTiles{32, 64};
}

// ---- sm80 (mma.sync) kernels ----
// Forward: 16-row query blocks per warp (2 up to D = 128: every K/V fragment loaded from shared
// memory feeds two row blocks, halving shared-memory traffic; 1 above, for registers), as many
// warps as fill the plan's query tile, and 64 KV rows per step: FlashAttention-2's sm80 choice
// above D = 64 (its 8 warps above 128 are our one row block per warp). At D = 64 FA2 takes 128 KV
// rows; here that spills 112-152 bytes in the KV loop (nvcc 13.0), 64 rows spill nothing.
// The Hopper family's 192-row tiles at D = 64 (fwd_block_m; the portable forward runs them when
// the Hopper forward falls back) keep 4 warps, one per SM sub-partition, with 3 row blocks each and
// 32-row KV steps (no spills): 6 warps of 2 row blocks, which leave two sub-partitions with two
// warps, took 1.40-1.57x the 128-row kernel's time, 4 x 3 takes 1.16-1.31x (H200, 2026-12-03).
// Above D = 256 (D = 512) the output accumulator of a 16-row block, 16 x 512 fp32 = 256 registers
// per thread, cannot be one warp's: d_split = 2 warps share each row block, each owning half of
// D's columns of O (128 registers, as at D = 256). Each computes S over its half of D and the two
// partial scores are summed through shared memory (no QK^T work is repeated), after which both
// run the same softmax. KV steps of 32 rows there: S in 16 registers, and K, V (2 x 32 KiB) next
// to Q (64 KiB) and the partial scores (16 KiB) fit A100's 163 KiB.
struct Sm80FwdTiles {
  int row_blocks;  // 16-row query blocks per warp
  int block_n;     // KV rows per step
  int d_split;     // warps sharing a row block, each with D / d_split columns of the output
};
DUALKV_TILE_FN Sm80FwdTiles sm80_fwd_tiles(int head_dim, int block_m) {
  return block_m == 192    ? Sm80FwdTiles{3, 32, 1}
         : head_dim <= 256 ? Sm80FwdTiles{head_dim <= 128 ? 2 : 1, 64, 1}
                           : Sm80FwdTiles{1, 32, 2};
}

// Shared-memory rows of the Q / K / V / dO tiles (sm80/smem_tile.cuh): exactly D elements with
// XOR-swizzled 16-byte chunks, or padded by 16 bytes. Padded rows misalign every cp.async phase
// with the 128-byte lines (10.5 shared wavefronts per copy for an ideal 4 at D = 256); swizzled
// rows need D a power of two from 64 up (whole lines, power-of-two warp column parts). Measured on
// the H200 against padded rows (2026-12-02, main kernels): forward 0.88-0.90 of the time at D = 256,
// 0.95-0.96 at 128, 0.96-0.98 at 64; backward 0.970-0.973 at 256, 0.952-0.961 at 128. The backward
// keeps padded rows at D = 64: its 128-row kernels hold 255 registers, the swizzled addresses spill
// 16-24 bytes there (nvcc 13.0), and the first A/B showed no gain (0.996-1.009). The deterministic
// dQ kernel keeps padded rows (not measured swizzled).
DUALKV_TILE_FN bool sm80_swizzled_rows(int head_dim, bool backward) {
  return head_dim >= 64 && (head_dim & (head_dim - 1)) == 0 && !(backward && head_dim == 64);
}

// Deterministic dQ kernel (query-tile-outer): the forward's warp layout, KV steps short enough for
// S, dP and dQ in registers. Above D = 256 the forward's split of D over warp pairs (dQ's columns
// as O's; the partial S and dP summed through shared memory), with KV steps of 16 rows: Q and dO
// (128 KiB), K and V (32 KiB) and the partial S and dP (16 KiB) fit the H100's 227 KiB (32 rows do
// not: 231.5 KiB). The 192-row tiles (D = 64, Hopper family) with 3 row blocks per warp, as the
// forward's (4 warps, 254 registers; the default kernel spills nothing, the window and softcap
// ones 4-32 bytes, nvcc 13.0; deterministic fwd+bwd 0.92-0.99x the time of 128-row tiles).
DUALKV_TILE_FN Sm80FwdTiles sm80_dq_tiles(int head_dim, int block_m) {
  return block_m == 192    ? Sm80FwdTiles{3, 32, 1}
         : head_dim <= 256 ? Sm80FwdTiles{head_dim <= 128 ? 2 : 1, 32, 1}
                           : Sm80FwdTiles{1, 16, 2};
}

// Backward main kernel (KV-tile-outer): 8 warps as warp_rows x (8 / warp_rows), each owning
// row_blocks x 16 KV rows of the plan's KV tile and 1 / (8 / warp_rows) of its columns. Two row
// blocks per warp wherever the tile has 64 rows or more: every Q / dO fragment loaded from shared
// memory then feeds two row blocks of S^T and dP^T, and the dV, dK and dQ products read a narrower
// B operand per warp. That is 4 x 2 up to D = 128 (128-row tiles) and 2 x 4 above (64-row tiles,
// FlashAttention-2's dK/dV layout at 256: each warp 32 rows by a quarter of D, dK and dV in 128
// registers per thread as 16 rows by half of D were; ldmatrix per step 204 -> 180 at D = 256). At
// D = 512 the 32-row tiles give 2 x 4 with one row block (16 rows by a quarter of D, 128 registers).
DUALKV_TILE_FN int sm80_bwd_row_blocks(int head_dim) { return plan_tiles(head_dim).bwd_block_n >= 64 ? 2 : 1; }
DUALKV_TILE_FN int sm80_bwd_warp_rows(int head_dim) {
  return plan_tiles(head_dim).bwd_block_n / (16 * sm80_bwd_row_blocks(head_dim));
}
// Phase 4 (dQ = dS K with atomics) holds a warp's dQ block in registers next to dK and dV: at most
// 128 columns at a time (D = 512: two passes over the warp's 256 columns, 64 registers each).
DUALKV_TILE_FN int sm80_bwd_dq_pass_cols(int warp_cols) { return warp_cols <= 128 ? warp_cols : 128; }
// Query rows per step: 128 at D = 64 (FlashAttention-2's D-64 backward: 128 x 128; each warp then
// holds S^T and dP^T of 32 KV rows by 64 queries next to dK and dV of 32 rows by 32 columns, 192
// accumulators as D = 128's 64-row step, and the step's fixed cost (barriers, the lse/delta and
// loader bookkeeping, the P/dS epilogue's tail) is paid once per twice the GEMM work, as on sm90:
// sm90_bwd_block_m), 64 otherwise. Softcap kernels keep 64 at D = 64, as on sm90: the cap's
// derivative next to 64 x 128 scores and dP^T spills 4-12 bytes on sm_80 and 44-68 bytes with the
// window (nvcc 13.0). The 128-row kernel needs 159 KiB of shared memory with two Q buffers:
// sm_86/89 (99 KiB) run the 64-row one (the launcher picks by the device's limit).
// A multiple of the plan's bwd_block_m (its split granularity).
DUALKV_TILE_FN int sm80_bwd_block_m(int head_dim, bool softcap) { return head_dim == 64 && !softcap ? 128 : 64; }

// ---- sm90 (wgmma + TMA) kernels ----
// Shared memory a block may opt into on sm_90 (H100 / H200): 227 KiB = 232,448 bytes. Every Hopper
// kernel's layout is checked against it at compile time; the portable kernels' launcher counts it as
// the largest device class they run on.
inline constexpr int kSm90SmemOptinBytes = 227 * 1024;
// Forward KV rows per pipeline stage: 128 up to D = 128, 64 above (shared memory: Q 64 KiB plus
// two stages of K and V). The D-128 kernel without modifiers or an external prefix walks wide
// tiles of 160 rows (sm90/fwd_kernel.cuh fwd_wide_tiles): the per-tile fixed cost (row max / sum,
// O rescale, barriers) is paid once per 160 keys; 160 is the widest whose two K / V stages fit next
// to Q and the O staging buffer (230,528 of 232,448 bytes). The D-256 one walks 80-row tiles the
// same way (FA3 / FA4's 128 x 80 at D 256; two K / V stages next to Q: 230,528 bytes too;
// docs/notes/2026-12-03-fa4-d256-forward-comparison.md §5).
DUALKV_TILE_FN int sm90_fwd_block_n(int head_dim, bool wide = false) {
  if (head_dim <= 128) return wide && head_dim == 128 ? 160 : 128;
  return wide && head_dim == 256 ? 80 : 64;
}
// Wide tiles pay only where the KV walks are long; elsewhere their ragged last tile of each range
// (and the diagonal's) costs more than the per-tile saving (and at D 64 skipping the KV tiles hidden
// from a warpgroup pays only where they are short: sm90/fwd_kernel.cuh). The plan says which (its
// key's long-walk bit, plan_format.h): the forward's query rows walk on average (row-weighted over
// the forward items) at least kFwdLongWalkKeys keys. Measured 2026-12-03 (H200, D 128, forward kernel time of 128-row
// against 160-row tiles, profiler, 5 rounds; docs/notes/2026-12-03-issue23-kv-width-bwd-order.md):
// 0.902 / 0.939 / 0.967 / 0.985 / 0.988 / 0.990 / 0.996 at mean walks of 1.3K (N64 P1K R512) /
// 0.5K (small groups) / 2.4K (N8 P256 R4K) / 2.4K (N16 P4K R48) / the tree / tiny responses / 4.2K
// (N16 P4K R1K), but 1.035 at 6.1K (N8 P2K R8K), 1.000 / 1.008 at 12.9K / 15.4K (P 16K): the
// threshold sits between 4.2K and 6.1K.
inline constexpr int64_t kFwdLongWalkKeys = 5120;
// At D 256 (80-row against 64-row tiles) measured 2026-12-04 (H200, forward kernel time, profiler,
// 5 rounds, every plan wide): 0.934 (N8 P16K R2K, mean walk 12.9K keys) / 0.954 (N8 P2K R8K, 6.1K) /
// 0.958 (long responses, 3.2K) / 0.965 (tiny responses, 2.3K) / 0.967 (N16 P4K R1K, 4.2K) / 0.975 (the
// tree, 1.7K) / 0.981 (N8 P256 R4K, 2.4K) / 0.988 (N64 P1K R512, 1.3K), but 1.004 on small groups
// (0.5K): the ragged last tile of each short range costs more than the per-tile saving there. So
// 1,024 keys, between 0.5K and 1.3K (the work model of docs/notes/2026-12-03-d256-wide80-static.md
// had predicted the same order).
inline constexpr int64_t kFwdLongWalkKeysD256 = 1024;
DUALKV_TILE_FN int64_t fwd_long_walk_keys(int head_dim) {
  return head_dim == 256 ? kFwdLongWalkKeysD256 : kFwdLongWalkKeys;
}
DUALKV_TILE_FN bool fwd_long_kv_walks(int64_t row_keys, int64_t rows, int64_t long_walk_keys = kFwdLongWalkKeys) {
  return rows > 0 && row_keys / rows >= long_walk_keys;  // (= row_keys >= long_walk_keys * rows, no overflow)
}
// The forward's query tiles are ragged where fewer than 95% of their rows hold tokens (rows over tiles x
// block_m; the plan key's ragged-tiles bit). In the sliding-window kernels (128-row query tiles over 128-key
// KV tiles from the segment's start) packed query heads (sm90/fwd_kernel.cuh fwd_packs_query_heads) save a
// ragged tile's empty rows and little else: a packed item of 128 / G tokens walks its query tile's diagonal
// KV tile, as the unpacked item does, and at most one tile fewer where the window starts, so on full tiles
// packing costs the packed rows' mask arithmetic. Measured 2026-12-07 (one H100, forward kernel time against
// the kernels before packing, 5 rounds, A/A beside; docs/notes/2026-12-07-fwd-packed-query-heads.md §8): the
// window kernels packed took 1.020 / 1.028 on long responses / N8 P16K R2K (gpt-oss's sliding layers: D 64,
// window 128 with sinks, G 8; fill 0.986 / 1.000) and 1.000 / 1.009 at D 128 with a window of 1,024 (G 4),
// but 0.887 / 0.856 on small groups (fill 0.80). The other kernels pack on full tiles too: their diagonal KV
// tiles (192-row query tiles at D 64, 160-key KV tiles in D 128's long-walk build) are where packing saves,
// 0.86-1.00 of the unpacked time on six layouts (session 57).
inline constexpr int kFwdRaggedFillPercent = 95;
DUALKV_TILE_FN bool fwd_ragged_tiles(int64_t rows, int64_t tiles, int block_m) {
  return rows * 100 < tiles * block_m * kFwdRaggedFillPercent;
}
// Backward main kernel (D <= 128) query rows per step: 128 at D = 64 (a step then has D 128's
// GEMM work and accumulator registers, so its fixed cost is amortised over twice the FLOPs of a
// 64-row step; docs/notes/2026-12-02-d64-bwd-steps.md), 64 otherwise. Softcap kernels keep 64 at
// D = 64: the cap's derivative next to 64 x 128 scores and dP^T spills 44-96 bytes (nvcc 13.0).
// A multiple of the plan's bwd_block_m (its split granularity).
DUALKV_TILE_FN int sm90_bwd_block_m(int head_dim, bool softcap) { return head_dim == 64 && !softcap ? 128 : 64; }

}  // namespace dualkv

#undef DUALKV_TILE_FN
