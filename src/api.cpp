// The C ABI: argument validation and dispatch to the backends.
//
// Every check here exists so that a bad call returns an error naming the problem instead of
// reading or writing out of bounds in a backend. Backends assume validated params.
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>

#include "dualkv/dualkv.h"
#include "dualkv/layout.h"
#include "internal.h"
#include "plan.h"
#include "tile_size.h"

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

// Every layout the params structs have had, oldest first: the struct_size and abi_version a
// caller built against that dualkv.h passes. New fields go in blocks appended at the end, with a
// row here; the sizes are pinned so that no field of an earlier layout moves.
struct ParamsLayout {
  size_t size;
  uint32_t abi_version;
};
template <typename Params>
constexpr ParamsLayout kParamsLayouts[] = {
    {offsetof(Params, prefixes), 1},  // ABI 1
    {offsetof(Params, softcap), 1},   // ABI 1 with the external prefix segments block
    {sizeof(Params), DUALKV_ABI_VERSION},  // ABI 2: the mask modifiers block appended
};
static_assert(kParamsLayouts<dualkv_fwd_params>[0].size == 264 && kParamsLayouts<dualkv_bwd_params>[0].size == 376 &&
                  kParamsLayouts<dualkv_fwd_params>[1].size == 336 && kParamsLayouts<dualkv_bwd_params>[1].size == 496,
              "the fields of an earlier ABI must keep their size and place: new fields go at the end");

// Copies the caller's params into `out`, a struct of this ABI: only the bytes of the caller's
// layout are read, and the fields after them are zero (a zero block means "not used": no
// prefixes, no mask modifiers). A size of no layout, or a version that is not the size's, is
// refused.
template <typename Params>
dualkv_status read_params(const Params* p, const char* what, Params* out) {
  if (!p) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: params is NULL", what);
  const size_t size = p->struct_size;
  const ParamsLayout* known = nullptr;
  for (const ParamsLayout& l : kParamsLayouts<Params>)
    if (l.size == size) known = &l;
  if (!known) {
    std::string sizes;  // the message's list, built on this path only (not on every call)
    for (const ParamsLayout& l : kParamsLayouts<Params>)
      sizes += (sizes.empty() ? "" : ", ") + std::to_string(l.size) + ": ABI " + std::to_string(l.abi_version);
    return fail(DUALKV_ERROR_VERSION, "%s: params struct_size %zu is that of no ABI this library takes (%s); "
                "rebuild the caller against this dualkv.h", what, size, sizes.c_str());
  }
  if (p->abi_version != known->abi_version)
    return fail(DUALKV_ERROR_VERSION, "%s: abi_version %u, but struct_size %zu is that of ABI %u", what,
                p->abi_version, size, known->abi_version);
  std::memset(static_cast<void*>(out), 0, sizeof(Params));
  std::memcpy(static_cast<void*>(out), p, size);
  out->struct_size = sizeof(Params);
  out->abi_version = DUALKV_ABI_VERSION;
  return DUALKV_OK;
}

// The modifiers' values (both directions); which backend runs them is check_common's business.
template <typename Params>
dualkv_status check_modifiers(const Params& p, const char* what) {
  if (p.window < 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: window must be >= 1 (or 0 for none), got %d", what, p.window);
  if (!(p.softcap >= 0.0) || !std::isfinite(p.softcap))
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: softcap must be finite and > 0 (or 0 for none), got %g", what,
                p.softcap);
  return DUALKV_OK;
}

size_t lse_element_size(int32_t dtype) { return dtype == DUALKV_DTYPE_FLOAT64 ? 8 : 4; }

// One [tokens, heads, dim] operand of an attention call (dim contiguous; strides in elements).
struct Operand {
  const char* name;
  const void* ptr;
  int64_t tokens, heads, dim, token_stride, head_stride;
  size_t element_size;
  bool output;

  uintptr_t begin() const { return reinterpret_cast<uintptr_t>(ptr); }
  // Elements of one token, from its first to its last byte.
  int64_t token_bytes() const { return ((heads - 1) * head_stride + dim) * int64_t(element_size); }
  uintptr_t end() const {
    return begin() + uintptr_t((tokens - 1) * token_stride * int64_t(element_size) + token_bytes());
  }
};

// Checks one operand: pointer, alignment to its element size (the backends load whole elements),
// non-negative strides, and that the largest element offset fits in int64 (so no backend index
// arithmetic can overflow). An output must also not overlap itself, or two threads would write
// the same element.
dualkv_status check_operand(const Operand& o) {
  if (!o.ptr) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: pointer is NULL", o.name);
  if (o.begin() % o.element_size != 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: pointer %p is not aligned to its %zu-byte elements", o.name,
                o.ptr, o.element_size);
  if (o.token_stride < 0 || o.head_stride < 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: negative strides (token %lld, head %lld) are not supported",
                o.name, static_cast<long long>(o.token_stride), static_cast<long long>(o.head_stride));
  const long double max_offset = (long double)(o.tokens - 1) * o.token_stride +
                                 (long double)(o.heads - 1) * o.head_stride + (o.dim - 1);
  if (max_offset >= (long double)(std::numeric_limits<int64_t>::max() / 16))
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: strides overflow 64-bit indexing", o.name);
  if (o.output) {
    // Non-overlap of a (tokens, heads, dim) view with unit innermost stride: ordering the two
    // outer dims by stride, each must step past the whole extent of the inner ones.
    int64_t inner_extent = o.dim;  // elements spanned by the dims already placed
    struct Dim { int64_t size, stride; } dims[2] = {{o.tokens, o.token_stride}, {o.heads, o.head_stride}};
    if (dims[0].stride > dims[1].stride) std::swap(dims[0], dims[1]);
    for (const Dim& d : dims) {
      if (d.size <= 1) continue;
      if (d.stride < inner_extent)
        return fail(DUALKV_ERROR_INVALID_ARGUMENT,
                    "%s: output strides (token %lld, head %lld) make elements overlap", o.name,
                    static_cast<long long>(o.token_stride), static_cast<long long>(o.head_stride));
      inner_extent = d.stride * d.size;
    }
  }
  return DUALKV_OK;
}

// Whether two operands may share a byte. Disjoint byte ranges never do. Operands interleaved
// token by token in one buffer with the same token stride (dk and dv as buf[:, 0] and buf[:, 1]
// of a [T, 2, Hk, D] buffer) do not either when, within a token's stride, their bytes fall in
// disjoint intervals. Anything else that shares a byte range counts as overlapping.
bool may_overlap(const Operand& a, const Operand& b) {
  if (a.end() <= b.begin() || b.end() <= a.begin()) return false;
  const int64_t stride = a.token_stride * int64_t(a.element_size);
  if (stride <= 0 || stride != b.token_stride * int64_t(b.element_size) || a.token_bytes() > stride ||
      b.token_bytes() > stride)
    return true;
  // b's first token starts `shift` bytes into one of a's token strides.
  const int64_t shift = int64_t((b.begin() - a.begin()) % uintptr_t(stride) + uintptr_t(stride)) % stride;
  const int64_t distance = b.begin() >= a.begin() ? shift : (stride - shift) % stride;
  return !(distance >= a.token_bytes() && distance + b.token_bytes() <= stride);
}

// Outputs must share no memory with any other operand: an output overlapping another output
// leaves one of the two corrupted, and one overlapping an input is overwritten while a kernel
// still reads it. Inputs may overlap each other (q, k, v slices of one fused projection).
dualkv_status check_no_aliasing(const Operand* operands, size_t n) {
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j)
      if (i != j && operands[i].output && (j > i || !operands[j].output) && may_overlap(operands[i], operands[j]))
        return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s and %s overlap in memory; outputs must not share memory "
                    "with another operand", operands[i].name, operands[j].name);
  return DUALKV_OK;
}

// The operands of one call, on the stack (no allocation per call): at most 16, the backward's nine
// with dlse, sinks and dsinks, and the external prefixes' four.
class OperandList {
 public:
  static constexpr size_t kCapacity = 16;
  OperandList(std::initializer_list<Operand> operands) {
    for (const Operand& o : operands) push_back(o);
  }
  void push_back(const Operand& o) {
    if (n_ < kCapacity) items_[n_] = o;
    ++n_;  // past kCapacity: refused by check_operands
  }
  const Operand* data() const { return items_; }
  size_t size() const { return n_; }

 private:
  Operand items_[kCapacity];
  size_t n_ = 0;
};

dualkv_status check_operands(const Operand* operands, size_t n) {
  if (n > OperandList::kCapacity)
    return fail(DUALKV_ERROR_INTERNAL, "%zu operands, more than the %zu the checks hold", n, OperandList::kCapacity);
  for (size_t i = 0; i < n; ++i)
    if (dualkv_status st = check_operand(operands[i]); st != DUALKV_OK) return st;
  return check_no_aliasing(operands, n);
}

// Checks shared by forward and backward (on params read_params returned): device, dtype, sizes,
// mask modifiers, layout.
template <typename Params>
dualkv_status check_common(const Params* p, const char* what) {
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
  if (dualkv_status st = check_modifiers(*p, what); st != DUALKV_OK) return st;
  const dualkv_layout& l = p->layout;
  if (l.num_segments < 1 || l.num_tokens < 1)
    return fail(DUALKV_ERROR_INVALID_LAYOUT, "%s: layout has %d segments and %d tokens; both must be >= 1",
                what, l.num_segments, l.num_tokens);

  if (p->device == DUALKV_DEVICE_CPU) {
    if (p->head_dim > kCpuMaxHeadDim)
      return fail(DUALKV_ERROR_UNSUPPORTED, "%s: head_dim %d is not supported by the CPU backend (max %d)",
                  what, p->head_dim, kCpuMaxHeadDim);
    return check_host_layout(l, &p->prefixes);
  }
  if (p->device == DUALKV_DEVICE_CUDA) {
    // The kernels run the mask modifiers (issue 16) and external prefix segments (issue 17), but
    // not a modifier together with external prefixes (no such kernel instantiations, and no
    // windowed plan with prefixes): refused in every build, before anything else of the device.
    if (p->prefixes.num_prefixes != 0 && p->window != 0)
      return fail(DUALKV_ERROR_UNSUPPORTED, "%s: a sliding window (%d) with external prefix segments is not supported "
                  "by the CUDA backend (the CPU backend runs it)", what, p->window);
    if (p->prefixes.num_prefixes != 0 && (p->softcap != 0.0f || p->sinks != nullptr))
      return fail(DUALKV_ERROR_UNSUPPORTED, "%s: %s%s%s with external prefix segments is not supported by the CUDA "
                  "backend (no such kernels; the CPU backend runs it)", what, p->softcap != 0.0f ? "softcap" : "",
                  p->softcap != 0.0f && p->sinks != nullptr ? " and " : "", p->sinks != nullptr ? "sinks" : "");
#if defined(DUALKV_WITH_CUDA)
    if (p->dtype != DUALKV_DTYPE_FLOAT16 && p->dtype != DUALKV_DTYPE_BFLOAT16)
      return fail(DUALKV_ERROR_UNSUPPORTED, "%s: dtype %s is not supported on CUDA (float16, bfloat16)",
                  what, dtype_name(p->dtype));
    if (!l.seg_offsets || !l.seg_parent || !l.seg_subtree_end || !l.seg_position_offset || !l.seg_depth)
      return fail(DUALKV_ERROR_INVALID_LAYOUT, "%s: a layout array is NULL", what);
    // The prefix table lives in device memory like the layout (validated on the host by
    // dualkv_plan_build_ex; the plan key holds its size, checked by the dispatcher).
    if (p->prefixes.num_prefixes != 0) {
      const dualkv_prefixes& x = p->prefixes;
      if (x.num_prefixes < 0 || x.num_prefix_rows < x.num_prefixes)
        return fail(DUALKV_ERROR_INVALID_LAYOUT, "%s: %d external prefixes of %d rows in all (each prefix has >= 1 "
                    "row)", what, x.num_prefixes, x.num_prefix_rows);
      if (!x.seg_prefix || !x.prefix_offsets)
        return fail(DUALKV_ERROR_INVALID_LAYOUT, "%s: a prefix table array (seg_prefix, prefix_offsets) is NULL",
                    what);
    }
    if (!p->plan || p->plan_len <= 0)
      return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: CUDA needs a work plan (dualkv_plan_build)", what);
    return cuda_check_supported(p->device_index, p->dtype, p->head_dim);
#else
    return fail(DUALKV_ERROR_UNSUPPORTED, "%s: this libdualkv was built without CUDA", what);
#endif
  }
  return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: unknown device code %d", what, p->device);
}

// The prefix key/value buffers of a call with external prefix segments ([rows, Hk, D], inputs).
template <typename Params>
void add_prefix_inputs(const Params* p, OperandList* ops) {
  if (p->prefixes.num_prefixes == 0) return;
  const int64_t rows = p->prefixes.num_prefix_rows, Hk = p->num_kv_heads, D = p->head_dim;
  const size_t es = dtype_size(p->dtype);
  ops->push_back({"prefix_k", p->prefix_k, rows, Hk, D, p->prefix_k_token_stride, p->prefix_k_head_stride, es, false});
  ops->push_back({"prefix_v", p->prefix_v, rows, Hk, D, p->prefix_v_token_stride, p->prefix_v_head_stride, es, false});
}

dualkv_status check_fwd(const dualkv_fwd_params* p) {
  if (dualkv_status st = check_common(p, "fwd"); st != DUALKV_OK) return st;
  const int64_t T = p->layout.num_tokens, H = p->num_heads, Hk = p->num_kv_heads, D = p->head_dim;
  const size_t es = dtype_size(p->dtype), ls = lse_element_size(p->dtype);
  OperandList ops = {
      {"q", p->q, T, H, D, p->q_token_stride, p->q_head_stride, es, false},
      {"k", p->k, T, Hk, D, p->k_token_stride, p->k_head_stride, es, false},
      {"v", p->v, T, Hk, D, p->v_token_stride, p->v_head_stride, es, false},
      {"out", p->out, T, H, D, p->out_token_stride, p->out_head_stride, es, true},
  };
  if (p->lse) ops.push_back({"lse", p->lse, H, 1, T, p->lse_head_stride, 0, ls, true});
  if (p->sinks) ops.push_back({"sinks", p->sinks, 1, 1, H, 0, 0, ls, false});
  add_prefix_inputs(p, &ops);
  return check_operands(ops.data(), ops.size());
}

dualkv_status check_bwd(const dualkv_bwd_params* p) {
  if (dualkv_status st = check_common(p, "bwd"); st != DUALKV_OK) return st;
  const int64_t T = p->layout.num_tokens, H = p->num_heads, Hk = p->num_kv_heads, D = p->head_dim;
  const size_t es = dtype_size(p->dtype), ls = lse_element_size(p->dtype);
  if (!p->lse) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "lse: pointer is NULL (the backward needs the forward's lse)");
  if (!p->sinks != !p->dsinks)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, p->sinks ? "dsinks: pointer is NULL (a backward with sinks returns "
                "their gradient)" : "dsinks: given without sinks");
  OperandList ops = {
      {"q", p->q, T, H, D, p->q_token_stride, p->q_head_stride, es, false},
      {"k", p->k, T, Hk, D, p->k_token_stride, p->k_head_stride, es, false},
      {"v", p->v, T, Hk, D, p->v_token_stride, p->v_head_stride, es, false},
      {"out", p->out, T, H, D, p->out_token_stride, p->out_head_stride, es, false},
      {"dout", p->dout, T, H, D, p->dout_token_stride, p->dout_head_stride, es, false},
      {"lse", p->lse, H, 1, T, p->lse_head_stride, 0, ls, false},
      {"dq", p->dq, T, H, D, p->dq_token_stride, p->dq_head_stride, es, true},
      {"dk", p->dk, T, Hk, D, p->dk_token_stride, p->dk_head_stride, es, true},
      {"dv", p->dv, T, Hk, D, p->dv_token_stride, p->dv_head_stride, es, true},
  };
  if (p->dlse) ops.push_back({"dlse", p->dlse, H, 1, T, p->dlse_head_stride, 0, ls, false});
  if (p->sinks) {
    ops.push_back({"sinks", p->sinks, 1, 1, H, 0, 0, ls, false});
    ops.push_back({"dsinks", p->dsinks, 1, 1, H, 0, 0, ls, true});
  }
  add_prefix_inputs(p, &ops);
  if (p->prefixes.num_prefixes != 0) {
    const int64_t rows = p->prefixes.num_prefix_rows;
    ops.push_back({"prefix_dk", p->prefix_dk, rows, Hk, D, p->prefix_dk_token_stride, p->prefix_dk_head_stride, es, true});
    ops.push_back({"prefix_dv", p->prefix_dv, rows, Hk, D, p->prefix_dv_token_stride, p->prefix_dv_head_stride, es, true});
  }
  return check_operands(ops.data(), ops.size());
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

namespace {

// A plan request as the library takes it: the _ex entry points' struct (its size checked), or the
// plain entry points' arguments with no window.
dualkv_status read_plan_request(const dualkv_plan_request* r, const char* what, dualkv_plan_request* out) {
  if (!r) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: request is NULL", what);
  // The request before `tiles` was appended: the device's family.
  constexpr size_t kWithoutTiles = offsetof(dualkv_plan_request, tiles);
  if (r->struct_size != sizeof(dualkv_plan_request) && r->struct_size != kWithoutTiles)
    return fail(DUALKV_ERROR_VERSION,
                "%s: request struct_size %u does not match the library's %zu (or %zu without tiles)", what,
                r->struct_size, sizeof(dualkv_plan_request), kWithoutTiles);
  if (r->window < 0)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "%s: window must be >= 1 (or 0 for none), got %d", what, r->window);
  *out = dualkv_plan_request{};
  std::memcpy(out, r, r->struct_size);
  out->struct_size = sizeof(dualkv_plan_request);
  if (out->tiles != DUALKV_PLAN_TILES_DEVICE && out->tiles != DUALKV_PLAN_TILES_PORTABLE &&
      out->tiles != DUALKV_PLAN_TILES_SM90)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT,
                "%s: tiles must be DUALKV_PLAN_TILES_DEVICE (0), _PORTABLE (1) or _SM90 (2), got %d", what, out->tiles);
  return DUALKV_OK;
}

dualkv_plan_request plain_request(int32_t device, int32_t device_index, int32_t dtype, int32_t head_dim) {
  return dualkv_plan_request{sizeof(dualkv_plan_request), device, device_index, dtype, head_dim, 0, nullptr,
                             DUALKV_PLAN_TILES_DEVICE};
}

dualkv_status plan_size(const dualkv_layout* host_layout, const dualkv_plan_request& r, int64_t* plan_len,
                        uint64_t* plan_key) {
  if (!host_layout || !plan_len || !plan_key)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_size: NULL argument");
  if (dualkv_status st = check_host_layout(*host_layout, r.prefixes); st != DUALKV_OK) return st;
  if (r.device == DUALKV_DEVICE_CPU) {
    *plan_len = 0;
    *plan_key = 0;
    return DUALKV_OK;
  }
#if defined(DUALKV_WITH_CUDA)
  if (r.device == DUALKV_DEVICE_CUDA) {
    if (dualkv_status st = cuda_check_supported(r.device_index, r.dtype, r.head_dim); st != DUALKV_OK) return st;
    return cuda_plan_size(*host_layout, r.prefixes, r.device_index, r.dtype, r.head_dim, r.window, r.tiles,
                          plan_len, plan_key);
  }
#else
  if (r.device == DUALKV_DEVICE_CUDA)
    return fail(DUALKV_ERROR_UNSUPPORTED, "plan_size: this libdualkv was built without CUDA");
#endif
  return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_size: unknown device code %d", r.device);
}

dualkv_status plan_build(const dualkv_layout* host_layout, const dualkv_plan_request& r, int32_t* plan,
                         int64_t plan_len) {
  if (!host_layout) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: layout is NULL");
  if (dualkv_status st = check_host_layout(*host_layout, r.prefixes); st != DUALKV_OK) return st;
  if (r.device == DUALKV_DEVICE_CPU) return DUALKV_OK;
#if defined(DUALKV_WITH_CUDA)
  if (r.device == DUALKV_DEVICE_CUDA) {
    if (!plan) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: plan is NULL");
    if (dualkv_status st = cuda_check_supported(r.device_index, r.dtype, r.head_dim); st != DUALKV_OK) return st;
    return cuda_plan_build(*host_layout, r.prefixes, r.device_index, r.dtype, r.head_dim, r.window, r.tiles, plan,
                           plan_len);
  }
#else
  (void)plan; (void)plan_len;
  if (r.device == DUALKV_DEVICE_CUDA)
    return fail(DUALKV_ERROR_UNSUPPORTED, "plan_build: this libdualkv was built without CUDA");
#endif
  return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_build: unknown device code %d", r.device);
}

// tiles: DUALKV_PLAN_TILES_*; DEVICE (there is none here) is PORTABLE.
dualkv_status plan_inspect(const dualkv_layout* host_layout, const dualkv_prefixes* prefixes, int32_t head_dim,
                           int32_t window, int32_t tiles, int32_t num_sms, dualkv_plan_info* info, int32_t* plan,
                           int64_t plan_len) {
  if (!host_layout || !info) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_inspect: NULL argument");
  if (info->struct_size != sizeof(dualkv_plan_info))
    return fail(DUALKV_ERROR_VERSION, "plan_inspect: info struct_size %u does not match the library's %zu",
                info->struct_size, sizeof(dualkv_plan_info));
  if (head_dim < 1 || num_sms < 1)
    return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_inspect: head_dim (%d) and num_sms (%d) must be >= 1",
                head_dim, num_sms);
  if (dualkv_status st = check_host_layout(*host_layout, prefixes); st != DUALKV_OK) return st;
  const dualkv::TileFamily family =
      tiles == DUALKV_PLAN_TILES_SM90 ? dualkv::TileFamily::kSm90 : dualkv::TileFamily::kPortable;
  dualkv::plan::Plan p;
  if (dualkv_status st = dualkv::plan::build(*host_layout, prefixes, head_dim, family, window, num_sms, &p);
      st != DUALKV_OK)
    return st;
  const dualkv::PlanTiles bwd_tiles = dualkv::plan_tiles(head_dim);
  const int32_t* hdr = p.data.data();
  info->head_dim = head_dim;
  info->fwd_block_m = dualkv::fwd_block_m(head_dim, family, window > 0);
  info->bwd_block_n = bwd_tiles.bwd_block_n;
  info->bwd_block_m = bwd_tiles.bwd_block_m;
  info->bwd_split_rows = p.split_rows;
  info->num_fwd_tiles = hdr[dualkv::kHdrNumFwd];
  info->num_bwd_items = hdr[dualkv::kHdrNumBwd];
  info->num_reductions = hdr[dualkv::kHdrNumRed];
  info->num_split_slots = hdr[dualkv::kHdrNumSlots];
  info->plan_len = static_cast<int64_t>(p.data.size());
  info->plan_key = p.key;
  if (plan) {
    if (plan_len != info->plan_len)
      return fail(DUALKV_ERROR_INVALID_ARGUMENT, "plan_inspect: plan_len %lld, but this layout's plan has %lld int32",
                  static_cast<long long>(plan_len), static_cast<long long>(info->plan_len));
    std::memcpy(plan, p.data.data(), p.data.size() * sizeof(int32_t));
  }
  return DUALKV_OK;
}

}  // namespace

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
                    ", \"isa\": \"" + cpu_isa() + "\", \"modifiers\": [\"window\", \"softcap\", \"sinks\"]}";
#if defined(DUALKV_WITH_CUDA)
    // "modifiers": the mask modifiers a backend implements (check_common refuses the others).
    s += ", \"backends\": [\"cpu\", \"cuda\"], \"cuda\": {" + cuda_build_info_json() +
         ", \"modifiers\": [\"window\", \"softcap\", \"sinks\"]}";
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
  return plan_size(host_layout, plain_request(device, device_index, dtype, head_dim), plan_len, plan_key);
}

DUALKV_API dualkv_status dualkv_plan_build(const dualkv_layout* host_layout, int32_t device,
                                           int32_t device_index, int32_t dtype, int32_t head_dim,
                                           int32_t* plan, int64_t plan_len) {
  clear_error();
  return plan_build(host_layout, plain_request(device, device_index, dtype, head_dim), plan, plan_len);
}

DUALKV_API dualkv_status dualkv_plan_size_ex(const dualkv_layout* host_layout, const dualkv_plan_request* request,
                                             int64_t* plan_len, uint64_t* plan_key) {
  clear_error();
  dualkv_plan_request r{};  // filled by read_plan_request on success (GCC cannot see that)
  if (dualkv_status st = read_plan_request(request, "plan_size", &r); st != DUALKV_OK) return st;
  return plan_size(host_layout, r, plan_len, plan_key);
}

DUALKV_API dualkv_status dualkv_plan_build_ex(const dualkv_layout* host_layout, const dualkv_plan_request* request,
                                              int32_t* plan, int64_t plan_len) {
  clear_error();
  dualkv_plan_request r{};  // filled by read_plan_request on success (GCC cannot see that)
  if (dualkv_status st = read_plan_request(request, "plan_build", &r); st != DUALKV_OK) return st;
  return plan_build(host_layout, r, plan, plan_len);
}

DUALKV_API dualkv_status dualkv_plan_inspect(const dualkv_layout* host_layout, int32_t head_dim,
                                             int32_t num_sms, dualkv_plan_info* info, int32_t* plan,
                                             int64_t plan_len) {
  clear_error();
  return plan_inspect(host_layout, nullptr, head_dim, 0, DUALKV_PLAN_TILES_PORTABLE, num_sms, info, plan, plan_len);
}

DUALKV_API dualkv_status dualkv_plan_inspect_ex(const dualkv_layout* host_layout, const dualkv_plan_request* request,
                                                int32_t num_sms, dualkv_plan_info* info, int32_t* plan,
                                                int64_t plan_len) {
  clear_error();
  dualkv_plan_request r{};  // filled by read_plan_request on success (GCC cannot see that)
  if (dualkv_status st = read_plan_request(request, "plan_inspect", &r); st != DUALKV_OK) return st;
  return plan_inspect(host_layout, r.prefixes, r.head_dim, r.window, r.tiles, num_sms, info, plan, plan_len);
}

DUALKV_API dualkv_status dualkv_fwd_workspace_size(const dualkv_fwd_params* params, size_t* bytes) {
  clear_error();
  if (!bytes) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "fwd_workspace_size: bytes is NULL");
  dualkv_fwd_params p;
  if (dualkv_status st = read_params(params, "fwd", &p); st != DUALKV_OK) return st;
  if (dualkv_status st = check_common(&p, "fwd"); st != DUALKV_OK) return st;
  *bytes = fwd_workspace(p);
  return DUALKV_OK;
}

DUALKV_API dualkv_status dualkv_bwd_workspace_size(const dualkv_bwd_params* params, size_t* bytes) {
  clear_error();
  if (!bytes) return fail(DUALKV_ERROR_INVALID_ARGUMENT, "bwd_workspace_size: bytes is NULL");
  dualkv_bwd_params p;
  if (dualkv_status st = read_params(params, "bwd", &p); st != DUALKV_OK) return st;
  if (dualkv_status st = check_common(&p, "bwd"); st != DUALKV_OK) return st;
  *bytes = bwd_workspace(p);
  return DUALKV_OK;
}

DUALKV_API dualkv_status dualkv_fwd(const dualkv_fwd_params* params) {
  clear_error();
  dualkv_fwd_params p;
  if (dualkv_status st = read_params(params, "fwd", &p); st != DUALKV_OK) return st;
  if (dualkv_status st = check_fwd(&p); st != DUALKV_OK) return st;
  if (dualkv_status st = check_workspace(p.workspace, p.workspace_bytes, fwd_workspace(p), "fwd"); st != DUALKV_OK)
    return st;
#if defined(DUALKV_WITH_CUDA)
  if (p.device == DUALKV_DEVICE_CUDA) return cuda_fwd(p);
#endif
  return cpu_fwd(p);
}

DUALKV_API dualkv_status dualkv_bwd(const dualkv_bwd_params* params) {
  clear_error();
  dualkv_bwd_params p;
  if (dualkv_status st = read_params(params, "bwd", &p); st != DUALKV_OK) return st;
  if (dualkv_status st = check_bwd(&p); st != DUALKV_OK) return st;
  if (dualkv_status st = check_workspace(p.workspace, p.workspace_bytes, bwd_workspace(p), "bwd"); st != DUALKV_OK)
    return st;
#if defined(DUALKV_WITH_CUDA)
  if (p.device == DUALKV_DEVICE_CUDA) return cuda_bwd(p);
#endif
  return cpu_bwd(p);
}

}  // extern "C"
