// How the portable kernels store a [rows][D] tile of Q, K, V or dO in shared memory, and the
// addresses their lanes pass to cp.async and ldmatrix. Which kernel uses which layout at which head
// dim is the tile-size table's rule (tile_size.h sm80_swizzled_rows), with its measurements.
//
// Swizzled: rows of exactly D elements (whole 128-byte lines; D a power of two from 64 up), 16-byte
// chunk c of row r stored at chunk c ^ (r mod 8) of its 128-byte line. The eight rows an ldmatrix
// phase reads then fall in eight different chunks (conflict-free), and the eight lanes that copy
// one 128-byte global segment write one 128-byte line of shared memory: one wavefront per copy
// phase. Padded: pitch D + 8 elements, conflict-free for ldmatrix too, but each row sits 16 bytes
// further off the lines, so a cp.async phase spans two: at D = 256 the backward's tile loads took
// 10.5 shared wavefronts per instruction for an ideal 4, 12% of the kernel's shared-memory
// wavefronts (docs/notes/2026-12-02-portable-d256-bwd.md §2). Head dims 96 and 192 are padded (a
// warp's share of D is not a power-of-two number of chunks there, so a compile-time chunk step
// would carry into the swizzled bits).
//
// The swizzle acts on bits 4-6 of a byte offset from the start of the kernel's dynamic shared
// memory, where every swizzled tile starts at a multiple of 128 bytes; the kernels declare that
// memory __align__(128), so the offsets' 128-byte lines are the hardware's (ldmatrix would be
// conflict-free at any 16-byte alignment; the one-line cp.async phases need this one).
#pragma once

#include <stdint.h>

namespace dualkv::cuda::sm80 {

// 16-bit elements (bf16, fp16); kSwizzle from the tile-size table (tile_size.h sm80_swizzled_rows).
template <int D, bool kSwizzle>
struct SmemTile {
  static constexpr bool kSwizzled = kSwizzle;
  static_assert(!kSwizzled || (D >= 64 && (D & (D - 1)) == 0), "swizzled rows need a power-of-two D from 64 up");
  static constexpr int kPitch = kSwizzled ? D : D + 8;  // elements per row
  static constexpr int kRowBytes = kPitch * 2;
  static_assert(!kSwizzled || kRowBytes % 128 == 0, "swizzled rows are whole 128-byte lines");

  // Element index of (row, col) from the tile's start (col a multiple of 8), for loaders that
  // address the tile through a pointer.
  static __device__ __forceinline__ int index(int row, int col) {
    if constexpr (kSwizzled)
      return row * kPitch + ((((col >> 3) ^ (row & 7)) << 3) | (col & 7));
    else
      return row * kPitch + col;
  }

  // Byte offset of 16-byte chunk `chunk` of row `row` from the tile's start: a lane's base, computed
  // once per kernel.
  static __device__ __forceinline__ uint32_t offset(int row, int chunk) {
    // Padded: the element arithmetic the kernels had before SmemTile. The backward's D = 64 128-row
    // kernels sit at 255 registers, and byte-unit or unsigned forms of the same sum spill 16-24
    // bytes there (nvcc 13.0).
    if constexpr (kSwizzled)
      return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
    else
      return static_cast<uint32_t>((row * kPitch + chunk * 8) * 2);
  }

  // The offset `rows` rows and `chunks` chunks past `ofs` (an offset(), plus multiples of 128 bytes);
  // both steps are constants once the caller's loops are unrolled. Swizzled, a step only XORs bits 4-6
  // and adds whole lines, which holds when the step's low three bits of rows and of chunks share no
  // bit with the lane's own (no carry): steps are multiples of 8 rows, or of a power of two above
  // the lane's row; chunk steps are even next to a lane chunk of 0 / 1, or below the power-of-two
  // number of chunks a lane's column part starts at.
  static __device__ __forceinline__ uint32_t at(uint32_t ofs, int rows, int chunks) {
    if constexpr (kSwizzled)
      return (ofs ^ static_cast<uint32_t>(((chunks ^ rows) & 7) << 4)) +
             static_cast<uint32_t>(rows * kRowBytes + ((chunks >> 3) << 7));
    else
      return ofs + static_cast<uint32_t>((rows * kPitch + chunks * 8) * 2);
  }
};

}  // namespace dualkv::cuda::sm80
