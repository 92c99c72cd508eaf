"""dualkv.attention with external prefix segments (prefix_k / prefix_v) against the same forest
with the prefixes' rows as ordinary tokens, on the CPU backend, without and with the mask modifiers
(window, softcap, sinks); the layout and op checks."""
import random

import pytest
import torch

import dualkv
from conftest import random_forest
from dualkv.reference import flatten_prefixes


def split_forest(rng: random.Random, lens, parents):
    """Turn some roots with children of a forest into external prefix segments. Returns the prefixed
    layout, the flat (all-token) layout, the flat tokens that stay local and, per prefix row, its
    flat token. Prefix 0 is an unused one of 3 rows; the others are stored in a shuffled order."""
    S = len(lens)
    external = [s for s in range(S) if parents[s] == -1 and s + 1 < S and parents[s + 1] == s and rng.random() < 0.7]
    order = list(range(1, len(external) + 1))
    rng.shuffle(order)
    prefix_lens = [3] + [0] * len(external)
    seg_prefix = [-1] * S
    for s, e in zip(external, order):
        seg_prefix[s] = e
        prefix_lens[e] = lens[s]
    flat = dualkv.Layout.from_tree(lens, parents)
    prefixed = dualkv.Layout.from_tree([0 if seg_prefix[s] >= 0 else n for s, n in enumerate(lens)], parents,
                                       seg_prefix, prefix_lens)
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    prefix_starts = [0]
    for n in prefix_lens:
        prefix_starts.append(prefix_starts[-1] + n)
    local = [t for s in range(S) if seg_prefix[s] < 0 for t in range(starts[s], starts[s + 1])]
    prefix_rows = [-1] * prefix_starts[-1]  # -1: a row of the unused prefix
    for s in external:
        for j in range(lens[s]):
            prefix_rows[prefix_starts[seg_prefix[s]] + j] = starts[s] + j
    return prefixed, flat, torch.tensor(local), prefix_rows


@pytest.mark.parametrize("trial", range(8))
def test_flatten_prefixes_inverts_split_forest(trial):
    """dualkv.reference.flatten_prefixes (the dense reference's view of a prefixed layout) gives back
    the forest split_forest started from: its segment lengths and parents, where each local token
    sits and each prefix row's flat token (-1 for the unused prefix)."""
    rng = random.Random(300 + trial)
    lens, parents = random_forest(rng, roots=rng.randint(1, 4), max_depth=rng.randint(2, 4), max_children=3)
    prefixed, flat, local, prefix_rows = split_forest(rng, lens, parents)
    got, got_local, got_rows = flatten_prefixes(prefixed)
    assert got.segment_lens == flat.segment_lens and got.parents == flat.parents
    assert torch.equal(got_local, local)
    assert got_rows.tolist() == prefix_rows


def modifier_args(rng: random.Random, H: int):
    """A window that cuts the prefixes (1 to 12 positions), a softcap and [H] sinks (fp64 values)."""
    return dict(window=rng.randint(1, 12), softcap=rng.uniform(0.5, 3.0),
                sinks=torch.tensor([rng.uniform(-2, 3) for _ in range(H)], dtype=torch.float64))


@pytest.mark.parametrize("trial", range(12))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_modifiers", [False, True])
def test_prefixed_equals_flat_forest(trial, dtype, with_modifiers):
    """With the modifiers, positions continue after each prefix, so the window cuts prefix rows as it
    cuts the flat forest's root tokens; the sinks' gradient sums over the local rows (the flat
    loss leaves the prefix rows out, so their share is zero there too)."""
    rng = random.Random(100 + trial)
    lens, parents = random_forest(rng, roots=rng.randint(1, 4), max_depth=rng.randint(2, 4), max_children=3)
    prefixed, flat, local, prefix_rows = split_forest(rng, lens, parents)
    Hk = rng.choice([1, 2])
    H, D = Hk * rng.choice([1, 2]), rng.choice([8, 16])
    g = torch.Generator().manual_seed(trial)
    T = flat.num_tokens
    q, k, v = (torch.randn(T, h, D, generator=g, dtype=torch.float64) for h in (H, Hk, Hk))
    dout = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    unused_k, unused_v = (torch.randn(3, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    mods = modifier_args(rng, H) if with_modifiers else {}
    sinks = mods.pop("sinks", None)
    f_sinks, p_sinks = ((sinks.to(dtype).clone().requires_grad_() if with_modifiers else None) for _ in range(2))

    # flat: a loss on the local tokens only (prefix rows have no queries in the prefixed call)
    fq, fk, fv = (t.to(dtype).clone().requires_grad_() for t in (q, k, v))
    out_f = dualkv.attention(fq, fk, fv, flat, sinks=f_sinks, **mods)
    (out_f[local] * dout[local].to(dtype)).sum().backward()

    rows = torch.tensor([max(r, 0) for r in prefix_rows])
    unused = torch.tensor([r < 0 for r in prefix_rows])
    pk = torch.where(unused[:, None, None], torch.cat([unused_k, k[rows[3:]]]), k[rows])
    pv = torch.where(unused[:, None, None], torch.cat([unused_v, v[rows[3:]]]), v[rows])
    lq, lk, lv, pk, pv = (t.to(dtype).clone().requires_grad_() for t in (q[local], k[local], v[local], pk, pv))
    out_p = dualkv.attention(lq, lk, lv, prefixed, prefix_k=pk, prefix_v=pv, sinks=p_sinks, **mods)
    (out_p * dout[local].to(dtype)).sum().backward()

    tol = 1e-12 if dtype == torch.float64 else 2e-5
    if with_modifiers:
        torch.testing.assert_close(p_sinks.grad, f_sinks.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(out_p, out_f[local].detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(lq.grad, fq.grad[local], rtol=tol, atol=tol)
    torch.testing.assert_close(lk.grad, fk.grad[local], rtol=tol, atol=tol)
    torch.testing.assert_close(lv.grad, fv.grad[local], rtol=tol, atol=tol)
    torch.testing.assert_close(pk.grad[~unused], fk.grad[rows[~unused]], rtol=tol, atol=tol)
    torch.testing.assert_close(pv.grad[~unused], fv.grad[rows[~unused]], rtol=tol, atol=tol)
    assert not pk.grad[unused].any() and not pv.grad[unused].any()  # the unused prefix gets no gradient


def test_responses_split_over_calls_sum_the_prompt_gradient():
    """One group's responses in three calls that share the prompt's keys and values: outputs and
    the summed prefix gradients equal one call over the whole group (fp64)."""
    torch.manual_seed(0)
    P, R, H, Hk, D = 7, [3, 1, 4, 2, 5], 4, 2, 8
    whole = dualkv.Layout.from_groups([P], [R])
    T = whole.num_tokens
    q, k, v = (torch.randn(T, h, D, dtype=torch.float64) for h in (H, Hk, Hk))
    dout = torch.randn(T, H, D, dtype=torch.float64)
    wq, wk, wv = (t.clone().requires_grad_() for t in (q, k, v))
    out_w = dualkv.attention(wq, wk, wv, whole)
    (out_w[P:] * dout[P:]).sum().backward()

    pk, pv = k[:P].clone().requires_grad_(), v[:P].clone().requires_grad_()
    start = P
    for part in ([3, 1], [4], [2, 5]):  # uneven splits, one response alone
        n = sum(part)
        layout = dualkv.Layout.from_tree([0] + part, [-1] + [0] * len(part), [0] + [-1] * len(part), [P])
        sl = slice(start, start + n)
        lq, lk, lv = (t[sl].clone().requires_grad_() for t in (q, k, v))
        out = dualkv.attention(lq, lk, lv, layout, prefix_k=pk, prefix_v=pv)
        (out * dout[sl]).sum().backward()
        torch.testing.assert_close(out, out_w[sl].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lq.grad, wq.grad[sl], rtol=1e-12, atol=1e-12)
        start += n
    torch.testing.assert_close(pk.grad, wk.grad[:P], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pv.grad, wv.grad[:P], rtol=1e-12, atol=1e-12)


def test_layout_positions_and_sizes():
    layout = dualkv.Layout.from_groups([1, 4], [[2, 3], [2]], prompt_prefix=[1, -1], prefix_lens=[2, 5])
    assert layout.segment_lens == [0, 1, 2, 3, 4, 2]
    assert layout.parents == [-1, 0, 1, 1, -1, 4]
    assert layout.seg_prefix == [1, -1, -1, -1, -1, -1]
    assert layout.prefix_lens == [2, 5]
    assert (layout.num_prefixes, layout.num_prefix_rows, layout.num_tokens) == (2, 7, 12)
    # the last prompt token at position 5 (after the 5 prefix rows), responses from 6
    assert layout.position_ids.tolist() == [5, 6, 7, 6, 7, 8, 0, 1, 2, 3, 4, 5]
    assert layout.visible_pairs == 6 + (7 + 8) + (7 + 8 + 9) + 10 + (5 + 6)
    assert "prefixes=2" in repr(layout)


@pytest.mark.parametrize("window, softcap, with_sinks", [(0, 0.0, False), (3, 2.0, True)])
def test_opcheck_with_prefixes(window, softcap, with_sinks):
    layout = dualkv.Layout.from_groups([1, 3], [[2, 3], [1]], prompt_prefix=[0, -1], prefix_lens=[4])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(layout.num_tokens, h, 8, generator=g) for h in (4, 2, 2))
    pk, pv = (torch.randn(4, 2, 8, generator=g) for _ in range(2))
    sinks = torch.randn(4, generator=g) if with_sinks else None
    plan, key = layout.plan_for(q.dtype, 8)
    args = (q, k, v, layout.meta, plan, layout.num_segments, layout.max_depth, key, 0.35, False, pk, pv,
            layout.num_prefixes, window, softcap, sinks)
    torch.library.opcheck(torch.ops.dualkv.fwd.default, args)
    out, lse = torch.ops.dualkv.fwd(*args)
    bargs = (torch.randn_like(out), q, k, v, out, lse, None, layout.meta, plan, layout.num_segments, layout.max_depth,
             key, 0.35, False, pk, pv, layout.num_prefixes, window, softcap, sinks)
    torch.library.opcheck(torch.ops.dualkv.bwd.default, bargs)


@pytest.mark.parametrize("mods", [{}, {"window": 4, "softcap": 1.5}])
def test_torch_compile_fullgraph_with_prefixes(mods):
    layout = dualkv.Layout.from_groups([2], [[3, 2]], prompt_prefix=[0], prefix_lens=[5])
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(layout.num_tokens, h, 8, generator=g).requires_grad_() for h in (2, 1, 1))
    pk, pv = (torch.randn(5, 1, 8, generator=g).requires_grad_() for _ in range(2))
    sinks = torch.randn(2, generator=g).requires_grad_()
    leaves = (q, k, v, pk, pv) + ((sinks,) if mods else ())

    def f(q, k, v, pk, pv, *sinks):
        return dualkv.attention(q, k, v, layout, prefix_k=pk, prefix_v=pv, sinks=sinks[0] if sinks else None,
                                **mods).square().sum()

    torch._dynamo.reset()
    f(*leaves).backward()
    eager = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves).backward()
    for a, t in zip(eager, leaves):
        torch.testing.assert_close(a, t.grad)


def test_gradcheck_prefixes_with_modifiers_fp64():
    """Autograd through every differentiable input at once: q, k, v, the prefix buffers and the
    sinks, under a window that cuts the prefix, a softcap, and lse returned (its gradient too)."""
    layout = dualkv.Layout.from_groups([1, 2], [[2, 3], [2]], prompt_prefix=[0, -1], prefix_lens=[4])
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(layout.num_tokens, h, 4, generator=g, dtype=torch.float64).requires_grad_()
               for h in (2, 1, 1))
    pk, pv = (torch.randn(4, 1, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    sinks = torch.randn(2, generator=g, dtype=torch.float64).requires_grad_()

    def f(q, k, v, pk, pv, sinks):
        return dualkv.attention(q, k, v, layout, prefix_k=pk, prefix_v=pv, window=3, softcap=1.5, sinks=sinks,
                                return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v, pk, pv, sinks))


@pytest.mark.parametrize("segment_lens, parents, seg_prefix, prefix_lens, match", [
    ([0, 2], [-1, 0], [1, -1], [3], "references external prefix 1, but there are 1 prefixes"),
    ([0, 2], [-1, 0], [0, -1], [], "references external prefix 0, but there are 0 prefixes"),
    ([0, 2, 0, 1], [-1, 0, -1, 2], [0, -1, 0, -1], [3], "held by segments 0 and 2"),
    ([2, 0, 1], [-1, 0, 1], [-1, 0, -1], [3], "must be a root"),
    ([2, 0], [-1, -1], [-1, 0], [3], "has no children"),
    ([1, 2], [-1, 0], [0, -1], [3], "holds 1 tokens"),
    ([0, 2], [-1, 0], [0, -1], [0], "prefix 0 is empty"),
])
def test_invalid_prefix_layouts_raise_layout_errors(segment_lens, parents, seg_prefix, prefix_lens, match):
    with pytest.raises(dualkv.LayoutError, match=match):
        dualkv.Layout.from_tree(segment_lens, parents, seg_prefix, prefix_lens)


def test_bad_prefix_buffers_raise_typed_errors():
    layout = dualkv.Layout.from_groups([1], [[2, 1]], prompt_prefix=[0], prefix_lens=[4])
    q, k, v = (torch.randn(layout.num_tokens, h, 8) for h in (4, 2, 2))
    pk, pv = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    attention = dualkv.attention
    with pytest.raises(dualkv.ArgumentError, match="pass their keys and values as prefix_k"):
        attention(q, k, v, layout)
    with pytest.raises(dualkv.ArgumentError, match="go together"):
        attention(q, k, v, layout, prefix_k=pk)
    with pytest.raises(dualkv.ArgumentError, match="kv heads 2"):  # heads
        attention(q, k, v, layout, prefix_k=torch.randn(4, 1, 8), prefix_v=pv)
    with pytest.raises(dualkv.ArgumentError, match="head_dim 8"):  # head dim
        attention(q, k, v, layout, prefix_k=pk, prefix_v=torch.randn(4, 2, 4))
    with pytest.raises(dualkv.ArgumentError, match=r"prefix rows 4"):  # rows of the layout's prefixes
        attention(q, k, v, layout, prefix_k=torch.randn(5, 2, 8), prefix_v=pv)
    with pytest.raises(dualkv.ArgumentError, match="dtype torch.float64"):
        attention(q, k, v, layout, prefix_k=pk.double(), prefix_v=pv)
    with pytest.raises(dualkv.ArgumentError, match="contiguous last dimension"):
        attention(q, k, v, layout, prefix_k=pk, prefix_v=torch.randn(4, 2, 16)[:, :, ::2])
    with pytest.raises(dualkv.ArgumentError, match="no external prefix"):
        attention(q, k, v, dualkv.Layout.varlen([layout.num_tokens]), prefix_k=pk, prefix_v=pv)


@pytest.mark.cuda_head_dims(64)
@pytest.mark.gpu
def test_bad_prefix_device_and_cuda_run():
    layout = dualkv.Layout.from_groups([1], [[2, 1]], prompt_prefix=[0], prefix_lens=[4])
    q, k, v = (torch.randn(layout.num_tokens, h, 64, dtype=torch.bfloat16, device="cuda") for h in (4, 2, 2))
    pk, pv = (torch.randn(4, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    with pytest.raises(dualkv.ArgumentError, match="is on cpu but k is on cuda"):
        dualkv.attention(q, k, v, layout.to("cuda"), prefix_k=pk, prefix_v=pv)
    # the CUDA kernels read the prefix buffers (issue 17; tests/gpu/test_prefix_cuda.py tests them)
    out = dualkv.attention(q, k, v, layout.to("cuda"), prefix_k=pk.cuda(), prefix_v=pv.cuda())
    assert out.shape == q.shape and torch.isfinite(out).all()
    # a prefix buffer whose rows are not 16-byte aligned: a typed refusal naming it
    odd = torch.randn(4, 2, 72, dtype=torch.bfloat16, device="cuda")[:, :, 4:68]
    with pytest.raises(dualkv.UnsupportedError, match="prefix_k needs 16-byte aligned rows"):
        dualkv.attention(q, k, v, layout.to("cuda"), prefix_k=odd, prefix_v=pv.cuda())


def test_bad_prefix_device_on_cpu():
    """A prefix buffer on another device than k (the meta device stands in for a GPU here)."""
    layout = dualkv.Layout.from_groups([1], [[2, 1]], prompt_prefix=[0], prefix_lens=[4])
    q, k, v = (torch.randn(layout.num_tokens, h, 8) for h in (4, 2, 2))
    with pytest.raises(dualkv.ArgumentError, match="is on meta but k is on cpu"):
        dualkv.attention(q, k, v, layout, prefix_k=torch.empty(4, 2, 8, device="meta"), prefix_v=torch.randn(4, 2, 8))
