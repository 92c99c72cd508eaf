// Device helpers of the portable (sm80+) kernels: cp.async, ldmatrix, mma.sync m16n8k16, tile
// loaders.
//
// Fragment layouts of mma.m16n8k16 (g = lane / 4, t = lane % 4):
//   A (16x16, 4 regs of 2 halves): a0 (row g, cols 2t..2t+1), a1 (row g+8, cols 2t..),
//                                  a2 (row g, cols 2t+8..), a3 (row g+8, cols 2t+8..)
//   B (16x8 k x n, 2 regs):        b0 (k 2t..2t+1, col g), b1 (k 2t+8.., col g)
//   C (16x8, 4 floats):            c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same cols)
// Two adjacent C tiles (cols 0-7, 8-15) of a row block therefore form one A fragment
// (a0 = C0.c01, a1 = C0.c23, a2 = C1.c01, a3 = C1.c23), which is how P and dS feed the next mma
// straight from registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "convert.cuh"
#include "dualkv/mask.h"
#include "sm80/smem_tile.cuh"

namespace dualkv::cuda::sm80 {

// Element type T's mma.sync m16n8k16 (fp32 accumulators) and its fp32 pair conversions.
template <typename T> struct TypeOps;
template <> struct TypeOps<__nv_bfloat16> : Convert<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <> struct TypeOps<__half> : Convert<__half> {
  static __device__ __forceinline__ void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// A value in shared memory re-read at its point of use (volatile: the compiler may not keep it in
// registers from an earlier read), for CTA-uniform state written by one thread.
template <typename U>
__device__ __forceinline__ U load_shared_volatile(const U& x) {
  return *reinterpret_cast<const volatile U*>(&x);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared at a 32-bit shared-memory address (SmemTile's); bytes = 16, or 0
// to zero-fill the destination.
__device__ __forceinline__ void cp_async16_s(uint32_t saddr, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(gmem), "r"(bytes));
}
// The same at a generic pointer into shared memory, zero-filling when !valid. Its own asm: written
// as a call of cp_async16_s it reorders the deterministic dQ kernel's PTX (the byte-count selects).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// ldmatrix from 32-bit shared-memory addresses (SmemTile's swizzled or padded rows).
__device__ __forceinline__ void ldsm_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The same at generic pointers into shared memory.
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, const void* smem) { ldsm_x4(r, smem_addr(smem)); }
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, const void* smem) { ldsm_x4_trans(r, smem_addr(smem)); }

// Address a lane passes to ldmatrix_x4 for a 16x16 A fragment at (row0, col0) of a row-major
// smem tile with `pitch` elements per row.
template <typename T>
__device__ __forceinline__ const T* a_frag_addr(const T* base, int pitch, int row0, int col0, int lane) {
  return base + (row0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch + col0 + (lane >> 4) * 8;
}
// B fragments (two n8 blocks x k16) from a smem tile stored [n][k] row-major (e.g. K for Q K^T):
// regs 0,1 -> n-block 0, regs 2,3 -> n-block 1. Use with ldmatrix_x4 (non-trans).
template <typename T>
__device__ __forceinline__ const T* bnk_frag_addr(const T* base, int pitch, int n0, int k0, int lane) {
  return base + (n0 + (lane & 7) + (lane >> 4) * 8) * pitch + k0 + ((lane >> 3) & 1) * 8;
}
// B fragments (k16 x two n8 blocks) from a smem tile stored [k][n] row-major (e.g. V for P V):
// regs 0,1 -> n-block 0, regs 2,3 -> n-block 1. Use with ldmatrix_x4_trans.
template <typename T>
__device__ __forceinline__ const T* bkn_frag_addr(const T* base, int pitch, int k0, int n0, int lane) {
  return base + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * pitch + n0 + (lane >> 4) * 8;
}
// A fragment (rows m, cols k) from a smem tile stored transposed, [k][m] row-major. Use with
// ldmatrix_x4_trans.
template <typename T>
__device__ __forceinline__ const T* at_frag_addr(const T* base, int pitch, int m0, int k0, int lane) {
  return base + (k0 + (lane & 7) + (lane >> 4) * 8) * pitch + m0 + ((lane >> 3) & 1) * 8;
}

// acc[MI][D/8] += A · B for one warp: A is MI row blocks of 16 x BN columns held in fp32
// accumulator fragments (rounded to T here), B a [BN][D] smem tile stored [k][n] with `pitch`.
// The forward's O += P·V and the deterministic dQ kernel's dQ += dS·K are this product.
template <typename T, int MI, int BN, int D>
__device__ __forceinline__ void mma_frags_times_smem(float (&acc)[MI][D / 8][4], const float (&a_frags)[MI][BN / 8][4],
                                                     const T* b_smem, int pitch, int lane) {
  using Ops = TypeOps<T>;
#pragma unroll
  for (int kk = 0; kk < BN / 16; ++kk) {
    uint32_t a[MI][4];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      a[mi][0] = Ops::pack(a_frags[mi][2 * kk][0], a_frags[mi][2 * kk][1]);
      a[mi][1] = Ops::pack(a_frags[mi][2 * kk][2], a_frags[mi][2 * kk][3]);
      a[mi][2] = Ops::pack(a_frags[mi][2 * kk + 1][0], a_frags[mi][2 * kk + 1][1]);
      a[mi][3] = Ops::pack(a_frags[mi][2 * kk + 1][2], a_frags[mi][2 * kk + 1][3]);
    }
#pragma unroll
    for (int nd = 0; nd < D / 16; ++nd) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, bkn_frag_addr(b_smem, pitch, kk * 16, nd * 16, lane));
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        Ops::mma(acc[mi][2 * nd], a[mi], b[0], b[1]);
        Ops::mma(acc[mi][2 * nd + 1], a[mi], b[2], b[3]);
      }
    }
  }
}

// The D split (config.h kDSplit > 1) of the forward and the deterministic dQ kernel, where a warp
// pair sums its partial products: kAdd false stores a warp's partial accumulator fragments
// frags[MI][NB][4] (one or more arrays, S and dP in the dQ kernel) to its slots of shared memory,
// slot k for array k, each as [fragment register][lane] (conflict-free); kAdd true adds the
// partner's slots into the warp's arrays. The arrays go element by element together, as the
// kernels had them inline (array by array changed the dQ kernel's machine code).
template <bool kAdd, int MI, int NB, typename... Frags>
__device__ __forceinline__ void exchange_split_partial(float (*slots)[MI * NB * 4][32], int lane, Frags&... frags) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int j = 0; j < NB; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        int k = 0;
        if constexpr (kAdd)
          ((frags[mi][j][e] += slots[k++][(mi * NB + j) * 4 + e][lane]), ...);
        else
          ((slots[k++][(mi * NB + j) * 4 + e][lane] = frags[mi][j][e]), ...);
      }
}

// How NT threads copy a [rows][D] tile in 16-byte chunks with compile-time trip counts: thread tid
// owns chunk column tid % kThreadsPerRow of every column block, in rows tid / kThreadsPerRow + p
// kRowsPerPass. A row is one block when the threads split it evenly into D / 8 chunks, else blocks
// of 64 (or 32) columns (head dims 96 and 192).
template <int D, int NT>
struct ChunkMap {
  static constexpr int kBlockCols = NT % (D / 8) == 0 ? D : (D % 64 == 0 ? 64 : 32);
  static constexpr int kBlocks = D / kBlockCols;
  static constexpr int kThreadsPerRow = kBlockCols / 8;
  static constexpr int kRowsPerPass = NT / kThreadsPerRow;
  static_assert(D % kBlockCols == 0 && NT % kThreadsPerRow == 0, "whole rows of chunks per pass");
  // SmemTile::at steps a thread's chunk by kRowsPerPass rows and kBlockCols columns without a carry
  // into its own row / chunk bits: both are powers of two above the thread's first row / chunk.
  static_assert((kRowsPerPass & (kRowsPerPass - 1)) == 0 && (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                "pass rows and row threads are powers of two");
};

// Loads rows [0, rows) of a [rows_max, D] tile from global (token-major, token stride in
// elements) into smem in layout Tile (SmemTile); rows >= valid_rows are zero-filled. All threads
// participate.
template <int D, int ROWS, typename Tile, int NT, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t token_stride,
                                                int valid_rows, int tid) {
  constexpr int kChunksPerRow = D / 8;
  constexpr int kChunks = ROWS * kChunksPerRow;
#pragma unroll
  for (int i = tid; i < kChunks; i += NT) {
    const int row = i / kChunksPerRow;
    const int c = i % kChunksPerRow;
    const bool valid = row < valid_rows;
    const T* src = valid ? gmem + static_cast<int64_t>(row) * token_stride + c * 8 : gmem;
    cp_async16(smem + Tile::index(row, c * 8), src, valid);
  }
}

// dst[0..3] += v in fp32 global memory (dst 16-byte aligned): the portable backward's dQ accumulation,
// a lane's four values of one accumulator row in a 16-column group (columns 2t, 2t + 1, 8 + 2t,
// 9 + 2t of the two n8 blocks), contiguous in the accumulator's quad order (bwd_prepost.cuh).
// sm_90+: one 16-byte vector atomic (red.global.add.v4.f32) read straight from the
// accumulator registers, half the instructions of the 8-byte pairs it replaced (those had replaced
// 16-byte atomics fed by a lane-pair shuffle, a serial register chain that was 21% of the stall
// samples; docs/cuda.md "dQ atomics"). Earlier archs: four scalar atomics.
__device__ __forceinline__ void atomic_add_quad(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(a, b, c, d));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

// SegmentMask::fwd_visible_cols of the C-fragment rows a thread holds in MI 16-row blocks from query
// first_row (rows first_row + 16 mi + g and + 8): the forward mask of the forward and dQ kernels.
template <int MI>
__device__ __forceinline__ void fwd_visible_cols_of_rows(int32_t (&cols)[MI][2], int32_t kpos, int32_t krem, bool own,
                                                         int32_t first_row, int g) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int r = 0; r < 2; ++r) cols[mi][r] = SegmentMask::fwd_visible_cols(kpos, krem, own, first_row + mi * 16 + g + r * 8);
}

__device__ __forceinline__ float warp_max4(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return v;
}
__device__ __forceinline__ float warp_sum4(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}

}  // namespace dualkv::cuda::sm80
