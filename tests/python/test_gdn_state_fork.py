"""dualkv.state_fork: the Gated DeltaNet conv + recurrence of a packed forest equals, token by token,
an independent per-path computation on the unpacked root-to-leaf sequences (outputs and every input
gradient), on random forests of depth up to 3 with 1-token segments and segments shorter than the
conv kernel; bad input raises typed errors. The chunk backend (transformers' PyTorch chunked rule on
right-padded per-depth batches) equals the exact recurrence in fp64 (outputs, final states, gradients
of inputs and initial states) on forests with segments around the chunk length; the backend choice
(argument, $DUALKV_GDN_BACKEND, fla's refusal of the Triton on Hopper) is checked without a GPU. On a
GPU: the chunk backend, and fla's when installed and not refused, under the tolerance rule."""
import random
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from conftest import random_forest
from dualkv import ArgumentError, Layout, LayoutError, UnsupportedError
from dualkv.reference import unpacked_groups
from dualkv import state_fork as sf
from dualkv.state_fork import BACKEND_ENV, StateFork, recurrence_backend, state_fork


def conv_ref(x, weight, bias):
    """Causal depthwise conv of one sequence x [L, C], weight [C, K]: tap by tap, then SiLU."""
    L, K = x.shape[0], weight.shape[1]
    xp = torch.cat([x.new_zeros(K - 1, x.shape[1]), x])
    y = sum(xp[j:j + L] * weight[:, j] for j in range(K))
    return F.silu(y + bias)


def rule_ref(q, k, v, g, beta):
    """The gated delta rule on one sequence, token by token, from a zero state (q, k already
    normalised and scaled; value head h reads key head h // (Hv / Hk))."""
    rep = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    state = q.new_zeros(v.shape[1], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[t], state)
        state = state + k[t][:, :, None] * ((v[t] - pred) * beta[t][:, None])[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out)


def l2n(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def make_inputs(T, dtype, seed, Hk=2, Hv=4, Dk=5, Dv=3, C=7, K=4):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return dict(x=r(T, C), weight=r(C, K), bias=r(C), q=r(T, Hk, Dk), k=r(T, Hk, Dk), v=r(T, Hv, Dv),
                a=r(T, Hv), b=r(T, Hv))


def forked(layout, inp, backend="recurrent"):
    """Conv then rule through the state fork; returns (conv out [T, C], rule out [T, Hv, Dv])."""
    fork = state_fork(layout, inp["q"].device)
    y = fork.causal_conv1d(inp["x"], inp["weight"], inp["bias"], activation="silu")
    o = fork.gated_delta_rule(inp["q"], inp["k"], inp["v"], -F.softplus(inp["a"]), inp["b"].sigmoid(),
                              use_qk_l2norm=True, backend=backend)
    return y, o


def unpacked(layout, inp):
    """The same per root-to-leaf path, each path its own sequence (packed index of every output)."""
    ys, os_, idx = [], [], []
    scale = inp["q"].shape[-1] ** -0.5
    for path in unpacked_groups(layout):
        ys.append(conv_ref(inp["x"][path], inp["weight"], inp["bias"]))
        os_.append(rule_ref(l2n(inp["q"][path]) * scale, l2n(inp["k"][path]), inp["v"][path],
                            -F.softplus(inp["a"][path]), inp["b"][path].sigmoid()))
        idx.append(path)
    return ys, os_, idx


def check_forest(lens, parents, dtype, tol, seed=0, K=4):
    layout = Layout.from_tree(lens, parents)
    T = layout.num_tokens
    inp = make_inputs(T, dtype, seed, K=K)
    y, o = forked(layout, inp)
    ys, os_, paths = unpacked(layout, inp)
    # every token's outputs equal its value in every path that contains it
    for yp, op, path in zip(ys, os_, paths):
        torch.testing.assert_close(y[path], yp, rtol=tol, atol=tol)
        torch.testing.assert_close(o[path], op, rtol=tol, atol=tol)
    # gradients: a weighted sum counting each token once (from the first path holding it) is the same
    # function of the inputs both ways
    g = torch.Generator().manual_seed(seed + 1)
    wy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(dtype)
    wo = torch.randn(o.shape, generator=g, dtype=torch.float64).to(dtype)
    loss_fork = (y * wy).sum() + (o * wo).sum()
    seen = torch.zeros(T, dtype=torch.bool)
    loss_ref = 0
    for yp, op, path in zip(ys, os_, paths):
        new = ~seen[path]
        loss_ref = loss_ref + (yp[new] * wy[path[new]]).sum() + (op[new] * wo[path[new]]).sum()
        seen[path] = True
    assert bool(seen.all())
    names = list(inp)
    grads_fork = torch.autograd.grad(loss_fork, [inp[n] for n in names])
    grads_ref = torch.autograd.grad(loss_ref, [inp[n] for n in names])
    for n, a, b in zip(names, grads_fork, grads_ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=n: f"grad of {n}: {m}")
    return layout


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_random_forests_match_unpacked_paths(dtype, tol):
    rng = random.Random(21)
    for case in range(6):
        lens, parents = random_forest(rng, roots=rng.randint(1, 3), max_depth=3, max_children=3, max_len=7)
        check_forest(lens, parents, dtype, tol, seed=case)


def test_depth_three_tree_short_segments():
    """Multi-turn: a 2-token prompt (shorter than the conv context), 1-token and 2-token turns, so the
    conv context of a grandchild reaches into its grandparent and the root's zero padding."""
    lens = [2, 1, 3, 1, 2, 5, 1]
    parents = [-1, 0, 1, 1, 0, 4, 4]
    layout = check_forest(lens, parents, torch.float64, 1e-10)
    assert layout.max_depth == 3


@pytest.mark.parametrize("K", [1, 2, 4])
def test_conv_kernel_sizes(K):
    check_forest([3, 1, 2, 4, 2, 1], [-1, 0, 0, -1, 3, 3], torch.float64, 1e-10, K=K)


def test_order_tables():
    one_group = state_fork(Layout.from_groups([5], [[2, 1, 3]]))
    assert one_group.identity_order and len(one_group.depths) == 2
    two_groups = state_fork(Layout.from_groups([5, 3], [[2, 1], [4]]))
    assert not two_groups.identity_order
    assert [d.tokens for d in two_groups.depths] == [(0, 8), (8, 15)]
    assert two_groups.depths[1].parent_slot.tolist() == [0, 0, 1]
    assert state_fork(Layout.varlen([3, 4])).depths[0].cu_seqlens.tolist() == [0, 3, 4 + 3]
    lay = Layout.from_groups([5], [[2]])
    assert state_fork(lay) is state_fork(lay)  # cached per layout and device


def test_bad_input_raises_typed_errors():
    with pytest.raises(LayoutError, match="DFS"):  # a child before its parent: no state to hand off
        Layout.from_tree([2, 3], [1, -1])
    with pytest.raises(LayoutError, match="contiguous"):  # a subtree split by another root
        Layout.from_tree([2, 2, 1, 1], [-1, -1, 0, 1])
    with pytest.raises(TypeError):
        state_fork([[3], [1, 2]])
    layout = Layout.from_groups([4], [[2, 3]])
    fork = state_fork(layout)
    T = layout.num_tokens
    q = torch.randn(T, 2, 4)
    v = torch.randn(T, 4, 3)
    gb = torch.randn(T, 4)
    with pytest.raises(ArgumentError, match="T=9"):
        fork.gated_delta_rule(q[:-1], q[:-1], v[:-1], gb[:-1], gb[:-1])
    with pytest.raises(ArgumentError, match="multiple"):
        fork.gated_delta_rule(torch.randn(T, 3, 4), torch.randn(T, 3, 4), v, gb, gb)
    with pytest.raises(ArgumentError, match="g and beta"):
        fork.gated_delta_rule(q, q, v, gb[:, :2], gb)
    with pytest.raises(ArgumentError, match="backend"):
        fork.gated_delta_rule(q, q, v, gb, gb, backend="cuda")
    with pytest.raises(UnsupportedError):
        fork.gated_delta_rule(q, q, v, gb, gb, backend="fla")
    x = torch.randn(T, 6)
    with pytest.raises(ArgumentError, match="weight"):
        fork.causal_conv1d(x, torch.randn(5, 4))
    with pytest.raises(ArgumentError, match=r"x must be"):
        fork.causal_conv1d(x[:-1], torch.randn(6, 4))
    with pytest.raises(UnsupportedError, match="activation"):
        fork.causal_conv1d(x, torch.randn(6, 4), activation="gelu")
    assert isinstance(fork, StateFork)


# ---- the chunk backend: transformers' PyTorch chunked rule on right-padded per-depth batches ---------------

#: segments around the chunk length (64): 1 token, 63 / 64 / 65, two chunks and a bit; three levels
CHUNK_FOREST = ([130, 1, 65, 2, 64, 63, 129, 1, 7, 66], [-1, 0, 1, 1, 0, 4, 4, 6, -1, 8])


def rule_inputs(T, seed, Hk=2, Hv=4, Dk=8, Dv=6, dtype=torch.float64):
    """Leaves q, k, v, a, b [T, ...] and per value head decay rates from 0.01 to 1 (g = -rate * softplus(a)):
    slow heads carry the state across many chunks and into the children, fast ones forget within a few
    steps."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    leaves = dict(q=r(T, Hk, Dk), k=r(T, Hk, Dk), v=r(T, Hv, Dv), a=r(T, Hv), b=r(T, Hv))
    return leaves, torch.linspace(0.01, 1.0, Hv, dtype=torch.float64).to(dtype)


def gates(leaves, rate, l2norm):
    """(q, k, v, g, beta): without the rule's own L2 norm, unit keys (beta |k|^2 <= 1 keeps the delta rule
    stable) and queries."""
    q, k = leaves["q"], leaves["k"]
    if not l2norm:
        q, k = l2n(q), l2n(k)
    return q, k, leaves["v"], -F.softplus(leaves["a"]) * rate, leaves["b"].sigmoid()


def check_chunk_equals_recurrent(layout, seed, tol=2e-5, l2norm=True, scale=None, Hk=2, Hv=4):
    T = layout.num_tokens
    leaves, rate = rule_inputs(T, seed, Hk=Hk, Hv=Hv)
    fork = state_fork(layout)
    outs = {b: fork.gated_delta_rule(*gates(leaves, rate, l2norm), scale=scale, use_qk_l2norm=l2norm, backend=b)
            for b in ("recurrent", "chunk")}
    assert outs["chunk"].dtype == torch.float64  # returned in q's dtype; computed in fp32 by transformers
    torch.testing.assert_close(outs["chunk"], outs["recurrent"], rtol=tol, atol=tol)
    w = torch.randn(outs["chunk"].shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    names = list(leaves)
    grads = {b: torch.autograd.grad((o * w).sum(), [leaves[n] for n in names]) for b, o in outs.items()}
    for n, a, b in zip(names, grads["chunk"], grads["recurrent"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, n=n: f"grad of {n}: {m}")


@pytest.mark.parametrize("l2norm,scale,Hk", [(True, None, 2), (True, 0.3, 4), (False, 0.5, 1)])
def test_chunk_backend_matches_recurrent(l2norm, scale, Hk):
    """The fixed forest (three levels, segments of 1, 63-66, 129, 130 tokens), GVA and not, the rule's L2
    norm and scale and a caller's: outputs and every input gradient equal the fp64 exact recurrence."""
    check_chunk_equals_recurrent(Layout.from_tree(*CHUNK_FOREST), seed=3, l2norm=l2norm, scale=scale, Hk=Hk)


def test_chunk_backend_random_forests():
    rng = random.Random(64)
    for case in range(3):
        while True:  # at least a grandchild: two state hand-offs in a row
            lens, parents = random_forest(rng, roots=rng.randint(1, 3), max_depth=4, max_children=2, max_len=150)
            layout = Layout.from_tree(lens, parents)
            if layout.max_depth >= 3:
                break
        check_chunk_equals_recurrent(layout, seed=10 + case)


def test_chunk_rule_initial_and_final_states():
    """One depth of uneven segments (65, 1, 130, 64, 63 tokens: right padding of 65 to 129 steps) from
    given initial states: outputs, final states and the gradients of inputs and initial states of the
    chunk rule equal the exact recurrence's."""
    layout = Layout.varlen([65, 1, 130, 64, 63])
    part = state_fork(layout).depths[0]
    leaves, rate = rule_inputs(layout.num_tokens, seed=7)
    gen = torch.Generator().manual_seed(8)
    h0 = (0.5 * torch.randn(5, 4, 8, 6, generator=gen, dtype=torch.float64)).requires_grad_()
    inputs = list(leaves.values()) + [h0]
    res, grads = {}, {}
    for name, rule in (("chunk", sf._rule_chunk), ("recurrent", sf._rule_recurrent)):
        o, final = rule(*gates(leaves, rate, True), part, h0, 8 ** -0.5, True, True)
        res[name] = (o, final)
        gen = torch.Generator().manual_seed(9)
        wo, wf = (torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in (o, final))
        grads[name] = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), inputs)
    (o_c, f_c), (o_r, f_r) = res["chunk"], res["recurrent"]
    assert f_c.dtype == torch.float32 and o_c.dtype == torch.float64
    torch.testing.assert_close(o_c, o_r, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(f_c.double(), f_r, rtol=2e-5, atol=2e-5)
    for n, a, b in zip(list(leaves) + ["h0"], grads["chunk"], grads["recurrent"]):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5, msg=lambda m, n=n: f"grad of {n}: {m}")
    # padding is inert: the 1-token segment's final state is one step from its initial state
    q, k, v, g, beta = (t[65] for t in gates(leaves, rate, True))
    k = l2n(k).repeat_interleave(2, 0)
    state = h0[1] * g.exp()[:, None, None]
    state = state + k[:, :, None] * ((v - torch.einsum("hk,hkv->hv", k, state)) * beta[:, None])[:, None, :]
    torch.testing.assert_close(f_c[1].double(), state, rtol=1e-5, atol=1e-5)


# ---- backend choice ---------------------------------------------------------------------------------------

@pytest.fixture
def clean_backend_env(monkeypatch):
    """No $DUALKV_GDN_BACKEND, and fla's refusal recomputed (it is cached) before and after the test."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    refusal = sf._fla_refusal  # the cached function (a test may monkeypatch the name)
    refusal.cache_clear()
    yield monkeypatch
    refusal.cache_clear()


def test_backend_argument_and_environment(clean_backend_env):
    monkeypatch = clean_backend_env
    auto = recurrence_backend("cpu")
    assert (auto.name, auto.forced) == ("recurrent", False) and "cpu" in auto.reason
    assert recurrence_backend("cpu", "chunk") == ("chunk", "forced by the backend argument", True)
    layout = Layout.from_groups([70], [[3, 66]])
    leaves, rate = rule_inputs(layout.num_tokens, seed=1, dtype=torch.float32)
    fork = state_fork(layout)
    calls = []
    for name in ("chunk", "recurrent"):  # count the depths each rule runs
        monkeypatch.setitem(sf._RULES, name, lambda *a, name=name, rule=sf._RULES[name]: calls.append(name) or rule(*a))

    monkeypatch.setenv(BACKEND_ENV, "chunk")
    assert recurrence_backend("cpu") == ("chunk", f"forced by ${BACKEND_ENV}", True)
    fork.gated_delta_rule(*gates(leaves, rate, True), use_qk_l2norm=True)
    assert calls == ["chunk", "chunk"]  # the environment reaches the fork (two depths: prompt, responses)
    fork.gated_delta_rule(*gates(leaves, rate, True), use_qk_l2norm=True, backend="recurrent")
    assert calls[2:] == ["recurrent", "recurrent"]  # an explicit argument wins over the environment
    monkeypatch.setenv(BACKEND_ENV, "auto")
    assert recurrence_backend("cpu") == auto

    monkeypatch.setenv(BACKEND_ENV, "torch")  # the old name of the recurrent backend is gone
    with pytest.raises(ArgumentError, match=BACKEND_ENV):
        recurrence_backend("cpu")
    with pytest.raises(ArgumentError, match="backend must be one of"):
        recurrence_backend("cpu", "torch")
    monkeypatch.setenv(BACKEND_ENV, "fla")  # a forced backend that cannot run says which and why
    with pytest.raises(UnsupportedError, match=r"backend 'fla' \(from \$DUALKV_GDN_BACKEND\).*CUDA"):
        fork.gated_delta_rule(*gates(leaves, rate, True))
    monkeypatch.delenv(BACKEND_ENV)
    monkeypatch.setattr(sf, "_chunk_rule", lambda: None)  # a transformers without the PyTorch rule
    with pytest.raises(UnsupportedError, match="torch_chunk_gated_delta_rule is not importable"):
        fork.gated_delta_rule(*gates(leaves, rate, True), backend="chunk")


def test_auto_backend_on_cuda(clean_backend_env):
    """auto on CUDA: fla where it is installed and runs, else chunk (saying why), else the recurrence;
    decided without a GPU (fla's availability and refusal monkeypatched)."""
    monkeypatch = clean_backend_env
    monkeypatch.setattr(sf, "fla_available", lambda: True)
    monkeypatch.setattr(sf, "_fla_refusal", lambda: None)
    assert sf._auto_backend("cuda") == ("fla", "flash-linear-attention on CUDA", False)
    assert recurrence_backend("cuda").name == "fla" and recurrence_backend("cpu").name == "recurrent"
    refusal = "fla-core 0.6.0 refuses Triton 3.6.0 on Hopper (fla #640)"
    monkeypatch.setattr(sf, "_fla_refusal", lambda: refusal)
    chosen = recurrence_backend("cuda")
    assert chosen.name == "chunk" and chosen.reason.startswith(refusal) and not chosen.forced
    with pytest.raises(UnsupportedError, match="refuses Triton 3.6.0"):
        recurrence_backend("cuda", "fla")
    monkeypatch.setattr(sf, "fla_available", lambda: False)
    chosen = recurrence_backend("cuda")
    assert chosen.name == "chunk" and "not installed" in chosen.reason
    monkeypatch.setattr(sf, "_chunk_rule", lambda: None)
    chosen = recurrence_backend("cuda")
    assert chosen.name == "recurrent" and "not importable" in chosen.reason


def fake_fla(monkeypatch, hopper, triton, tilelang):
    """A stand-in for fla-core 0.6.0's modules that _fla_refusal reads: the hardware and Triton flags of
    fla.utils and the TileLang backend of fla.ops.common.backends.tilelang."""
    major, minor, patch = (int(x) for x in triton.split("."))
    utils = types.SimpleNamespace(IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=(major, minor) >= (3, 4),
                                  TRITON_ABOVE_3_7_1=(major, minor, patch) >= (3, 7, 1))

    class CommonTileLangBackend:
        @classmethod
        def is_available(cls):
            return tilelang

        def is_enabled(self):
            return True
    modules = {"fla": types.ModuleType("fla"), "triton": types.ModuleType("triton")}
    modules["fla"].__version__, modules["fla"].utils, modules["triton"].__version__ = "0.6.0", utils, triton
    for name in ("fla.ops", "fla.ops.common", "fla.ops.common.backends", "fla.ops.common.backends.tilelang"):
        modules[name] = types.ModuleType(name)
    modules["fla.ops.common.backends.tilelang"].CommonTileLangBackend = CommonTileLangBackend
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    sf._fla_refusal.cache_clear()


def test_fla_refusal_of_triton_on_hopper(clean_backend_env):
    monkeypatch = clean_backend_env
    fake_fla(monkeypatch, hopper=True, triton="3.6.0", tilelang=False)
    why = sf._fla_refusal()
    assert why is not None and "fla-core 0.6.0 refuses Triton 3.6.0" in why and "#640" in why
    fake_fla(monkeypatch, hopper=True, triton="3.3.1", tilelang=False)  # before the miscompiling Triton
    assert sf._fla_refusal() is None
    fake_fla(monkeypatch, hopper=True, triton="3.7.1", tilelang=False)  # fixed
    assert sf._fla_refusal() is None
    fake_fla(monkeypatch, hopper=False, triton="3.6.0", tilelang=False)  # not Hopper
    assert sf._fla_refusal() is None
    fake_fla(monkeypatch, hopper=True, triton="3.6.0", tilelang=True)  # fla dispatches the kernel to TileLang
    assert sf._fla_refusal() is None
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")  # ... unless its dispatch is off
    sf._fla_refusal.cache_clear()
    assert sf._fla_refusal() is not None


# ---- on a GPU ---------------------------------------------------------------------------------------------

def library_rule(backend):
    """The library function of a backend on one unpacked sequence (batch 1): fla's chunk kernel, or
    transformers' PyTorch chunked rule (q and k repeated to the value heads: transformers 5.17 wants them so)."""
    if backend == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule

    def chunk(q, k, v, g, beta, **kw):
        rep = v.shape[2] // q.shape[2]
        return sf._chunk_rule()(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta, **kw)
    return chunk


def tolerance_rule(backend, device, dtype):
    """The forked recurrence's error against the fp64 per-path reference is at most 2x (+ a small absolute
    term) the error of the backend's library function run on the unpacked paths themselves; the
    backward gives finite gradients."""
    why_not = sf._unavailable(backend, torch.device(device).type)
    if why_not is not None:
        pytest.skip(f"backend {backend}: {why_not}")
    rng = random.Random(5)
    lens, parents = random_forest(rng, roots=3, max_depth=3, max_children=4, max_len=150)
    layout = Layout.from_tree(lens, parents).to(device)
    T = layout.num_tokens
    gen = torch.Generator().manual_seed(0)
    Hk, Hv, D = 2, 4, 64
    raw = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((T, Hk, D), (T, Hk, D), (T, Hv, D),
                                                                      (T, Hv), (T, Hv))]
    q, k, v, a, b = (t.to(device) for t in raw)
    g64, beta64 = -F.softplus(a) - 0.01, b.sigmoid()
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    g32, beta = g64.float(), beta64.to(dtype)
    o_fork = state_fork(layout).gated_delta_rule(*low, g32, beta, use_qk_l2norm=True, backend=backend)
    rule = library_rule(backend)
    err_fork = err_std = 0.0
    scale = D ** -0.5
    for path in unpacked_groups(layout):
        p = path.to(device)
        ref = rule_ref(l2n(q[p]) * scale, l2n(k[p]), v[p], g64[p], beta64[p])
        o_std, _ = rule(*(t[p].unsqueeze(0) for t in low), g32[p].unsqueeze(0), beta[p].unsqueeze(0),
                        use_qk_l2norm_in_kernel=True)
        err_std = max(err_std, float((o_std[0].detach().double() - ref).abs().max()))
        err_fork = max(err_fork, float((o_fork[p].detach().double() - ref).abs().max()))
    print(f"{backend} {dtype}: max |error| vs fp64: on unpacked paths {err_std:.3e}, forked {err_fork:.3e}")
    assert err_fork <= 2 * err_std + 1e-4
    o_fork.float().square().sum().backward()  # the backward runs (dh0 / dht through the fork)
    assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in low)


def test_chunk_backend_tolerance_rule_cpu():
    tolerance_rule("chunk", "cpu", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["chunk", "fla"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_tolerance_rule_cuda(backend, dtype):
    """On CUDA: the chunk backend (the H200's without fla), and fla where it is installed and does not
    refuse the Triton here (skipped with the reason otherwise)."""
    tolerance_rule(backend, "cuda", dtype)
