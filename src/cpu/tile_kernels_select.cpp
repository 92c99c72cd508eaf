// Picks the tile kernels for this processor (see tile_kernels.h).
#include <cstdlib>
#include <cstring>

#include "cpu/tile_kernels.h"

namespace dualkv::detail::cpu {

// Instruction sets not built on this platform (sources.cmake builds the x86 ones on x86-64 only).
#if !defined(DUALKV_CPU_HAVE_X86_ISAS)
const TileKernels* tile_kernels_avx2() { return nullptr; }
const TileKernels* tile_kernels_avx512() { return nullptr; }
#endif

namespace {

bool cpu_runs(const char* isa) {
#if defined(DUALKV_CPU_HAVE_X86_ISAS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx2") == 0) return avx2;
  if (std::strcmp(isa, "avx512") == 0)
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
#endif
  return std::strcmp(isa, "generic") == 0;
}

const TileKernels& choose() {
  const TileKernels* candidates[] = {tile_kernels_avx512(), tile_kernels_avx2(), tile_kernels_generic()};
  const char* wanted = std::getenv("DUALKV_CPU_ISA");
  for (const TileKernels* k : candidates) {
    if (!k || !cpu_runs(k->isa)) continue;
    if (!wanted || !*wanted || std::strcmp(wanted, k->isa) == 0) return *k;
  }
  return *tile_kernels_generic();  // DUALKV_CPU_ISA named a set this processor or build lacks
}

}  // namespace

const TileKernels& tile_kernels() {
  static const TileKernels& chosen = choose();
  return chosen;
}

}  // namespace dualkv::detail::cpu
