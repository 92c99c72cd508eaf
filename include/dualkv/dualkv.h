/*
 * dualkv public C ABI.
 *
 * The native library knows pointers, strides, sizes and a stream, nothing else: no torch, no
 * Python. Callers allocate every output and the workspace (destination passing); the library
 * never allocates caller-visible memory, which keeps CUDA graphs and caching allocators happy.
 *
 * Every entry point returns a dualkv_status. On failure, dualkv_last_error() returns a message
 * (thread-local) that names the problem, e.g. "q: head_dim 100 is not built for CUDA bf16".
 *
 * Attention contract (see docs/c_abi.md):
 *   q [T, H, D], k and v [T, Hk, D]; H % Hk == 0; query head h reads kv head h / (H / Hk).
 *   out [T, H, D] in the input dtype; lse [H, T] natural-log, float32 (float64 for float64 input).
 *   Query token i in segment s sees key token j iff j lies in a proper ancestor of s, or j lies in
 *   s at an offset <= i's offset (include/dualkv/layout.h defines it once for host and device),
 *   and, with a sliding window W, pos(i) - pos(j) < W (include/dualkv/mask.h).
 *   Every pointer is aligned to its element size; an output shares no byte with another operand
 *   (inputs may overlap each other); both are checked (DUALKV_ERROR_INVALID_ARGUMENT).
 *   External prefix segments (dualkv_prefixes) add keys and values from a second buffer: rows of
 *   a prompt an earlier call computed, seen by the segment's descendants like a parent's tokens
 *   (in full but for the window; prefix row r is at position r - prefix start).
 */
#ifndef DUALKV_DUALKV_H_
#define DUALKV_DUALKV_H_

#include <stddef.h>
#include <stdint.h>

/* 2: the "mask modifiers" block appended to dualkv_fwd_params / dualkv_bwd_params (after the
 * "external prefix segments" block, which ABI 1 gained). The library also takes the params of
 * ABI 1, abi_version 1 with either of its struct sizes: offsetof(..., prefixes) (no prefixes, no
 * modifiers) or offsetof(..., softcap) (no modifiers). */
#define DUALKV_ABI_VERSION 2
#define DUALKV_VERSION_STRING "0.1.0"

#if defined(_WIN32)
#define DUALKV_API __declspec(dllexport)
#else
#define DUALKV_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dualkv_status {
  DUALKV_OK = 0,
  DUALKV_ERROR_INVALID_ARGUMENT = 1, /* shapes, strides, null pointers, scale, device */
  DUALKV_ERROR_INVALID_LAYOUT = 2,   /* malformed segment forest */
  DUALKV_ERROR_UNSUPPORTED = 3,      /* valid but not built / not implemented (dtype, head dim, arch) */
  DUALKV_ERROR_WORKSPACE = 4,        /* workspace missing or too small */
  DUALKV_ERROR_VERSION = 5,          /* params struct size or ABI version mismatch */
  DUALKV_ERROR_CUDA = 6,             /* a CUDA runtime call failed */
  DUALKV_ERROR_INTERNAL = 7          /* a bug: please report */
} dualkv_status;

typedef enum dualkv_dtype {
  DUALKV_DTYPE_FLOAT32 = 0,
  DUALKV_DTYPE_FLOAT16 = 1,
  DUALKV_DTYPE_BFLOAT16 = 2,
  DUALKV_DTYPE_FLOAT64 = 3 /* CPU backend only; for tests and gradcheck */
} dualkv_dtype;

typedef enum dualkv_device { DUALKV_DEVICE_CPU = 0, DUALKV_DEVICE_CUDA = 1 } dualkv_device;

enum {
  /* Bit-identical dq/dk/dv from run to run. The CPU backend is always deterministic. */
  DUALKV_FLAG_DETERMINISTIC = 1,
  /* CPU backend: accumulate in float64 instead of float32 (float64 inputs always do). */
  DUALKV_FLAG_ACCUMULATE_FP64 = 2
};

/*
 * A segment forest in DFS pre-order, plus the arrays dualkv_layout_derive() computes from it.
 * All pointers address memory of the device the attention runs on (host memory for the CPU
 * backend, device memory for CUDA). int32 throughout: T < 2^31.
 */
typedef struct dualkv_layout {
  int32_t num_segments;                /* S >= 1 */
  int32_t num_tokens;                  /* T == seg_offsets[S] */
  int32_t max_depth;                   /* 1 for a forest of roots only (plain varlen) */
  int32_t reserved0;
  const int32_t* seg_offsets;          /* [S+1] cumulative token offsets, strictly increasing */
  const int32_t* seg_parent;           /* [S] parent segment index, or -1 for a root */
  const int32_t* seg_subtree_end;      /* [S] one past the last segment of s's subtree (derived) */
  const int32_t* seg_position_offset;  /* [S] total length of s's proper ancestors (derived) */
  const int32_t* seg_depth;            /* [S] 0 for a root (derived) */
} dualkv_layout;

/*
 * External prefix segments (docs/layout.md "External prefixes"). An external segment is a root of
 * the forest that holds no tokens of q, k, v (seg_offsets[s] == seg_offsets[s+1]) but the rows of
 * one prefix of the separate buffers prefix_k / prefix_v: keys and values of a prompt computed in
 * an earlier call. It has no queries; every token of its subtree sees all of its rows, and the
 * positions of its children continue after its length. Prefix e is the rows
 * [prefix_offsets[e], prefix_offsets[e+1]) of the prefix buffers; a prefix is held by at most one
 * segment of a layout, and an external segment has at least one child.
 */
typedef struct dualkv_prefixes {
  int32_t num_prefixes;          /* E >= 0; 0 = no external segment (the pointers are ignored) */
  int32_t num_prefix_rows;       /* rows of the prefix buffers, == prefix_offsets[E] */
  const int32_t* seg_prefix;     /* [S] the prefix external segment s holds, or -1 (same memory as the layout) */
  const int32_t* prefix_offsets; /* [E+1] cumulative rows: 0, strictly increasing */
} dualkv_prefixes;

typedef struct dualkv_fwd_params {
  uint32_t struct_size; /* sizeof(dualkv_fwd_params) */
  uint32_t abi_version; /* DUALKV_ABI_VERSION */
  int32_t device;       /* dualkv_device */
  int32_t device_index; /* CUDA ordinal; ignored on CPU */
  int32_t dtype;        /* dualkv_dtype of q, k, v, out */
  int32_t flags;        /* DUALKV_FLAG_* */
  int32_t num_heads;    /* H */
  int32_t num_kv_heads; /* Hk */
  int32_t head_dim;     /* D */
  int32_t num_threads;  /* CPU worker threads; 0 = hardware concurrency, larger values are capped to it */
  double softmax_scale; /* > 0 and finite; 1/sqrt(D) is the usual choice */

  dualkv_layout layout;
  /* Backend work plan from dualkv_plan_build (device memory); NULL/0 for the CPU backend. */
  const int32_t* plan;
  int64_t plan_len;
  uint64_t plan_key;

  /* Inputs [T, H or Hk, D]; strides in elements; the last dim is contiguous. */
  const void* q;
  const void* k;
  const void* v;
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;

  /* Outputs. */
  void* out; /* [T, H, D] input dtype */
  int64_t out_token_stride, out_head_stride;
  void* lse; /* [H, T] float32 (float64 for float64 input), token stride 1; may be NULL */
  int64_t lse_head_stride;

  void* workspace; /* dualkv_fwd_workspace_size() bytes, 256-byte aligned */
  size_t workspace_bytes;
  void* stream; /* cudaStream_t; NULL = legacy default stream */

  /* ---- external prefix segments (appended in ABI 1: a caller built before this block passes
   * struct_size = offsetof(dualkv_fwd_params, prefixes) and has none) ---- */
  dualkv_prefixes prefixes;
  const void* prefix_k; /* [num_prefix_rows, Hk, D] in dtype, last dim contiguous */
  const void* prefix_v;
  int64_t prefix_k_token_stride, prefix_k_head_stride;
  int64_t prefix_v_token_stride, prefix_v_head_stride;

  /* ---- mask modifiers (ABI 2; each off when zero / NULL: a caller of ABI 1 has none) ---- */
  double softcap;    /* > 0: scores s = scale * q.k become softcap * tanh(s / softcap) before masking */
  const void* sinks; /* [num_heads] per-head sink logits, lse dtype, contiguous: each joins every row's
                        softmax denominator (and its lse) as one more key of value zero */
  int32_t window;    /* > 0: key j is visible from query i only if pos(i) - pos(j) < window, positions
                        along the root-to-leaf path (the layout's position ids; a prefix row's position
                        is its row within its prefix) */
} dualkv_fwd_params;

typedef struct dualkv_bwd_params {
  uint32_t struct_size; /* sizeof(dualkv_bwd_params) */
  uint32_t abi_version;
  int32_t device;
  int32_t device_index;
  int32_t dtype;
  int32_t flags;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t num_threads;
  double softmax_scale;

  dualkv_layout layout;
  const int32_t* plan;
  int64_t plan_len;
  uint64_t plan_key;

  const void* q;
  const void* k;
  const void* v;
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  const void* out; /* forward output [T, H, D] */
  int64_t out_token_stride, out_head_stride;
  const void* dout; /* [T, H, D] */
  int64_t dout_token_stride, dout_head_stride;
  const void* lse; /* [H, T] from the forward, required */
  int64_t lse_head_stride;
  const void* dlse; /* [H, T] gradient w.r.t. lse, same dtype as lse; NULL = zero */
  int64_t dlse_head_stride;

  void* dq; /* [T, H, D] input dtype */
  int64_t dq_token_stride, dq_head_stride;
  void* dk; /* [T, Hk, D] */
  int64_t dk_token_stride, dk_head_stride;
  void* dv; /* [T, Hk, D] */
  int64_t dv_token_stride, dv_head_stride;

  void* workspace;
  size_t workspace_bytes;
  void* stream;

  /* ---- external prefix segments (appended in ABI 1: a caller built before this block passes
   * struct_size = offsetof(dualkv_bwd_params, prefixes) and has none) ---- */
  dualkv_prefixes prefixes;
  const void* prefix_k; /* [num_prefix_rows, Hk, D], as in the forward */
  const void* prefix_v;
  int64_t prefix_k_token_stride, prefix_k_head_stride;
  int64_t prefix_v_token_stride, prefix_v_head_stride;
  /* [num_prefix_rows, Hk, D] in dtype. ACCUMULATED: the gradient w.r.t. the rows of every prefix
   * the layout references is added to what they hold (+=), other rows are left as they are, so
   * that the micro-batches that share a prompt sum its gradient in the caller's buffer. Each row
   * is updated by one work item in a fixed order: deterministic. */
  void* prefix_dk;
  void* prefix_dv;
  int64_t prefix_dk_token_stride, prefix_dk_head_stride;
  int64_t prefix_dv_token_stride, prefix_dv_head_stride;

  /* ---- mask modifiers (ABI 2): the forward's, and the sinks' gradient ---- */
  double softcap;
  const void* sinks;
  void* dsinks;   /* [num_heads] lse dtype, contiguous: d loss / d sinks (written, not accumulated);
                     required with sinks, NULL without */
  int32_t window;
} dualkv_bwd_params;

/* ---- library information ---- */
DUALKV_API uint32_t dualkv_abi_version(void);
/* JSON: {"version", "abi_version", "backends", "cuda_archs", "head_dims", "dtypes", ...} */
DUALKV_API const char* dualkv_build_info(void);
/* Message of the last failed call on this thread ("" if none). */
DUALKV_API const char* dualkv_last_error(void);
/* Human-readable name of a status code. */
DUALKV_API const char* dualkv_status_string(dualkv_status status);

/* ---- layout (host memory) ---- */
/* Validates a forest; on success fills the derived arrays (each [S], caller-allocated) and
 * *max_depth. Any of the outputs may be NULL to only validate. */
DUALKV_API dualkv_status dualkv_layout_derive(const int32_t* seg_offsets, const int32_t* seg_parent,
                                              int32_t num_segments, int64_t num_tokens,
                                              int32_t* seg_subtree_end, int32_t* seg_position_offset,
                                              int32_t* seg_depth, int32_t* max_depth);
/* RoPE position of every token: position_offset[segment] + offset in segment. out: [T]. */
DUALKV_API dualkv_status dualkv_layout_position_ids(const dualkv_layout* host_layout, int32_t* out);
/* Number of visible (query, key) pairs, for FLOP counting (4 * H * D * pairs in the forward). */
DUALKV_API dualkv_status dualkv_layout_visible_pairs(const dualkv_layout* host_layout, int64_t* pairs);
/* The same three for a forest with external prefix segments (prefixes may be NULL: none); the
 * functions above refuse such a forest (its external segments look empty without prefixes). */
DUALKV_API dualkv_status dualkv_layout_derive_prefixed(const int32_t* seg_offsets, const int32_t* seg_parent,
                                                       int32_t num_segments, int64_t num_tokens,
                                                       const dualkv_prefixes* prefixes, int32_t* seg_subtree_end,
                                                       int32_t* seg_position_offset, int32_t* seg_depth,
                                                       int32_t* max_depth);
DUALKV_API dualkv_status dualkv_layout_position_ids_prefixed(const dualkv_layout* host_layout,
                                                             const dualkv_prefixes* prefixes, int32_t* out);
DUALKV_API dualkv_status dualkv_layout_visible_pairs_prefixed(const dualkv_layout* host_layout,
                                                              const dualkv_prefixes* prefixes, int64_t* pairs);

/* ---- work plans (kernel work lists, built once per layout on the host) ---- */
/* Size in int32 of the plan for (device, dtype, head_dim) on this layout; 0 for the CPU backend.
 * *plan_key identifies the tiling it was built for; pass it back in the params. */
DUALKV_API dualkv_status dualkv_plan_size(const dualkv_layout* host_layout, int32_t device,
                                          int32_t device_index, int32_t dtype, int32_t head_dim,
                                          int64_t* plan_len, uint64_t* plan_key);
DUALKV_API dualkv_status dualkv_plan_build(const dualkv_layout* host_layout, int32_t device,
                                           int32_t device_index, int32_t dtype, int32_t head_dim,
                                           int32_t* plan, int64_t plan_len);
/* A plan request (the _ex entry points): what dualkv_plan_size / dualkv_plan_build take as
 * arguments, plus the sliding window the plan is cut to and the forest's external prefix table
 * (plan version 3). The plan of a call with window W must be built for W, and the plan of a
 * forest with external prefix segments with its table: plans built for another window, or without
 * the table, are rejected by the plan key. The plain functions are the request with window 0 and
 * no prefixes (they refuse a forest with external segments). A window together with external
 * prefixes is refused (DUALKV_ERROR_UNSUPPORTED) for the CUDA backend.
 * Versioned by struct_size: later fields are appended; the library also takes the request without
 * `tiles` (struct_size offsetof(dualkv_plan_request, tiles): DUALKV_PLAN_TILES_DEVICE). */
typedef struct dualkv_plan_request {
  uint32_t struct_size; /* sizeof(dualkv_plan_request) */
  int32_t device;
  int32_t device_index;
  int32_t dtype;
  int32_t head_dim;
  int32_t window;       /* 0: none (the plan dualkv_plan_size / dualkv_plan_build build); >= 1: W */
  const dualkv_prefixes* prefixes; /* host table of the external prefix segments; NULL: none */
  int32_t tiles;        /* dualkv_plan_tiles: the kernel family the plan's tiles are cut for */
} dualkv_plan_request;
/* The kernel family a CUDA plan is cut for. Their forward query tiles differ at head dim 64 without
 * a window (192 rows for the Hopper forward, 128 for the portable kernels); elsewhere the plans are
 * the same.
 * A plan of either family runs on any device: the portable kernels take both, the Hopper forward
 * its own (the dispatcher runs a portable-family plan's forward on the portable kernels).
 * DEVICE: the family the dispatcher runs on the request's device when the plan is built (the
 * Hopper kernels on sm_90 unless DUALKV_DISABLE_SM90 is set, else the portable ones); for
 * dualkv_plan_inspect_ex, which has no device, DEVICE is PORTABLE. */
typedef enum dualkv_plan_tiles {
  DUALKV_PLAN_TILES_DEVICE = 0,
  DUALKV_PLAN_TILES_PORTABLE = 1,
  DUALKV_PLAN_TILES_SM90 = 2
} dualkv_plan_tiles;
DUALKV_API dualkv_status dualkv_plan_size_ex(const dualkv_layout* host_layout, const dualkv_plan_request* request,
                                             int64_t* plan_len, uint64_t* plan_key);
DUALKV_API dualkv_status dualkv_plan_build_ex(const dualkv_layout* host_layout, const dualkv_plan_request* request,
                                              int32_t* plan, int64_t plan_len);

/* Statistics of a work plan (dualkv_plan_inspect). */
typedef struct dualkv_plan_info {
  uint32_t struct_size;      /* sizeof(dualkv_plan_info), set by the caller */
  int32_t head_dim;
  int32_t fwd_block_m;       /* query rows of a forward work tile */
  int32_t bwd_block_n;       /* KV rows of a backward work item */
  int32_t bwd_block_m;       /* query rows of a backward step */
  int32_t bwd_split_rows;    /* backward query ranges longer than this are split into several items */
  int32_t num_fwd_tiles;     /* forward work tiles (each runs once per query head) */
  int32_t num_bwd_items;     /* backward work items (each runs once per KV head) */
  int32_t num_reductions;    /* split KV tiles, each reduced from its items' fp32 partials */
  int32_t num_split_slots;   /* fp32 partial slots of the split items */
  int64_t plan_len;          /* int32 elements of the plan */
  uint64_t plan_key;
} dualkv_plan_info;
/* The plan the CUDA backend builds for this layout and head_dim on a device with num_sms
 * multiprocessors, without a device (any build): for tests and tools. Fills *info; when plan is
 * not NULL, also copies the plan (format: src/plan_format.h) into plan[plan_len], plan_len being
 * info->plan_len. */
DUALKV_API dualkv_status dualkv_plan_inspect(const dualkv_layout* host_layout, int32_t head_dim,
                                             int32_t num_sms, dualkv_plan_info* info, int32_t* plan,
                                             int64_t plan_len);
/* The same for a plan request (its head_dim, window and prefixes; device, device_index and dtype
 * unused). */
DUALKV_API dualkv_status dualkv_plan_inspect_ex(const dualkv_layout* host_layout, const dualkv_plan_request* request,
                                                int32_t num_sms, dualkv_plan_info* info, int32_t* plan,
                                                int64_t plan_len);

/* ---- attention ---- */
DUALKV_API dualkv_status dualkv_fwd_workspace_size(const dualkv_fwd_params* params, size_t* bytes);
DUALKV_API dualkv_status dualkv_fwd(const dualkv_fwd_params* params);
DUALKV_API dualkv_status dualkv_bwd_workspace_size(const dualkv_bwd_params* params, size_t* bytes);
DUALKV_API dualkv_status dualkv_bwd(const dualkv_bwd_params* params);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DUALKV_DUALKV_H_ */
