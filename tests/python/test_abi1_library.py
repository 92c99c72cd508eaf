"""The package drives a library of C ABI 1 (conftest.abi1_library: a build of 72977b9, issue 15's A/B
base) next to its own, in one process, for every call without external prefixes and mask modifiers:
the ABI-1 params (struct sizes 264 / 376, which that build checks exactly), layouts through the plain
entry points, and typed refusals naming the newer features."""
import ctypes

import pytest
import torch

import dualkv
from conftest import random_forest
from dualkv import _native


@pytest.fixture(scope="module")
def abi1(abi1_library):
    return _native.open_library(abi1_library)


def fwd_bwd(layout, q, k, v, dout, dlse):
    """out, lse and the gradients of q, k, v (through out and lse)."""
    x = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = dualkv.attention(*x, layout, return_lse=True)
    torch.autograd.backward([out, lse], [dout, dlse])
    return [out.detach(), lse.detach()] + [t.grad for t in x]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_abi1_build_computes_what_the_current_one_does(abi1, rng, dtype):
    lens, parents = random_forest(rng, roots=3, max_depth=3)
    T, H, Hk, D = sum(lens), 4, 2, 16
    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(T, h, D, generator=g, dtype=dtype) for h in (H, Hk, Hk, H))
    dlse = torch.randn(H, T, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    layout = dualkv.Layout.from_tree(lens, parents)
    current = fwd_bwd(layout, q, k, v, dout, dlse)
    assert _native.params_version(_native.FwdParams, [], "t") == (ctypes.sizeof(_native.FwdParams), 2)
    own_modifiers = _native.backend_modifiers("cpu")
    assert own_modifiers == {"window", "softcap", "sinks"}
    with _native.using(abi1):
        assert _native.lib() is abi1
        assert _native.backend_modifiers("cpu") == frozenset()  # the ABI-1 build's own answer
        assert _native.params_version(_native.FwdParams, [], "t") == (264, 1)
        assert _native.params_version(_native.BwdParams, [], "t") == (376, 1)
        old_layout = dualkv.Layout.from_tree(lens, parents)  # derived by the ABI-1 build
        old = fwd_bwd(old_layout, q, k, v, dout, dlse)
        assert torch.equal(old_layout.position_ids, layout.position_ids)
        assert old_layout.visible_pairs == layout.visible_pairs
    assert _native.lib() is not abi1 and _native.backend_modifiers("cpu") == own_modifiers
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), current, old):
        torch.testing.assert_close(b, a, msg=lambda m, name=name: f"{name}: {m}")


def test_abi1_build_refuses_the_newer_features_by_name(abi1):
    prefixed = dualkv.Layout.from_groups([2], [[3, 1]], prompt_prefix=[0], prefix_lens=[4])
    pk = torch.randn(4, 1, 8, dtype=torch.float64)
    q = torch.randn(prefixed.num_tokens, 2, 8, dtype=torch.float64)
    layout = dualkv.Layout.from_groups([2], [[3, 1]])
    qf = torch.randn(layout.num_tokens, 2, 8, dtype=torch.float64)
    kf = qf[:, :1]
    with _native.using(abi1):
        with pytest.raises(dualkv.UnsupportedError, match="external prefix segments need C ABI 2.*has C ABI 1"):
            dualkv.Layout.from_groups([2], [[3, 1]], prompt_prefix=[0], prefix_lens=[4])
        with pytest.raises(dualkv.UnsupportedError, match="attention: external prefix segments need C ABI 2.*C ABI 1"):
            dualkv.attention(q, q[:, :1], q[:, :1], prefixed, prefix_k=pk, prefix_v=pk)
        for modifier in ({"window": 2}, {"softcap": 5.0}, {"sinks": torch.zeros(2)}):
            with pytest.raises(dualkv.UnsupportedError, match="attention: mask modifiers need C ABI 2.*C ABI 1"):
                dualkv.attention(qf, kf, kf, layout, **modifier)


def test_the_package_library_must_have_the_package_abi(abi1_library, monkeypatch):
    """$DUALKV_LIBRARY of an older ABI is a stale build: lib() asks for a rebuild (open_library, for
    the A/B harnesses, takes it)."""
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_candidates", lambda: [abi1_library])
    with pytest.raises(dualkv.LibraryNotFoundError, match="C ABI version 1, this package needs 2: rebuild it"):
        _native.lib()
