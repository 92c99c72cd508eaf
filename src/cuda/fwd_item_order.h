// The Hopper forward's item order: which (plan query tile, query head) forward item i covers.
//
// Host and device code: the launcher picks the order's two numbers (sm90/fwd_launch.cuh), the
// kernel decodes its items with them (sm90/fwd_kernel.cuh), and the CPU tests
// (tests/cpp/test_fwd_item_order.cpp) check that every order is a permutation of the items. The
// plan itself does not know the head counts, so the order of heads is decided here, per launch.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__)
#define DUALKV_ORDER_FN __host__ __device__ __forceinline__
#else
#define DUALKV_ORDER_FN inline
#endif

namespace dualkv::cuda {

// Forward item index -> (tile, h), item in [0, n_tiles * H).
//
// The plan's tiles (longest work first: neighbours have similar work, usually one prompt group)
// are cut into scheduling windows of `window` consecutive tiles; a window's window * H items come
// before the next window's. Inside a window of cnt tiles the query heads go in runs of `head_run`
// consecutive heads: item = w * window * H + ((h / head_run) * cnt + t) * head_run + h % head_run
// for tile = w * window + t:
//   head_run 1:     query head outer, tiles inner (the only order up to 2026-12-02).
//   head_run group: KV head outer, tiles, then the group's query heads (h = hk * group + g): the
//                   query heads that read one KV head take the same tile one after another, so
//                   their CTAs walk the same K / V at the same time, and with a window of at
//                   least SMs / group tiles the CTAs running at once read one KV head's K / V.
// Requires 1 <= window <= n_tiles (clamp_fwd_window) and H % head_run == 0; the last window may
// have fewer tiles. window == 1 with head_run == H is the plain order (tile = item / H).
DUALKV_ORDER_FN void decode_fwd_item(int32_t item, int32_t n_tiles, int32_t H, int32_t window, int32_t head_run,
                                     int32_t& tile, int32_t& h) {
  const int32_t per_w = window * H;
  const int32_t w = item / per_w;
  const int32_t r = item - w * per_w;
  const int32_t first = w * window;
  const int32_t cnt = n_tiles - first < window ? n_tiles - first : window;
  const int32_t per_run = cnt * head_run;  // items of one run of heads over the window's tiles
  const int32_t run = r / per_run;
  const int32_t r2 = r - run * per_run;
  const int32_t t = r2 / head_run;
  tile = first + t;
  h = run * head_run + (r2 - t * head_run);
}

// The window a launch's decode_fwd_item uses: the host's (FwdItemOrder::window, which may ask for
// the whole plan with INT32_MAX) clamped to [1, n_tiles], so that window * H cannot overflow.
DUALKV_ORDER_FN int32_t clamp_fwd_window(int32_t window, int32_t n_tiles) {
  const int32_t w = window < n_tiles ? window : n_tiles;
  return w > 1 ? w : 1;
}

// ---- Packed query heads (the Hopper forward; FA4's pack_gqa) ----
// With pack_shift s > 0 the G = 2^s query heads of a KV head share a forward item's block_m tile
// rows: item (tile, h) of KV head hk = h / G covers the tile's tokens [q0 + j B, q0 + (j + 1) B),
// j = h % G, B = block_m / G, for all G heads of hk at once, tile row t G + i being token
// q0 + j B + t, head hk G + i (the layout of a TMA box of G heads by B tokens). The items are the
// same n_tiles * H, each covering block_m (token, head) rows as before, but a row's walk now ends
// within B tokens of its own (not block_m): the causal diagonal and a segment's ragged end cost
// tiles of B tokens. Measured before building it (docs/notes/2026-12-07-fwd-packed-query-heads.md):
// FA4 dense's Hopper forward packs its heads so and issues exactly the wgmmas of this tiling, 5.1%
// fewer than ours on long responses at D 256.
//
// The rows of one item: the first segment of the tile whose tokens reach q0 (a tile of siblings
// holds several; the earlier ones are hidden from every row of the item, so its walk starts at this
// one: siblings share their ancestors), the token range [q0, q1) (empty when the tile's last sub-
// range lies past its end), the first query head of its rows, and q_diag: the first row token to
// test the causal diagonal against (a tile of siblings keeps the tile's first token, where each of
// its own ranges starts: the kernels' diagonal test relies on it).
struct FwdItemRows {
  int32_t seg, q0, q1, q_diag, head0;
};
DUALKV_ORDER_FN FwdItemRows fwd_item_rows(int32_t seg, int32_t q0, int32_t q1, const int32_t* offsets, int32_t h,
                                          int32_t pack_shift, int32_t block_m) {
  if (pack_shift == 0) return FwdItemRows{seg, q0, q1, q0, h};
  const int32_t j = h & ((1 << pack_shift) - 1);
  const int32_t b = block_m >> pack_shift;
  FwdItemRows r{seg, q0 + j * b, 0, q0, h - j};
  r.q1 = r.q0 + b < q1 ? r.q0 + b : q1;
  if (j == 0 || r.q0 >= q1) return r;
  if (q1 <= offsets[seg + 1]) {  // one segment's tile
    r.q_diag = r.q0;
    return r;
  }
  // Siblings are consecutive segments that end at q1 > r.q0 at the latest: the scan stops there.
  while (offsets[r.seg + 1] <= r.q0) ++r.seg;
  return r;
}

// ---- host: the order a launch uses (declared in nvcc's device pass too, where the launchers'
// host code is parsed; never called from device code) ----

// The two numbers of decode_fwd_item for one launch.
struct FwdItemOrder {
  int32_t window;    // tiles per scheduling window, in [1, n_tiles] once clamped to the plan
  int32_t head_run;  // query heads per run, divides H
};

// Which order a launch with H query heads and Hk KV heads uses: KV-head-major (head_run = the GQA
// group) over the whole plan as one window (docs/notes/2026-12-02-fwd-kv-head-order.md): the CTAs
// running at once read one KV head's K / V, which is then read from HBM about once per forward
// instead of once per 16-tile window. Measured on the H200 against the query-head-outer order with
// 16-tile windows (main's until 2026-12-02): fwd 0.984 / 0.988 / 0.986 of its time at N8 P16K R2K /
// N16 P8K R2K / N16 P4K R1K (H 32, Hk 8, D 128), W 1024 0.975 at P 4K; the other orders swept
// (head runs of 1 with windows 16..all, KV-head runs with windows 16/33/64) are in docs/decisions.md.
inline FwdItemOrder choose_fwd_item_order(int32_t H, int32_t Hk) {
  constexpr int32_t kWholePlan = INT32_MAX;  // the kernel clamps the window to the plan's tiles
  FwdItemOrder o{kWholePlan, (Hk > 0 && H % Hk == 0) ? H / Hk : 1};
  return o;
}

// The pack_shift a Hopper forward launch with H query heads and Hk KV heads uses: log2 of the
// group H / Hk when it is 2, 4, 8 or 16 (so that a warpgroup's 64 rows hold whole tokens and the
// fragment rows g and g + 8 of a warp are 8 >> s tokens apart), else 0 (one head per item).
inline int32_t choose_fwd_pack_shift(int32_t H, int32_t Hk) {
  if (Hk <= 0 || H % Hk != 0) return 0;
  const int32_t g = H / Hk;
  return g == 2 ? 1 : g == 4 ? 2 : g == 8 ? 3 : g == 16 ? 4 : 0;
}

// The order the Hopper backward main kernel's producer claims its items in at the head dims of
// sm90/bwd_kernel.cuh bwd_claim_ordered (D 64): decode_fwd_item over (plan work items, KV heads),
// windows of SMs / 2 work items (the plan's longest first) and inside a window runs of 2 KV heads.
// The CTAs running at once then hold about SMs / 2 work items of two KV heads instead of SMs / Hk
// work items of every KV head, so the KV tiles of one prompt, which walk the same response rows, run
// together (their shared Q / dO reads and dQ reductions in L2 is the hypothesis, not a measured
// counter: docs/notes/2026-12-06-bwd-claim-order.md). An odd Hk keeps each work item's KV heads
// together (head_run = Hk: the plan's order).
inline FwdItemOrder choose_bwd_item_order(int32_t sms, int32_t Hk) {
  const int32_t run = Hk <= 0 ? 1 : Hk % 2 == 0 ? 2 : Hk;
  const int32_t window = sms / 2;
  return FwdItemOrder{window > 1 ? window : 1, run};
}

}  // namespace dualkv::cuda
