// Seeded layout fuzzer: random valid and invalid segment forests against the validator (checked by
// an independent re-implementation of the rules), and small valid ones through the CPU attention,
// forward and backward, against the brute-force fp64 dense attention of forest_testing.h.
//
//   dualkv_fuzz_layouts [--seed N] [--layouts N] [--seconds S]
//
// Layout i is generated from (seed, i) alone, so a failure names the one layout to replay
// (--seed N --first i --layouts 1). It stops after --layouts layouts or --seconds seconds
// (0 = no time limit), whichever comes first; ctest runs a bounded pass, docs/layout.md gives the
// long run (>= 10^6 layouts).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "forest_testing.h"

using dualkv::testing::dense_attention;
using dualkv::testing::HostLayout;
using dualkv::testing::random_forest;
using dualkv::testing::relative_error;

namespace {

struct Forest {
  std::vector<int32_t> offsets, parent;  // offsets has S + 1 entries
  int64_t num_tokens = 0;
};

// The validity rules of docs/layout.md, written independently of src/layout.cpp: offsets start at
// 0, increase strictly and end at T in [1, 2^31); parents point backwards (or are -1); every
// segment strictly between a parent and its child descends from that parent (DFS pre-order, each
// subtree contiguous); positions fit in int32.
bool valid_by_rules(const Forest& f) {
  const int64_t S = int64_t(f.parent.size());
  if (S < 1 || f.num_tokens < 1 || f.num_tokens > INT32_MAX || f.offsets[0] != 0) return false;
  for (int64_t s = 0; s < S; ++s)
    if (f.offsets[size_t(s + 1)] <= f.offsets[size_t(s)]) return false;
  if (f.offsets[size_t(S)] != f.num_tokens) return false;
  auto descends = [&](int64_t t, int64_t a) {
    for (int64_t x = f.parent[size_t(t)]; x >= 0; x = f.parent[size_t(x)])
      if (x == a) return true;
    return false;
  };
  for (int64_t s = 0; s < S; ++s) {
    const int64_t p = f.parent[size_t(s)];
    if (p < -1 || p >= s) return false;
    if (p >= 0)
      for (int64_t t = p + 1; t < s; ++t)
        if (!descends(t, p)) return false;
  }
  for (int64_t s = 0; s < S; ++s) {
    int64_t end = f.offsets[size_t(s + 1)] - f.offsets[size_t(s)];
    for (int64_t a = f.parent[size_t(s)]; a >= 0; a = f.parent[size_t(a)])
      end += f.offsets[size_t(a + 1)] - f.offsets[size_t(a)];
    if (end > INT32_MAX) return false;
  }
  return true;
}

// The derived arrays by their definitions: subtree end = first later segment that does not
// descend from s; position offset = total length of the ancestors; depth = number of ancestors.
void derive_by_definition(const Forest& f, std::vector<int32_t>* end, std::vector<int32_t>* pos,
                          std::vector<int32_t>* depth) {
  const int32_t S = int32_t(f.parent.size());
  end->assign(size_t(S), S);
  pos->assign(size_t(S), 0);
  depth->assign(size_t(S), 0);
  for (int32_t s = 0; s < S; ++s) {
    for (int32_t a = f.parent[size_t(s)]; a >= 0; a = f.parent[size_t(a)]) {
      (*pos)[size_t(s)] += f.offsets[size_t(a + 1)] - f.offsets[size_t(a)];
      ++(*depth)[size_t(s)];
    }
    for (int32_t t = s + 1; t < S; ++t) {
      bool below = false;
      for (int32_t a = f.parent[size_t(t)]; a >= 0 && !below; a = f.parent[size_t(a)]) below = a == s;
      if (!below) {
        (*end)[size_t(s)] = t;
        break;
      }
    }
  }
}

Forest from_lengths(const std::vector<int32_t>& lengths, const std::vector<int32_t>& parents) {
  Forest f;
  f.parent = parents;
  f.offsets.assign(1, 0);
  for (int32_t n : lengths) f.offsets.push_back(f.offsets.back() + n);
  f.num_tokens = f.offsets.back();
  return f;
}

// A valid forest of up to `max_segments` segments, or a mutation of one that is usually invalid
// (and sometimes still valid: the oracle decides, not the mutation).
Forest random_case(std::mt19937& rng, bool* mutated) {
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<int32_t> lengths, parents;
  random_forest(rng, 1 + pick(rng) % 4, 1 + pick(rng) % 4, 1 + pick(rng) % 4, 1 + pick(rng) % 12, &lengths, &parents);
  Forest f = from_lengths(lengths, parents);
  *mutated = pick(rng) < 50;
  if (!*mutated) return f;
  const int S = int(f.parent.size());
  std::uniform_int_distribution<int> seg(0, S - 1), small(-3, 3);
  switch (pick(rng) % 9) {
    case 0: f.parent[size_t(seg(rng))] = seg(rng) + small(rng); break;            // anywhere, maybe forward
    case 1: f.parent[size_t(seg(rng))] = int32_t(rng());  break;                   // garbage
    case 2: f.offsets[size_t(seg(rng) + 1)] += small(rng); break;                 // empty or reordered
    case 3: f.offsets[0] = small(rng); break;                                      // not starting at 0
    case 4: f.num_tokens += small(rng); break;                                     // T mismatch
    case 5: f.offsets[size_t(seg(rng) + 1)] = int32_t(rng()); break;              // garbage offset
    case 6: std::swap(f.parent[size_t(seg(rng))], f.parent[size_t(seg(rng))]); break;  // breaks DFS order
    case 7: f.num_tokens = int64_t(INT32_MAX) + 1 + small(rng); break;             // 32-bit limit
    default: {  // a segment moved to the end: its subtree is no longer contiguous (or still fine)
      const int s = seg(rng);
      const int32_t p = f.parent[size_t(s)];
      f.parent.erase(f.parent.begin() + s);
      f.parent.push_back(p);
    }
  }
  return f;
}

struct Failure {
  std::string what;
};

void check_validator(const Forest& f) {
  const int32_t S = int32_t(f.parent.size());
  std::vector<int32_t> end(size_t(S), -7), pos(size_t(S), -7), depth(size_t(S), -7);
  int32_t max_depth = -7;
  const dualkv_status st = dualkv_layout_derive(f.offsets.data(), f.parent.data(), S, f.num_tokens, end.data(),
                                                pos.data(), depth.data(), &max_depth);
  const bool expect = valid_by_rules(f);
  if ((st == DUALKV_OK) != expect)
    throw Failure{std::string("validator says ") + (st == DUALKV_OK ? "valid" : dualkv_last_error()) +
                  ", the rules say " + (expect ? "valid" : "invalid")};
  if (st != DUALKV_OK) {
    if (st != DUALKV_ERROR_INVALID_LAYOUT) throw Failure{"invalid layout with status " + std::to_string(st)};
    if (std::strlen(dualkv_last_error()) == 0) throw Failure{"invalid layout without a message"};
    return;
  }
  std::vector<int32_t> e2, p2, d2;
  derive_by_definition(f, &e2, &p2, &d2);
  if (end != e2 || pos != p2 || depth != d2 || max_depth != *std::max_element(d2.begin(), d2.end()) + 1)
    throw Failure{"derived arrays differ from their definitions"};
}

// An invalid forest handed to the attention entry point (with whatever derived arrays) is refused.
void check_attention_refuses(const Forest& f) {
  const int32_t S = int32_t(f.parent.size());
  std::vector<int32_t> junk(size_t(S), 0);
  const int64_t T = std::clamp<int64_t>(f.num_tokens, 1, 64);
  std::vector<float> q(size_t(T) * 8, 0.5f), out(q.size()), lse(static_cast<size_t>(T));
  dualkv_fwd_params p{};
  p.struct_size = sizeof(p);
  p.abi_version = DUALKV_ABI_VERSION;
  p.dtype = DUALKV_DTYPE_FLOAT32;
  p.num_heads = p.num_kv_heads = 1;
  p.head_dim = 8;
  p.softmax_scale = 0.3;
  p.layout = dualkv_layout{S, int32_t(T), 1, 0, f.offsets.data(), f.parent.data(), junk.data(), junk.data(), junk.data()};
  p.q = p.k = p.v = q.data();
  p.out = out.data();
  p.lse = lse.data();
  p.q_token_stride = p.k_token_stride = p.v_token_stride = p.out_token_stride = 8;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.out_head_stride = 8;
  p.lse_head_stride = T;
  if (dualkv_fwd(&p) == DUALKV_OK) throw Failure{"attention accepted an invalid layout"};
}

// One forward + backward on the CPU backend in `dtype` (fp32: the blocked path; fp64: the
// reference), every output within `tol` relative error of the dense fp64 result.
template <typename T>
void check_outputs(const HostLayout& layout, const dualkv::testing::DenseResult& ref, int32_t dtype, int H, int Hk,
                   int D, double scale, const std::vector<T>& q, const std::vector<T>& k, const std::vector<T>& v,
                   const std::vector<T>& dout, int threads, double tol, const char* what) {
  const size_t T_ = size_t(layout.num_tokens());
  std::vector<T> out(q.size(), T(NAN)), lse(size_t(H) * T_, T(NAN)), dq(q.size(), T(NAN)), dk(k.size(), T(NAN)),
      dv(k.size(), T(NAN));
  dualkv_fwd_params fp = dualkv::testing::contiguous_fwd_params(layout, dtype, H, Hk, D, scale, q.data(), k.data(),
                                                               v.data(), out.data(), lse.data());
  fp.num_threads = threads;
  if (dualkv_fwd(&fp) != DUALKV_OK) throw Failure{std::string("fwd failed: ") + dualkv_last_error()};
  dualkv_bwd_params bp = dualkv::testing::contiguous_bwd_params(fp, dout.data(), dq.data(), dk.data(), dv.data());
  if (dualkv_bwd(&bp) != DUALKV_OK) throw Failure{std::string("bwd failed: ") + dualkv_last_error()};
  const std::pair<const char*, double> errs[] = {
      {"out", relative_error(out, ref.out)}, {"lse", relative_error(lse, ref.lse)}, {"dq", relative_error(dq, ref.dq)},
      {"dk", relative_error(dk, ref.dk)},    {"dv", relative_error(dv, ref.dv)}};
  for (const auto& [name, err] : errs)
    if (!(err <= tol))
      throw Failure{std::string(name) + " relative error " + std::to_string(err) + " (" + what + "), H " +
                    std::to_string(H) + " Hk " + std::to_string(Hk) + " D " + std::to_string(D)};
}

// A small valid forest through the CPU attention (fp32 blocked path and fp64 reference), forward
// and backward, against the brute-force fp64 dense attention.
void check_attention(const Forest& f, std::mt19937& rng) {
  std::vector<int32_t> lengths;
  for (size_t s = 0; s + 1 < f.offsets.size(); ++s) lengths.push_back(f.offsets[s + 1] - f.offsets[s]);
  const HostLayout layout(lengths, f.parent);
  const int group = 1 << (rng() % 3), Hk = 1 + int(rng() % 2), H = group * Hk;
  const int dims[] = {1, 3, 8, 16, 33, 64};
  const int D = dims[rng() % 6];
  const int64_t T = layout.num_tokens();
  std::normal_distribution<double> normal;
  auto fill = [&](size_t n, std::vector<float>* x, std::vector<double>* x64) {
    x->resize(n);
    x64->resize(n);
    for (size_t i = 0; i < n; ++i) (*x64)[i] = (*x)[i] = float(normal(rng));
  };
  std::vector<float> q, k, v, dout;
  std::vector<double> q64, k64, v64, do64;
  fill(size_t(T) * H * D, &q, &q64);
  fill(size_t(T) * Hk * D, &k, &k64);
  fill(size_t(T) * Hk * D, &v, &v64);
  fill(size_t(T) * H * D, &dout, &do64);
  const double scale = 1.0 / std::sqrt(double(D));
  const auto ref = dense_attention(layout, H, Hk, D, scale, q64, k64, v64, do64);
  const int threads = 1 + int(rng() % 3);
  check_outputs<float>(layout, ref, DUALKV_DTYPE_FLOAT32, H, Hk, D, scale, q, k, v, dout, threads, 2e-5, "fp32");
  check_outputs<double>(layout, ref, DUALKV_DTYPE_FLOAT64, H, Hk, D, scale, q64, k64, v64, do64, threads, 1e-10,
                        "fp64");
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t seed = 20261201, first = 0, layouts = 20000;
  double seconds = 30;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const char* v = argv[i + 1];
    if (a == "--seed") seed = std::strtoull(v, nullptr, 10);
    else if (a == "--first") first = std::strtoull(v, nullptr, 10);
    else if (a == "--layouts") layouts = std::strtoull(v, nullptr, 10);
    else if (a == "--seconds") seconds = std::strtod(v, nullptr);
    else {
      std::fprintf(stderr, "usage: %s [--seed N] [--first I] [--layouts N] [--seconds S]\n", argv[0]);
      return 2;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  uint64_t done = 0, valid = 0, attention = 0;
  for (uint64_t i = first; i < first + layouts; ++i) {
    if (seconds > 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > seconds) break;
    std::seed_seq seq{uint32_t(seed), uint32_t(seed >> 32), uint32_t(i), uint32_t(i >> 32)};
    std::mt19937 rng(seq);
    bool mutated = false;
    const Forest f = random_case(rng, &mutated);
    try {
      check_validator(f);
      const bool ok = valid_by_rules(f);
      valid += ok;
      if (!ok) {
        check_attention_refuses(f);
      } else if (f.num_tokens <= 48 && i % 4 == 0) {  // every 4th small valid forest: the dense check is O(T^2 H D)
        check_attention(f, rng);
        ++attention;
      }
    } catch (const Failure& e) {
      std::fprintf(stderr, "FAILED layout %llu (replay: --seed %llu --first %llu --layouts 1): %s\n",
                   (unsigned long long)i, (unsigned long long)seed, (unsigned long long)i, e.what.c_str());
      return 1;
    }
    ++done;
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("fuzz_layouts: seed %llu, %llu layouts (%llu valid, %llu through attention vs dense fp64) in %.1f s: "
              "all passed\n",
              (unsigned long long)seed, (unsigned long long)done, (unsigned long long)valid,
              (unsigned long long)attention, elapsed);
  return done > 0 ? 0 : 1;
}
