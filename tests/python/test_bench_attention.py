"""bench/attention.py's round logic (--rounds): rotated method orders, the median round and the
same-round ratios. Pure Python; the timing itself needs a GPU and runs on the device."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import attention  # noqa: E402


def res(fwd_ms, fwdbwd_ms, peak=1.0, pairs=1000):
    flops = 4.0 * 32 * 128 * pairs
    return {"pairs": pairs, "fwd_ms": fwd_ms, "fwd_tflops": flops / (fwd_ms * 1e-3) / 1e12,
            "fwdbwd_ms": fwdbwd_ms, "fwdbwd_tflops": 3.5 * flops / (fwdbwd_ms * 1e-3) / 1e12, "peak_gib": peak}


def test_round_orders_rotate():
    assert attention.round_orders(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                          ["a", "b", "c"]]
    assert attention.round_orders(["a"], 2) == [["a"], ["a"]]
    assert attention.round_orders([], 3) == []


def test_combine_rounds_takes_the_median_round():
    one = res(2.0, 8.0)
    assert attention.combine_rounds([one]) == one  # a single round is passed through
    c = attention.combine_rounds([res(2.0, 9.0, peak=1.5), res(3.0, 8.0), res(2.5, 10.0, peak=0.5)])
    assert c["rounds"] == 3 and c["fwd_ms"] == 2.5 and c["fwdbwd_ms"] == 9.0 and c["peak_gib"] == 1.5
    assert c["fwd_ms_rounds"] == [2.0, 3.0, 2.5]
    # TF/s belongs to the median time, not to any one round's.
    assert c["fwd_tflops"] == pytest.approx(res(2.5, 9.0)["fwd_tflops"])
    assert c["fwdbwd_tflops"] == pytest.approx(res(2.5, 9.0)["fwdbwd_tflops"])


def test_combine_rounds_reports_an_error():
    assert attention.combine_rounds([res(2.0, 8.0), {"error": "OOM"}]) == {"error": "OOM"}


def test_round_speedups_pair_rounds():
    per = {"dualkv": [res(1.0, 4.0), res(1.1, 4.4), res(1.0, 4.0)],
           "fa2": [res(2.0, 8.0), res(2.0, 8.0), res(3.0, 8.0)],
           "broken": [{"error": "x"}]}
    fwd = attention.round_speedups(per, "fwd")
    assert fwd["fa2"] == pytest.approx(2.0)  # median of 2.0, 1.818, 3.0
    assert "broken" not in fwd and "dualkv" not in fwd
    assert attention.round_speedups(per, "fwdbwd")["fa2"] == pytest.approx(2.0)
    assert attention.round_speedups({"dualkv": [res(1, 4)], "fa2": [res(2, 8)]}, "fwd") == {}  # one round: none
