// Picks the tile kernels for this processor (see tile_kernels.h).
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/tile_kernels.h"
#include "dualkv/dualkv.h"

namespace dualkv::detail::cpu {

// Instruction sets not built on this platform (sources.cmake builds the x86 ones on x86-64 only,
// amx with compilers that have its intrinsics).
#if !defined(DUALKV_CPU_HAVE_X86_ISAS)
const TileKernels* tile_kernels_avx2() { return nullptr; }
const TileKernels* tile_kernels_avx512() { return nullptr; }
#endif
#if !defined(DUALKV_CPU_HAVE_AMX)
const TileKernels* tile_kernels_amx() { return nullptr; }
#endif

namespace {

// Linux gives a process the AMX tile registers (8 KiB more state per thread to save on every
// context switch) only when it asks for them; the request holds for all its threads. It fails on
// kernels before 5.16, without AMX support, or when a thread's signal stack is too small for the
// larger state.
bool amx_permitted() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

bool cpu_runs(const char* isa) {
#if defined(DUALKV_CPU_HAVE_X86_ISAS)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  if (std::strcmp(isa, "avx2") == 0) return avx2;
  if (std::strcmp(isa, "avx512") == 0) return avx512;
  if (std::strcmp(isa, "amx") == 0)
    return avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-tile") &&
           __builtin_cpu_supports("amx-bf16") && amx_permitted();
#endif
  return std::strcmp(isa, "generic") == 0;
}

// The kernels for bfloat16 inputs, and for every other dtype (amx has no fp32 kernels).
struct Choice {
  const TileKernels *bf16, *other;
};

Choice choose() {
  const TileKernels* widest_first[] = {tile_kernels_amx(), tile_kernels_avx512(), tile_kernels_avx2(),
                                       tile_kernels_generic()};
  const char* wanted = std::getenv("DUALKV_CPU_ISA");
  bool allowed = !wanted || !*wanted;  // DUALKV_CPU_ISA names the widest set allowed
  Choice c{nullptr, nullptr};
  for (const TileKernels* k : widest_first) {
    if (!k) continue;
    allowed = allowed || std::strcmp(wanted, k->isa) == 0;
    if (!allowed || !cpu_runs(k->isa)) continue;
    if (!c.bf16) c.bf16 = k;
    if (!c.other && k->operand_dtype == DUALKV_DTYPE_FLOAT32) c.other = k;
  }
  if (!c.other) c = {tile_kernels_generic(), tile_kernels_generic()};  // DUALKV_CPU_ISA named no set built
  return c;
}

}  // namespace

const TileKernels& tile_kernels(int32_t dtype) {
  static const Choice chosen = choose();
  return dtype == DUALKV_DTYPE_BFLOAT16 ? *chosen.bf16 : *chosen.other;
}

}  // namespace dualkv::detail::cpu
