"""DUALKV_LOG_KERNELS=1: one stderr line per call naming the kernel family and why the Hopper one
was passed over. The switch is read once per process, so each case runs in a subprocess."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
SNIPPET = """
import torch, dualkv
layout = dualkv.Layout.from_groups([200], [[70, 1]]).to("cuda")
T = layout.num_tokens
q, k, v = (torch.randn(T, h, {head_dim}, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (4, 1, 1))
dualkv.attention(q, k, v, layout).sum().backward()
torch.cuda.synchronize()
"""


def kernel_log(head_dim: int = 128, **env) -> list[str]:
    e = dict(os.environ, DUALKV_LOG_KERNELS="1", **env)
    e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SNIPPET.format(head_dim=head_dim)], env=e, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return [line for line in res.stderr.splitlines() if line.startswith("[dualkv]")]


def built(direction: str) -> bool:
    from dualkv import _native
    kernels = _native.build_info().get("cuda", {}).get("kernels", {})
    return 128 in [int(d) for d in kernels.get("sm90", {}).get(direction, [])]


@pytest.mark.cuda_head_dims(128)
def test_log_names_the_kernels():
    lines = kernel_log()
    assert any(line.startswith("[dualkv] fwd: ") for line in lines), lines
    assert any(line.startswith("[dualkv] bwd: ") for line in lines), lines
    hopper = torch.cuda.get_device_capability() == (9, 0)
    fwd = next(line for line in lines if line.startswith("[dualkv] fwd: "))
    bwd = next(line for line in lines if line.startswith("[dualkv] bwd: "))
    assert ("sm90 wgmma" in fwd) == (hopper and built("fwd")), fwd
    assert ("sm90 wgmma" in bwd) == (hopper and built("bwd")), bwd
    if not hopper:
        assert "device is not sm_90" in fwd or "sm90" not in fwd, fwd


@pytest.mark.cuda_head_dims(128)
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels apply to sm_90 only")
def test_log_gives_the_reason_of_a_fallback():
    lines = kernel_log(DUALKV_DISABLE_SM90="1", DUALKV_DISABLE_SM90_BWD="1")
    fwd = next(line for line in lines if line.startswith("[dualkv] fwd: "))
    bwd = next(line for line in lines if line.startswith("[dualkv] bwd: "))
    assert fwd.startswith("[dualkv] fwd: sm80 mma"), fwd
    assert bwd.startswith("[dualkv] bwd: sm80 mma"), bwd
    if built("fwd"):
        assert "(DUALKV_DISABLE_SM90)" in fwd, fwd
    if built("bwd"):
        assert "(DUALKV_DISABLE_SM90_BWD)" in bwd, bwd


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels apply to sm_90 only")
def test_head_dim_512_runs_the_portable_kernels_on_hopper():
    """Head dim 512 has no Hopper kernel (src/cuda/CMakeLists.txt): on an H200 both directions run
    the portable ones, the log naming why the Hopper family was passed over."""
    from dualkv import _native
    if 512 not in _native.build_info().get("cuda", {}).get("head_dims", []):
        pytest.skip("needs a library with head dim 512")
    lines = kernel_log(head_dim=512)
    for direction in ("fwd", "bwd"):
        line = next(line for line in lines if line.startswith(f"[dualkv] {direction}: "))
        assert line == f"[dualkv] {direction}: sm80 mma (no sm90 kernel built for this head dim)", line


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernels apply to sm_90 only")
def test_log_names_a_plan_cut_for_the_portable_kernels():
    """At head dim 64 the two kernel families' plans differ (tile_size.h fwd_block_m): a plan built
    while DUALKV_DISABLE_SM90 was set, run after it is cleared, runs the portable forward, the log
    saying why; the backward takes either plan and runs the Hopper kernels."""
    from dualkv import _native
    if 64 not in _native.build_info().get("cuda", {}).get("kernels", {}).get("sm90", {}).get("fwd", []):
        pytest.skip("needs a library with the Hopper forward at head dim 64")
    snippet = SNIPPET.format(head_dim=64).replace(
        '.to("cuda")\n', '.to("cuda")\nimport os\ndel os.environ["DUALKV_DISABLE_SM90"]\n')
    e = dict(os.environ, DUALKV_LOG_KERNELS="1", DUALKV_DISABLE_SM90="1")
    e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", snippet], env=e, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("[dualkv]")]
    fwd = next(line for line in lines if line.startswith("[dualkv] fwd: "))
    bwd = next(line for line in lines if line.startswith("[dualkv] bwd: "))
    assert fwd == "[dualkv] fwd: sm80 mma (plan cut for another kernel family's forward tiles (128 query rows))", fwd
    assert bwd.startswith("[dualkv] bwd: sm90 wgmma") or not built("bwd"), bwd


@pytest.mark.cuda_head_dims(128)
def test_no_log_without_the_switch():
    e = {k: v for k, v in os.environ.items() if k != "DUALKV_LOG_KERNELS"}
    e["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + e.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", SNIPPET.format(head_dim=128)], env=e, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "[dualkv]" not in res.stderr
