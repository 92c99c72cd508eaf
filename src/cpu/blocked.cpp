// The blocked path of the CPU backend (backends.h).
//
// Operands are read in place when the tile kernels take their dtype (float32; bfloat16 on AMX),
// else converted once to fp32; then every query tile
// (tiles.h: up to kQueryRows tokens of one segment, or of sibling responses) walks the key blocks
// it sees, ancestors in full and its own segments causally, with the arithmetic of one
// (tile, block) in tile_kernels.h. An external prefix segment's blocks read the prefix buffers.
// - Forward: one work item per (query tile, head), online softmax over the key blocks; a head's
//   sink joins the denominator in the epilogue.
// - Backward: fused (each (tile, block) computes its probabilities once and feeds dq, dk and dv),
//   one work item per (tree, kv head). Trees share no keys, so an item owns the dk/dv of its
//   tree's tokens (and of its external root's prefix rows, which a layout gives to one segment)
//   and the dq of its query rows: no atomics, no reduction across threads, and every sum runs in
//   the same order whatever the thread count. The sinks' gradient comes from the rows' lse and
//   delta alone (one sum per head, in token order).
// The mask modifiers: the window through the tiles (tiles.h), the softcap in the score kernel.
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <numeric>
#include <vector>

#include "cpu/backends.h"
#include "cpu/convert.h"
#include "cpu/parallel.h"
#include "cpu/tile_kernels.h"
#include "cpu/tiles.h"
#include "dualkv/layout.h"
#include "dualkv/mask.h"

namespace dualkv::detail::cpu {
namespace {

// Tile sizes: up to 256 query rows (several responses of a group share the prompt's key blocks)
// by 128 keys; score blocks and operands stay in L2 at D <= 256. Against 128-row tiles +2-3%
// (within the noise of this shared machine), against 64 x 128 +10% (docs/decisions.md).
constexpr int32_t kQueryRows = 256;
constexpr int32_t kKeyCols = 128;
constexpr int64_t kGatherTokens = 256;  // tokens per work item of the fp32 conversion

// n elements of a bfloat16 or float16 row to fp32.
void convert_row(const void* base, int64_t offset, int32_t dtype, int64_t n, float* out) {
  switch (dtype) {
    case DUALKV_DTYPE_BFLOAT16: {
      const uint16_t* in = static_cast<const uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = bf16_to_float(in[i]);
      break;
    }
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = fp16_to_float(static_cast<const uint16_t*>(base)[offset + i]);
  }
}

// base[offset + i] = factor * row[i] for i < n, rounded to the output dtype (the dtype switch
// outside the loop, so the float32 case is a plain vectorised loop).
void store_row(void* base, int64_t offset, int32_t dtype, const float* row, float factor, int64_t n) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: {
      float* out = static_cast<float*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = factor * row[i];
      break;
    }
    case DUALKV_DTYPE_BFLOAT16: {
      uint16_t* out = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16(factor * row[i]);
      break;
    }
    default: {
      uint16_t* out = static_cast<uint16_t*>(base) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = float_to_fp16(factor * row[i]);
    }
  }
}

// base[offset + i] += factor * row[i] for i < n, in the output dtype (the accumulated prefix
// gradients).
void add_row(void* base, int64_t offset, int32_t dtype, const float* row, float factor, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    store_element<float>(base, offset + i, dtype, load_element<float>(base, offset + i, dtype) + factor * row[i]);
}

// A [T, heads, D] operand as rows of the tile kernels' operand dtype: element (t, h, d) at
// data[t * token_stride + h * head_stride + d], each `element_bytes` wide.
struct Operand {
  const void* data;
  int64_t token_stride, head_stride, D, element_bytes;
  std::vector<float> converted;  // the fp32 copy of a 16-bit operand; empty when read in place
};

// Operands of the kernels' dtype (float32, or bfloat16 for amx) are read in place (the kernels take
// any row stride); bfloat16 and float16 ones for the fp32 kernels are converted once to a
// contiguous fp32 [heads][T][D] copy.
Operand as_operand(const TileKernels& kernels, const void* base, int32_t dtype, int64_t T, int64_t heads, int64_t D,
                   int64_t token_stride, int64_t head_stride, int32_t threads) {
  if (dtype == kernels.operand_dtype)
    return {base, token_stride, head_stride, D, dtype == DUALKV_DTYPE_FLOAT32 ? 4 : 2, {}};
  Operand op{nullptr, D, T * D, D, 4, std::vector<float>(static_cast<size_t>(heads * T * D))};
  const int64_t chunks = (T + kGatherTokens - 1) / kGatherTokens;
  parallel_for(heads * chunks, threads, [&](int64_t item) {
    const int64_t h = item / chunks, begin = (item % chunks) * kGatherTokens;
    for (int64_t t = begin; t < std::min(T, begin + kGatherTokens); ++t)
      convert_row(base, t * token_stride + h * head_stride, dtype, D, &op.converted[static_cast<size_t>((h * T + t) * D)]);
  });
  op.data = op.converted.data();
  return op;
}

// Rows [begin, end) of one head.
ConstMatrix rows_of(const Operand& a, int64_t head, int32_t begin, int32_t end) {
  const int64_t offset = (begin * a.token_stride + head * a.head_stride) * a.element_bytes;
  return {static_cast<const char*>(a.data) + offset, end - begin, a.D, a.token_stride};
}

// n floats at a 64-byte boundary inside `storage` (grown if needed, contents unspecified). Eigen's
// row reductions (the softmax row sums) peel off elements up to the first aligned one, so their
// summation order depends on a row's alignment: scratch rows are aligned the same way in every
// work item, whichever thread runs it, which keeps results bit-identical across thread counts.
float* aligned_floats(std::vector<float>& storage, size_t n) {
  if (storage.size() < n + 16) storage.resize(n + 16);
  const uintptr_t address = reinterpret_cast<uintptr_t>(storage.data());
  return storage.data() + ((64 - address % 64) % 64) / sizeof(float);
}

// A thread's tile-sized buffers (at most kQueryRows x max(kKeyCols, D) floats each), reused by all
// its work items and by the calling thread across calls: allocating a score block per item meant
// an mmap, fresh zeroed pages and an munmap each time, which serialised the threads on the
// process's memory map (1.8x instead of 2x on 2 cores). Buffers that scale with the layout (a
// tree's dk/dv) stay per item, so nothing large outlives a call.
struct Workspace {
  std::vector<float> scores, scratch, rows, row_max, row_sum;
  std::vector<KeyBlock> blocks;
};

Workspace& thread_workspace() {
  thread_local Workspace workspace;
  return workspace;
}

// Visible (query, key) pairs of segments [first, last): the cost of a tree as a unit of backward work.
int64_t visible_pairs(const ForestView& f, int32_t first, int32_t last) {
  int64_t pairs = 0;
  for (int32_t s = first; s < last; ++s) {
    const int64_t n = f.segment_length(s);
    pairs += n * f.position_offset[s] + n * (n + 1) / 2;
  }
  return pairs;
}

// Threads for a call: one when the whole call is under ~16M multiply-adds (well under a
// millisecond), where starting and joining a worker costs more than it saves (and, on a loaded
// machine, waits for the scheduler).
int32_t threads_for(const ForestView& f, int64_t heads, int64_t D, int32_t requested) {
  constexpr int64_t kMinParallelWork = int64_t(1) << 24;
  return visible_pairs(f, 0, f.num_segments) * heads * D < kMinParallelWork ? 1 : requested;
}

// What the forward and the backward share: the forest, the sizes, the mask modifiers, the thread
// count, the tile kernels and q, k, v (and the prefix buffers' keys and values, without rows when
// there is no external segment) as their operands.
struct Problem {
  ForestView f;
  int64_t T, H, Hk, D, group;
  float scale, softcap;
  PositionWindow window;
  int32_t threads;
  const TileKernels& kernels;
  Operand q, k, v, prefix_k, prefix_v;

  // Keys / values of kv head g of a key block: tokens, or an external segment's prefix rows.
  ConstMatrix keys(const KeyBlock& b, int64_t g) const {
    return rows_of(f.is_external(b.segment) ? prefix_k : k, g, b.pair.keys.begin, b.pair.keys.end);
  }
  ConstMatrix values(const KeyBlock& b, int64_t g) const {
    return rows_of(f.is_external(b.segment) ? prefix_v : v, g, b.pair.keys.begin, b.pair.keys.end);
  }
};

template <typename Params>
Problem make_problem(const Params& p) {
  const ForestView f = make_forest_view(p.layout, p.prefixes);
  const int64_t T = f.num_tokens, H = p.num_heads, Hk = p.num_kv_heads, D = p.head_dim;
  const int64_t prefix_rows = p.prefixes.num_prefixes ? p.prefixes.num_prefix_rows : 0;
  const int32_t threads = threads_for(f, H, D, p.num_threads);
  const TileKernels& kernels = tile_kernels(p.dtype);
  auto operand = [&](const void* base, int64_t rows, int64_t heads, int64_t token_stride, int64_t head_stride) {
    return as_operand(kernels, base, p.dtype, rows, heads, D, token_stride, head_stride, threads);
  };
  auto prefix = [&](const void* base, int64_t token_stride, int64_t head_stride) {
    return prefix_rows ? operand(base, prefix_rows, Hk, token_stride, head_stride) : Operand{nullptr, 0, 0, D, 4, {}};
  };
  return {f, T, H, Hk, D, H / Hk, static_cast<float>(p.softmax_scale), static_cast<float>(p.softcap),
          PositionWindow{p.window}, threads, kernels,
          operand(p.q, T, H, p.q_token_stride, p.q_head_stride),
          operand(p.k, T, Hk, p.k_token_stride, p.k_head_stride),
          operand(p.v, T, Hk, p.v_token_stride, p.v_head_stride),
          prefix(p.prefix_k, p.prefix_k_token_stride, p.prefix_k_head_stride),
          prefix(p.prefix_v, p.prefix_v_token_stride, p.prefix_v_head_stride)};
}

}  // namespace

void blocked_forward(const dualkv_fwd_params& p) {
  const Problem pr = make_problem(p);
  const TileKernels& kernels = pr.kernels;
  const ForestView& f = pr.f;
  const int64_t H = pr.H, D = pr.D, group = pr.group;
  const float scale = pr.scale;
  const int32_t threads = pr.threads;
  const Operand& q = pr.q;
  const std::vector<QueryTile> tiles = query_tiles(f, kQueryRows, /*stack_roots=*/true);

  parallel_for(static_cast<int64_t>(tiles.size()) * H, threads, [&](int64_t item) {
    const QueryTile& tile = tiles[static_cast<size_t>(item / H)];
    const int64_t h = item % H, g = h / group, rows = tile.end - tile.begin;
    Workspace& w = thread_workspace();
    float* scores = aligned_floats(w.scores, static_cast<size_t>(rows * kKeyCols));
    std::vector<float>& acc = w.rows;
    acc.assign(static_cast<size_t>(rows * D), 0.0f);
    std::vector<float>& row_max = w.row_max;
    std::vector<float>& row_sum = w.row_sum;
    row_max.assign(static_cast<size_t>(rows), -INFINITY);
    row_sum.assign(static_cast<size_t>(rows), 0.0f);
    std::vector<KeyBlock>& blocks = w.blocks;
    key_blocks(f, pr.window, tile, kKeyCols, &blocks);
    for (const KeyBlock& b : blocks) {
      const int64_t r = b.row_begin - tile.begin, n = b.row_end - b.row_begin;  // the rows that see b
      const Matrix s{scores + r * kKeyCols, n, b.pair.keys.end - b.pair.keys.begin, kKeyCols};
      kernels.scores(rows_of(q, h, b.row_begin, b.row_end), pr.keys(b, g), scale, pr.softcap, s);
      if (b.masked) mask_block(f, pr.window, tile, b, s.data, s.ld);
      kernels.softmax_accumulate(s, pr.values(b, g), &row_max[static_cast<size_t>(r)],
                                 &row_sum[static_cast<size_t>(r)], Matrix{&acc[static_cast<size_t>(r * D)], n, D, D});
    }
    // Every row sees at least its own key, so row_sum >= 1. The head's sink, if any, is one more
    // key of every row (of value zero).
    const int32_t ldt = lse_dtype(p.dtype);
    const float sink = p.sinks ? load_element<float>(p.sinks, h, ldt) : 0.0f;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t t = tile.begin + i, o = t * p.out_token_stride + h * p.out_head_stride;
      float m = row_max[static_cast<size_t>(i)], l = row_sum[static_cast<size_t>(i)];
      const float rescale = p.sinks ? fold_sink(m, l, sink) : 1.0f;
      store_row(p.out, o, p.dtype, &acc[static_cast<size_t>(i * D)], rescale / l, D);
      if (p.lse) store_element<float>(p.lse, h * p.lse_head_stride + t, ldt, m + std::log(l));
    }
  });
}

void blocked_backward(const dualkv_bwd_params& p) {
  const Problem pr = make_problem(p);
  const TileKernels& kernels = pr.kernels;
  const ForestView& f = pr.f;
  const int64_t T = pr.T, H = pr.H, Hk = pr.Hk, D = pr.D, group = pr.group;
  const float scale = pr.scale;
  const int32_t threads = pr.threads;
  const Operand& q = pr.q;
  const Operand dout = as_operand(kernels, p.dout, p.dtype, T, H, D, p.dout_token_stride, p.dout_head_stride, threads);

  // lse and delta = rowsum(dO * O) - dlse per (head, token), the softmax-backward correction; and
  // a head's d loss / d sink = -sum over its rows of sink_probability * delta (fp64 sum).
  const int32_t ldt = lse_dtype(p.dtype);
  std::vector<float> lse(static_cast<size_t>(H * T)), delta(static_cast<size_t>(H * T));
  parallel_for(H, threads, [&](int64_t h) {
    const float sink = p.sinks ? load_element<float>(p.sinks, h, ldt) : 0.0f;
    double dsink = 0;
    for (int64_t t = 0; t < T; ++t) {
      const size_t i = static_cast<size_t>(h * T + t);
      const int64_t o = t * p.out_token_stride + h * p.out_head_stride;
      const int64_t od = t * p.dout_token_stride + h * p.dout_head_stride;
      float sum = 0;
      for (int64_t d = 0; d < D; ++d)
        sum += load_element<float>(p.dout, od + d, p.dtype) * load_element<float>(p.out, o + d, p.dtype);
      if (p.dlse) sum -= load_element<float>(p.dlse, h * p.dlse_head_stride + t, ldt);
      delta[i] = sum;
      lse[i] = load_element<float>(p.lse, h * p.lse_head_stride + t, ldt);
      if (p.sinks) dsink -= double(sink_probability(sink, lse[i])) * sum;
    }
    if (p.sinks) store_element<double>(p.dsinks, h, ldt, dsink);
  });

  const std::vector<QueryTile> tiles = query_tiles(f, kQueryRows, /*stack_roots=*/false);
  const std::vector<Tree> forest = trees(f);
  // Tiles are in token order, so each tree's tiles are one range; items run largest tree first.
  std::vector<size_t> first_tile(forest.size() + 1, tiles.size());
  for (size_t r = 0, i = 0; r < forest.size(); ++r) {
    while (tiles[i].begin < forest[r].token_begin) ++i;
    first_tile[r] = i;
  }
  std::vector<size_t> order(forest.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::vector<int64_t> cost(forest.size());
  for (size_t r = 0; r < forest.size(); ++r) cost[r] = visible_pairs(f, forest[r].first, forest[r].last);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return cost[a] > cost[b]; });

  parallel_for(static_cast<int64_t>(forest.size()) * Hk, threads, [&](int64_t item) {
    const size_t tree_index = order[static_cast<size_t>(item / Hk)];
    const Tree& tree = forest[tree_index];
    const int64_t g = item % Hk, n = tree.token_end - tree.token_begin;
    std::vector<float> dk(static_cast<size_t>(n * D), 0.0f), dv(static_cast<size_t>(n * D), 0.0f);
    // An external root's prefix rows: their gradients, added to prefix_dk / prefix_dv at the end.
    const bool external = f.is_external(tree.first);
    const int32_t prefix_begin = external ? f.prefix_begin(tree.first) : 0;
    const int64_t prefix_n = external ? f.prefix_end(tree.first) - prefix_begin : 0;
    std::vector<float> prefix_dk(static_cast<size_t>(prefix_n * D), 0.0f), prefix_dv(prefix_dk.size(), 0.0f);
    Workspace& w = thread_workspace();
    std::vector<float>& dq = w.rows;
    dq.resize(static_cast<size_t>(kQueryRows * D));
    float* scores = aligned_floats(w.scores, static_cast<size_t>(kQueryRows * kKeyCols));
    float* scratch = aligned_floats(w.scratch, static_cast<size_t>(kQueryRows * kKeyCols));
    std::vector<KeyBlock>& blocks = w.blocks;
    for (int64_t h = g * group; h < (g + 1) * group; ++h)
      for (size_t ti = first_tile[tree_index]; ti < first_tile[tree_index + 1]; ++ti) {
        const QueryTile& tile = tiles[ti];
        const int64_t rows = tile.end - tile.begin;
        std::fill(dq.begin(), dq.begin() + rows * D, 0.0f);
        key_blocks(f, pr.window, tile, kKeyCols, &blocks);
        for (const KeyBlock& b : blocks) {
          const int64_t r = b.row_begin - tile.begin, n = b.row_end - b.row_begin;  // the rows that see b
          const TokenRange keys = b.pair.keys;
          const int64_t cols = keys.end - keys.begin;
          // the block's rows of the tree's dk/dv, or of its prefix's
          const bool prefix = f.is_external(b.segment);
          float* block_dk = prefix ? &prefix_dk[static_cast<size_t>((keys.begin - prefix_begin) * D)]
                                   : &dk[static_cast<size_t>((keys.begin - tree.token_begin) * D)];
          float* block_dv = prefix ? &prefix_dv[static_cast<size_t>((keys.begin - prefix_begin) * D)]
                                   : &dv[static_cast<size_t>((keys.begin - tree.token_begin) * D)];
          const size_t row0 = static_cast<size_t>(h * T + b.row_begin);
          const ConstMatrix qt = rows_of(q, h, b.row_begin, b.row_end);
          const Matrix s{scores + r * kKeyCols, n, cols, kKeyCols};
          kernels.scores(qt, pr.keys(b, g), scale, pr.softcap, s);
          if (b.masked) mask_block(f, pr.window, tile, b, s.data, s.ld);
          kernels.backward_block(s, &lse[row0], &delta[row0], pr.softcap, qt, pr.keys(b, g), pr.values(b, g),
                                 rows_of(dout, h, b.row_begin, b.row_end),
                                 Matrix{scratch + r * kKeyCols, n, cols, kKeyCols},
                                 Matrix{&dq[static_cast<size_t>(r * D)], n, D, D}, Matrix{block_dk, cols, D, D},
                                 Matrix{block_dv, cols, D, D});
        }
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t o = (tile.begin + i) * p.dq_token_stride + h * p.dq_head_stride;
          store_row(p.dq, o, p.dtype, &dq[static_cast<size_t>(i * D)], scale, D);
        }
      }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = tree.token_begin + j;
      const int64_t ok = t * p.dk_token_stride + g * p.dk_head_stride, ov = t * p.dv_token_stride + g * p.dv_head_stride;
      store_row(p.dk, ok, p.dtype, &dk[static_cast<size_t>(j * D)], scale, D);
      store_row(p.dv, ov, p.dtype, &dv[static_cast<size_t>(j * D)], 1.0f, D);
    }
    for (int64_t j = 0; j < prefix_n; ++j) {
      const int64_t row = prefix_begin + j;
      add_row(p.prefix_dk, row * p.prefix_dk_token_stride + g * p.prefix_dk_head_stride, p.dtype,
              &prefix_dk[static_cast<size_t>(j * D)], scale, D);
      add_row(p.prefix_dv, row * p.prefix_dv_token_stride + g * p.prefix_dv_head_stride, p.dtype,
              &prefix_dv[static_cast<size_t>(j * D)], 1.0f, D);
    }
  });
}

}  // namespace dualkv::detail::cpu
