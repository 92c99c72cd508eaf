// Host side of the CUDA backend: device checks, plans for a device (the planner is plan.cpp),
// workspace sizes, and the dispatcher: each call runs on the first arch of the kernel table
// (src/cuda/CMakeLists.txt, generated into kernel_table.h) that has a kernel for its head dim,
// runs on the device, takes its arguments and is not switched off by its environment variable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "dualkv/dualkv.h"
#include "internal.h"
#include "kernel_params.h"
#include "kernel_table.h"  // generated: every arch's arch.h and the kernel lists
#include "modifiers.cuh"
#include "per_device.h"
#include "plan.h"
#include "tile_size.h"

namespace dualkv::detail {

namespace {

using namespace dualkv::cuda;

// Head dims with a kernel of some arch in this build.
constexpr int kBuiltHeadDims[] = {
#define DKV_HEAD_DIM(D) D,
    DUALKV_HEAD_DIMS(DKV_HEAD_DIM)
#undef DKV_HEAD_DIM
};

bool head_dim_built(int d) {
  for (int b : kBuiltHeadDims)
    if (b == d) return true;
  return false;
}

// The built head dims as "a, b, c" (CMake requires at least one).
std::string built_head_dims_string() {
  std::string s;
  for (int b : kBuiltHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(b);
  return s;
}

__global__ void probe_kernel(int* p) {
  if (p) *p = 0;
}

// Sets the current device for the scope of a call and restores the caller's.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) {
      ok_ = cudaSetDevice(device) == cudaSuccess;
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_ && prev_ >= 0) cudaSetDevice(prev_);
  }
  bool ok() const { return ok_; }

 private:
  int prev_ = -1;
  bool ok_ = true;
  bool switched_ = false;
};

struct DeviceInfo {
  int status = -1;  // -1 unknown, 0 ok, 1 unsupported
  int sms = 0;
  int major = 0, minor = 0;
  std::string error;
};

// The runtime's device count and its error: both fixed once the runtime has initialised (the
// visible devices are read then; a missing driver stays missing), so asked once per process.
struct DeviceCount {
  cudaError_t err = cudaSuccess;
  int count = 0;
};
const DeviceCount& device_count() {
  static const DeviceCount counted = [] {
    DeviceCount c;
    c.err = cudaGetDeviceCount(&c.count);
    if (c.err != cudaSuccess) {
      c.count = 0;
      cudaGetLastError();
    }
    return c;
  }();
  return counted;
}

// A device's compute capability, SM count and whether this build has kernels for it: asked once
// per device (its properties never change while the process runs).
DeviceInfo load_device(int device_index) {
  DeviceInfo d;
  cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device_index);
  cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, device_index);
  cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device_index);
  if (d.major < 8) {
    d.status = 1;
    d.error = "cuda: device " + std::to_string(device_index) + " is sm_" + std::to_string(d.major) +
              std::to_string(d.minor) + "; the CUDA backend needs sm_80 or newer";
  } else {
    DeviceGuard guard(device_index);
    cudaFuncAttributes attr;
    const cudaError_t err = guard.ok() ? cudaFuncGetAttributes(&attr, probe_kernel) : cudaErrorInvalidDevice;
    if (err != cudaSuccess) {
      cudaGetLastError();
      d.status = 1;
      d.error = "cuda: this libdualkv has no kernels for device " + std::to_string(device_index) + " (sm_" +
                std::to_string(d.major) + std::to_string(d.minor) + "); built for CUDA archs " +
                DUALKV_CUDA_ARCHS_STRING + " (" + cudaGetErrorString(err) +
                "); rebuild with DUALKV_CUDA_ARCHS including this arch";
    } else {
      d.status = 0;
    }
  }
  return d;
}
PerDevice<DeviceInfo> g_devices;

// Returns DUALKV_OK and points *out at the device's info, or fails naming the reason. After a
// device's first call: no CUDA call, no lock (every attention call passes here twice).
dualkv_status query_device(int32_t device_index, const DeviceInfo** out) {
  const DeviceCount& c = device_count();
  if (c.err != cudaSuccess || c.count == 0)
    return fail(DUALKV_ERROR_UNSUPPORTED, "cuda: no usable CUDA device (%s)",
                c.err != cudaSuccess ? cudaGetErrorString(c.err) : "device count is 0");
  if (device_index < 0 || device_index >= c.count || device_index >= kMaxCachedDevices)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "cuda: device_index %d out of range (%d devices)", device_index,
                c.count);
  const DeviceInfo& d = g_devices.get(device_index, load_device);
  if (d.status != 0) return fail(DUALKV_ERROR_UNSUPPORTED, "%s", d.error.c_str());
  *out = &d;
  return DUALKV_OK;
}

// Checks the plan key against the call and says which family's forward query tiles the plan has
// (*fwd_tile_rows; the key hashes them, tile_size.h fwd_block_m): the host learns it without
// reading the plan, which lives on the device.
template <typename Params>
dualkv_status check_plan(const Params& p, const char* what, int32_t* fwd_tile_rows) {
  const int32_t E = p.prefixes.num_prefixes, rows = E > 0 ? p.prefixes.num_prefix_rows : 0;
  const uint64_t key = p.plan_key >> kPlanKeyLowBits;
  *fwd_tile_rows = 0;
  const int32_t portable = fwd_block_m(p.head_dim, TileFamily::kPortable, p.window > 0);
  const int32_t sm90 = fwd_block_m(p.head_dim, TileFamily::kSm90, p.window > 0);
  for (int32_t m : {portable, sm90}) {  // the second hash only if the first key does not match
    if (*fwd_tile_rows == 0 &&
        key == plan::key_hash(p.head_dim, m, p.layout.num_segments, p.layout.num_tokens, p.window, E, rows))
      *fwd_tile_rows = m;
  }
  if (*fwd_tile_rows == 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT,
                "%s: plan_key does not match this layout (S=%d, T=%d, %d external prefixes of %d rows), head_dim "
                "%d tiling and window %d; the plan was built for another layout or configuration: rebuild it with "
                "dualkv_plan_build_ex (with the call's window and the layout's prefix table)",
                what, p.layout.num_segments, p.layout.num_tokens, E, rows, p.head_dim, p.window);
  if (p.plan_len < kHeaderInts)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: plan_len %lld is too small", what,
                static_cast<long long>(p.plan_len));
  return DUALKV_OK;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

dualkv_status check_rows(const char* what, const char* name, const void* ptr, int64_t ts, int64_t hs) {
  if (!aligned16(ptr) || ts % 8 != 0 || hs % 8 != 0)
    return fail(DUALKV_ERROR_UNSUPPORTED,
                "%s: %s needs 16-byte aligned rows on CUDA (pointer 16-byte aligned, token stride %lld and "
                "head stride %lld multiples of 8 elements)",
                what, name, static_cast<long long>(ts), static_cast<long long>(hs));
  return DUALKV_OK;
}

dualkv_status cuda_fail(const char* what, cudaError_t err) {
  return fail(DUALKV_ERROR_CUDA, "%s: CUDA error %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err));
}

size_t bwd_partials_bytes(const dualkv_bwd_params& p) {
  const size_t slots = static_cast<size_t>(plan::key_slots(p.plan_key));
  return slots * p.num_kv_heads * 2 * plan_tiles(p.head_dim).bwd_block_n * p.head_dim * sizeof(float);
}

LayoutPtrs layout_ptrs(const dualkv_layout& l, const dualkv_prefixes& x) {
  const bool prefixed = x.num_prefixes > 0;
  return LayoutPtrs{l.seg_offsets, l.seg_parent, l.seg_subtree_end, l.num_segments, l.num_tokens,
                    prefixed ? x.seg_prefix : nullptr, prefixed ? x.prefix_offsets : nullptr,
                    l.seg_position_offset};
}

// external prefix (issue 17): the prefix buffers' rows must be 16-byte aligned like k and v.
template <typename Params>
dualkv_status check_prefix_rows(const Params& p, const char* what) {
  if (p.prefixes.num_prefixes == 0) return DUALKV_OK;
  dualkv_status st;
  if ((st = check_rows(what, "prefix_k", p.prefix_k, p.prefix_k_token_stride, p.prefix_k_head_stride))) return st;
  if ((st = check_rows(what, "prefix_v", p.prefix_v, p.prefix_v_token_stride, p.prefix_v_head_stride))) return st;
  if constexpr (std::is_same_v<Params, dualkv_bwd_params>) {
    if ((st = check_rows(what, "prefix_dk", p.prefix_dk, p.prefix_dk_token_stride, p.prefix_dk_head_stride)))
      return st;
    if ((st = check_rows(what, "prefix_dv", p.prefix_dv, p.prefix_dv_token_stride, p.prefix_dv_head_stride)))
      return st;
  }
  return DUALKV_OK;
}

// external prefix (issue 17): the prefix buffers into the kernel args (left null without prefixes).
template <typename Params, typename Args>
void fill_prefix_args(const Params& p, Args* a) {
  if (p.prefixes.num_prefixes == 0) return;
  a->prefix_k = p.prefix_k;
  a->prefix_v = p.prefix_v;
  a->pk_ts = p.prefix_k_token_stride; a->pk_hs = p.prefix_k_head_stride;
  a->pv_ts = p.prefix_v_token_stride; a->pv_hs = p.prefix_v_head_stride;
  a->prefix_rows = p.prefixes.num_prefix_rows;
  if constexpr (std::is_same_v<Params, dualkv_bwd_params>) {
    a->prefix_dk = p.prefix_dk;
    a->prefix_dv = p.prefix_dv;
    a->pdk_ts = p.prefix_dk_token_stride; a->pdk_hs = p.prefix_dk_head_stride;
    a->pdv_ts = p.prefix_dv_token_stride; a->pdv_hs = p.prefix_dv_head_stride;
  }
}

// One arch of the kernel table, as the dispatcher sees it (each folder's arch.h).
struct Arch {
  const char* name;         // folder: "sm90"
  const char* kernel_name;  // DUALKV_LOG_KERNELS: "sm90 wgmma"
  bool (*runs_on)(int major, int minor);
  const char* device_mismatch;  // why it does not run on this device
  const char* args_mismatch;    // why it does not take these arguments
  const char* fwd_disable_env;  // set: pass the arch over (null: no switch)
  const char* bwd_disable_env;
  bool (*fwd_args_ok)(const FwdArgs&, int head_dim);
  bool (*bwd_args_ok)(const BwdArgs&, int head_dim);
  TileFamily tiles;  // the plan family its forward is cut for (what a DEVICE plan request builds)
  bool (*fwd_tiles_ok)(int head_dim, bool windowed, int fwd_block_m);  // its forward runs plans of these tiles
  // its backward computes dQ query-outer outside deterministic mode too (head dim, external prefixes)
  bool (*bwd_dq_query_outer)(int head_dim, bool prefixed);
};

#define DKV_ARCH(ARCH)                                                                                       \
  Arch{#ARCH, ARCH::kKernelName, &ARCH::runs_on, ARCH::kDeviceMismatch, ARCH::kArgsMismatch, ARCH::kFwdDisableEnv, \
       ARCH::kBwdDisableEnv, &ARCH::fwd_args_ok, &ARCH::bwd_args_ok, ARCH::kTiles, &ARCH::fwd_tiles_ok,        \
       &ARCH::bwd_dq_query_outer},
const Arch kArchs[] = {DUALKV_ARCHS(DKV_ARCH)};
#undef DKV_ARCH

template <typename Args>
using Launcher = cudaError_t (*)(const Args&, int sms, cudaStream_t);

// The mask modifiers a call compiles in (modifiers.cuh; instantiated by src/cuda/CMakeLists.txt):
// the forward's softcap, sinks and window, the backward's softcap and window (its sinks' gradient
// is not a kernel variant).
struct ModifierVariant {
  bool softcap;
  bool sinks;
  bool window;
};
ModifierVariant modifier_variant(const FwdArgs& a) { return {a.softcap > 0.f, a.sinks != nullptr, a.window > 0}; }
ModifierVariant modifier_variant(const BwdArgs& a) { return {a.softcap > 0.f, false, a.window > 0}; }
// A variant's modifiers by name, for the error messages.
std::string modifier_names(const ModifierVariant& v) {
  std::string s;
  if (v.window) s = "sliding window";
  if (v.softcap) s += std::string(s.empty() ? "" : ", ") + "softcap";
  if (v.sinks) s += std::string(s.empty() ? "" : ", ") + "sinks";
  return s;
}

// One launcher of `FN` (an arch's run_fwd / run_bwd) per modifier variant.
#define DKV_PICK_MODS_W(FN, D, T, V, W)                                                                   \
  ((V).softcap ? ((V).sinks ? &FN<D, T, Modifiers<true, true, W>> : &FN<D, T, Modifiers<true, false, W>>) \
               : ((V).sinks ? &FN<D, T, Modifiers<false, true, W>> : &FN<D, T, Modifiers<false, false, W>>))
#define DKV_PICK_MODS(FN, D, T, V) \
  ((V).window ? DKV_PICK_MODS_W(FN, D, T, V, true) : DKV_PICK_MODS_W(FN, D, T, V, false))
#define DKV_PICK_MODS_BWD_W(FN, D, T, V, W) \
  ((V).softcap ? &FN<D, T, Modifiers<true, false, W>> : &FN<D, T, Modifiers<false, false, W>>)
#define DKV_PICK_MODS_BWD(FN, D, T, V) \
  ((V).window ? DKV_PICK_MODS_BWD_W(FN, D, T, V, true) : DKV_PICK_MODS_BWD_W(FN, D, T, V, false))
// A head dim of the kernel table's PLAIN list: the default kernels only.
#define DKV_PICK_PLAIN(FN, D, T, V) \
  ((V).softcap || (V).sinks || (V).window ? nullptr : &FN<D, T, Modifiers<false, false>>)

// `arch`'s launcher for (head dim, dtype, modifiers) in this build, or null.
template <typename Args>
Launcher<Args> find_launcher(const char* arch, int head_dim, bool bf16, ModifierVariant mods) {
#define DKV_LAUNCHER(ARCH, D, DIR, PICK)                                                        \
  if (head_dim == D && std::strcmp(arch, #ARCH) == 0)                                           \
    return bf16 ? PICK(ARCH::run_##DIR, D, __nv_bfloat16, mods) : PICK(ARCH::run_##DIR, D, __half, mods);
  if constexpr (std::is_same_v<Args, FwdArgs>) {
#define DKV_FWD(ARCH, D) DKV_LAUNCHER(ARCH, D, fwd, DKV_PICK_MODS)
    DUALKV_FWD_KERNELS(DKV_FWD)
#undef DKV_FWD
#define DKV_FWD_PLAIN(ARCH, D) DKV_LAUNCHER(ARCH, D, fwd, DKV_PICK_PLAIN)
    DUALKV_FWD_PLAIN_KERNELS(DKV_FWD_PLAIN)
#undef DKV_FWD_PLAIN
  } else {
#define DKV_BWD(ARCH, D) DKV_LAUNCHER(ARCH, D, bwd, DKV_PICK_MODS_BWD)
    DUALKV_BWD_KERNELS(DKV_BWD)
#undef DKV_BWD
#define DKV_BWD_PLAIN(ARCH, D) DKV_LAUNCHER(ARCH, D, bwd, DKV_PICK_PLAIN)
    DUALKV_BWD_PLAIN_KERNELS(DKV_BWD_PLAIN)
#undef DKV_BWD_PLAIN
  }
#undef DKV_LAUNCHER
  return nullptr;
#undef DKV_PICK_MODS
#undef DKV_PICK_MODS_W
#undef DKV_PICK_MODS_BWD
#undef DKV_PICK_MODS_BWD_W
#undef DKV_PICK_PLAIN
}

// DUALKV_LOG_KERNELS=1: one line on stderr per call saying which kernel family runs and, when an
// arch before it was passed over, why (the fallbacks are silent otherwise, by design).
void log_kernel_choice(const char* dir, const char* kernel, const std::string& why) {
  static const bool on = std::getenv("DUALKV_LOG_KERNELS") != nullptr;
  if (!on) return;
  if (!why.empty())
    std::fprintf(stderr, "[dualkv] %s: %s (%s)\n", dir, kernel, why.c_str());
  else
    std::fprintf(stderr, "[dualkv] %s: %s\n", dir, kernel);
}

bool args_ok(const Arch& arch, const FwdArgs& a, int head_dim) { return arch.fwd_args_ok(a, head_dim); }
bool args_ok(const Arch& arch, const BwdArgs& a, int head_dim) { return arch.bwd_args_ok(a, head_dim); }

// Runs `dir` on the first arch of the table that can take the call; a launcher returning
// cudaErrorNotSupported has launched nothing (e.g. no TMA descriptor for these strides) and the
// next arch is tried.
template <typename Args>
dualkv_status run_on_first_arch(const char* dir, const Args& a, int head_dim, int32_t dtype, const DeviceInfo& info,
                                cudaStream_t stream) {
  constexpr bool kFwd = std::is_same_v<Args, FwdArgs>;
  const bool bf16 = dtype == DUALKV_DTYPE_BFLOAT16;
  // A head dim whose kernels are built without mask-modifier variants (the kernel table's PLAIN
  // list: 512) refuses a modifier by name, before any device arch is tried.
  const ModifierVariant mods = modifier_variant(a);
  if (mods.softcap || mods.sinks || mods.window) {
    bool plain = false, with_mods = false;
    for (const Arch& arch : kArchs) {
      plain = plain || find_launcher<Args>(arch.name, head_dim, bf16, ModifierVariant{false, false, false}) != nullptr;
      with_mods = with_mods || find_launcher<Args>(arch.name, head_dim, bf16, mods) != nullptr;
    }
    if (plain && !with_mods)
      return fail(DUALKV_ERROR_UNSUPPORTED,
                  "%s: the %s is not supported by the CUDA kernels at head_dim %d (built without mask modifiers: "
                  "head dims %s; the CPU backend runs it)",
                  dir, modifier_names(mods).c_str(), head_dim,
                  DUALKV_PLAIN_HEAD_DIMS_STRING);
  }
  std::string passed_over;  // why the last arch before the one that runs was not used
  for (const Arch& arch : kArchs) {
    const Launcher<Args> launch = find_launcher<Args>(arch.name, head_dim, bf16, mods);
    const char* env = kFwd ? arch.fwd_disable_env : arch.bwd_disable_env;
    if (!arch.runs_on(info.major, info.minor)) {
      passed_over = arch.device_mismatch;
    } else if (launch == nullptr) {
      passed_over = std::string("no ") + arch.name + " kernel built for this head dim";
    } else if (!args_ok(arch, a, head_dim)) {
      passed_over = arch.args_mismatch;
    } else if (env != nullptr && std::getenv(env) != nullptr) {
      passed_over = env;
    } else if (kFwd && !arch.fwd_tiles_ok(head_dim, a.window > 0, a.fwd_block_m)) {
      passed_over = std::string("plan cut for another kernel family's forward tiles (") +
                    std::to_string(a.fwd_block_m) + " query rows)";
    } else {
      const cudaError_t err = launch(a, info.sms, stream);
      if (err == cudaSuccess) {
        log_kernel_choice(dir, arch.kernel_name, passed_over);
        return DUALKV_OK;
      }
      if (err != cudaErrorNotSupported) return cuda_fail(dir, err);
      cudaGetLastError();
      passed_over = std::string(arch.name) + " launcher declined";
    }
  }
  return fail(DUALKV_ERROR_UNSUPPORTED, "%s: no CUDA kernel takes head_dim %d on this device (%s)", dir, head_dim,
              passed_over.c_str());
}

// The mask modifiers of a call (issue 16) into the kernels' arguments: the scores' cap and the
// factor SoftcapFromExp takes (mask.h), the sinks (float32: the lse dtype on CUDA), the window.
template <typename Params, typename Args>
void set_modifiers(const Params& p, Args* a) {
  a->window = p.window;
  a->softcap = static_cast<float>(p.softcap);
  a->softcap_exp2_factor =
      p.softcap > 0.0 ? static_cast<float>(2.0 * 1.4426950408889634 * p.softmax_scale / p.softcap) : 0.f;
  a->sinks = static_cast<const float*>(p.sinks);
}

// The first arch whose `Args` direction (without modifiers) the dispatcher would run on this device
// now, as run_on_first_arch tries them before the call's arguments are known; null if none.
template <typename Args>
const Arch* first_arch(const DeviceInfo& info, int32_t dtype, int32_t head_dim) {
  constexpr bool kFwd = std::is_same_v<Args, FwdArgs>;
  const bool bf16 = dtype == DUALKV_DTYPE_BFLOAT16;
  for (const Arch& arch : kArchs) {
    const char* env = kFwd ? arch.fwd_disable_env : arch.bwd_disable_env;
    if (arch.runs_on(info.major, info.minor) &&
        find_launcher<Args>(arch.name, head_dim, bf16, ModifierVariant{false, false, false}) != nullptr &&
        !(env != nullptr && std::getenv(env) != nullptr))
      return &arch;
  }
  return nullptr;
}

// The plan family a DEVICE request builds: that of the first arch whose forward the dispatcher
// would run on this device now (as run_on_first_arch tries them, before the call's arguments are
// known: a call whose pointers or strides the arch declines falls back to the portable kernels,
// which take every family's tiles). tiles: DUALKV_PLAN_TILES_*.
TileFamily plan_family(int32_t tiles, const DeviceInfo& info, int32_t dtype, int32_t head_dim) {
  if (tiles == DUALKV_PLAN_TILES_PORTABLE) return TileFamily::kPortable;
  if (tiles == DUALKV_PLAN_TILES_SM90) return TileFamily::kSm90;
  const Arch* arch = first_arch<FwdArgs>(info, dtype, head_dim);
  return arch != nullptr ? arch->tiles : TileFamily::kPortable;
}

// Whether the backward computes dQ query-outer: by a dQ kernel after a main kernel that computes
// none, so that the workspace holds no fp32 dQ accumulator and dQ is bit-identical run to run. In
// deterministic mode always; otherwise where the backward's first arch says so (its
// bwd_dq_query_outer: Hopper at head dim 256 without external prefixes). The workspace size and the
// call both ask here, so they agree. A call that arch's launcher then declines (strides TMA cannot
// take) runs the portable kernels in their deterministic form.
bool bwd_dq_query_outer(const dualkv_bwd_params& p) {
  if (p.flags & DUALKV_FLAG_DETERMINISTIC) return true;
  const DeviceInfo* info;
  if (query_device(p.device_index, &info) != DUALKV_OK) return false;
  const Arch* arch = first_arch<BwdArgs>(*info, p.dtype, p.head_dim);
  return arch != nullptr &&
         arch->bwd_dq_query_outer(p.head_dim, p.prefixes.num_prefixes > 0);
}

}  // namespace

dualkv_status cuda_check_supported(int32_t device_index, int32_t dtype, int32_t head_dim) {
  if (dtype != DUALKV_DTYPE_FLOAT16 && dtype != DUALKV_DTYPE_BFLOAT16)
    return fail(DUALKV_ERROR_UNSUPPORTED, "cuda: dtype %s is not supported on CUDA (float16, bfloat16)",
                dtype_name(dtype));
  if (!head_dim_built(head_dim))
    return fail(DUALKV_ERROR_UNSUPPORTED,
                "cuda: head_dim %d is not built for CUDA %s (built head dims: %s; supported: %s via "
                "-DDUALKV_HEAD_DIMS)",
                head_dim, dtype_name(dtype), built_head_dims_string().c_str(), DUALKV_SUPPORTED_HEAD_DIMS_STRING);
  const DeviceInfo* info;
  return query_device(device_index, &info);
}

dualkv_status cuda_plan_size(const dualkv_layout& host_layout, const dualkv_prefixes* prefixes, int32_t device_index,
                             int32_t dtype, int32_t head_dim, int32_t window, int32_t tiles, int64_t* plan_len,
                             uint64_t* plan_key) {
  const DeviceInfo* info;
  if (dualkv_status st = query_device(device_index, &info); st != DUALKV_OK) return st;
  const TileFamily family = plan_family(tiles, *info, dtype, head_dim);
  dualkv::plan::Plan built;
  if (dualkv_status st = dualkv::plan::build(host_layout, prefixes, head_dim, family, window, info->sms, &built);
      st != DUALKV_OK)
    return st;
  *plan_len = static_cast<int64_t>(built.data.size());
  *plan_key = built.key;
  return DUALKV_OK;
}

dualkv_status cuda_plan_build(const dualkv_layout& host_layout, const dualkv_prefixes* prefixes, int32_t device_index,
                              int32_t dtype, int32_t head_dim, int32_t window, int32_t tiles, int32_t* plan,
                              int64_t plan_len) {
  const DeviceInfo* info;
  if (dualkv_status st = query_device(device_index, &info); st != DUALKV_OK) return st;
  const TileFamily family = plan_family(tiles, *info, dtype, head_dim);
  dualkv::plan::Plan p;
  if (dualkv_status st = dualkv::plan::build(host_layout, prefixes, head_dim, family, window, info->sms, &p);
      st != DUALKV_OK)
    return st;
  if (plan_len != static_cast<int64_t>(p.data.size()))
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: plan_len %lld, but this layout's plan has %zu int32",
                static_cast<long long>(plan_len), p.data.size());
  std::memcpy(plan, p.data.data(), p.data.size() * sizeof(int32_t));
  return DUALKV_OK;
}

size_t cuda_fwd_workspace_bytes(const dualkv_fwd_params& p) {
  (void)p;
  return 256;  // the work-item counter
}

size_t cuda_bwd_workspace_bytes(const dualkv_bwd_params& p) {
  const size_t T = static_cast<size_t>(p.layout.num_tokens), H = static_cast<size_t>(p.num_heads);
  size_t bytes = kBwdCounterBytes;                      // counters
  if (!bwd_dq_query_outer(p))
    bytes += align_workspace(T * H * p.head_dim * sizeof(float));  // dq accumulator (after the counters)
  bytes += align_workspace(H * T * sizeof(float));      // delta
  bytes += align_workspace(bwd_partials_bytes(p));
  return bytes;
}

dualkv_status cuda_fwd(const dualkv_fwd_params& p) {
  int32_t fwd_tile_rows;
  if (dualkv_status st = check_plan(p, "fwd", &fwd_tile_rows); st != DUALKV_OK) return st;
  dualkv_status st;
  if ((st = check_rows("fwd", "q", p.q, p.q_token_stride, p.q_head_stride))) return st;
  if ((st = check_rows("fwd", "k", p.k, p.k_token_stride, p.k_head_stride))) return st;
  if ((st = check_rows("fwd", "v", p.v, p.v_token_stride, p.v_head_stride))) return st;
  if ((st = check_rows("fwd", "out", p.out, p.out_token_stride, p.out_head_stride))) return st;
  if ((st = check_prefix_rows(p, "fwd"))) return st;
  const DeviceInfo* info;
  if ((st = query_device(p.device_index, &info))) return st;
  DeviceGuard guard(p.device_index);
  if (!guard.ok()) return fail(DUALKV_ERROR_CUDA, "fwd: cannot select device %d", p.device_index);

  FwdArgs a{};
  a.layout = layout_ptrs(p.layout, p.prefixes);
  a.plan = p.plan;
  a.plan_len = p.plan_len;
  a.fwd_block_m = fwd_tile_rows;
  a.long_kv_walks = plan::key_long_kv_walks(p.plan_key) ? 1 : 0;
  a.ragged_tiles = plan::key_ragged_fwd_tiles(p.plan_key) ? 1 : 0;
  a.q = p.q; a.k = p.k; a.v = p.v; a.out = p.out;
  a.lse = static_cast<float*>(p.lse);
  a.q_ts = p.q_token_stride; a.q_hs = p.q_head_stride;
  a.k_ts = p.k_token_stride; a.k_hs = p.k_head_stride;
  a.v_ts = p.v_token_stride; a.v_hs = p.v_head_stride;
  a.o_ts = p.out_token_stride; a.o_hs = p.out_head_stride;
  a.lse_hs = p.lse_head_stride;
  a.num_heads = p.num_heads; a.num_kv_heads = p.num_kv_heads;
  a.scale = static_cast<float>(p.softmax_scale);
  a.scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);
  a.counter = static_cast<int32_t*>(p.workspace);
  fill_prefix_args(p, &a);
  set_modifiers(p, &a);

  cudaGetLastError();  // do not report an earlier, unrelated launch error as ours
  return run_on_first_arch("fwd", a, p.head_dim, p.dtype, *info, static_cast<cudaStream_t>(p.stream));
}

dualkv_status cuda_bwd(const dualkv_bwd_params& p) {
  int32_t fwd_tile_rows;
  if (dualkv_status st = check_plan(p, "bwd", &fwd_tile_rows); st != DUALKV_OK) return st;
  dualkv_status st;
  if ((st = check_rows("bwd", "q", p.q, p.q_token_stride, p.q_head_stride))) return st;
  if ((st = check_rows("bwd", "k", p.k, p.k_token_stride, p.k_head_stride))) return st;
  if ((st = check_rows("bwd", "v", p.v, p.v_token_stride, p.v_head_stride))) return st;
  if ((st = check_rows("bwd", "out", p.out, p.out_token_stride, p.out_head_stride))) return st;
  if ((st = check_rows("bwd", "dout", p.dout, p.dout_token_stride, p.dout_head_stride))) return st;
  if ((st = check_rows("bwd", "dq", p.dq, p.dq_token_stride, p.dq_head_stride))) return st;
  if ((st = check_rows("bwd", "dk", p.dk, p.dk_token_stride, p.dk_head_stride))) return st;
  if ((st = check_rows("bwd", "dv", p.dv, p.dv_token_stride, p.dv_head_stride))) return st;
  if ((st = check_prefix_rows(p, "bwd"))) return st;
  const DeviceInfo* info;
  if ((st = query_device(p.device_index, &info))) return st;
  DeviceGuard guard(p.device_index);
  if (!guard.ok()) return fail(DUALKV_ERROR_CUDA, "bwd: cannot select device %d", p.device_index);

  BwdArgs a{};
  a.layout = layout_ptrs(p.layout, p.prefixes);
  a.plan = p.plan;
  a.plan_len = p.plan_len;
  a.fwd_block_m = fwd_tile_rows;
  a.q = p.q; a.k = p.k; a.v = p.v; a.out = p.out; a.dout = p.dout;
  a.lse = static_cast<const float*>(p.lse);
  a.dlse = static_cast<const float*>(p.dlse);
  a.dq = p.dq; a.dk = p.dk; a.dv = p.dv;
  a.q_ts = p.q_token_stride; a.q_hs = p.q_head_stride;
  a.k_ts = p.k_token_stride; a.k_hs = p.k_head_stride;
  a.v_ts = p.v_token_stride; a.v_hs = p.v_head_stride;
  a.o_ts = p.out_token_stride; a.o_hs = p.out_head_stride;
  a.do_ts = p.dout_token_stride; a.do_hs = p.dout_head_stride;
  a.lse_hs = p.lse_head_stride; a.dlse_hs = p.dlse_head_stride;
  a.dq_ts = p.dq_token_stride; a.dq_hs = p.dq_head_stride;
  a.dk_ts = p.dk_token_stride; a.dk_hs = p.dk_head_stride;
  a.dv_ts = p.dv_token_stride; a.dv_hs = p.dv_head_stride;
  a.num_heads = p.num_heads; a.num_kv_heads = p.num_kv_heads;
  a.scale = static_cast<float>(p.softmax_scale);
  a.scale_log2 = static_cast<float>(p.softmax_scale * 1.4426950408889634);
  a.deterministic = bwd_dq_query_outer(p);  // dQ query-outer (its comment says when)
  a.n_slots = plan::key_slots(p.plan_key);

  const size_t T = static_cast<size_t>(p.layout.num_tokens), H = static_cast<size_t>(p.num_heads);
  char* ws = static_cast<char*>(p.workspace);
  // The dQ accumulator right after the counters: one memset zeroes both (launch_bwd_preprocess).
  a.counters = reinterpret_cast<int32_t*>(ws);
  ws += kBwdCounterBytes;
  if (!a.deterministic) {
    a.dq_accum = reinterpret_cast<float*>(ws);
    ws += align_workspace(T * H * p.head_dim * sizeof(float));
  }
  a.delta = reinterpret_cast<float*>(ws);
  ws += align_workspace(H * T * sizeof(float));
  a.partials = a.n_slots > 0 ? reinterpret_cast<float*>(ws) : nullptr;
  fill_prefix_args(p, &a);
  set_modifiers(p, &a);
  a.dsinks = static_cast<float*>(p.dsinks);

  cudaGetLastError();
  return run_on_first_arch("bwd", a, p.head_dim, p.dtype, *info, static_cast<cudaStream_t>(p.stream));
}

// "a,b" -> ["a", "b"] (a JSON array of strings; empty items skipped).
static std::string json_string_array(const std::string& csv) {
  std::string out = "[";
  size_t start = 0;
  bool first = true;
  while (start <= csv.size()) {
    size_t end = csv.find(',', start);
    if (end == std::string::npos) end = csv.size();
    if (end > start) {
      out += (first ? "\"" : ", \"") + csv.substr(start, end - start) + "\"";
      first = false;
    }
    start = end + 1;
  }
  return out + "]";
}

std::string cuda_build_info_json() {
  const std::string archs = json_string_array(DUALKV_CUDA_ARCHS_STRING);
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  // head_dims: every head dim with a kernel; plain_head_dims: those built without mask-modifier
  // kernels (a modifier there is refused); kernels: per arch (dispatch order) and direction.
  return "\"cuda_archs\": " + archs + ", \"head_dims\": [" + built_head_dims_string() +
         "], \"plain_head_dims\": [" DUALKV_PLAIN_HEAD_DIMS_STRING "], \"dtypes\": [\"float16\", \"bfloat16\"], "
         "\"kernels\": " DUALKV_KERNELS_JSON ", \"cuda_runtime\": " + std::to_string(runtime);
}

}  // namespace dualkv::detail
