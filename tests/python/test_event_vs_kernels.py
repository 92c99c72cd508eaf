"""tools/event_vs_kernels.py's summary of profiled kernels and its refusals (the timed loops run on
the device)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "event_vs_kernels.py"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool prepends tools/
    spec = importlib.util.spec_from_file_location("event_vs_kernels", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_of_two_calls(tool):
    # two calls: a 1 us memset and a 1000 us kernel each, 2 us apart, the calls 40 us apart
    kernels = [("kernel", 3.0, 1003.0), ("memset", 0.0, 1.0), ("memset", 1043.0, 1044.0),
               ("kernel", 1046.0, 2046.0)]
    s = tool.summarize(kernels, 2)
    assert s["kernels_ms"] == pytest.approx((2 * 1000 + 2 * 1) / 2 / 1e3)
    assert s["span_ms"] == pytest.approx(2046.0 / 2 / 1e3)
    assert s["gaps_us"] == [2.0, 2.0, 40.0]
    assert s["by_name"]["kernel"] == {"median_ms": 1.0, "count": 2, "per_call_ms": 1.0}
    assert s["by_name"]["memset"]["count"] == 2 and s["by_name"]["memset"]["per_call_ms"] == pytest.approx(1e-3)


def test_summary_refuses_nothing(tool):
    with pytest.raises(ValueError, match="at least one call and one kernel"):
        tool.summarize([], 3)
    with pytest.raises(ValueError, match="at least one call"):
        tool.summarize([("k", 0.0, 1.0)], 0)


def test_bad_direction_is_named(tool, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--case", "tree", "--direction", "bwd"])
    assert exc.value.code == 2
    assert "--direction: fwd and/or fwdbwd" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(tool, capsys):
    with pytest.raises(SystemExit) as exc:
        tool.main(["--case", "tree"])
    assert exc.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err
