// External prefix segments (dualkv_prefixes): layout derivation and validation, and the CPU
// backend (fp32 blocked path, fp64 reference, bf16 inputs; with and without the mask modifiers)
// against the brute-force fp64 dense attention of forest_testing.h over the same forest with the
// prefixes' rows as ordinary tokens; and the params layouts of every ABI.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cpu/convert.h"
#include "forest_testing.h"

using dualkv::testing::dense_attention;
using dualkv::testing::HostLayout;
using dualkv::testing::PrefixedLayout;
using dualkv::testing::Modifiers;
using dualkv::testing::random_forest;
using dualkv::testing::relative_error;

namespace {

// GRPO group with an external prompt: prefix 0 (5 rows) -> last prompt token (1) -> 3 responses,
// then an ordinary group: prompt 4 -> responses 2, 3.
PrefixedLayout two_groups() {
  return PrefixedLayout({0, 1, 2, 3, 1, 4, 2, 3}, {-1, 0, 1, 1, 1, -1, 5, 5}, {0, -1, -1, -1, -1, -1, -1, -1}, {5});
}

TEST(Prefix, PositionsContinueAfterTheExternalPrefix) {
  PrefixedLayout l = two_groups();
  ASSERT_EQ(l.derive(), DUALKV_OK) << dualkv_last_error();
  EXPECT_EQ(l.position_offset, (std::vector<int32_t>{0, 5, 6, 6, 6, 0, 4, 4}));
  EXPECT_EQ(l.subtree_end, (std::vector<int32_t>{5, 5, 3, 4, 5, 8, 7, 8}));
  EXPECT_EQ(l.depth, (std::vector<int32_t>{0, 1, 2, 2, 2, 0, 1, 1}));
  EXPECT_EQ(l.max_depth, 3);
  const dualkv_layout v = l.view();
  const dualkv_prefixes p = l.prefixes();
  std::vector<int32_t> pos(size_t(v.num_tokens));
  ASSERT_EQ(dualkv_layout_position_ids_prefixed(&v, &p, pos.data()), DUALKV_OK) << dualkv_last_error();
  EXPECT_EQ(pos, (std::vector<int32_t>{5, 6, 7, 6, 7, 8, 6, 0, 1, 2, 3, 4, 5, 4, 5, 6}));
  int64_t pairs = 0;
  ASSERT_EQ(dualkv_layout_visible_pairs_prefixed(&v, &p, &pairs), DUALKV_OK);
  // last prompt token 6, responses 6*2+3, 6*3+6, 6*1+1; prompt 10, responses 4*2+3, 4*3+6
  EXPECT_EQ(pairs, 6 + 15 + 24 + 7 + 10 + 11 + 18);
  // Without its prefixes the forest is refused (the external segment looks empty), with a hint.
  EXPECT_EQ(dualkv_layout_position_ids(&v, pos.data()), DUALKV_ERROR_INVALID_LAYOUT);
  EXPECT_NE(std::string(dualkv_last_error()).find("dualkv_prefixes"), std::string::npos);
}

TEST(Prefix, InvalidPrefixLayoutsNameTheProblem) {
  struct Case {
    const char* what;
    PrefixedLayout layout;
    const char* message;
  };
  std::vector<Case> cases = {
      {"missing prefix", PrefixedLayout({0, 2}, {-1, 0}, {1, -1}, {3}), "references external prefix 1"},
      {"negative reference", PrefixedLayout({0, 2}, {-1, 0}, {-2, -1}, {3}), "references external prefix -2"},
      {"held twice", PrefixedLayout({0, 2, 0, 2}, {-1, 0, -1, 2}, {0, -1, 0, -1}, {3}), "held by segments 0 and 2"},
      {"external with a parent", PrefixedLayout({2, 0, 1}, {-1, 0, 1}, {-1, 0, -1}, {3}), "must be a root"},
      {"external without children", PrefixedLayout({2, 0}, {-1, -1}, {-1, 0}, {3}), "has no children"},
      {"empty prefix", PrefixedLayout({0, 2}, {-1, 0}, {0, -1}, {0}), "prefix 0 is empty"},
  };
  for (Case& c : cases) {
    SCOPED_TRACE(c.what);
    EXPECT_EQ(c.layout.derive(), DUALKV_ERROR_INVALID_LAYOUT);
    EXPECT_NE(std::string(dualkv_last_error()).find(c.message), std::string::npos) << dualkv_last_error();
  }
  // An external segment with tokens of its own (seg_offsets built by hand).
  PrefixedLayout tokens({0, 2}, {-1, 0}, {0, -1}, {3});
  tokens.offsets = {0, 1, 3};
  EXPECT_EQ(tokens.derive(), DUALKV_ERROR_INVALID_LAYOUT);
  EXPECT_NE(std::string(dualkv_last_error()).find("holds 1 tokens"), std::string::npos) << dualkv_last_error();
  // prefix_offsets that do not end at num_prefix_rows.
  PrefixedLayout rows({0, 2}, {-1, 0}, {0, -1}, {3});
  dualkv_prefixes p = rows.prefixes();
  p.num_prefix_rows = 4;
  EXPECT_EQ(dualkv_layout_derive_prefixed(rows.offsets.data(), rows.parent.data(), 2, 2, &p, nullptr, nullptr, nullptr,
                                          nullptr),
            DUALKV_ERROR_INVALID_LAYOUT);
  EXPECT_NE(std::string(dualkv_last_error()).find("num_prefix_rows 4"), std::string::npos) << dualkv_last_error();
}

// A random prefixed problem: the forest of `flat` (all segments ordinary) where some roots with
// children are external; their rows go to the prefix buffers, in a shuffled prefix order, after
// an unused prefix (whose gradient rows must stay untouched).
struct Case {
  HostLayout flat;
  PrefixedLayout prefixed;
  std::vector<int32_t> local_of_flat;   // flat token -> local token, or -1 for a prefix row
  std::vector<int32_t> prefix_of_flat;  // flat token -> prefix row, or -1
};

// The case of a flat forest (lengths, parents) whose segments with prefix_of[s] >= 0 are external,
// holding that prefix (prefix_lens[e] rows; a referenced one as long as its segment).
Case make_case(const std::vector<int32_t>& lengths, const std::vector<int32_t>& parents,
               const std::vector<int32_t>& prefix_of, const std::vector<int32_t>& prefix_lens) {
  const int32_t S = int32_t(lengths.size());
  Case c{HostLayout(lengths, parents), PrefixedLayout(lengths, parents, prefix_of, prefix_lens), {}, {}};
  if (c.prefixed.derive() != DUALKV_OK) throw std::runtime_error(dualkv_last_error());
  for (int32_t s = 0; s < S; ++s)
    for (int32_t j = 0; j < lengths[size_t(s)]; ++j) {
      const int32_t e = prefix_of[size_t(s)];
      c.local_of_flat.push_back(e >= 0 ? -1 : c.prefixed.offsets[size_t(s)] + j);
      c.prefix_of_flat.push_back(e >= 0 ? c.prefixed.prefix_offsets[size_t(e)] + j : -1);
    }
  return c;
}

Case random_case(std::mt19937& rng) {
  std::vector<int32_t> lengths, parents;
  random_forest(rng, 1 + int(rng() % 4), 4, 3, 12, &lengths, &parents);
  const int32_t S = int32_t(lengths.size());
  std::vector<int32_t> prefix_of(S, -1), external;
  for (int32_t s = 0; s < S; ++s)
    if (parents[s] == -1 && s + 1 < S && parents[s + 1] == s && rng() % 3 != 0) external.push_back(s);
  // prefix 0 is unused; the external roots take prefixes 1..E in a shuffled order
  std::vector<int32_t> order(external.size());
  std::iota(order.begin(), order.end(), 1);
  std::shuffle(order.begin(), order.end(), rng);
  std::vector<int32_t> prefix_lens(external.size() + 1, 0);
  prefix_lens[0] = 1 + int32_t(rng() % 5);
  for (size_t i = 0; i < external.size(); ++i) {
    prefix_of[size_t(external[i])] = order[i];
    prefix_lens[size_t(order[i])] = lengths[size_t(external[i])];
  }
  return make_case(lengths, parents, prefix_of, prefix_lens);
}

// Mask modifiers for trial i of H query heads: every trial has a window (1 to 40 positions, so
// that it cuts prefixes short and long, or hides them) and cycles through the softcap and sinks
// (both, softcap only, sinks only).
Modifiers random_modifiers(std::mt19937& rng, int i, int H) {
  Modifiers mods;
  mods.window = std::uniform_int_distribution<int>(1, 40)(rng);
  if (i % 3 != 2) mods.softcap = std::uniform_real_distribution<double>(0.5, 4.0)(rng);
  if (i % 3 != 1)
    for (int h = 0; h < H; ++h) mods.sinks.push_back(std::uniform_real_distribution<double>(-2.0, 3.0)(rng));
  return mods;
}

template <typename T>
T from_double(double x) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return dualkv::detail::cpu::float_to_bf16(float(x));
  } else {
    return T(x);
  }
}
template <typename T>
double to_double(T x) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return dualkv::detail::cpu::bf16_to_float(x);
  } else {
    return double(x);
  }
}

// The prefix block of forward or backward params: the layout's table and contiguous
// [rows, Hk, D] prefix buffers.
template <typename Params>
void set_prefix_inputs(Params* p, const PrefixedLayout& l, const void* pk, const void* pv, int Hk, int D) {
  p->prefixes = l.prefixes();
  p->prefix_k = pk;
  p->prefix_v = pv;
  p->prefix_k_token_stride = p->prefix_v_token_stride = int64_t(Hk) * D;
  p->prefix_k_head_stride = p->prefix_v_head_stride = D;
}

void set_prefix_grads(dualkv_bwd_params* b, void* pdk, void* pdv, int Hk, int D) {
  b->prefix_dk = pdk;
  b->prefix_dv = pdv;
  b->prefix_dk_token_stride = b->prefix_dv_token_stride = int64_t(Hk) * D;
  b->prefix_dk_head_stride = b->prefix_dv_head_stride = D;
}

// Appends the bytes of `x` to `bytes`.
template <typename V>
void append_bytes(const V& x, std::vector<unsigned char>* bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(x.data());
  bytes->insert(bytes->end(), p, p + x.size() * sizeof(x[0]));
}

// Runs `c` through the C ABI (dtype, threads, mask modifiers) and compares every output with the
// dense fp64 attention of the flat forest. With `bytes`, appends the raw outputs to it.
template <typename T>
void check_case(const Case& c, std::mt19937& rng, int32_t dtype, int H, int Hk, int D, int threads, double tol,
                std::vector<unsigned char>* bytes = nullptr, const Modifiers& mods = {}) {
  const int Tf = c.flat.num_tokens(), Tl = c.prefixed.offsets.back(), Tp = c.prefixed.prefix_offsets.back();
  std::normal_distribution<double> normal(0.0, 1.0);
  // fp64 values (rounded to T first) of the flat problem; dout is 0 on the prefix rows, which
  // have no queries in the prefixed problem.
  auto rounded = [&](size_t n) {
    std::vector<double> x(n);
    for (double& e : x) e = to_double(from_double<T>(normal(rng)));
    return x;
  };
  const std::vector<double> q = rounded(size_t(Tf) * H * D), k = rounded(size_t(Tf) * Hk * D),
                            v = rounded(size_t(Tf) * Hk * D);
  std::vector<double> dout = rounded(size_t(Tf) * H * D);
  for (int t = 0; t < Tf; ++t)
    if (c.local_of_flat[size_t(t)] < 0) std::fill_n(&dout[size_t(t) * H * D], H * D, 0.0);
  // (the prefix rows' zero dout makes their delta zero: no share of dsinks either)
  const dualkv::testing::DenseResult want =
      dense_attention(c.flat, H, Hk, D, 1.0 / std::sqrt(double(D)), q, k, v, dout, mods);

  // Scatter into the local and prefix operands (contiguous [rows, heads, D]).
  std::vector<T> lq(size_t(Tl) * H * D), lk(size_t(Tl) * Hk * D), lv(lk.size()), ldo(lq.size());
  std::vector<T> pk(size_t(Tp) * Hk * D), pv(pk.size());
  for (size_t i = 0; i < pk.size(); ++i) {  // rows of the unused prefix
    pk[i] = from_double<T>(normal(rng));
    pv[i] = from_double<T>(normal(rng));
  }
  for (int t = 0; t < Tf; ++t) {
    const int32_t l = c.local_of_flat[size_t(t)], r = c.prefix_of_flat[size_t(t)];
    for (int i = 0; i < Hk * D; ++i) {
      (l >= 0 ? lk[size_t(l) * Hk * D + i] : pk[size_t(r) * Hk * D + i]) = from_double<T>(k[size_t(t) * Hk * D + i]);
      (l >= 0 ? lv[size_t(l) * Hk * D + i] : pv[size_t(r) * Hk * D + i]) = from_double<T>(v[size_t(t) * Hk * D + i]);
    }
    if (l >= 0)
      for (int i = 0; i < H * D; ++i) {
        lq[size_t(l) * H * D + i] = from_double<T>(q[size_t(t) * H * D + i]);
        ldo[size_t(l) * H * D + i] = from_double<T>(dout[size_t(t) * H * D + i]);
      }
  }
  using Lse = std::conditional_t<std::is_same_v<T, double>, double, float>;
  std::vector<T> out(lq.size()), dq(lq.size()), dk(lk.size()), dv(lk.size());
  std::vector<Lse> lse(size_t(H) * Tl);
  const std::vector<Lse> sinks(mods.sinks.begin(), mods.sinks.end());
  std::vector<Lse> dsinks(sinks.size(), Lse(NAN));
  // The prefix gradients accumulate onto what the buffers hold: start from a known value.
  std::vector<T> pdk(pk.size(), from_double<T>(0.5)), pdv(pk.size(), from_double<T>(-0.25));
  const std::vector<T> pdk0 = pdk, pdv0 = pdv;

  const HostLayout shape({1}, {-1});  // only for the contiguous strides of the helper
  dualkv_fwd_params f = dualkv::testing::contiguous_fwd_params(shape, dtype, H, Hk, D, 1.0 / std::sqrt(double(D)),
                                                                lq.data(), lk.data(), lv.data(), out.data(), lse.data());
  f.layout = c.prefixed.view();
  f.lse_head_stride = Tl;
  f.num_threads = threads;
  set_prefix_inputs(&f, c.prefixed, pk.data(), pv.data(), Hk, D);
  f.window = mods.window;
  f.softcap = mods.softcap;
  f.sinks = sinks.empty() ? nullptr : sinks.data();
  EXPECT_EQ(dualkv_fwd(&f), DUALKV_OK) << dualkv_last_error();
  dualkv_bwd_params b = dualkv::testing::contiguous_bwd_params(f, ldo.data(), dq.data(), dk.data(), dv.data());
  b.dsinks = sinks.empty() ? nullptr : dsinks.data();
  set_prefix_inputs(&b, c.prefixed, pk.data(), pv.data(), Hk, D);
  set_prefix_grads(&b, pdk.data(), pdv.data(), Hk, D);
  EXPECT_EQ(dualkv_bwd(&b), DUALKV_OK) << dualkv_last_error();

  // Gather the expected values in the local / prefix order.
  std::vector<double> w_out(out.size()), w_lse(lse.size()), w_dq(dq.size()), w_dk(dk.size()), w_dv(dv.size());
  std::vector<double> w_pdk(pdk.size()), w_pdv(pdv.size());
  for (size_t i = 0; i < pdk.size(); ++i) {
    w_pdk[i] = to_double(pdk0[i]);
    w_pdv[i] = to_double(pdv0[i]);
  }
  for (int t = 0; t < Tf; ++t) {
    const int32_t l = c.local_of_flat[size_t(t)], r = c.prefix_of_flat[size_t(t)];
    for (int i = 0; i < Hk * D; ++i) {
      if (l >= 0) {
        w_dk[size_t(l) * Hk * D + i] = want.dk[size_t(t) * Hk * D + i];
        w_dv[size_t(l) * Hk * D + i] = want.dv[size_t(t) * Hk * D + i];
      } else {
        w_pdk[size_t(r) * Hk * D + i] += want.dk[size_t(t) * Hk * D + i];
        w_pdv[size_t(r) * Hk * D + i] += want.dv[size_t(t) * Hk * D + i];
      }
    }
    if (l < 0) continue;
    for (int i = 0; i < H * D; ++i) {
      w_out[size_t(l) * H * D + i] = want.out[size_t(t) * H * D + i];
      w_dq[size_t(l) * H * D + i] = want.dq[size_t(t) * H * D + i];
    }
    for (int h = 0; h < H; ++h) w_lse[size_t(h) * Tl + l] = want.lse[size_t(h) * Tf + t];
  }
  auto as_double = [](const auto& x) {
    std::vector<double> y(x.size());
    for (size_t i = 0; i < x.size(); ++i) y[i] = to_double(x[i]);
    return y;
  };
  const std::pair<const char*, double> errors[] = {
      {"out", relative_error(as_double(out), w_out)}, {"lse", relative_error(lse, w_lse)},
      {"dq", relative_error(as_double(dq), w_dq)},    {"dk", relative_error(as_double(dk), w_dk)},
      {"dv", relative_error(as_double(dv), w_dv)},    {"prefix_dk", relative_error(as_double(pdk), w_pdk)},
      {"prefix_dv", relative_error(as_double(pdv), w_pdv)}};
  for (const auto& [name, err] : errors) EXPECT_LE(err, tol) << name;
  if (!sinks.empty()) EXPECT_LE(relative_error(dsinks, want.dsinks), tol) << "dsinks";
  if (bytes) {
    for (const std::vector<T>* x : {&out, &dq, &dk, &dv, &pdk, &pdv}) append_bytes(*x, bytes);
    append_bytes(lse, bytes);
    append_bytes(dsinks, bytes);
  }
  // The unused prefix's gradient rows are exactly as they were.
  for (int32_t i = 0; i < c.prefixed.prefix_offsets[1] * Hk * D; ++i) {
    EXPECT_EQ(std::memcmp(&pdk[size_t(i)], &pdk0[size_t(i)], sizeof(T)), 0);
    EXPECT_EQ(std::memcmp(&pdv[size_t(i)], &pdv0[size_t(i)], sizeof(T)), 0);
  }
}

TEST(Prefix, Float32MatchesDenseFp64) {
  std::mt19937 rng(17);
  for (int i = 0; i < 60; ++i) {
    SCOPED_TRACE(i);
    const Case c = random_case(rng);
    const int Hk = 1 + int(rng() % 2), H = Hk * (1 + int(rng() % 2)), D = 8 << (rng() % 3);
    check_case<float>(c, rng, DUALKV_DTYPE_FLOAT32, H, Hk, D, 1 + int(rng() % 3), 2e-5);
  }
}

TEST(Prefix, Float64IsExactToRounding) {
  std::mt19937 rng(18);
  for (int i = 0; i < 30; ++i) {
    SCOPED_TRACE(i);
    check_case<double>(random_case(rng), rng, DUALKV_DTYPE_FLOAT64, 4, 2, 16, 2, 1e-12);
  }
}

TEST(Prefix, Bfloat16Inputs) {
  std::mt19937 rng(19);
  for (int i = 0; i < 20; ++i) {
    SCOPED_TRACE(i);
    // bf16 outputs: one rounding (2^-9 relative) of fp32-accumulated values
    check_case<uint16_t>(random_case(rng), rng, DUALKV_DTYPE_BFLOAT16, 2, 1, 32, 2, 8e-3);
  }
}

// The mask modifiers with external prefixes: the window on positions that continue after the
// prefix (a token near its segment's start sees the tail of the prefix; a long window all of it, a
// short one none), the softcap and sinks on the prefix rows' scores like any key's, dsinks over
// every query row. The fp32 blocked path within 1e-5 and the fp64 reference within 1e-10 of the
// dense fp64 attention of the flat forest, dsinks and the accumulated prefix gradients included.
TEST(Prefix, ModifiersMatchDenseFp64) {
  std::mt19937 rng(21);
  for (int i = 0; i < 60; ++i) {
    const Case c = random_case(rng);
    const int Hk = 1 + int(rng() % 2), H = Hk * (1 + int(rng() % 2)), D = 8 << (rng() % 3);
    const Modifiers mods = random_modifiers(rng, i, H);
    SCOPED_TRACE(::testing::Message() << "case " << i << " window " << mods.window << " softcap " << mods.softcap
                                      << " sinks " << mods.sinks.size());
    check_case<float>(c, rng, DUALKV_DTYPE_FLOAT32, H, Hk, D, 1 + int(rng() % 3), 1e-5, nullptr, mods);
    check_case<double>(c, rng, DUALKV_DTYPE_FLOAT64, H, Hk, D, 1 + int(rng() % 3), 1e-10, nullptr, mods);
  }
}

// The window across the blocked path's block edges in a prefix longer than two 128-key blocks:
// a group whose 300-row prompt is external (then its last token and 3 responses), windows that
// end inside the first, second or third block of the prefix, at its end, or past it.
TEST(Prefix, WindowAcrossPrefixBlocks) {
  const Case c = make_case({300, 1, 150, 40, 1}, {-1, 0, 1, 1, 1}, {1, -1, -1, -1, -1}, {3, 300});  // 0 unused
  for (int32_t window : {1, 100, 129, 200, 290, 301, 500}) {
    SCOPED_TRACE(::testing::Message() << "window " << window);
    std::mt19937 rng(window);
    Modifiers mods;
    mods.window = window;
    mods.softcap = 2.0;
    mods.sinks = {0.5, -1.0};
    check_case<float>(c, rng, DUALKV_DTYPE_FLOAT32, 2, 1, 16, 2, 1e-5, nullptr, mods);
    check_case<double>(c, rng, DUALKV_DTYPE_FLOAT64, 2, 1, 16, 2, 1e-10, nullptr, mods);
  }
}

// Every output, the accumulated prefix gradients and dsinks included, is bit-identical for any
// thread count on both paths, without and with the mask modifiers.
TEST(Prefix, DeterministicAcrossThreadCounts) {
  Modifiers all;
  all.window = 6;
  all.softcap = 1.5;
  all.sinks = {0.3, -0.7, 1.1, 0.0};
  for (const Modifiers& mods : {Modifiers{}, all})
    for (int32_t dtype : {DUALKV_DTYPE_FLOAT32, DUALKV_DTYPE_FLOAT64}) {
      std::vector<std::vector<unsigned char>> runs;
      for (int threads : {1, 2, 3}) {
        std::mt19937 rng(20);  // the same case and values every time
        const Case c = random_case(rng);
        runs.emplace_back();
        if (dtype == DUALKV_DTYPE_FLOAT32)
          check_case<float>(c, rng, dtype, 4, 2, 16, threads, 1e-5, &runs.back(), mods);
        else
          check_case<double>(c, rng, dtype, 4, 2, 16, threads, 1e-10, &runs.back(), mods);
      }
      EXPECT_EQ(runs[0], runs[1]) << "window " << mods.window;
      EXPECT_EQ(runs[0], runs[2]) << "window " << mods.window;
    }
}

// The checks of dualkv_fwd / dualkv_bwd around the prefix block: buffers, aliasing, the params
// struct of callers built before the block.
TEST(Prefix, ApiChecksThePrefixBlock) {
  PrefixedLayout l = two_groups();
  ASSERT_EQ(l.derive(), DUALKV_OK);
  const int H = 2, Hk = 1, D = 8, T = l.offsets.back(), Tp = 5;
  std::vector<float> q(size_t(T) * H * D, 0.5f), k(size_t(T) * Hk * D, 0.25f), v(k), out(q.size()), lse(size_t(H) * T);
  std::vector<float> pk(size_t(Tp) * Hk * D, 0.1f), pv(pk), dq(q.size()), dk(k.size()), dv(k.size()), pdk(pk.size()),
      pdv(pk.size());
  const HostLayout shape({1}, {-1});
  dualkv_fwd_params f = dualkv::testing::contiguous_fwd_params(shape, DUALKV_DTYPE_FLOAT32, H, Hk, D, 0.3, q.data(),
                                                                k.data(), v.data(), out.data(), lse.data());
  f.layout = l.view();
  f.lse_head_stride = T;
  set_prefix_inputs(&f, l, pk.data(), pv.data(), Hk, D);
  ASSERT_EQ(dualkv_fwd(&f), DUALKV_OK) << dualkv_last_error();
  dualkv_bwd_params b = dualkv::testing::contiguous_bwd_params(f, q.data(), dq.data(), dk.data(), dv.data());
  set_prefix_inputs(&b, l, pk.data(), pv.data(), Hk, D);
  set_prefix_grads(&b, pdk.data(), pdv.data(), Hk, D);
  ASSERT_EQ(dualkv_bwd(&b), DUALKV_OK) << dualkv_last_error();

  auto expect_error = [](dualkv_status got, dualkv_status want, const char* message) {
    EXPECT_EQ(got, want);
    EXPECT_NE(std::string(dualkv_last_error()).find(message), std::string::npos) << dualkv_last_error();
  };
  dualkv_fwd_params bad = f;
  bad.prefix_v = nullptr;
  expect_error(dualkv_fwd(&bad), DUALKV_ERROR_INVALID_ARGUMENT, "prefix_v: pointer is NULL");
  bad = f;
  bad.prefixes.seg_prefix = nullptr;
  expect_error(dualkv_fwd(&bad), DUALKV_ERROR_INVALID_LAYOUT, "seg_prefix or prefix_offsets is NULL");
  bad = f;
  bad.prefixes = dualkv_prefixes{};  // the layout has an external segment: it looks empty
  expect_error(dualkv_fwd(&bad), DUALKV_ERROR_INVALID_LAYOUT, "segment 0 is empty");
  bad = f;
  bad.prefix_k = reinterpret_cast<const char*>(pk.data()) + 1;  // misaligned
  expect_error(dualkv_fwd(&bad), DUALKV_ERROR_INVALID_ARGUMENT, "prefix_k: pointer");
  dualkv_bwd_params bad_b = b;
  bad_b.prefix_dv = dv.data();  // an output overlapping another output
  expect_error(dualkv_bwd(&bad_b), DUALKV_ERROR_INVALID_ARGUMENT, "overlap");
  bad_b = b;
  bad_b.prefix_dk = const_cast<float*>(pk.data());  // accumulating into an input
  expect_error(dualkv_bwd(&bad_b), DUALKV_ERROR_INVALID_ARGUMENT, "prefix_dk and prefix_k overlap");
  bad_b = b;
  bad_b.prefix_dk = nullptr;
  expect_error(dualkv_bwd(&bad_b), DUALKV_ERROR_INVALID_ARGUMENT, "prefix_dk: pointer is NULL");
}

// The params of every ABI a dualkv.h has had, each as its callers pass them (struct_size,
// abi_version): ABI 1 (264 / 376 bytes: no prefixes, no modifiers), ABI 1 with the prefix block
// (336 / 496: no modifiers) and ABI 2 (both blocks). Only the caller's bytes are read (those past
// them are poisoned: 0xff), and the results are bit for bit those of this ABI's params with the
// blocks the caller lacks zeroed, for the forward, the backward and the workspace sizes. A size
// of no ABI, or a version that is not the size's, is refused.
TEST(Prefix, ParamsOfEveryAbiAreRead) {
  PrefixedLayout prefixed = two_groups();
  ASSERT_EQ(prefixed.derive(), DUALKV_OK);
  const HostLayout plain({4, 2, 3}, {-1, 0, 0});
  const int H = 2, Hk = 1, D = 8, T = prefixed.offsets.back(), Tp = 5;
  ASSERT_EQ(plain.num_tokens(), 9);
  std::mt19937 rng(22);
  std::normal_distribution<float> normal;
  auto random = [&](size_t n) {
    std::vector<float> x(n);
    for (float& e : x) e = normal(rng);
    return x;
  };
  const std::vector<float> q = random(size_t(T) * H * D), k = random(size_t(T) * Hk * D), v = random(k.size()),
                           dout = random(q.size()), pk = random(size_t(Tp) * Hk * D), pv = random(pk.size());
  const std::vector<float> sinks = {0.5f, -0.5f};

  // Every output of a forward and backward with params (f, b) passed as `size_f` / `size_b` bytes of
  // ABI `abi`; prefix_dk / prefix_dv start at zero.
  struct Outputs {
    std::vector<float> out, lse, dq, dk, dv, pdk, pdv, dsinks;
    bool operator==(const Outputs& o) const {
      auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
      };
      return same(out, o.out) && same(lse, o.lse) && same(dq, o.dq) && same(dk, o.dk) && same(dv, o.dv) &&
             same(pdk, o.pdk) && same(pdv, o.pdv) && same(dsinks, o.dsinks);
    }
  };
  auto run = [&](dualkv_fwd_params f, dualkv_bwd_params b, size_t size_f, size_t size_b, uint32_t abi) {
    Outputs o{std::vector<float>(q.size(), NAN), std::vector<float>(size_t(H) * T, NAN),
              std::vector<float>(q.size(), NAN),  std::vector<float>(k.size(), NAN),
              std::vector<float>(k.size(), NAN),  std::vector<float>(pk.size(), 0.0f),
              std::vector<float>(pk.size(), 0.0f), std::vector<float>(sinks.size(), NAN)};
    f.out = o.out.data();
    f.lse = o.lse.data();
    b.out = f.out;
    b.lse = f.lse;
    b.dq = o.dq.data();
    b.dk = o.dk.data();
    b.dv = o.dv.data();
    b.prefix_dk = o.pdk.data();
    b.prefix_dv = o.pdv.data();
    b.dsinks = b.sinks ? o.dsinks.data() : nullptr;
    std::memset(reinterpret_cast<char*>(&f) + size_f, 0xff, sizeof(f) - size_f);
    std::memset(reinterpret_cast<char*>(&b) + size_b, 0xff, sizeof(b) - size_b);
    f.struct_size = uint32_t(size_f);
    b.struct_size = uint32_t(size_b);
    f.abi_version = b.abi_version = abi;
    size_t bytes = 1;
    EXPECT_EQ(dualkv_fwd_workspace_size(&f, &bytes), DUALKV_OK) << dualkv_last_error();
    EXPECT_EQ(dualkv_bwd_workspace_size(&b, &bytes), DUALKV_OK) << dualkv_last_error();
    EXPECT_EQ(dualkv_fwd(&f), DUALKV_OK) << dualkv_last_error();
    EXPECT_EQ(dualkv_bwd(&b), DUALKV_OK) << dualkv_last_error();
    return o;
  };

  // This ABI's params for `layout`, with or without the prefix block and the modifiers.
  auto params = [&](const dualkv_layout& layout, bool with_prefixes, bool with_modifiers) {
    const HostLayout shape({1}, {-1});  // only for the contiguous strides of the helper
    dualkv_fwd_params f = dualkv::testing::contiguous_fwd_params(shape, DUALKV_DTYPE_FLOAT32, H, Hk, D, 0.3, q.data(),
                                                                  k.data(), v.data(), nullptr, nullptr);
    f.layout = layout;
    f.lse_head_stride = T;
    if (with_prefixes) set_prefix_inputs(&f, prefixed, pk.data(), pv.data(), Hk, D);
    if (with_modifiers) {
      f.window = 4;
      f.softcap = 1.5;
      f.sinks = sinks.data();
    }
    dualkv_bwd_params b = dualkv::testing::contiguous_bwd_params(f, dout.data(), nullptr, nullptr, nullptr);
    if (with_prefixes) {
      set_prefix_inputs(&b, prefixed, pk.data(), pv.data(), Hk, D);
      set_prefix_grads(&b, nullptr, nullptr, Hk, D);
    }
    return std::make_pair(f, b);
  };
  constexpr size_t kFwd1 = offsetof(dualkv_fwd_params, prefixes), kBwd1 = offsetof(dualkv_bwd_params, prefixes);
  constexpr size_t kFwd1p = offsetof(dualkv_fwd_params, softcap), kBwd1p = offsetof(dualkv_bwd_params, softcap);
  static_assert(kFwd1 == 264 && kBwd1 == 376 && kFwd1p == 336 && kBwd1p == 496);
  const size_t kFwd2 = sizeof(dualkv_fwd_params), kBwd2 = sizeof(dualkv_bwd_params);

  {  // ABI 1: a plain forest (the caller's T tokens are the first 9 of the buffers)
    SCOPED_TRACE("ABI 1");
    const auto [f, b] = params(plain.view(), false, false);
    EXPECT_TRUE(run(f, b, kFwd1, kBwd1, 1) == run(f, b, kFwd2, kBwd2, 2));
  }
  {  // ABI 1 with the prefix block
    SCOPED_TRACE("ABI 1 with prefixes");
    const auto [f, b] = params(prefixed.view(), true, false);
    const Outputs old = run(f, b, kFwd1p, kBwd1p, 1);
    EXPECT_TRUE(old == run(f, b, kFwd2, kBwd2, 2));
    EXPECT_NE(old.pdk, std::vector<float>(pk.size(), 0.0f));  // the prefix rows were read and got gradients
  }
  {  // ABI 2: both blocks; the modifiers change the results
    SCOPED_TRACE("ABI 2");
    const auto [f, b] = params(prefixed.view(), true, true);
    const auto [f0, b0] = params(prefixed.view(), true, false);
    const Outputs with = run(f, b, kFwd2, kBwd2, 2);
    EXPECT_FALSE(with == run(f0, b0, kFwd2, kBwd2, 2));
    EXPECT_TRUE(std::isfinite(with.dsinks[0]) && std::isfinite(with.dsinks[1]));
  }

  // Refused: a known size with another ABI's version, and sizes of no ABI (among them the params of
  // a mask-modifiers build without the prefix block, which no release had).
  auto [f, b] = params(prefixed.view(), true, true);
  std::vector<float> out(q.size()), lse(size_t(H) * T);
  f.out = out.data();
  f.lse = lse.data();
  const std::pair<size_t, uint32_t> bad[] = {
      {kFwd1, 2}, {kFwd1p, 2}, {kFwd2, 1}, {kFwd1 + 8, 1}, {kFwd1 + 24, 2}, {kFwd2 + 8, 2}, {8, 1}};
  for (const auto& [size, abi] : bad) {
    SCOPED_TRACE(::testing::Message() << "size " << size << " abi " << abi);
    f.struct_size = uint32_t(size);
    f.abi_version = abi;
    EXPECT_EQ(dualkv_fwd(&f), DUALKV_ERROR_VERSION);
    EXPECT_NE(std::string(dualkv_last_error()).find("struct_size"), std::string::npos) << dualkv_last_error();
  }
  b.struct_size = uint32_t(kFwd2);  // the backward's sizes are its own
  b.abi_version = 2;
  EXPECT_EQ(dualkv_bwd(&b), DUALKV_ERROR_VERSION);
  EXPECT_NE(std::string(dualkv_last_error()).find("376: ABI 1, 496: ABI 1"), std::string::npos) << dualkv_last_error();
}

}  // namespace
