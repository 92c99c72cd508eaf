// Hopper (sm_90a) PTX primitives used by the sm90 kernels: mbarriers, TMA tensor loads, wgmma
// fences and matrix descriptors, register reallocation, named barriers.
//
// Shared-memory tiles are written by TMA with the 128-byte swizzle: a tile of R rows x 64 16-bit
// elements (one "box") stores row r at byte r * 128, with its 16-byte chunk c at chunk c ^ (r % 8).
// That is the canonical wgmma layout for 128B swizzling:
//   K-major (Q and K in S = Q K^T): 8-row atoms of 1024 B, SBO = 1024 B, LBO unused; a k16 step
//     inside the 64-element box advances the start address by 32 B; the next box is R * 128 B on.
//   N-major (V in O += P V, rows = tokens = k, columns = d = n): LBO = distance between boxes of 64
//     columns (R * 128 B), SBO = 1024 B (8 k-rows); a k16 step advances the start by 16 * 128 B.
// Box bases must be 1024-byte aligned (the swizzle pattern repeats every 1024 B).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <stdint.h>

namespace dualkv::cuda::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- The racecheck build ----
// A consumer warp hands a shared-memory buffer back with one arrival (lane 0, after __syncwarp,
// which orders the warp's reads before lane 0's release: the PTX memory model), so the mbarriers
// consumers release count warps. compute-sanitizer racecheck does not follow that ordering and
// reports the producer's next write as a race. -DDUALKV_SM90_PER_THREAD_RELEASE=1 builds the
// diagnostic library in which every consumer thread arrives (and the barriers count threads):
// racecheck runs on it (docs/hopper.md "Sanitizers"); the default kernels' SASS does not change.
#if defined(DUALKV_SM90_PER_THREAD_RELEASE)
constexpr bool kPerThreadRelease = true;
#else
constexpr bool kPerThreadRelease = false;
#endif
constexpr uint32_t kArrivalsPerWarp = kPerThreadRelease ? 32 : 1;

// ---- mbarrier ----
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// An arrival at a shared-window address (kExpAfterPvWait computes the address from a pinned value).
__device__ __forceinline__ void mbar_arrive_at(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) { mbar_arrive_at(smem_u32(bar)); }
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
                   smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// Blocks until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ----
__device__ __forceinline__ void tma_prefetch_desc(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}
// 3-d tiled load (coordinates innermost first) completing on `bar` with complete_tx bytes.
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, uint64_t* bar, int32_t c0,
                                            int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// 4-d tiled reduce-add of a smem box into global (smem source read by the async proxy; element type,
// dims and swizzle from the map; out-of-bounds box elements are skipped). Completes in a bulk group of
// the issuing thread: cp.async.bulk.commit_group, then wait_group.read before the source is rewritten.
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* smem_src, int32_t c0,
                                                  int32_t c1, int32_t c2, int32_t c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_u32(smem_src)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// 3-d tiled store of a smem box to global (the forward's O epilogue): element type and swizzle from
// the map; box elements past the tensor's bounds are skipped (clipped at the tensor, nothing finer).
// Completes in a bulk group of the issuing thread, like tma_reduce_add_4d.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* map, uint32_t smem_src, int32_t c0, int32_t c1,
                                             int32_t c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(smem_src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
// 4-byte store to smem byte address `addr` (a 32-bit shared-window address: no 64-bit pointer kept).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
// This thread's index in its block, read afresh (volatile: not kept live from an earlier read).
__device__ __forceinline__ uint32_t thread_index_x() {
  uint32_t t;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(t));
  return t;
}
// A zero (%laneid < 32) that NVVM cannot fold, for pinned_after.
__device__ __forceinline__ uint32_t opaque_zero() {
  uint32_t l;
  asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(l));
  return l >> 5;
}
// x, bit for bit, but computed from `dep` as well (x | (dep & zero), zero from opaque_zero()).
// ptxas schedules a block by data dependences and moves independent work across
// wgmma.wait_group and mbarrier arrives in either direction; what uses the result stays below
// whatever produced `dep` (with `dep` a register of an in-flight wgmma: below its wait).
__device__ __forceinline__ uint32_t pinned_after(uint32_t x, uint32_t dep, uint32_t zero) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xF8;\n" : "=r"(r) : "r"(x), "r"(dep), "r"(zero));
  return r;
}
// The float form reads its operands as f32 registers (PTX's .b32 takes any 32-bit register): with
// __float_as_uint on `dep`, a wgmma accumulator, NVVM carried that accumulator as an integer
// through two loops that both pin to it (the D-128 steady loop, fwd_kernel.cuh kSteadyLoop) and
// moved it back before each P V wgmma, where ptxas then serialised the wgmmas (C7511).
__device__ __forceinline__ float pinned_after(float x, float dep, uint32_t zero) {
  float r;
  asm("lop3.b32 %0, %1, %2, %3, 0xF8;\n" : "=f"(r) : "f"(x), "f"(dep), "r"(zero));
  return r;
}
// A branch ptxas never takes and cannot remove: to a cold spin on `never`, a warp-uniform condition
// the kernel's own arithmetic makes false whatever its inputs (so that no plan or layout reaches the
// spin) and that neither NVVM nor ptxas can fold. ptxas moves independent work across
// such a branch both ways, but not a side effect issued before it (an mbarrier arrive stays
// before it), nor what `held` is computed from (the spin reads `held`, so it is computed before the
// branch). Two boundaries need two different `never` conditions: NVVM drops a branch on a condition
// an earlier one already tested. A trap in place of the spin made ptxas serialise the D-256
// forward's wgmmas (C7512), a per-thread condition the D-64 / 128 ones (C7520).
__device__ __forceinline__ void schedule_boundary(bool never, float held = 0.f) {
  if (never) {
    for (;;) asm volatile("nanosleep.u32 %0;\n" ::"r"(__float_as_uint(held)) : "memory");
  }
}
// Makes this thread's generic-proxy writes to smem visible to the async proxy (a TMA store that reads
// them after a barrier).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Until at most N of this thread's bulk groups still read their smem sources.
template <int N>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Until at most N of this thread's bulk groups are incomplete (their global writes done).
template <int N>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- wgmma ----
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across wgmma issue/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Matrix descriptor for a 128B-swizzled operand starting at smem byte address `addr`.
__device__ __forceinline__ uint64_t make_desc_sw128(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((addr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes & 0x3FFFF) >> 4) << 16;
  d |= static_cast<uint64_t>((sbo_bytes & 0x3FFFF) >> 4) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}
// The descriptor of the operand `bytes` further on in shared memory: the start-address field (bits
// 0-13, address >> 4) plus bytes >> 4, which never carries out of it (shared memory < 256 KiB).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// ---- warp specialisation ----
// Whether a kernel of `threads` threads (one producer warpgroup, the rest consumers, launched with
// __launch_bounds__(threads, 1)) can move registers from its producer to its consumers with
// setmaxnreg: the launch gives every thread 65536 / threads registers rounded down to a multiple of 8
// (168 at 384 threads), and setmaxnreg.inc only takes registers that a setmaxnreg.dec returned, so
// 128 x producer + (threads - 128) x consumer must fit in that; past it the consumers wait forever
// (a 32 / 240 split at 384 threads hung the backward: docs/decisions.md, session 19). Counts are
// multiples of 8 in [24, 256] (PTX).
constexpr bool setmaxnreg_split_fits(int threads, int producer_regs, int consumer_regs) {
  const int launch_regs = (65536 / threads) / 8 * 8;
  const bool legal = producer_regs % 8 == 0 && consumer_regs % 8 == 0 && producer_regs >= 24 &&
                     consumer_regs <= 256 && producer_regs <= launch_regs && consumer_regs >= launch_regs;
  return legal && 128 * producer_regs + (threads - 128) * consumer_regs <= launch_regs * threads;
}
static_assert(setmaxnreg_split_fits(384, 40, 232) && setmaxnreg_split_fits(384, 24, 240) &&
                  !setmaxnreg_split_fits(384, 32, 240),
              "the setmaxnreg budget rule");

template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <uint32_t R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
__device__ __forceinline__ void named_bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace dualkv::cuda::sm90
