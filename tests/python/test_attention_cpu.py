"""dualkv.attention on the CPU backend vs independent references."""
import functools
import random

import pytest
import torch
import torch.nn.functional as F

import dualkv
from dualkv.reference import attention_ref, position_ids_ref, unpacked_groups, visibility_mask
from conftest import random_forest
from tolerance import assert_low_precision_rule


def rel(a, b):
    """||a - b|| / ||b||; a reference whose RMS is below 0.5 (a gradient that is zero up to rounding,
    e.g. dq and dk of a lone token, whose one visible key has p = 1 and dS = p (dP - delta) = 0) is
    measured against an RMS of 0.5: fp32 cancellation there is an absolute error, not one relative
    to zero. It grows with dP's size (|dO| |v| ~ sqrt(D)) and with the heads summed into one kv head:
    a lone token at D 256 with 4 heads per kv head gives dk at RMS up to 2e-6 (measured over 300 dO
    draws; the floor was 0.1, which failed 1 run in 20 of `make test`), while the other layouts'
    gradient errors stay below 7e-7 at reference RMS 0.3-1.1 (median dq 0.35, dk 0.55)."""
    floor = 0.5 * b.numel() ** 0.5
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor)).item()


def make_qkv(T, H, Hk, D, dtype=torch.float32, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(T, Hk, D, generator=g).to(dtype)
    v = torch.randn(T, Hk, D, generator=g).to(dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def grads_of(fn, inputs, dout, dlse=None):
    for t in inputs:
        t.grad = None
    out, lse = fn(*inputs)
    loss = (out * dout).sum() + ((lse * dlse).sum() if dlse is not None else 0)
    loss.backward()
    return out.detach(), lse.detach(), [t.grad.clone() for t in inputs]


@pytest.mark.parametrize("trial", range(50))
def test_random_forests_match_fp64_reference(trial):
    rng = random.Random(trial)
    lens, parents = random_forest(rng, roots=rng.randint(1, 3), max_depth=rng.randint(1, 3),
                                  max_len=20 if trial % 5 == 0 else 8)
    layout = dualkv.Layout.from_tree(lens, parents)
    Hk = rng.choice([1, 2])
    H = Hk * rng.choice([1, 2, 4, 8])
    D = rng.choice([64, 128, 256, 5, 24])
    q, k, v = make_qkv(layout.num_tokens, H, Hk, D, seed=trial)
    g = torch.Generator().manual_seed(1000 + trial)  # dO and dlse per trial, whatever ran before
    dout = torch.randn(layout.num_tokens, H, D, dtype=torch.float64, generator=g)
    dlse = torch.randn(H, layout.num_tokens, dtype=torch.float64, generator=g) if trial % 2 else None
    out, lse, grads = grads_of(lambda a, b, c: dualkv.attention(a, b, c, layout, return_lse=True), [q, k, v],
                               dout.float(), None if dlse is None else dlse.float())
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rout, rlse, rgrads = grads_of(lambda a, b, c: attention_ref(a, b, c, layout), [q64, k64, v64], dout, dlse)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert rel(out, rout) <= 1e-5
    assert rel(lse, rlse) <= 1e-5
    for name, g, r in zip("qkv", grads, rgrads):
        assert rel(g, r) <= 1e-5, name


def test_mask_and_positions_cross_check(rng):
    for _ in range(30):
        lens, parents = random_forest(rng, roots=3, max_depth=3)
        layout = dualkv.Layout.from_tree(lens, parents)
        assert torch.equal(layout.position_ids, position_ids_ref(layout))
        assert layout.visible_pairs == int(visibility_mask(layout).sum()) == layout.window_pairs(None)
        for window in (1, 3, 8):
            assert layout.window_pairs(window) == int(visibility_mask(layout, window).sum()), window


def test_from_groups_layout():
    layout = dualkv.Layout.from_groups([4, 2], [[3, 1], [5]])
    assert layout.segment_lens == [4, 3, 1, 2, 5]
    assert layout.parents == [-1, 0, 0, -1, 3]
    assert layout.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 0, 1, 2, 3, 4, 5, 6]
    assert layout.max_depth == 2
    assert dualkv.Layout.varlen([3, 2]).position_ids.tolist() == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_equivalence_with_unpacked_causal_attention(seed):
    """Packed [P | R_1..R_N] equals N independent causal sequences P+R_i: every response output,
    and the prompt's dK/dV equal the sum of the N copies' gradients."""
    rng = random.Random(seed)
    prompts = [rng.randint(1, 12) for _ in range(3)]
    responses = [[rng.randint(1, 9) for _ in range(rng.randint(1, 5))] for _ in prompts]
    layout = dualkv.Layout.from_groups(prompts, responses)
    H, Hk, D = 4, 2, 16
    q, k, v = make_qkv(layout.num_tokens, H, Hk, D, dtype=torch.float64, seed=seed)
    out = dualkv.attention(q, k, v, layout)
    # Loss on response tokens only (GRPO trains on responses).
    resp_mask = torch.ones(layout.num_tokens, dtype=torch.bool)
    offsets = [0]
    for n in layout.segment_lens:
        offsets.append(offsets[-1] + n)
    for s, p in enumerate(layout.parents):
        if p < 0:
            resp_mask[offsets[s]:offsets[s + 1]] = False
    w = torch.randn(layout.num_tokens, H, D, dtype=torch.float64)
    (out * w * resp_mask[:, None, None]).sum().backward()

    # Unpacked: gather each prompt+response as its own causal sequence.
    dk_sum = torch.zeros_like(k)
    dv_sum = torch.zeros_like(v)
    dq_sum = torch.zeros_like(q)
    for idx in unpacked_groups(layout):
        qu, ku, vu = [t.detach()[idx].clone().requires_grad_() for t in (q, k, v)]
        ou = F.scaled_dot_product_attention(qu.transpose(0, 1)[None], ku.transpose(0, 1)[None],
                                            vu.transpose(0, 1)[None], is_causal=True,
                                            enable_gqa=True)[0].transpose(0, 1)
        is_resp = resp_mask[idx]
        torch.testing.assert_close(ou[is_resp], out.detach()[idx][is_resp], rtol=1e-12, atol=1e-12)
        (ou * w[idx] * is_resp[:, None, None]).sum().backward()
        dq_sum.index_add_(0, idx, qu.grad)
        dk_sum.index_add_(0, idx, ku.grad)
        dv_sum.index_add_(0, idx, vu.grad)
    torch.testing.assert_close(k.grad, dk_sum, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(v.grad, dv_sum, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(q.grad, dq_sum, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("dtype,seed,D", [(torch.float16, 7, 64)] +
                         [(torch.bfloat16, seed, D) for seed, D in enumerate([64, 128, 64, 128, 80, 24])])
def test_low_precision_tolerance_rule(dtype, seed, D):
    """Kernel error vs fp64 within the low-precision rule (tests/tolerance.py), on
    inputs from seeded generators. bf16 runs the AMX tile kernels where the processor has them: short
    segments and ones longer than a key block (128) and a query tile (256)."""
    rng = random.Random(seed)
    if seed % 2 == 0:
        lens, parents = random_forest(rng, roots=3, max_depth=3, max_len=16)
    else:  # a prompt of 129-300 tokens and 1-3 responses of 1-270
        lens = [rng.randint(129, 300)] + [rng.choice([1, rng.randint(2, 270)]) for _ in range(rng.randint(1, 3))]
        parents = [-1] + [0] * (len(lens) - 1)
    layout = dualkv.Layout.from_tree(lens, parents)
    q, k, v = make_qkv(layout.num_tokens, 8, 2, D, dtype=dtype, seed=3)
    dout = torch.randn(layout.num_tokens, 8, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    out, lse, grads = grads_of(lambda a, b, c: dualkv.attention(a, b, c, layout, return_lse=True), [q, k, v], dout)
    q64, k64, v64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rout, rlse, rgrads = grads_of(lambda a, b, c: attention_ref(a, b, c, layout), [q64, k64, v64], dout.double())
    ql, kl, vl = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lout, llse, lgrads = grads_of(lambda a, b, c: attention_ref(a, b, c, layout), [ql, kl, vl], dout)
    assert out.dtype == dtype
    for name, mine, ref, low in zip(["out", "lse", "dq", "dk", "dv"], [out, lse] + list(grads),
                                    [rout, rlse] + list(rgrads), [lout, llse] + list(lgrads)):
        assert_low_precision_rule(mine, ref, low, name)


def test_strided_inputs_and_fused_qkv():
    layout = dualkv.Layout.from_groups([5], [[3, 4]])
    T, H, Hk, D = layout.num_tokens, 4, 2, 8
    qkv = torch.randn(T, H + 2 * Hk, D, dtype=torch.float64)
    q, k, v = qkv[:, :H], qkv[:, H:H + Hk], qkv[:, H + Hk:]
    out = dualkv.attention(q, k, v, layout)
    ref, _ = attention_ref(q, k, v, layout)
    torch.testing.assert_close(out, ref)
    # heads-major storage: [H, T, D] viewed as [T, H, D]
    qh = torch.randn(H, T, D, dtype=torch.float64).transpose(0, 1)
    torch.testing.assert_close(dualkv.attention(qh, k, v, layout), attention_ref(qh, k, v, layout)[0])


def test_softmax_scale_and_accumulation():
    layout = dualkv.Layout.from_groups([6], [[2, 3]])
    q, k, v = make_qkv(layout.num_tokens, 2, 1, 4, dtype=torch.float64, requires_grad=False)
    out = dualkv.attention(q, k, v, layout, softmax_scale=0.37)
    torch.testing.assert_close(out, attention_ref(q, k, v, layout, softmax_scale=0.37)[0])


def test_gradcheck_fp64():
    layout = dualkv.Layout.from_tree([3, 2, 1, 2], [-1, 0, 1, 0])
    q, k, v = make_qkv(layout.num_tokens, 2, 1, 3, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b, c: dualkv.attention(a, b, c, layout, return_lse=True), (q, k, v))


def test_opcheck():
    layout = dualkv.Layout.from_groups([4, 3], [[2, 3], [1]])
    q, k, v = make_qkv(layout.num_tokens, 4, 2, 8, dtype=torch.float32)
    plan, key = layout.plan_for(q.dtype, 8)
    args = (q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, 0.35, False)
    torch.library.opcheck(torch.ops.dualkv.fwd.default, args)
    out, lse = torch.ops.dualkv.fwd(*args)
    bargs = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
             torch.randn_like(lse), layout.meta, plan, layout.num_segments, layout.max_depth, key, 0.35, False)
    torch.library.opcheck(torch.ops.dualkv.bwd.default, bargs)


def test_torch_compile_fullgraph():
    layout = dualkv.Layout.from_groups([5, 2], [[3, 1], [4]])
    q, k, v = make_qkv(layout.num_tokens, 4, 2, 8)

    def f(q, k, v):
        x = dualkv.attention(q * 2.0, k, v, layout)
        return (x.square()).sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v)
    loss.backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    f(q, k, v).backward()
    torch.testing.assert_close(loss, f(q, k, v))
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)


def test_build_info_and_version():
    info = dualkv.build_info()
    assert "cpu" in info["backends"]
    assert info["abi_version"] == 2


# Runs fp32 and bf16 forward + backward on a layout with partial tiles and blocks and saves inputs,
# outputs and gradients to argv[1]; prints the instruction set in use. With argv[2] == "deny-amx"
# it first installs a seccomp filter that makes arch_prctl(ARCH_REQ_XCOMP_PERM) fail with EPERM,
# as a kernel does that refuses a process the AMX tile state.
_ISA_RUN = """
import ctypes, struct, sys
if sys.argv[2:] == ["deny-amx"]:
    insn = lambda code, jt, jf, k: struct.pack("HBBI", code, jt, jf, k)
    ld, jeq, ret = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
    prog = ctypes.create_string_buffer(b"".join([
        insn(ld, 0, 0, 4), insn(jeq, 0, 5, 0xC000003E),  # seccomp_data.arch == x86-64, else allow
        insn(ld, 0, 0, 0), insn(jeq, 0, 3, 158),          # nr == arch_prctl, else allow
        insn(ld, 0, 0, 16), insn(jeq, 0, 1, 0x1023),      # args[0] == ARCH_REQ_XCOMP_PERM, else allow
        insn(ret, 0, 0, 0x00050001),                      # SECCOMP_RET_ERRNO | EPERM
        insn(ret, 0, 0, 0x7FFF0000)]))                    # SECCOMP_RET_ALLOW
    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    fprog = Fprog(8, ctypes.addressof(prog))
    if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):  # NO_NEW_PRIVS, SECCOMP
        sys.exit(77)
import torch, dualkv
L = dualkv.Layout.from_groups([300], [[130, 1, 257]])
g = torch.Generator().manual_seed(0)
saved = {}
for dtype in (torch.float32, torch.bfloat16):
    q = torch.randn(L.num_tokens, 4, 64, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(L.num_tokens, 2, 64, generator=g).to(dtype).requires_grad_() for _ in range(2))
    dout = torch.randn(L.num_tokens, 4, 64, generator=g).to(dtype)
    out = dualkv.attention(q, k, v, L)
    out.backward(dout)
    saved[dtype] = [t.detach() for t in (q, k, v, dout, out, q.grad, k.grad, v.grad)]
print(dualkv.build_info()["cpu"]["isa"])
torch.save(saved, sys.argv[1])
"""


@functools.lru_cache(maxsize=None)
def _run_isa(isa, *args):
    """Runs _ISA_RUN with DUALKV_CPU_ISA=isa (None: unset): (return code, isa in use, saved results).
    Cached: the tests below share runs (each starts a Python with torch)."""
    import os
    import subprocess
    import sys
    env = dict(os.environ)
    env.pop("DUALKV_CPU_ISA", None)
    if isa:
        env["DUALKV_CPU_ISA"] = isa
    path = f"/tmp/dualkv_isa_{os.getpid()}_{isa}_{len(args)}.pt"
    r = subprocess.run([sys.executable, "-c", _ISA_RUN, path, *args], env=env, capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        return r.returncode, r.stderr[-2000:], None
    saved = torch.load(path)
    os.remove(path)
    return 0, r.stdout.strip(), saved


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []


def test_cpu_instruction_set_can_be_forced_and_agrees():
    """DUALKV_CPU_ISA names the widest instruction set the blocked kernels may use; build_info reports
    the one in use (amx where bfloat16 runs on AMX tiles). fp32 agrees across sets within fp32
    rounding; bf16 meets the tolerance rule against fp64 on every set."""
    import os
    runs = {}
    for isa in ("generic", "avx512", "amx"):
        rc, reported, saved = _run_isa(isa)
        assert rc == 0, reported
        runs[isa] = (reported, saved)
    has_amx = {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(_cpu_flags())
    assert runs["generic"][0] == "generic"
    assert runs["avx512"][0] != "amx"
    assert (runs["amx"][0] == "amx") == has_amx
    if not os.environ.get("DUALKV_CPU_ISA"):  # this process runs the default: the widest set
        assert dualkv.build_info()["cpu"]["isa"] == runs["amx"][0]
    fp32 = [saved[torch.float32] for _, saved in runs.values()]
    for other in fp32[1:]:
        for a, b in zip(other[4:], fp32[0][4:]):
            assert rel(a, b) <= 1e-5
    # bf16: the same inputs in every run (seeded); error vs fp64 within the low-precision rule
    q, k, v, dout = runs["amx"][1][torch.bfloat16][:4]
    layout = dualkv.Layout.from_groups([300], [[130, 1, 257]])
    refs = grads_of(lambda a, b, c: attention_ref(a, b, c, layout),
                    [t.double().requires_grad_() for t in (q, k, v)], dout.double())
    lows = grads_of(lambda a, b, c: attention_ref(a, b, c, layout), [t.clone().requires_grad_() for t in (q, k, v)],
                    dout)
    for isa, (_, saved) in runs.items():
        mine = saved[torch.bfloat16][4:]
        for m, r, low in zip(mine, [refs[0]] + refs[2], [lows[0]] + lows[2]):
            assert_low_precision_rule(m, r, low, isa)


def test_bf16_falls_back_when_linux_refuses_amx():
    """A kernel that refuses the AMX tile state (arch_prctl fails): bf16 runs the widest fp32 set, bit
    for bit what DUALKV_CPU_ISA=avx512 runs; nothing crashes."""
    import platform
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        pytest.skip("arch_prctl and the seccomp filter are Linux x86-64")
    rc, reported, denied = _run_isa(None, "deny-amx")
    if rc == 77:
        pytest.skip("seccomp filters are not permitted here")
    assert rc == 0, reported
    assert reported != "amx"
    rc, reported_avx512, avx512 = _run_isa("avx512")
    assert rc == 0 and reported == reported_avx512
    for a, b in zip(denied[torch.bfloat16][4:], avx512[torch.bfloat16][4:]):
        assert torch.equal(a, b)
