// Test-only shim: an extern "C" launcher of the sm90 forward over raw pointers, so the kernel can be
// tested from Python (ctypes) before it is wired into the library's dispatcher. Not part of libdualkv.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "sm90/fwd_sm90.h"
#include "sm90/fwd_sm90.h"

using dualkv::cuda::FwdArgs;

// sm90_harness_variants.cu: the non-default (no ping-pong) hdim-128 kernels, for A/B runs.
cudaError_t sm90_test_alt_variant(int variant, int dtype, int head_dim, const FwdArgs& a, cudaStream_t st,
                                  int window);

static int g_variant = 0;  // 0: run_fwd (the default); 1-3: alternatives (sm90_harness_variants.cu)
extern "C" void dualkv_sm90_test_set_variant(int v) { g_variant = v; }
static int g_window = 0;  // 0: run_fwd's default tile window; > 0: that window
extern "C" void dualkv_sm90_test_set_window(int w) { g_window = w; }

extern "C" int dualkv_sm90_test_fwd(int dtype /*1 fp16, 2 bf16*/, int head_dim, const int32_t* offsets,
                                    const int32_t* parent, const int32_t* subtree_end, int32_t S, int32_t T,
                                    const int32_t* plan, int64_t plan_len, const void* q, const void* k,
                                    const void* v, void* out, float* lse, const int64_t* strides /*9*/,
                                    int32_t H, int32_t Hk, float scale, int32_t* counter, void* stream) {
  FwdArgs a{};
  a.layout.offsets = offsets;
  a.layout.parent = parent;
  a.layout.subtree_end = subtree_end;
  a.layout.num_segments = S;
  a.layout.num_tokens = T;
  a.plan = plan;
  a.plan_len = plan_len;
  a.q = q; a.k = k; a.v = v; a.out = out; a.lse = lse;
  a.q_ts = strides[0]; a.q_hs = strides[1];
  a.k_ts = strides[2]; a.k_hs = strides[3];
  a.v_ts = strides[4]; a.v_hs = strides[5];
  a.o_ts = strides[6]; a.o_hs = strides[7];
  a.lse_hs = strides[8];
  a.num_heads = H; a.num_kv_heads = Hk;
  a.scale = scale;
  a.scale_log2 = scale * 1.4426950408889634f;
  a.counter = counter;
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  namespace s9 = dualkv::cuda::sm90;
  cudaError_t e = cudaErrorInvalidValue;
  if (g_variant != 0) return static_cast<int>(sm90_test_alt_variant(g_variant, dtype, head_dim, a, st, g_window));
  constexpr bool kPP = s9::kDefaultPingPong, kSR = s9::kDefaultSplitRelease;
  switch (head_dim * 10 + dtype) {
#ifdef DUALKV_SM90_HDIM_64
    case 641: e = g_window > 0 ? s9::launch_fwd_variant<__half, 64, kPP, kSR>(a, st, g_window) : s9::run_fwd<__half, 64>(a, st); break;
    case 642: e = g_window > 0 ? s9::launch_fwd_variant<__nv_bfloat16, 64, kPP, kSR>(a, st, g_window) : s9::run_fwd<__nv_bfloat16, 64>(a, st); break;
#endif
#ifdef DUALKV_SM90_HDIM_128
    case 1281: e = g_window > 0 ? s9::launch_fwd_variant<__half, 128, kPP, kSR>(a, st, g_window) : s9::run_fwd<__half, 128>(a, st); break;
    case 1282: e = g_window > 0 ? s9::launch_fwd_variant<__nv_bfloat16, 128, kPP, kSR>(a, st, g_window) : s9::run_fwd<__nv_bfloat16, 128>(a, st); break;
#endif
#ifdef DUALKV_SM90_HDIM_256
    case 2561: e = g_window > 0 ? s9::launch_fwd_variant<__half, 256, kPP, kSR>(a, st, g_window) : s9::run_fwd<__half, 256>(a, st); break;
    case 2562: e = g_window > 0 ? s9::launch_fwd_variant<__nv_bfloat16, 256, kPP, kSR>(a, st, g_window) : s9::run_fwd<__nv_bfloat16, 256>(a, st); break;
#endif
    default: break;
  }
  return static_cast<int>(e);
}
