// How the portable backward stores a [rows][D] tile of Q, K, V or dO in shared memory, and the
// addresses its lanes pass to cp.async and ldmatrix.
//
// Head dims that are powers of two from 64 up (64, 128, 256, 512): rows of exactly D elements (whole
// 128-byte lines), 16-byte chunk c of row r stored at chunk c ^ (r mod 8) of its 128-byte line.
// The eight rows an ldmatrix phase reads then fall in eight different chunks (conflict-free), and
// the eight lanes that copy one 128-byte global segment write one 128-byte line of shared memory:
// one wavefront per copy phase. Rows padded by 16 bytes instead (pitch D + 8, the layout of the
// other portable kernels) are conflict-free for ldmatrix too, but shift each row 16 bytes off the
// lines, so every cp.async phase spans two: at D = 256 the tile loads took 10.5 shared wavefronts
// per instruction for an ideal 4, 12% of the backward kernel's shared-memory wavefronts
// (docs/notes/2026-12-02-portable-d256-bwd.md §2).
// Head dims 96 and 192: padded rows (a warp's share of D is not a power-of-two number of chunks
// there, so a compile-time chunk step would carry into the swizzled bits).
//
// The swizzle acts on bits 4-6 of the absolute shared address, so a swizzled tile must start at a
// multiple of 128 bytes (BwdSmem's tiles do, from a base the kernel rounds up).
#pragma once

#include <stdint.h>

namespace dualkv::cuda::sm80 {

// 16-bit elements (bf16, fp16).
template <int D>
struct SmemTile {
  static constexpr bool kSwizzled = D >= 64 && (D & (D - 1)) == 0;
  static constexpr int kPitch = kSwizzled ? D : D + 8;  // elements per row
  static constexpr uint32_t kRowBytes = kPitch * 2;
  static_assert(!kSwizzled || kRowBytes % 128 == 0, "swizzled rows are whole 128-byte lines");

  // Byte offset of 16-byte chunk `chunk` of row `row` from the tile's start: a lane's base, computed
  // once per kernel.
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
    if constexpr (kSwizzled)
      return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
    else
      return row * kRowBytes + (chunk << 4);
  }

  // The address `rows` rows and `chunks` chunks past `addr` (a tile's start plus an offset()); both
  // steps are constants once the caller's loops are unrolled. Swizzled, a step only XORs bits 4-6
  // and adds whole lines, which holds when the step's low three bits of rows and of chunks share no
  // bit with the lane's own (no carry): steps are multiples of 8 rows, or of a power of two above
  // the lane's row; chunk steps are even next to a lane chunk of 0 / 1, or below the power-of-two
  // number of chunks a lane's column part starts at.
  static __device__ __forceinline__ uint32_t at(uint32_t addr, int rows, int chunks) {
    if constexpr (kSwizzled)
      return (addr ^ (((chunks ^ rows) & 7) << 4)) + rows * kRowBytes + ((chunks >> 3) << 7);
    else
      return addr + rows * kRowBytes + (chunks << 4);
  }
};

}  // namespace dualkv::cuda::sm80
