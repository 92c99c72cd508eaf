"""dualkv.state_fork: the Gated DeltaNet conv + recurrence of a packed forest equals, token by token,
an independent per-path computation on the unpacked root-to-leaf sequences (outputs and every input
gradient), on random forests of depth up to 3 with 1-token segments and segments shorter than the
conv kernel; bad input raises typed errors. The fla backend is checked on a GPU when installed."""
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import random_forest
from dualkv import ArgumentError, Layout, LayoutError, UnsupportedError
from dualkv.reference import unpacked_groups
from dualkv.state_fork import StateFork, fla_available, state_fork


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


def forked(layout, inp, backend="torch"):
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


@pytest.mark.gpu
@pytest.mark.skipif(not fla_available(), reason="flash-linear-attention is not installed")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fla_backend_tolerance_rule(dtype):
    """On CUDA with fla: the forked fla recurrence's error against the fp64 per-path reference is at
    most 2x (+ a small absolute term) the error of fla run on the unpacked paths themselves."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    rng = random.Random(5)
    lens, parents = random_forest(rng, roots=3, max_depth=3, max_children=4, max_len=150)
    layout = Layout.from_tree(lens, parents).to("cuda")
    T = layout.num_tokens
    gen = torch.Generator().manual_seed(0)
    Hk, Hv, D = 2, 4, 64
    raw = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((T, Hk, D), (T, Hk, D), (T, Hv, D),
                                                                      (T, Hv), (T, Hv))]
    q, k, v, a, b = (t.cuda() for t in raw)
    g64, beta64 = -F.softplus(a) - 0.01, b.sigmoid()
    low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    g32, beta = g64.float(), beta64.to(dtype)
    o_fork = state_fork(layout).gated_delta_rule(*low, g32, beta, use_qk_l2norm=True, backend="fla")
    err_fork = err_std = 0.0
    scale = D ** -0.5
    for path in unpacked_groups(layout):
        p = path.cuda()
        ref = rule_ref(l2n(q[p]) * scale, l2n(k[p]), v[p], g64[p], beta64[p])
        o_std, _ = chunk_gated_delta_rule(*(t[p].unsqueeze(0) for t in low), g32[p].unsqueeze(0),
                                          beta[p].unsqueeze(0), use_qk_l2norm_in_kernel=True)
        err_std = max(err_std, float((o_std[0].double() - ref).abs().max()))
        err_fork = max(err_fork, float((o_fork[p].double() - ref).abs().max()))
    print(f"{dtype}: max |error| vs fp64: fla on unpacked paths {err_std:.3e}, forked {err_fork:.3e}")
    assert err_fork <= 2 * err_std + 1e-4
    o_fork.float().square().sum().backward()  # the backward runs (dh0 / dht through the fork)
    assert all(t.grad is not None and bool(t.grad.isfinite().all()) for t in low)
