// The C ABI: argument validation and dispatch to the backends.
//
// Every check here exists so that a bad call returns an error naming the problem instead of
// reading or writing out of bounds in a backend. Backends assume validated params.
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "dualkv/dualkv.h"
#include "dualkv/layout.h"
#include "internal.h"

namespace dualkv::detail {

namespace {
thread_local std::string g_last_error;
}  // namespace

dualkv_status fail(dualkv_status status, const char* format, ...) {
  char buffer[1024];
  va_list args;
  va_start(args, format);
  std::vsnprintf(buffer, sizeof(buffer), format, args);
  va_end(args);
  g_last_error = buffer;
  return status;
}

void clear_error() { g_last_error.clear(); }

const char* dtype_name(int32_t dtype) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: return "float32";
    case DUALKV_DTYPE_FLOAT16: return "float16";
    case DUALKV_DTYPE_BFLOAT16: return "bfloat16";
    case DUALKV_DTYPE_FLOAT64: return "float64";
    default: return "unknown";
  }
}

size_t dtype_size(int32_t dtype) {
  switch (dtype) {
    case DUALKV_DTYPE_FLOAT32: return 4;
    case DUALKV_DTYPE_FLOAT16: return 2;
    case DUALKV_DTYPE_BFLOAT16: return 2;
    case DUALKV_DTYPE_FLOAT64: return 8;
    default: return 0;
  }
}

namespace {

constexpr int32_t kCpuMaxHeadDim = 512;

// Checks one [T, heads, D] operand: pointer, non-negative strides, and that the largest element
// offset fits in int64 (so no backend index arithmetic can overflow). `output` operands must
// also not overlap themselves, or two threads would write the same element.
dualkv_status check_operand(const char* name, const void* ptr, int64_t tokens, int64_t heads,
                            int64_t dim, int64_t token_stride, int64_t head_stride, bool output) {
  if (!ptr) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: pointer is NULL", name);
  if (token_stride < 0 || head_stride < 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: negative strides (token %lld, head %lld) are not supported",
                name, static_cast<long long>(token_stride), static_cast<long long>(head_stride));
  const long double max_offset = (long double)(tokens - 1) * token_stride +
                                 (long double)(heads - 1) * head_stride + (dim - 1);
  if (max_offset >= (long double)(std::numeric_limits<int64_t>::max() / 16))
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: strides overflow 64-bit indexing", name);
  if (output) {
    // Non-overlap of a (tokens, heads, dim) view with unit innermost stride: ordering the two
    // outer dims by stride, each must step past the whole extent of the inner ones.
    int64_t inner_extent = dim;  // elements spanned by the dims already placed
    struct Dim { int64_t size, stride; } dims[2] = {{tokens, token_stride}, {heads, head_stride}};
    if (dims[0].stride > dims[1].stride) std::swap(dims[0], dims[1]);
    for (const Dim& d : dims) {
      if (d.size <= 1) continue;
      if (d.stride < inner_extent)
        return fail(DUALKV_ERROR_INVALID_ARGUMENT,
                    "%s: output strides (token %lld, head %lld) make elements overlap", name,
                    static_cast<long long>(token_stride), static_cast<long long>(head_stride));
      inner_extent = d.stride * d.size;
    }
  }
  return DUALKV_OK;
}

// Re-derives a host layout and compares, so that a CPU call can never index out of bounds
// through inconsistent derived arrays. O(S), negligible next to the attention itself.
dualkv_status check_host_layout_consistent(const dualkv_layout& l) {
  if (!l.seg_offsets || !l.seg_parent || !l.seg_subtree_end || !l.seg_position_offset || !l.seg_depth)
    return fail(DUALKV_ERROR_INVALID_LAYOUT, "layout: a layout array is NULL (derived arrays come from dualkv_layout_derive)");
  std::vector<int32_t> end(l.num_segments), pos(l.num_segments), depth(l.num_segments);
  int32_t max_depth = 0;
  if (dualkv_status st = dualkv_layout_derive(l.seg_offsets, l.seg_parent, l.num_segments, l.num_tokens,
                                              end.data(), pos.data(), depth.data(), &max_depth);
      st != DUALKV_OK)
    return st;
  if (std::memcmp(end.data(), l.seg_subtree_end, end.size() * 4) != 0 ||
      std::memcmp(pos.data(), l.seg_position_offset, pos.size() * 4) != 0 ||
      std::memcmp(depth.data(), l.seg_depth, depth.size() * 4) != 0 || max_depth != l.max_depth)
    return fail(DUALKV_ERROR_INVALID_LAYOUT,
                "layout: derived arrays do not match seg_offsets/seg_parent (stale layout?)");
  return DUALKV_OK;
}

// Checks shared by forward and backward: struct version, device, dtype, sizes, layout.
template <typename Params>
dualkv_status check_common(const Params* p, const char* what) {
  if (!p) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: params is NULL", what);
  if (p->struct_size != sizeof(Params))
    return fail(DUALKV_ERROR_VERSION, "%s: params struct_size %u does not match the library's %zu (rebuild the caller against this dualkv.h)",
                what, p->struct_size, sizeof(Params));
  if (p->abi_version != DUALKV_ABI_VERSION)
    return fail(DUALKV_ERROR_VERSION, "%s: abi_version %u, library is %d", what, p->abi_version,
                DUALKV_ABI_VERSION);
  if (p->dtype < DUALKV_DTYPE_FLOAT32 || p->dtype > DUALKV_DTYPE_FLOAT64)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: unknown dtype code %d", what, p->dtype);
  if (p->num_heads < 1 || p->num_kv_heads < 1)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: num_heads (%d) and num_kv_heads (%d) must be >= 1",
                what, p->num_heads, p->num_kv_heads);
  if (p->num_heads % p->num_kv_heads != 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: num_heads %d is not a multiple of num_kv_heads %d",
                what, p->num_heads, p->num_kv_heads);
  if (p->head_dim < 1)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: head_dim must be >= 1, got %d", what, p->head_dim);
  if (!(p->softmax_scale > 0.0) || !std::isfinite(p->softmax_scale))
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: softmax_scale must be finite and > 0, got %g", what,
                p->softmax_scale);
  if (p->num_threads < 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: num_threads must be >= 0", what);
  if (p->flags & ~(DUALKV_FLAG_DETERMINISTIC | DUALKV_FLAG_ACCUMULATE_FP64))
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: unknown flag bits 0x%x", what, p->flags);
  const dualkv_layout& l = p->layout;
  if (l.num_segments < 1 || l.num_tokens < 1)
    return fail(DUALKV_ERROR_INVALID_LAYOUT, "%s: layout has %d segments and %d tokens; both must be >= 1",
                what, l.num_segments, l.num_tokens);

  if (p->device == DUALKV_DEVICE_CPU) {
    if (p->head_dim > kCpuMaxHeadDim)
      return fail(DUALKV_ERROR_UNSUPPORTED, "%s: head_dim %d is not supported by the CPU backend (max %d)",
                  what, p->head_dim, kCpuMaxHeadDim);
    return check_host_layout_consistent(l);
  }
  if (p->device == DUALKV_DEVICE_CUDA) {
#if defined(DUALKV_WITH_CUDA)
    if (p->dtype != DUALKV_DTYPE_FLOAT16 && p->dtype != DUALKV_DTYPE_BFLOAT16)
      return fail(DUALKV_ERROR_UNSUPPORTED, "%s: dtype %s is not supported on CUDA (float16, bfloat16)",
                  what, dtype_name(p->dtype));
    if (!l.seg_offsets || !l.seg_parent || !l.seg_subtree_end || !l.seg_position_offset || !l.seg_depth)
      return fail(DUALKV_ERROR_INVALID_LAYOUT, "%s: a layout array is NULL", what);
    if (!p->plan || p->plan_len <= 0)
      return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: CUDA needs a work plan (dualkv_plan_build)", what);
    return cuda_check_supported(p->device_index, p->dtype, p->head_dim);
#else
    return fail(DUALKV_ERROR_UNSUPPORTED, "%s: this libdualkv was built without CUDA", what);
#endif
  }
  return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: unknown device code %d", what, p->device);
}

dualkv_status check_fwd(const dualkv_fwd_params* p) {
  if (dualkv_status st = check_common(p, "fwd"); st != DUALKV_OK) return st;
  const int64_t T = p->layout.num_tokens, H = p->num_heads, Hk = p->num_kv_heads, D = p->head_dim;
  dualkv_status st;
  if ((st = check_operand("q", p->q, T, H, D, p->q_token_stride, p->q_head_stride, false))) return st;
  if ((st = check_operand("k", p->k, T, Hk, D, p->k_token_stride, p->k_head_stride, false))) return st;
  if ((st = check_operand("v", p->v, T, Hk, D, p->v_token_stride, p->v_head_stride, false))) return st;
  if ((st = check_operand("out", p->out, T, H, D, p->out_token_stride, p->out_head_stride, true))) return st;
  if (p->lse && (st = check_operand("lse", p->lse, H, 1, T, p->lse_head_stride, 0, true))) return st;
  return DUALKV_OK;
}

dualkv_status check_bwd(const dualkv_bwd_params* p) {
  if (dualkv_status st = check_common(p, "bwd"); st != DUALKV_OK) return st;
  const int64_t T = p->layout.num_tokens, H = p->num_heads, Hk = p->num_kv_heads, D = p->head_dim;
  dualkv_status st;
  if ((st = check_operand("q", p->q, T, H, D, p->q_token_stride, p->q_head_stride, false))) return st;
  if ((st = check_operand("k", p->k, T, Hk, D, p->k_token_stride, p->k_head_stride, false))) return st;
  if ((st = check_operand("v", p->v, T, Hk, D, p->v_token_stride, p->v_head_stride, false))) return st;
  if ((st = check_operand("out", p->out, T, H, D, p->out_token_stride, p->out_head_stride, false))) return st;
  if ((st = check_operand("dout", p->dout, T, H, D, p->dout_token_stride, p->dout_head_stride, false))) return st;
  if ((st = check_operand("lse", p->lse, H, 1, T, p->lse_head_stride, 0, false))) return st;
  if (p->dlse && (st = check_operand("dlse", p->dlse, H, 1, T, p->dlse_head_stride, 0, false))) return st;
  if ((st = check_operand("dq", p->dq, T, H, D, p->dq_token_stride, p->dq_head_stride, true))) return st;
  if ((st = check_operand("dk", p->dk, T, Hk, D, p->dk_token_stride, p->dk_head_stride, true))) return st;
  if ((st = check_operand("dv", p->dv, T, Hk, D, p->dv_token_stride, p->dv_head_stride, true))) return st;
  return DUALKV_OK;
}

dualkv_status check_workspace(void* workspace, size_t have, size_t need, const char* what) {
  if (need == 0) return DUALKV_OK;
  if (!workspace || have < need)
    return fail(DUALKV_ERROR_WORKSPACE, "%s: workspace of %zu bytes needed, got %zu%s", what, need,
                workspace ? have : size_t(0), workspace ? "" : " (NULL)");
  if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0)
    return fail(DUALKV_ERROR_WORKSPACE, "%s: workspace must be 256-byte aligned", what);
  return DUALKV_OK;
}

size_t fwd_workspace(const dualkv_fwd_params& p) {
#if defined(DUALKV_WITH_CUDA)
  if (p.device == DUALKV_DEVICE_CUDA) return cuda_fwd_workspace_bytes(p);
#endif
  return cpu_fwd_workspace_bytes(p);
}

size_t bwd_workspace(const dualkv_bwd_params& p) {
#if defined(DUALKV_WITH_CUDA)
  if (p.device == DUALKV_DEVICE_CUDA) return cuda_bwd_workspace_bytes(p);
#endif
  return cpu_bwd_workspace_bytes(p);
}

}  // namespace
}  // namespace dualkv::detail

using namespace dualkv::detail;

extern "C" {

DUALKV_API uint32_t dualkv_abi_version(void) { return DUALKV_ABI_VERSION; }

DUALKV_API const char* dualkv_last_error(void) { return g_last_error.c_str(); }

DUALKV_API const char* dualkv_status_string(dualkv_status status) {
  switch (status) {
    case DUALKV_OK: return "ok";
    case DUALKV_ERROR_INVALID_ARGUMENT: return "invalid argument";
    case DUALKV_ERROR_INVALID_LAYOUT: return "invalid layout";
    case DUALKV_ERROR_UNSUPPORTED: return "unsupported";
    case DUALKV_ERROR_WORKSPACE: return "workspace";
    case DUALKV_ERROR_VERSION: return "version mismatch";
    case DUALKV_ERROR_CUDA: return "cuda error";
    case DUALKV_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

DUALKV_API const char* dualkv_build_info(void) {
  static const std::string info = [] {
    std::string s = "{\"version\": \"" DUALKV_VERSION_STRING "\", \"abi_version\": " +
                    std::to_string(DUALKV_ABI_VERSION) +
                    ", \"cpu\": {\"dtypes\": [\"float32\", \"float16\", \"bfloat16\", \"float64\"], "
                    "\"max_head_dim\": " + std::to_string(kCpuMaxHeadDim) +
                    ", \"isa\": \"" + cpu_isa() + "\"}";
#if defined(DUALKV_WITH_CUDA)
    s += ", \"backends\": [\"cpu\", \"cuda\"], \"cuda\": {" + cuda_build_info_json() + "}";
#else
    s += ", \"backends\": [\"cpu\"]";
#endif
    return s + "}";
  }();
  return info.c_str();
}

DUALKV_API dualkv_status dualkv_plan_size(const dualkv_layout* host_layout, int32_t device,
                                          int32_t device_index, int32_t dtype, int32_t head_dim,
                                          int64_t* plan_len, uint64_t* plan_key) {
  clear_error();
  if (!host_layout || !plan_len || !plan_key)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_size: NULL argument");
  if (dualkv_status st = check_host_layout_consistent(*host_layout); st != DUALKV_OK) return st;
  if (device == DUALKV_DEVICE_CPU) {
    *plan_len = 0;
    *plan_key = 0;
    return DUALKV_OK;
  }
#if defined(DUALKV_WITH_CUDA)
  if (device == DUALKV_DEVICE_CUDA) {
    if (dualkv_status st = cuda_check_supported(device_index, dtype, head_dim); st != DUALKV_OK) return st;
    return cuda_plan_size(*host_layout, device_index, dtype, head_dim, plan_len, plan_key);
  }
#else
  (void)device_index; (void)dtype; (void)head_dim;
  if (device == DUALKV_DEVICE_CUDA)
    return fail(DUALKV_ERROR_UNSUPPORTED, "plan_size: this libdualkv was built without CUDA");
#endif
  return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_size: unknown device code %d", device);
}

DUALKV_API dualkv_status dualkv_plan_build(const dualkv_layout* host_layout, int32_t device,
                                           int32_t device_index, int32_t dtype, int32_t head_dim,
                                           int32_t* plan, int64_t plan_len) {
  clear_error();
  if (!host_layout) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: layout is NULL");
  if (dualkv_status st = check_host_layout_consistent(*host_layout); st != DUALKV_OK) return st;
  if (device == DUALKV_DEVICE_CPU) return DUALKV_OK;
#if defined(DUALKV_WITH_CUDA)
  if (device == DUALKV_DEVICE_CUDA) {
    if (!plan) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: plan is NULL");
    if (dualkv_status st = cuda_check_supported(device_index, dtype, head_dim); st != DUALKV_OK) return st;
    return cuda_plan_build(*host_layout, device_index, dtype, head_dim, plan, plan_len);
  }
#else
  (void)device_index; (void)dtype; (void)head_dim; (void)plan; (void)plan_len;
  if (device == DUALKV_DEVICE_CUDA)
    return fail(DUALKV_ERROR_UNSUPPORTED, "plan_build: this libdualkv was built without CUDA");
#endif
  return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: unknown device code %d", device);
}

DUALKV_API dualkv_status dualkv_fwd_workspace_size(const dualkv_fwd_params* params, size_t* bytes) {
  clear_error();
  if (!bytes) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "fwd_workspace_size: bytes is NULL");
  if (dualkv_status st = check_common(params, "fwd"); st != DUALKV_OK) return st;
  *bytes = fwd_workspace(*params);
  return DUALKV_OK;
}

DUALKV_API dualkv_status dualkv_bwd_workspace_size(const dualkv_bwd_params* params, size_t* bytes) {
  clear_error();
  if (!bytes) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "bwd_workspace_size: bytes is NULL");
  if (dualkv_status st = check_common(params, "bwd"); st != DUALKV_OK) return st;
  *bytes = bwd_workspace(*params);
  return DUALKV_OK;
}

DUALKV_API dualkv_status dualkv_fwd(const dualkv_fwd_params* params) {
  clear_error();
  if (dualkv_status st = check_fwd(params); st != DUALKV_OK) return st;
  if (dualkv_status st = check_workspace(params->workspace, params->workspace_bytes,
                                         fwd_workspace(*params), "fwd");
      st != DUALKV_OK)
    return st;
#if defined(DUALKV_WITH_CUDA)
  if (params->device == DUALKV_DEVICE_CUDA) return cuda_fwd(*params);
#endif
  return cpu_fwd(*params);
}

DUALKV_API dualkv_status dualkv_bwd(const dualkv_bwd_params* params) {
  clear_error();
  if (dualkv_status st = check_bwd(params); st != DUALKV_OK) return st;
  if (dualkv_status st = check_workspace(params->workspace, params->workspace_bytes,
                                         bwd_workspace(*params), "bwd");
      st != DUALKV_OK)
    return st;
#if defined(DUALKV_WITH_CUDA)
  if (params->device == DUALKV_DEVICE_CUDA) return cuda_bwd(*params);
#endif
  return cpu_bwd(*params);
}

}  // extern "C"
