#!/usr/bin/env python3
"""Writes bwd_wgmma_ops.cuh: the extra wgmma.mma_async shape the sm90 backward needs.

Run from anywhere: python3 src/cuda/sm90/bwd_gen_wgmma.py (the output lands beside this script).
The forward's wrappers (wgmma_ops.cuh, gen_wgmma.py) are left untouched; this adds one form:
  ss_tb: A from shared memory, K-major (descriptor); B from shared memory, N-major (descriptor,
         imm-trans-b = 1)                                        -> dQ = dS K  (K stored [kv][d])
"""
from gen_wgmma import TYPES, write_header

NS = (32, 64, 128)


def ss_tb(n, t):
    r = n // 2
    accs = ", ".join(f"%{i}" for i in range(r))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(r))
    return f'''template <> struct WgmmaTB<{TYPES[t]}, {n}> {{
  // d[{r}] += A(64x16, smem desc, K-major) * B(16x{n}, smem desc, N-major); scale_d == 0 overwrites d.
  static __device__ __forceinline__ void ss(float* d, uint64_t desc_a, uint64_t desc_b, int scale_d) {{
    asm volatile(
        "{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r + 2}, 0;\\n"
        "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{t}.{t} "
        "{{{accs}}}, %{r}, %{r + 1}, p, 1, 1, 0, 1;\\n}}\\n"
        : {cons}
        : "l"(desc_a), "l"(desc_b), "r"(scale_d));
  }}
}};
'''


def main():
    write_header("bwd_wgmma_ops.cuh", "bwd_gen_wgmma.py", 'template <typename T, int N> struct WgmmaTB;',
                 [ss_tb(n, t) for t in TYPES for n in NS])


if __name__ == "__main__":
    main()
