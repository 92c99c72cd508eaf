// The host planner: builds the work plan (plan_format.h) of a layout for a head dim, and the key
// that ties it to that layout and tiling. Plain C++ (no CUDA), compiled in every build and unit
// tested without a GPU (tests/cpp/test_plan.cpp); the C ABI exposes it through dualkv_plan_size /
// dualkv_plan_build (CUDA, for a device) and dualkv_plan_inspect (any build, for a given SM count).
#ifndef DUALKV_SRC_PLAN_H_
#define DUALKV_SRC_PLAN_H_

#include <stdint.h>

#include <vector>

#include "dualkv/dualkv.h"
#include "plan_format.h"
#include "tile_size.h"

namespace dualkv::plan {

struct Plan {
  std::vector<int32_t> data;  // the plan buffer
  uint64_t key = 0;           // plan key (plan_format.h)
  int32_t split_rows = 0;     // backward query ranges longer than this were cut into several items
};

// Builds the plan of a valid, derived host layout (with its external prefix table `prefixes`, host
// memory, checked with it; NULL or num_prefixes 0: none) for `head_dim`, the forward query tiles of
// the kernel family `family` (tile_size.h fwd_block_m) and a sliding window of
// `window` positions (0: none; plan_format.h) on a device with `num_sms` multiprocessors (the
// backward split length is max(8192, total / num_sms) query rows, or DUALKV_CUDA_SPLIT_ROWS when
// set: tests use it to exercise splits).
dualkv_status build(const dualkv_layout& layout, const dualkv_prefixes* prefixes, int head_dim, TileFamily family,
                    int32_t window, int num_sms, Plan* out);

// The part of the plan key that names the tiling (the head dim's backward tiles and the forward's
// `fwd_tile_rows` query rows), the window, the layout's S and T and its prefix
// table's size (E prefixes of `prefix_rows` rows; 0, 0 without): kernels' callers recompute it
// from their params and reject a plan built for anything else (a plan built for another window,
// or without the table of a prefixed forest, among them).
uint64_t key_hash(int head_dim, int fwd_tile_rows, int32_t num_segments, int32_t num_tokens, int32_t window,
                  int32_t num_prefixes, int32_t prefix_rows);

// Split slots recorded in a plan key (they size the backward workspace).
inline int32_t key_slots(uint64_t key) { return static_cast<int32_t>(key & kPlanSlotMask); }
// Whether the plan's forward KV walks are long (tile_size.h fwd_long_kv_walks): the kernels with a
// long-walk build run it then (sm90/fwd_kernel.cuh fwd_has_long_walk_kernel).
inline bool key_long_kv_walks(uint64_t key) { return (key & kPlanLongWalksBit) != 0; }
// Whether the plan's forward query tiles are ragged (tile_size.h fwd_ragged_tiles): the sliding-window
// kernels pack query heads only then (sm90/fwd_launch.cuh).
inline bool key_ragged_fwd_tiles(uint64_t key) { return (key & kPlanRaggedTilesBit) != 0; }

}  // namespace dualkv::plan

#endif  // DUALKV_SRC_PLAN_H_
