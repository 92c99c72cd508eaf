// Mask modifiers (issue 16) as the kernels take them: a compile-time policy, so that the default
// instantiation (NoModifiers) compiles to the same code as a kernel that never heard of them, and
// each modifier's code exists only in the kernels that run it. The rules are mask.h's
// (SoftcapFromExp, fold_sink, sink_probability); this file only says which kernel applies which.
//
//   kSoftcap: scores become c tanh(scale q.k / c) right after S = Q K^T (before the mask); the
//             softmax then runs on these already-scaled scores (score_log2 = log2 e, score_scale
//             = 1 instead of scale log2 e and scale); the backward multiplies dS by 1 - tanh^2.
//   kSinks:   the forward epilogue folds each row's sink into its max and sum (the backward main
//             kernels need nothing: dS does not involve the sink; dsinks comes from lse and delta,
//             bwd_prepost.cuh).
//   kWindow:  the sliding window (args.window = W >= 1): the forward-style kernels (both forwards,
//             the deterministic dQ kernel) walk KvWalk's windowed walk from the tile's first
//             position and hide (q - k) + shift >= W on the tiles whose farthest pair is hidden
//             (SegmentMask::window_tile / window_hidden, shift = window_shift of the walk's range);
//             the KV-outer backward kernels take each item's distance bias from the windowed plan
//             (plan_format.h) as the shift.
//
// Instantiated per (arch, direction, head dim, dtype) by src/cuda/CMakeLists.txt: the forward for
// every combination, the backward for softcap and window on/off (sinks change no backward kernel).
#pragma once

#include <cuda_runtime.h>
#include <math_constants.h>

#include "dualkv/mask.h"
#include "kernel_params.h"

namespace dualkv::cuda {

template <bool kSoftcapOn, bool kSinksOn, bool kWindowOn = false>
struct Modifiers {
  static constexpr bool kSoftcap = kSoftcapOn;
  static constexpr bool kSinks = kSinksOn;
  static constexpr bool kWindow = kWindowOn;

  // The factor that takes a score as the softmax sees it into log2 units (exp2 argument): the raw
  // dot products' scale log2(e), or log2(e) for capped scores (the scale is inside the cap).
  template <typename Args>
  __device__ __forceinline__ static float score_log2(const Args& a) {
    if constexpr (kSoftcap) return 1.4426950408889634f;
    else return a.scale_log2;
  }
  // The same into natural units (lse = row max times this + log(row sum)).
  template <typename Args>
  __device__ __forceinline__ static float score_scale(const Args& a) {
    if constexpr (kSoftcap) return 1.f;
    else return a.scale;
  }
};

using NoModifiers = Modifiers<false, false>;

// The capped score of a raw dot product s (softcap_score(scale s, c)), and its derivative's factor.
template <typename Args>
__device__ __forceinline__ SoftcapFromExp softcap_of(float s, const Args& a) {
  return SoftcapFromExp(exp2f(s * a.softcap_exp2_factor));
}

// Forward: every score of a thread's S fragment (n floats) capped in place.
template <typename Args, int N>
__device__ __forceinline__ void softcap_scores(float (&s)[N], const Args& a) {
#pragma unroll
  for (int i = 0; i < N; ++i) s[i] = softcap_of(s[i], a).score(a.softcap);
}

// Forward epilogue with sinks: folds head h's sink into a row whose max (in the kernel's score
// units, i.e. times `score_scale` in natural units) and total are given; returns the factor the
// row's output is multiplied by (rescale / total, 0 for an empty row) and sets *lse.
// When the sink does not raise the row's max (a sink of -inf among them: then the sum is the
// row's total exactly), lse and the factor are rounded as the epilogue without sinks rounds them
// (fmaf(max, scale, log total), 1 / total), so that a sink of -inf changes no bit of out or lse
// (and so none of the backward's P). A row whose max and sum are both empty (-inf, 0: only rows
// past the tile's last query, never stored) gets the no-sink epilogue's +inf, not NaN.
__device__ __forceinline__ float fold_sink_epilogue(float row_max, float total, float score_scale, float sink,
                                                    float* lse) {
  float m = row_max * score_scale;  // -inf for a row that saw no key (then only the sink counts)
  float sum = total;
  const float rescale = fold_sink(m, sum, sink);
  if (!(sum > 0.f)) {  // no key and a sink of -inf (NaN from -inf - -inf lands here too)
    *lse = CUDART_INF_F;
    return 0.f;
  }
  *lse = rescale == 1.f ? fmaf(row_max, score_scale, logf(sum)) : m + logf(sum);
  return rescale * (1.f / sum);
}

}  // namespace dualkv::cuda
