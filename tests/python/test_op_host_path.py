"""The host work of one attention call (docs/notes/2026-12-02-op-host-overhead.md).

Outside torch.compile, dualkv.attention calls the ops' implementations directly (ops._EagerAttention)
instead of going through the dispatcher and the custom op's Python autograd wrapper, and it reads the
layout's C structs built once per layout object. These tests pin that structure by counting calls
(no timing): a regression that brings back per-call work of the layout or the dispatcher fails here.
They also check that the eager path and the custom-op path compute the same bits, and that the ops
still run wherever something must see them (dispatch modes such as selective checkpointing, torch
function modes)."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import dualkv
from dualkv import ops
from dualkv.layout import Layout


class Counting:
    """Counts the calls of chosen functions (patched in place for the test)."""

    def __init__(self, monkeypatch):
        self.calls = collections.Counter()
        self._monkeypatch = monkeypatch

    def watch(self, owner, name, label=None):
        original = getattr(owner, name)
        label = label or name

        def counted(*args, **kwargs):
            self.calls[label] += 1
            return original(*args, **kwargs)

        self._monkeypatch.setattr(owner, name, counted)


def _watch_all(monkeypatch):
    from torch._library import utils as library_utils
    c = Counting(monkeypatch)
    c.watch(Layout, "c_layout")
    c.watch(Layout, "c_prefixes")
    c.watch(ops, "_c_structs")  # the ops' C structs from their `meta` argument (the op path)
    c.watch(ops, "_fwd_impl")
    c.watch(ops, "_bwd_impl")
    c.watch(library_utils, "fill_defaults")  # the custom op's autograd wrapper
    return c


def _qkv(T, H=4, Hk=2, D=16, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64).requires_grad_(requires_grad)
            for h in (H, Hk, Hk)]


def test_layers_of_a_micro_batch_build_the_layout_structs_once(monkeypatch):
    """Four "layers" over one layout, forward and backward: the layout's C structs are built once,
    the implementations run once per layer and direction, and neither the dispatcher's custom-op
    wrapper (fill_defaults) nor the op path's struct building (_c_structs) runs."""
    layout = Layout.from_groups([5, 3], [[2, 4], [1, 3, 2]])
    c = _watch_all(monkeypatch)
    q, k, v = _qkv(layout.num_tokens)
    loss = 0
    for layer in range(4):
        out, lse = dualkv.attention(q * (layer + 1), k, v, layout, return_lse=True)
        loss = loss + out.sum() + 0.5 * lse.sum()
    loss.backward()
    assert c.calls == {"c_layout": 1, "c_prefixes": 1, "_fwd_impl": 4, "_bwd_impl": 4}
    # a new layout object (the next micro-batch) builds its own
    other = Layout.from_groups([5, 3], [[2, 4], [1, 3, 2]])
    with torch.no_grad():
        dualkv.attention(q, k, v, other)
        dualkv.attention(q, k, v, other)
    assert c.calls["c_layout"] == 2 and c.calls["_fwd_impl"] == 6


def test_a_copied_layout_never_reads_the_originals_structs():
    """A pickled (or deep-copied) layout has its own metadata: its structs are its own, never the
    original's addresses (which would dangle once the original is freed)."""
    import copy
    import pickle
    layout = Layout.from_groups([5, 3], [[2, 4], [1, 3, 2]], prompt_prefix=[0, -1], prefix_lens=[3])
    q, k, v = _qkv(layout.num_tokens, requires_grad=False)
    pk, pv = torch.randn(2, 3, 2, 16, dtype=torch.float64).unbind(0)
    expect = dualkv.attention(q, k, v, layout, prefix_k=pk, prefix_v=pv)  # builds the original's structs
    for other in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout)):
        c, x = other._c_structs()
        assert c.seg_offsets == other.meta.data_ptr() != layout.meta.data_ptr()
        assert x.seg_prefix == other.meta.data_ptr() + 4 * (5 * other.num_segments + 1)
        assert torch.equal(dualkv.attention(q, k, v, other, prefix_k=pk, prefix_v=pv), expect)


def test_no_grad_calls_build_no_autograd_node(monkeypatch):
    layout = Layout.from_groups([4], [[3, 2]])
    q, k, v = _qkv(layout.num_tokens)
    with torch.no_grad():
        assert dualkv.attention(q, k, v, layout).grad_fn is None
    q, k, v = _qkv(layout.num_tokens, requires_grad=False)
    assert dualkv.attention(q, k, v, layout).grad_fn is None
    q, k, v = _qkv(layout.num_tokens)
    assert type(dualkv.attention(q, k, v, layout).grad_fn).__name__ == "_EagerAttentionBackward"


class _SeesOps(TorchDispatchMode):
    """A dispatch mode (as selective activation checkpointing and FlopCounterMode are): records the
    ops it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


CASES = {
    "plain": dict(),
    "deterministic": dict(deterministic=True),
    "modifiers": dict(window=3, softcap=2.5, sinks=True),
    "prefixes": dict(prefixes=True),
    "prefixes and modifiers": dict(prefixes=True, window=4, sinks=True),
}


def _run(case, layout, tensors):
    q, k, v, pk, pv, sinks = (t.detach().clone().requires_grad_() if t is not None else None for t in tensors)
    out, lse = dualkv.attention(q, k, v, layout, return_lse=True, prefix_k=pk, prefix_v=pv,
                                deterministic=case.get("deterministic", False), window=case.get("window"),
                                softcap=case.get("softcap"), sinks=sinks)
    g = torch.Generator().manual_seed(7)
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().add(lse.sin().sum()).backward()
    leaves = (q, k, v, pk, pv, sinks)
    return [out, lse] + [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("name", list(CASES))
def test_eager_path_equals_the_op_path_bitwise(name, monkeypatch):
    """The same call through the eager path and, under a dispatch mode, through dualkv::fwd /
    dualkv::bwd (which the mode sees): identical outputs and gradients, bit for bit."""
    case = CASES[name]
    if case.get("prefixes"):
        layout = Layout.from_groups([3, 2], [[2, 3], [1, 2, 2]], prompt_prefix=[1, 0], prefix_lens=[4, 5])
    else:
        layout = Layout.from_groups([5, 3], [[2, 4], [1, 3, 2]])
    q, k, v = _qkv(layout.num_tokens)
    g = torch.Generator().manual_seed(3)
    pk = pv = sinks = None
    if case.get("prefixes"):
        pk, pv = (torch.randn(layout.num_prefix_rows, 2, 16, generator=g, dtype=torch.float64) for _ in range(2))
    if case.get("sinks"):
        sinks = torch.randn(4, generator=g, dtype=torch.float64)
    tensors = (q, k, v, pk, pv, sinks)
    c = _watch_all(monkeypatch)
    eager = _run(case, layout, tensors)
    assert c.calls["_c_structs"] == 0 and c.calls["fill_defaults"] == 0
    mode = _SeesOps()
    with mode:
        through_ops = _run(case, layout, tensors)
    assert "dualkv.fwd.default" in mode.seen and "dualkv.bwd.default" in mode.seen
    assert c.calls["_c_structs"] == 2  # the op path builds them from `meta`, per call
    assert len(eager) == len(through_ops)
    for a, b in zip(eager, through_ops):
        assert torch.equal(a, b)


def test_torch_function_mode_takes_the_op_path(monkeypatch):
    """A torch function mode (here `with torch.device(...)`) must see the op as before: the op path."""
    layout = Layout.from_groups([4], [[3, 2]])
    q, k, v = _qkv(layout.num_tokens)
    c = _watch_all(monkeypatch)
    with torch.device("cpu"):
        dualkv.attention(q, k, v, layout).sum().backward()
    assert c.calls["_c_structs"] == 2 and c.calls["c_layout"] == 0


def test_second_derivative_raises_on_both_paths():
    """A backward with create_graph=True goes through dualkv::bwd, which has no autograd formula: a
    second derivative raises (as on the op path), never silently misses this term."""
    layout = Layout.from_groups([4], [[3, 2]])
    for mode in (None, _SeesOps()):
        q, k, v = _qkv(layout.num_tokens)
        if mode is not None:
            mode.__enter__()
        try:
            (dq,) = torch.autograd.grad(dualkv.attention(q, k, v, layout).sum(), q, create_graph=True)
            assert dq.requires_grad
            with pytest.raises(RuntimeError, match="no autograd formula"):
                (dq * dq).sum().backward()
        finally:
            if mode is not None:
                mode.__exit__(None, None, None)


def test_profiler_traces_name_the_ops():
    """Traces of the eager path still show dualkv::fwd and dualkv::bwd (record_function while the
    profiler runs)."""
    layout = Layout.from_groups([4], [[3, 2]])
    q, k, v = _qkv(layout.num_tokens)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dualkv.attention(q, k, v, layout).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"dualkv::fwd", "dualkv::bwd"} <= names


def test_bad_input_still_raises_typed_errors_on_the_eager_path():
    """The checks stay per call where the input is per call (shapes, dtypes, the prefix buffers)."""
    layout = Layout.from_groups([4], [[3, 2]])
    q, k, v = _qkv(layout.num_tokens)
    with pytest.raises(dualkv.ArgumentError, match="tokens"):
        dualkv.attention(q[:-1], k[:-1], v[:-1], layout)
    with pytest.raises(dualkv.ArgumentError, match="dtypes differ"):
        dualkv.attention(q, k.float(), v, layout)
    prefixed = Layout.from_groups([2], [[3]], prompt_prefix=[0], prefix_lens=[4])
    q, k, v = _qkv(prefixed.num_tokens)
    with pytest.raises(dualkv.ArgumentError, match="prefix_k"):
        dualkv.attention(q, k, v, prefixed)
    with pytest.raises(dualkv.ArgumentError, match="prefix_k must be"):
        dualkv.attention(q, k, v, prefixed, prefix_k=torch.zeros(3, 2, 16, dtype=q.dtype),
                         prefix_v=torch.zeros(3, 2, 16, dtype=q.dtype))
