"""Many calls in a row give what the first call gave (docs/notes/2026-12-02-library-host-cost.md).

The library keeps a device's properties and each kernel's shared-memory opt-in and occupancy from
its first call on that device, no longer zeroes the Hopper backward's work counter with a memset of
its own (the preprocess's memset of the counters covers it) and zeroes the backward's counters and
fp32 dQ accumulator with one memset (the accumulator now follows the counters in the workspace).
A call that found a counter or the accumulator not zeroed would skip work items or add the last
call's dQ into this one's: here two layouts alternate for many calls, each workspace left dirty by
the call before (the caching allocator hands the same blocks back), on the default kernels and the
portable ones, and every call's outputs and gradients must equal the first call's (bit for bit in
deterministic mode; within float32 summation-order noise otherwise, where dQ is summed by atomics).
The caches' first fill under threads is run in a fresh process, several threads at once.
"""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from cases import PATHS, built_head_dims, use_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

if torch.cuda.is_available():
    import dualkv

ROOT = pathlib.Path(__file__).resolve().parents[2]
CALLS = 12  # per layout, alternating


def _head_dim() -> int:
    dims = built_head_dims()
    return 128 if 128 in dims else dims[0]


def _layouts():
    # A GRPO group (one prompt, responses of mixed lengths: a long prompt gives split KV tiles, so
    # the backward's partials and reductions run) and a plain varlen batch of another token count.
    a = dualkv.Layout.from_groups([900, 37], [[64, 3, 130, 257], [90, 1]]).to("cuda")
    b = dualkv.Layout.from_groups([128, 77, 300], [[1], [200, 5], [64, 64, 64]]).to("cuda")
    return a, b


def _inputs(layout, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = layout.num_tokens
    q, k, v = (torch.randn(T, h, D, generator=g, device="cuda").to(torch.bfloat16) for h in (8, 2, 2))
    dout = torch.randn(T, 8, D, generator=g, device="cuda").to(torch.bfloat16)
    return q, k, v, dout


def _call(layout, inputs, deterministic):
    q, k, v, dout = (t.detach().clone() for t in inputs)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = dualkv.attention(q, k, v, layout, return_lse=True, deterministic=deterministic)
    out.backward(dout)
    return [out.detach(), lse.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
@pytest.mark.parametrize("path", PATHS)
def test_many_calls_on_two_layouts_equal_the_first(monkeypatch, path, deterministic):
    use_path(monkeypatch, path)
    D = _head_dim()
    layouts = _layouts()
    inputs = [_inputs(layout, D, seed) for seed, layout in enumerate(layouts)]
    first = [_call(layout, x, deterministic) for layout, x in zip(layouts, inputs)]
    for i in range(CALLS):
        for which, (layout, x) in enumerate(zip(layouts, inputs)):
            # Dirty memory in the allocator's blocks between calls (the workspaces come from them).
            torch.full((1 << 20,), float("nan"), device="cuda")
            got = _call(layout, x, deterministic)
            for name, a, b in zip(["out", "lse", "dq", "dk", "dv"], first[which], got):
                if deterministic or name in ("out", "lse"):
                    assert torch.equal(a, b), f"call {i + 1}, layout {which}: {name} differs from the first call"
                else:
                    torch.testing.assert_close(b.float(), a.float(), rtol=2e-2, atol=2e-2,
                                               msg=lambda m: f"call {i + 1}, layout {which}: {name}: {m}")
    torch.cuda.synchronize()


THREADS_SNIPPET = """
import threading, torch, dualkv
D = {head_dim}
layout = dualkv.Layout.from_groups([500, 40], [[64, 3, 130], [90, 1]]).to("cuda")
g = torch.Generator(device="cuda").manual_seed(0)
T = layout.num_tokens
q, k, v = (torch.randn(T, h, D, generator=g, device="cuda").to(torch.bfloat16) for h in (8, 2, 2))
torch.cuda.synchronize()
results, errors = [None] * 6, []
barrier = threading.Barrier(len(results))
def run(i):
    try:
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            qi, ki, vi = (t.clone().requires_grad_() for t in (q, k, v))
            barrier.wait()  # the library's first calls of the process, all at once
            out = dualkv.attention(qi, ki, vi, layout, deterministic=True)
            out.float().square().sum().backward()
        s.synchronize()
        results[i] = [out.detach(), qi.grad, ki.grad, vi.grad]
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
[t.start() for t in threads]
[t.join() for t in threads]
assert not errors, errors
for r in results[1:]:
    assert all(torch.equal(a, b) for a, b in zip(results[0], r)), "threads' first calls differ"
print("ok")
"""


def test_first_calls_from_several_threads_agree():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", THREADS_SNIPPET.format(head_dim=_head_dim())], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_devices_each_get_their_own_caches():
    """The caches are per device: calls alternating between two devices give each device's first result."""
    D = _head_dim()
    per_device = []
    for dev in ("cuda:0", "cuda:1"):
        layout = dualkv.Layout.from_groups([300], [[64, 130]]).to(dev)
        g = torch.Generator(device="cpu").manual_seed(3)
        T = layout.num_tokens
        x = [torch.randn(T, h, D, generator=g).to(dev, torch.bfloat16) for h in (8, 2, 2)]
        per_device.append((dev, layout, x))

    def call(dev, layout, x):
        with torch.cuda.device(dev):
            q, k, v = (t.clone().requires_grad_() for t in x)
            out = dualkv.attention(q, k, v, layout, deterministic=True)
            out.float().square().sum().backward()
            return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]

    first = [call(*d) for d in per_device]
    for _ in range(4):
        for d, f in zip(per_device, first):
            assert all(torch.equal(a, b) for a, b in zip(f, call(*d)))
    # Same inputs on two identical devices: the same bits.
    if torch.cuda.get_device_name(0) == torch.cuda.get_device_name(1):
        assert all(torch.equal(a, b) for a, b in zip(first[0], first[1]))
