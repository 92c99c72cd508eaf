// The KV ranges a forward query tile sees, shared by the portable (sm80) and Hopper (sm90)
// forward kernels: every proper ancestor of the tile's segment in full, nearest first, then the
// segment itself up to the tile's last query.
#pragma once

#include <stdint.h>

#include "kernel_params.h"

namespace dualkv::cuda {

// Walks the KV ranges a query tile of segment `seg` (queries [q0, q1)) sees: ancestors from the
// parent up to the root, then the segment itself up to q1, in tiles of BN tokens.
template <int BN>
struct KvWalker {
  int32_t seg;      // query segment
  int32_t cur;      // segment of the current KV range
  int32_t pos;      // first token of the current KV tile
  int32_t end;      // end of the current KV range (exclusive)
  int32_t own_end;  // q1
  bool own;         // current range is the query segment itself

  __device__ __forceinline__ void init(const LayoutPtrs& L, int32_t s, int32_t q1) {
    seg = s;
    own_end = q1;
    const int32_t a = L.parent[s];
    if (a >= 0) {
      cur = a; pos = L.offsets[a]; end = L.offsets[a + 1]; own = false;
    } else {
      cur = s; pos = L.offsets[s]; end = q1; own = true;
    }
  }
  __device__ __forceinline__ int32_t len() const { return min(BN, end - pos); }
  // Advances; returns false when every range is done.
  __device__ __forceinline__ bool next(const LayoutPtrs& L) {
    pos += BN;
    if (pos < end) return true;
    if (own) return false;
    const int32_t a = L.parent[cur];
    if (a >= 0) {
      cur = a; pos = L.offsets[a]; end = L.offsets[a + 1];
    } else {
      cur = seg; pos = L.offsets[seg]; end = own_end; own = true;
    }
    return true;
  }
};

}  // namespace dualkv::cuda
