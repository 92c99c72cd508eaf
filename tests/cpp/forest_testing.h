// Test helpers: random segment forests, a derived host layout, and a brute-force fp64 dense
// attention (forward and backward) that evaluates the visibility predicate pair by pair.
#ifndef DUALKV_TESTS_FOREST_TESTING_H_
#define DUALKV_TESTS_FOREST_TESTING_H_

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <vector>

#include "dualkv/dualkv.h"
#include "dualkv/layout.h"

namespace dualkv::testing {

// A layout that owns its arrays.
struct HostLayout {
  std::vector<int32_t> offsets, parent, subtree_end, position_offset, depth;
  int32_t max_depth = 0;

  HostLayout(const std::vector<int32_t>& lengths, const std::vector<int32_t>& parents) : parent(parents) {
    offsets.assign(1, 0);
    for (int32_t len : lengths) offsets.push_back(offsets.back() + len);
    const size_t S = lengths.size();
    subtree_end.resize(S);
    position_offset.resize(S);
    depth.resize(S);
    const dualkv_status st = dualkv_layout_derive(offsets.data(), parent.data(), int32_t(S), offsets.back(),
                                                  subtree_end.data(), position_offset.data(), depth.data(),
                                                  &max_depth);
    if (st != DUALKV_OK) throw std::runtime_error(dualkv_last_error());
  }
  int32_t num_segments() const { return int32_t(parent.size()); }
  int32_t num_tokens() const { return offsets.back(); }
  dualkv_layout view() const {
    return dualkv_layout{num_segments(), num_tokens(), max_depth, 0, offsets.data(), parent.data(),
                         subtree_end.data(), position_offset.data(), depth.data()};
  }
};

// A forest with external prefix segments, its arrays owned.
struct PrefixedLayout {
  std::vector<int32_t> offsets, parent, subtree_end, position_offset, depth, seg_prefix, prefix_offsets;
  int32_t max_depth = 0;

  // lengths[s]: tokens of an ordinary segment (ignored for an external one); seg_prefix[s]: the
  // prefix an external segment holds or -1; prefix_lens[e]: rows of prefix e.
  PrefixedLayout(const std::vector<int32_t>& lengths, const std::vector<int32_t>& parents,
                 const std::vector<int32_t>& prefix_of, const std::vector<int32_t>& prefix_lens)
      : parent(parents), seg_prefix(prefix_of) {
    offsets.assign(1, 0);
    for (size_t s = 0; s < lengths.size(); ++s) offsets.push_back(offsets.back() + (prefix_of[s] >= 0 ? 0 : lengths[s]));
    prefix_offsets.assign(1, 0);
    for (int32_t n : prefix_lens) prefix_offsets.push_back(prefix_offsets.back() + n);
    subtree_end.resize(lengths.size());
    position_offset.resize(lengths.size());
    depth.resize(lengths.size());
  }
  dualkv_prefixes prefixes() const {
    return dualkv_prefixes{int32_t(prefix_offsets.size()) - 1, prefix_offsets.back(), seg_prefix.data(),
                           prefix_offsets.data()};
  }
  dualkv_status derive() {
    const dualkv_prefixes p = prefixes();
    return dualkv_layout_derive_prefixed(offsets.data(), parent.data(), int32_t(parent.size()), offsets.back(), &p,
                                         subtree_end.data(), position_offset.data(), depth.data(), &max_depth);
  }
  dualkv_layout view() const {
    return dualkv_layout{int32_t(parent.size()), offsets.back(), max_depth, 0, offsets.data(), parent.data(),
                         subtree_end.data(), position_offset.data(), depth.data()};
  }
};

// Params for contiguous [T, heads, D] operands on the CPU backend.
inline dualkv_fwd_params contiguous_fwd_params(const HostLayout& layout, int32_t dtype, int H, int Hk, int D,
                                               double scale, const void* q, const void* k, const void* v,
                                               void* out, void* lse) {
  dualkv_fwd_params f{};
  f.struct_size = sizeof(f);
  f.abi_version = DUALKV_ABI_VERSION;
  f.device = DUALKV_DEVICE_CPU;
  f.dtype = dtype;
  f.num_heads = H;
  f.num_kv_heads = Hk;
  f.head_dim = D;
  f.softmax_scale = scale;
  f.layout = layout.view();
  f.q = q;
  f.k = k;
  f.v = v;
  f.out = out;
  f.lse = lse;
  f.q_token_stride = f.out_token_stride = int64_t(H) * D;
  f.k_token_stride = f.v_token_stride = int64_t(Hk) * D;
  f.q_head_stride = f.k_head_stride = f.v_head_stride = f.out_head_stride = D;
  f.lse_head_stride = layout.num_tokens();
  return f;
}

inline dualkv_bwd_params contiguous_bwd_params(const dualkv_fwd_params& f, const void* dout, void* dq, void* dk,
                                               void* dv) {
  dualkv_bwd_params b{};
  b.struct_size = sizeof(b);
  b.abi_version = DUALKV_ABI_VERSION;
  b.device = f.device;
  b.dtype = f.dtype;
  b.flags = f.flags;
  b.num_heads = f.num_heads;
  b.num_kv_heads = f.num_kv_heads;
  b.head_dim = f.head_dim;
  b.num_threads = f.num_threads;
  b.softmax_scale = f.softmax_scale;
  b.window = f.window;
  b.softcap = f.softcap;
  b.sinks = f.sinks;  // the caller sets dsinks
  b.layout = f.layout;
  b.q = f.q;
  b.k = f.k;
  b.v = f.v;
  b.out = f.out;
  b.lse = f.lse;
  b.lse_head_stride = f.lse_head_stride;
  b.dout = dout;
  b.dq = dq;
  b.dk = dk;
  b.dv = dv;
  b.q_token_stride = b.out_token_stride = b.dout_token_stride = b.dq_token_stride = f.q_token_stride;
  b.k_token_stride = b.v_token_stride = b.dk_token_stride = b.dv_token_stride = f.k_token_stride;
  b.q_head_stride = b.k_head_stride = b.v_head_stride = b.out_head_stride = b.dout_head_stride =
      b.dq_head_stride = b.dk_head_stride = b.dv_head_stride = f.head_dim;
  return b;
}

// Random forest in DFS pre-order: `roots` trees, each node has up to `max_children` children down
// to `max_depth` levels, segment lengths in [1, max_len] (with a bias to 1-token segments).
inline void random_forest(std::mt19937& rng, int roots, int max_depth, int max_children, int max_len,
                          std::vector<int32_t>* lengths, std::vector<int32_t>* parents) {
  std::uniform_int_distribution<int> len_dist(1, max_len), child_dist(0, max_children), coin(0, 7);
  auto emit = [&](auto&& self, int32_t parent, int level) -> void {
    const int32_t me = int32_t(parents->size());
    parents->push_back(parent);
    lengths->push_back(coin(rng) == 0 ? 1 : len_dist(rng));
    if (level + 1 >= max_depth) return;
    const int children = child_dist(rng);
    for (int c = 0; c < children; ++c) self(self, me, level + 1);
  };
  for (int r = 0; r < roots; ++r) emit(emit, -1, 0);
}

// The mask modifiers of a call (the C ABI's block): all off by default.
struct Modifiers {
  int32_t window = 0;
  double softcap = 0;
  std::vector<double> sinks;  // [H] or empty
};

// Brute force, fp64: every (query, key) pair is tested with ForestView::visible and, with a
// window, by its distance in positions; written from the attention contract, not from the mask
// policy of mask.h, so that it checks it. `low`, when given, rounds to a low-precision kernel's
// format where such a kernel does: p and dS where they enter a product (p v with p = exp(s - max)
// before the division by the row sum, p^T dO, dS k, dS^T q) and the stored output that the
// backward's delta = rowsum(dO o) reads; the result is what that kernel computes with otherwise
// exact arithmetic.
struct DenseResult {
  std::vector<double> out, lse, dq, dk, dv;  // [T][H][D], [H][T], [T][H][D], [T][Hk][D] x2
  std::vector<double> dsinks;                // [H] with sinks
};

inline DenseResult dense_attention(const HostLayout& layout, int H, int Hk, int D, double scale,
                                   const std::vector<double>& q, const std::vector<double>& k,
                                   const std::vector<double>& v, const std::vector<double>& dout,
                                   const Modifiers& mods = {}, double (*low)(double) = nullptr) {
  auto op = [low](double x) { return low ? low(x) : x; };
  const dualkv_layout l = layout.view();
  const ForestView f = make_forest_view(l);
  const int T = layout.num_tokens(), group = H / Hk;
  std::vector<int32_t> seg(T), pos(T);
  for (int t = 0; t < T; ++t) {
    seg[t] = f.segment_of(t);
    pos[t] = f.position(seg[t], t);
  }
  DenseResult r;
  r.out.assign(size_t(T) * H * D, 0);
  r.lse.assign(size_t(H) * T, 0);
  r.dq.assign(size_t(T) * H * D, 0);
  r.dk.assign(size_t(T) * Hk * D, 0);
  r.dv.assign(size_t(T) * Hk * D, 0);
  r.dsinks.assign(mods.sinks.size(), 0);
  std::vector<double> p(T), capped(T);
  for (int h = 0; h < H; ++h) {
    const int g = h / group;
    for (int i = 0; i < T; ++i) {
      double m = -INFINITY;
      for (int j = 0; j < T; ++j) {
        p[j] = -INFINITY;
        if (!f.visible(seg[i], i, seg[j], j)) continue;
        if (mods.window > 0 && pos[i] - pos[j] >= mods.window) continue;
        double s = 0;
        for (int d = 0; d < D; ++d) s += q[(size_t(i) * H + h) * D + d] * k[(size_t(j) * Hk + g) * D + d];
        s *= scale;
        if (mods.softcap > 0) s = mods.softcap * std::tanh(s / mods.softcap);
        p[j] = capped[j] = s;
        m = std::max(m, p[j]);
      }
      // The sink: one more logit in the denominator, of a key whose value is zero.
      const bool sink = !mods.sinks.empty();
      if (sink) m = std::max(m, mods.sinks[h]);
      double sum = sink ? std::exp(mods.sinks[h] - m) : 0;
      for (int j = 0; j < T; ++j) sum += p[j] == -INFINITY ? 0 : std::exp(p[j] - m);
      r.lse[size_t(h) * T + i] = m + std::log(sum);
      for (int j = 0; j < T; ++j) p[j] = p[j] == -INFINITY ? 0 : std::exp(p[j] - m);
      double delta = 0;
      for (int d = 0; d < D; ++d) {
        double o = 0;
        for (int j = 0; j < T; ++j) o += op(p[j]) * v[(size_t(j) * Hk + g) * D + d];
        r.out[(size_t(i) * H + h) * D + d] = o / sum;
        delta += op(o / sum) * dout[(size_t(i) * H + h) * D + d];
      }
      for (int j = 0; j < T; ++j) p[j] /= sum;
      if (sink) r.dsinks[h] -= std::exp(mods.sinks[h] - m) / sum * delta;
      for (int j = 0; j < T; ++j) {
        if (p[j] == 0) continue;
        double dpj = 0;
        for (int d = 0; d < D; ++d) dpj += dout[(size_t(i) * H + h) * D + d] * v[(size_t(j) * Hk + g) * D + d];
        double ds = p[j] * (dpj - delta);
        if (mods.softcap > 0) ds *= 1 - std::pow(capped[j] / mods.softcap, 2);
        ds = op(ds);
        for (int d = 0; d < D; ++d) {
          r.dq[(size_t(i) * H + h) * D + d] += scale * ds * k[(size_t(j) * Hk + g) * D + d];
          r.dk[(size_t(j) * Hk + g) * D + d] += scale * ds * q[(size_t(i) * H + h) * D + d];
          r.dv[(size_t(j) * Hk + g) * D + d] += op(p[j]) * dout[(size_t(i) * H + h) * D + d];
        }
      }
    }
  }
  return r;
}

// ||a - b|| / ||b|| over all elements. A reference whose RMS is below 0.1 (a gradient that is
// zero up to rounding, e.g. dk of a lone token) is measured against an RMS of 0.1 instead: the
// fp32 cancellation error of such a gradient is absolute, not relative to a zero.
template <typename A>
double relative_error(const std::vector<A>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    const double d = double(a[i]) - b[i];
    num += d * d;
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-2 * double(b.size())));
}

}  // namespace dualkv::testing

#endif  // DUALKV_TESTS_FOREST_TESTING_H_
