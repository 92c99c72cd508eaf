"""External prefix segments on the CUDA backend (issue 17): keys and values of some roots come from
the prefix buffers (prefix_k / prefix_v) and the prefix rows' gradients are added into the caller's
prefix_dk / prefix_dv.

Each case is a random forest whose roots with children are, at random, turned external
(tests/python/test_prefix_attention.py's construction: shuffled prefix order, an unused prefix whose
rows must get no gradient). The prefixed call is checked against
  * the float64 dense reference of the same forest with the prefixes' rows as ordinary root tokens
    (the flat forest; its loss counts only the local tokens, which are the prefixed call's queries),
    under the GPU tests' tolerance rule (test_cuda_attention.py: max error <= 2 x PyTorch's own
    low-precision error + 1e-5), and
  * the flat forest through dualkv on the same device (the same rule, against the same reference);
on the default path (the Hopper kernels on an H200 where built) and the portable one
(DUALKV_DISABLE_SM90=1, DUALKV_DISABLE_SM90_BWD=1), bf16 and fp16, every built head dim, both
backward modes. Then: accumulation onto non-zero prefix gradients, split prefix items
(DUALKV_CUDA_SPLIT_ROWS=64), deterministic mode bitwise run to run, a group's responses in three
calls sharing the prompt's prefix against one call, and which kernels ran.
"""
from __future__ import annotations

import random
import re

import pytest
import torch

import cases  # tests/gpu/cases.py
from cases import PATHS, built_head_dims, use_path
from cases import tile_edge_length as seg_len
from tolerance import assert_low_precision_rule

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    import dualkv
    from dualkv import _native

DTYPES = [torch.bfloat16, torch.float16]


class Case:
    """A flat forest and the same forest with some roots external.

    flat: the flat layout (CPU); prefixed: the prefixed layout (CPU); local: flat token of every
    prefixed token; rows: flat token of every prefix row (-1: a row of the unused prefix 0)."""

    def __init__(self, rng: random.Random, max_tokens: int = 1400, min_external: int = 1):
        while True:
            lens, parents = cases.random_forest(rng, seg_len, max_tokens)
            S = len(lens)
            roots = [s for s in range(S) if parents[s] == -1 and s + 1 < S and parents[s + 1] == s]
            if len(roots) >= min_external:
                break
        external = [s for s in roots if rng.random() < 0.7] or roots[:1]
        order = list(range(1, len(external) + 1))
        rng.shuffle(order)
        prefix_lens = [rng.randint(1, 70)] + [0] * len(external)
        seg_prefix = [-1] * S
        for s, e in zip(external, order):
            seg_prefix[s] = e
            prefix_lens[e] = lens[s]
        self.flat = dualkv.Layout.from_tree(lens, parents)
        self.prefixed = dualkv.Layout.from_tree([0 if seg_prefix[s] >= 0 else n for s, n in enumerate(lens)],
                                                parents, seg_prefix, prefix_lens)
        starts = [0]
        for n in lens:
            starts.append(starts[-1] + n)
        pstarts = [0]
        for n in prefix_lens:
            pstarts.append(pstarts[-1] + n)
        self.local = torch.tensor([t for s in range(S) if seg_prefix[s] < 0 for t in range(starts[s], starts[s + 1])])
        rows = [-1] * pstarts[-1]
        for s in external:
            for j in range(lens[s]):
                rows[pstarts[seg_prefix[s]] + j] = starts[s] + j
        self.rows = torch.tensor(rows)
        self.used = self.rows >= 0
        self.desc = f"lens={lens} parents={parents} seg_prefix={seg_prefix} prefix_lens={prefix_lens}"


def flat_inputs(case: Case, H: int, Hk: int, D: int, dtype, seed: int):
    """q, k, v, dout of the flat forest (dout zero on the prefix tokens: they are no queries of the
    prefixed call) and the unused prefix's own keys and values."""
    q, k, v, dout = cases.make_inputs(case.flat, H, Hk, D, dtype, seed)
    keep = torch.zeros(case.flat.num_tokens, dtype=torch.bool)
    keep[case.local] = True
    dout = dout * keep.to(dout.device)[:, None, None].to(dtype)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    n_unused = int((~case.used).sum())
    unused_kv = [torch.randn(n_unused, Hk, D, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    return q, k, v, dout, unused_kv


def prefixed_inputs(case: Case, q, k, v, unused_kv):
    """The prefixed call's q, k, v and prefix buffers (prefix rows copied from the flat tokens)."""
    local = case.local.to(q.device)
    rows = case.rows.clamp(min=0).to(q.device)
    used = case.used.to(q.device)
    pk, pv = k[rows].clone(), v[rows].clone()
    pk[~used], pv[~used] = unused_kv[0], unused_kv[1]
    return q[local], k[local], v[local], pk, pv


def prefixed_grads(case: Case, layout, q, k, v, pk, pv, dout, deterministic=False, init=None):
    """[out, lse, dq, dk, dv, dpk, dpv] of the prefixed call for the loss sum(out * dout); `init`:
    values the prefix gradients start from (the library adds into them)."""
    qq, kk, vv, ppk, ppv = (t.clone().requires_grad_(True) for t in (q, k, v, pk, pv))
    if init is not None:
        from dualkv import ops
        start = iter(init)
        orig = ops._prefix_grad
        ops._prefix_grad = lambda prefix, like: next(start).clone()
    try:
        out, lse = dualkv.attention(qq, kk, vv, layout, prefix_k=ppk, prefix_v=ppv, deterministic=deterministic,
                                    return_lse=True)
        (out.float() * dout.float()).sum().backward()
    finally:
        if init is not None:
            ops._prefix_grad = orig
    torch.cuda.synchronize()
    return [out, lse, qq.grad, kk.grad, vv.grad, ppk.grad, ppv.grad]


def check_case(case: Case, got, flat_got, ref64, refpt, extra: str, slack: float = 0.0):
    """The prefixed call's outputs (and the flat dualkv call's, if given) against the flat references,
    mapped to the prefixed call: local tokens, prefix rows; the unused prefix untouched."""
    local, rows, used = (t.to(ref64[0].device) for t in (case.local, case.rows, case.used))

    def pick(vals):  # flat [out, lse, dq, dk, dv] -> the prefixed call's [out, lse, dq, dk, dv, dpk, dpv]
        out, lse, dq, dk, dv = vals
        return [out[local], lse[:, local], dq[local], dk[local], dv[local], dk[rows[used]], dv[rows[used]]]

    r64, rpt = pick(ref64), pick(refpt)
    names = ("out", "lse", "dq", "dk", "dv", "prefix_dk", "prefix_dv")
    mine = list(got[:5]) + [got[5][used], got[6][used]]
    for name, x, a, b in zip(names, mine, r64, rpt):
        assert_low_precision_rule(x, a, b, f"{name} {extra}", slack if name.startswith("prefix") else 0.0)
    if flat_got is not None:
        for name, x, a, b in zip(names, pick(flat_got), r64, rpt):
            assert_low_precision_rule(x, a, b, f"flat {name} {extra}")


def references(case: Case, q, k, v, dout, dtype):
    ref64 = cases.ref_grads(q.double(), k.double(), v.double(), dout.double(), case.flat, torch.float64)
    refpt = cases.ref_grads(q, k, v, dout, case.flat, dtype)
    return ref64, refpt


def random_cases():
    rng = random.Random(17)
    out = []
    for i in range(24):
        D = built_head_dims()[i % len(built_head_dims())]
        H, Hk = rng.choice([(4, 4), (4, 1), (8, 2)])
        out.append(pytest.param(i, D, H, Hk, DTYPES[i % 2], id=f"c{i}-D{D}-H{H}-Hk{Hk}-{DTYPES[i % 2]}"))
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("i,D,H,Hk,dtype", random_cases())
def test_prefixed_equals_flat_forest(i, D, H, Hk, dtype, path, monkeypatch):
    use_path(monkeypatch, path)
    case = Case(random.Random(1000 + i))
    prefixed, flat = case.prefixed.to("cuda"), case.flat.to("cuda")
    q, k, v, dout, unused = flat_inputs(case, H, Hk, D, dtype, seed=i)
    ref64, refpt = references(case, q, k, v, dout, dtype)
    flat_got = cases.kernel_grads(q, k, v, dout, flat)
    lq, lk, lv, pk, pv = prefixed_inputs(case, q, k, v, unused)
    local = case.local.cuda()
    for det in (False, True):
        got = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dout[local], deterministic=det)
        extra = f"({path}, deterministic={det}, {case.desc})"
        check_case(case, got, flat_got if not det else None, ref64, refpt, extra)
        used = case.used.cuda()
        assert not got[5][~used].any() and not got[6][~used].any(), f"unused prefix got a gradient {extra}"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", built_head_dims())
def test_prefix_gradients_accumulate_into_the_callers_buffers(D, dtype, path, monkeypatch):
    """prefix_dk / prefix_dv start non-zero: the result is the start plus the gradient (rounded once,
    so within one unit in the last place of the sum of the zero-start bound). The unused prefix's
    rows keep their start values exactly."""
    use_path(monkeypatch, path)
    case = Case(random.Random(77 + D), min_external=1)
    prefixed = case.prefixed.to("cuda")
    q, k, v, dout, unused = flat_inputs(case, 8, 2, D, dtype, seed=5)
    ref64, refpt = references(case, q, k, v, dout, dtype)
    lq, lk, lv, pk, pv = prefixed_inputs(case, q, k, v, unused)
    g = torch.Generator(device="cuda").manual_seed(9)
    init = [torch.randn(pk.shape, device="cuda", dtype=dtype, generator=g) for _ in range(2)]
    for det in (False, True):
        got = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dout[case.local.cuda()], det, init=init)
        used = case.used.cuda()
        for j in (5, 6):
            assert torch.equal(got[j][~used], init[j - 5][~used]), "the unused prefix's rows changed"
        ulp = torch.finfo(dtype).eps * max(got[5].abs().max().item(), got[6].abs().max().item())
        got = got[:5] + [got[5].double() - init[0].double(), got[6].double() - init[1].double()]
        check_case(case, got, None, ref64, refpt, f"({path}, deterministic={det}, accumulate, {case.desc})", ulp)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_split_prefix_items(deterministic, path, monkeypatch):
    """64-row splits: prefix tiles seen by long subtrees are cut into items whose fp32 partials the
    reduction adds into the prefix gradients (the plan is built with the variable set)."""
    use_path(monkeypatch, path)
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "64")
    for i in range(4):
        case = Case(random.Random(300 + i))
        D = built_head_dims()[i % len(built_head_dims())]
        prefixed = case.prefixed.to("cuda")  # the plan reads DUALKV_CUDA_SPLIT_ROWS here
        q, k, v, dout, unused = flat_inputs(case, 4, 2, D, torch.bfloat16, seed=i)
        ref64, refpt = references(case, q, k, v, dout, torch.bfloat16)
        lq, lk, lv, pk, pv = prefixed_inputs(case, q, k, v, unused)
        got = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dout[case.local.cuda()], deterministic)
        check_case(case, got, None, ref64, refpt, f"({path}, split 64, deterministic={deterministic}, {case.desc})")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("D", built_head_dims())
def test_deterministic_bitwise(D, path, monkeypatch):
    use_path(monkeypatch, path)
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "128")  # splits too: the reduction's fixed order
    case = Case(random.Random(4242 + D), max_tokens=3000)
    prefixed = case.prefixed.to("cuda")
    q, k, v, dout, unused = flat_inputs(case, 8, 2, D, torch.bfloat16, seed=3)
    lq, lk, lv, pk, pv = prefixed_inputs(case, q, k, v, unused)
    dl = dout[case.local.cuda()]
    first = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dl, deterministic=True)
    for _ in range(3):
        again = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dl, deterministic=True)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "prefix_dk", "prefix_dv"), first, again):
            assert torch.equal(a, b), f"{name} differs run to run ({path}, {case.desc})"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("D", built_head_dims())
def test_responses_split_over_three_calls_equal_one_call(D, path, monkeypatch):
    """One group's prompt in the prefix buffers and its responses in three calls (uneven, one alone)
    against one call over all of them: outputs and the responses' gradients the same bits
    (deterministic mode: each response's tiles do the same work in either call), the prompt's
    gradients summed over the calls by autograd within the tolerance rule of the one call's."""
    use_path(monkeypatch, path)
    P, R, H, Hk, dtype = 300, [130, 1, 64, 200, 77], 8, 2, torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(D)
    T = sum(R)
    q = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(T, Hk, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    pk, pv = (torch.randn(P, Hk, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    dout = torch.randn(T, H, D, device="cuda", dtype=dtype, generator=g)

    def run(parts):
        ppk, ppv = pk.clone().requires_grad_(), pv.clone().requires_grad_()
        outs, dqs, start = [], [], 0
        for part in parts:
            n = sum(part)
            layout = dualkv.Layout.from_tree([0] + part, [-1] + [0] * len(part), [0] + [-1] * len(part),
                                             [P]).to("cuda")
            lq, lk, lv = (t[start:start + n].clone().requires_grad_() for t in (q, k, v))
            out = dualkv.attention(lq, lk, lv, layout, prefix_k=ppk, prefix_v=ppv, deterministic=True)
            (out.float() * dout[start:start + n].float()).sum().backward()
            outs.append(out.detach())
            dqs += [lq.grad, lk.grad, lv.grad]
            start += n
        torch.cuda.synchronize()
        return torch.cat(outs), dqs, ppk.grad, ppv.grad

    out1, g1, dpk1, dpv1 = run([R])
    out3, g3, dpk3, dpv3 = run([R[:2], R[2:3], R[3:]])
    assert torch.equal(out1, out3)
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        assert torch.equal(g1[i], torch.cat([g3[3 * c + i] for c in range(3)])), name
    # The prompt's gradient of one call: a flat group (prompt tokens as a root with dout 0) through
    # the float64 reference and PyTorch's own bf16 math; the three calls' sum under the same rule.
    flat = dualkv.Layout.from_tree([P] + R, [-1] + [0] * len(R))
    fq = torch.cat([torch.zeros(P, H, D, device="cuda", dtype=dtype), q])
    fk, fv = torch.cat([pk, k]), torch.cat([pv, v])
    fd = torch.cat([torch.zeros(P, H, D, device="cuda", dtype=dtype), dout])
    ref64 = cases.ref_grads(fq.double(), fk.double(), fv.double(), fd.double(), flat, torch.float64)
    refpt = cases.ref_grads(fq, fk, fv, fd, flat, dtype)
    for name, got in (("prefix_dk one call", dpk1), ("prefix_dk three calls", dpk3)):
        assert_low_precision_rule(got, ref64[3][:P], refpt[3][:P], f"{name} ({path})")
    for name, got in (("prefix_dv one call", dpv1), ("prefix_dv three calls", dpv3)):
        assert_low_precision_rule(got, ref64[4][:P], refpt[4][:P], f"{name} ({path})")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels run on sm_90 only")
@pytest.mark.parametrize("D", built_head_dims())
def test_hopper_prefix_kernels_run(D, monkeypatch):
    """On an H200 the default path runs the Hopper kernels' prefix instantiations where built (and
    the portable ones when switched off)."""
    kernels = _native.build_info()["cuda"]["kernels"].get("sm90", {})
    case = Case(random.Random(5))
    prefixed = case.prefixed.to("cuda")
    q, k, v, dout, unused = flat_inputs(case, 4, 2, D, torch.bfloat16, seed=1)
    lq, lk, lv, pk, pv = prefixed_inputs(case, q, k, v, unused)
    dl = dout[case.local.cuda()]
    names = cases.cuda_kernels_run(lambda: prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dl))
    sm90 = [n for n in names if "sm90" in n and "dualkv" in n]
    if D in kernels.get("fwd", []):
        assert any(re.search(r"fwd_sm90_kernel<.*, true, false, false>\(", n) for n in sm90), names  # kPrefix
    if D in kernels.get("bwd", []):
        assert any("bwd_sm90_kernel" in n and ", true>" in n for n in sm90), names
    use_path(monkeypatch, "portable")
    names = cases.cuda_kernels_run(lambda: prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dl))
    assert not any("sm90_kernel" in n for n in names), names
    assert any("sm80" in n and "fwd_kernel" in n and ", true>" in n for n in names), names
