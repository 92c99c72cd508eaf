"""bench/attention.py's round logic (--rounds): rotated method orders, the median round and the
same-round ratios. Pure Python; the timing itself needs a GPU and runs on the device."""
from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import attention  # noqa: E402
import peers  # noqa: E402


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


def test_measure_case_interleaves_rounds_and_stops_retrying_a_failure():
    calls = []
    times = {"dualkv": iter([1.0, 1.1, 1.0]), "dualkv_ab": iter([1.0, 1.0, 1.05])}

    def run(m):
        calls.append(m)
        if m == "broken":
            raise RuntimeError("no kernel\nsecond line")
        t = next(times[m])
        return res(t, 4 * t)
    per = attention.measure_case(["dualkv", "dualkv_ab", "broken"], 3, run)
    # round r starts at method r mod 3; "broken" is tried once only
    assert calls == ["dualkv", "dualkv_ab", "broken", "dualkv_ab", "dualkv", "dualkv", "dualkv_ab"]
    assert per["broken"] == [{"error": "RuntimeError: no kernel"}]
    assert [r["fwd_ms"] for r in per["dualkv"]] == [1.0, 1.1, 1.0]
    assert len(attention.measure_case(["a"], 0, lambda m: res(1, 4))["a"]) == 1  # at least one round


def test_ab_summary_same_round_ratios_and_verdict():
    per = {"dualkv": [res(1.00, 4.0), res(1.10, 4.4), res(1.02, 4.0)],
           "dualkv_ab": [res(1.00, 3.9), res(1.00, 4.0), res(1.00, 3.8)]}
    ab = attention.ab_summary(per, 0.02)
    assert ab["fwd"]["time_ratios"] == pytest.approx([1.0, 1.1, 1.02])
    assert ab["fwd"]["median"] == pytest.approx(1.02)
    # 2% slower at the median but not in every round: within
    assert ab["fwd"]["within"] and not ab["fwd"]["slower_every_round"]
    # slower in every round (by 1.1-5%): outside, even though the median 1.026 is close
    assert ab["fwdbwd"]["slower_every_round"] and not ab["fwdbwd"]["within"]
    # faster in every round: within
    fast = attention.ab_summary({"dualkv": [res(1, 4)] * 3, "dualkv_ab": [res(2, 8)] * 3}, 0.02)
    assert fast["fwd"]["within"] and fast["fwd"]["median"] == 0.5
    # a median past the tolerance is outside even if one round was faster
    slow = attention.ab_summary({"dualkv": [res(1.0, 4), res(1.1, 4), res(1.1, 4)],
                                 "dualkv_ab": [res(1.01, 4), res(1.0, 4), res(1.0, 4)]}, 0.02)
    assert not slow["fwd"]["within"] and not slow["fwd"]["slower_every_round"]
    # one round, or a failed build: no verdict
    assert attention.ab_summary({"dualkv": [res(1, 4)], "dualkv_ab": [res(1, 4)]}, 0.02) == {}
    assert attention.ab_summary({"dualkv": [res(1, 4)] * 3, "dualkv_ab": [{"error": "x"}]}, 0.02) == {}


def test_case_results_combines_rounds_and_adds_the_ab():
    per = {"dualkv": [res(1.0, 4.0), res(1.2, 4.0), res(1.1, 4.0)],
           "dualkv_ab": [res(1.0, 4.0), res(1.0, 4.0), res(1.0, 4.0)],
           "sdpa_flash": [res(3.0, 12.0), res(3.0, 12.0), res(3.0, 12.0)]}
    entry = attention.case_results(per, 0.02)
    assert entry["results"]["dualkv"]["fwd_ms"] == 1.1
    assert entry["results"]["sdpa_flash"]["dualkv_speedup_fwd"] == pytest.approx(3.0 / 1.1)
    assert entry["results"]["sdpa_flash"]["dualkv_speedup_fwd_rounds"] == pytest.approx(3.0 / 1.1)
    assert entry["ab"]["fwd"]["median"] == pytest.approx(1.1) and not entry["ab"]["fwd"]["within"]
    assert entry["ab"]["fwdbwd"]["within"]
    assert "ab" not in attention.case_results({"dualkv": per["dualkv"]}, 0.02)


def test_a_second_library_build_runs_in_the_same_process(tmp_path):
    """Library.load: a copy of the library at another path is a separate build in this process;
    inside active() every dualkv call (layout, attention) goes to it, and the default comes back."""
    import shutil

    import torch

    import dualkv
    default = attention.Library.default()
    copy = tmp_path / "libdualkv_ab.so"
    shutil.copy(default.path, copy)
    other = attention.Library.load(copy)
    assert other.handle is not default.handle and other.path == copy.resolve()
    layout = dualkv.Layout.from_groups([5], [[3, 2]])
    q, k, v = (torch.randn(layout.num_tokens, 2, 8, dtype=torch.float64) for _ in range(3))
    ref = dualkv.attention(q, k, v, layout)
    with other.active():
        assert dualkv._native.lib() is other.handle
        out = dualkv.attention(q, k, v, dualkv.Layout.from_groups([5], [[3, 2]]))
    assert dualkv._native.lib() is default.handle
    assert torch.equal(out, ref)
    info = other.describe()
    assert info["path"] == str(copy.resolve()) and len(info["sha256"]) == 64 and "abi_version" in info["build"]
    with pytest.raises(dualkv.LibraryNotFoundError, match="missing"):
        attention.Library.load(tmp_path / "missing.so")
    not_dualkv = pathlib.Path(torch.__file__).parent / "lib" / "libc10.so"
    with pytest.raises(dualkv.LibraryNotFoundError, match="not a libdualkv"):
        attention.Library.load(not_dualkv)


def test_ab_rounds_against_an_abi1_build(abi1_library):
    """--ab-library with an ABI-1 build (72977b9, issue 15's base): the rounds of measure_case run a
    real fwd+bwd through each build (on the CPU: the timing itself needs a GPU, so the times are
    fake) via directions() with the build's switch, as method_dualkv does, and give the A/B verdict."""
    import torch

    import dualkv
    libraries = {"dualkv": attention.Library.default(), "dualkv_ab": attention.Library.load(abi1_library)}
    assert libraries["dualkv_ab"].describe()["build"]["abi_version"] == 1
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(14, h, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    x.append(torch.randn(14, 4, 8, generator=g, dtype=torch.float64))
    outputs, times = {}, {"dualkv": iter([1.0, 1.1, 1.0]), "dualkv_ab": iter([1.0, 1.0, 1.0])}

    def run(m):
        with libraries[m].active():
            layout = dualkv.Layout.from_groups([5], [[3, 2, 4]])
        _, fwdbwd = attention.directions(lambda x: dualkv.attention(x[0], x[1], x[2], layout), 3,
                                         libraries[m].active)
        fwdbwd(x)
        outputs.setdefault(m, []).append([t.grad.clone() for t in x[:3]])
        t = next(times[m])
        return res(t, 4 * t)
    entry = attention.case_results(attention.measure_case(["dualkv", "dualkv_ab"], 3, run), 0.02)
    assert entry["ab"]["fwd"]["median"] == pytest.approx(1.0) and entry["ab"]["fwdbwd"]["within"]
    for grads in outputs["dualkv_ab"]:
        for a, b in zip(grads, outputs["dualkv"][0]):
            torch.testing.assert_close(a, b)


def test_ab_table_names_both_builds_and_the_verdicts():
    per = {"dualkv": [res(1.0, 4.0), res(1.1, 4.4), res(1.1, 4.4)], "dualkv_ab": [res(1.0, 4.4)] * 3}
    results = {"env": {"dualkv_library": {"path": "/new/libdualkv.so"}, "ab_label": "72977b9",
                       "dualkv_ab_library": {"path": "/base/libdualkv.so"}},
               "ab_tolerance": 0.02, "cases": [dict(attention.case_results(per, 0.02), case={"name": "N16_P4096"})]}
    table = attention.ab_table(results).splitlines()
    assert "/new/libdualkv.so" in table[0] and "/base/libdualkv.so, 72977b9" in table[0] and "1.02" in table[0]
    assert table[2].split()[:3] == ["N16_P4096", "fwd", "1.100"] and table[2].endswith("OUTSIDE")
    assert table[3].split()[:3] == ["N16_P4096", "fwdbwd", "1.000"] and table[3].endswith("within")


def test_key_end_is_the_forest_rule():
    """Flex's mask_mod (k <= q < key_end[k]) is the visibility of dualkv.reference, GRPO groups."""
    import torch

    from dualkv.reference import visibility_mask
    case = attention.Case("c", [5, 3], [[2, 4, 1], [3]])
    end = case.key_end()
    idx = torch.arange(case.T)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])
    assert torch.equal(mask, visibility_mask(case.layout_cpu))
    assert int(mask.sum()) == case.shared_pairs


def test_next_block_size_follows_the_refused_tiles():
    tiles = [set(), set()]
    msg = "RuntimeError: CuteDSL template failed: sparse_block_size[1] must be a multiple of tile_n=80"
    assert peers.next_block_size((256, 128), tiles, msg) == (256, 160)
    # a second kernel (the backward, say) asks for 64 on the same side: a multiple of both
    assert peers.next_block_size((256, 160), tiles, "sparse_block_size[1] must be a multiple of tile_n=64") \
        == (256, 320)
    assert peers.next_block_size((64, 320), tiles, "sparse_block_size[0] must be a multiple of tile_m=128") \
        == (128, 320)
    assert peers.next_block_size((256, 128), [set(), set()], "out of memory") is None
    # the backward's stricter form (seen on the H200 at head dim 256): the block must equal the tile
    equal = "Block sparsity requires sparse_block_size[1]=160 to match tile_n=80."
    assert peers.next_block_size((256, 160), [set(), {80}], equal) == (256, 80)
    assert peers.next_block_size((256, 80), [set(), {80}], equal.replace("160", "80")) is None


def test_accepted_block_size_retries_refusals_only():
    """A refused block size is retried with the next one (every refusal recorded); an error that names
    no tile is raised as it is, and so is a run out of tries."""
    ran = []

    def attempt(block):
        ran.append(block)
        if block[1] % 80:
            raise RuntimeError("BackendCompilerFailed:\n sparse_block_size[1] must be a multiple of tile_n=80")
        return "compiled"
    assert peers.accepted_block_size(attempt, (256, 128)) == (
        "compiled", (256, 160), [{"block_size": [256, 128], "error": "BackendCompilerFailed: sparse_block_size[1] "
                                  "must be a multiple of tile_n=80"}])
    assert ran == [(256, 128), (256, 160)]

    def oom(block):
        raise RuntimeError("CUDA out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        peers.accepted_block_size(oom, (256, 128))

    def never(block):
        raise RuntimeError(f"sparse_block_size[0] must be a multiple of tile_m={block[0] + 1}")
    with pytest.raises(RuntimeError, match="no block size accepted after 2 tries"):
        peers.accepted_block_size(never, (64, 64), tries=2)


def test_fa4_missing_is_a_clear_skip(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_flash(name, *a, **kw):
        if name.startswith("flash_attn"):
            raise ImportError("No module named 'flash_attn'")
        return real_import(name, *a, **kw)
    monkeypatch.setattr(builtins, "__import__", no_flash)
    with pytest.raises(peers.Unavailable, match="skipped: FlashAttention-4 .* fa4-install"):
        peers.fa4()
    per = attention.measure_case(["fa4_dense"], 2, lambda m: peers.fa4())
    assert per["fa4_dense"] == [{"error": per["fa4_dense"][0]["error"]}]  # recorded once, not retried
    assert per["fa4_dense"][0]["error"].startswith("Unavailable: skipped: FlashAttention-4")


def test_directions_feed_every_output_its_gradient():
    import torch
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    ga, gb = torch.randn(3), torch.randn(3)
    fwd, fwdbwd = attention.directions(lambda x: [x[0] * 2, x[1] * 3], 2)
    out = fwd([a, b, ga, gb])
    assert not out[0].requires_grad
    fwdbwd([a, b, ga, gb])
    assert torch.equal(a.grad, 2 * ga) and torch.equal(b.grad, 3 * gb)
    fwdbwd([a, b, ga, gb])  # grads are reset between calls, not accumulated
    assert torch.equal(a.grad, 2 * ga)


def test_summary_table_states_flex_costs_apart():
    flex = dict(res(2.0, 8.0), block_size=[256, 160], mask_first_build_s=3.5, mask_build_ms=1.25,
                compile_fwd_s=9.0, compile_fwdbwd_s=21.0, dualkv_speedup_fwdbwd=2.0)
    results = {"cases": [{"case": {"name": "N16"}, "results": {"dualkv": res(1.0, 4.0), "flex_fa4": flex,
                                                              "fa4_dense": {"error": "Unavailable: skipped: x"}}}]}
    lines = attention.summary_table(results).splitlines()
    assert lines[2].split()[1] == "flex_fa4" and "2.00x" in lines[2]
    assert "block mask 256x160, first build 3.50 s, then 1.2 ms per build" in lines[3]
    assert "compile fwd 9.0 s, fwd+bwd 21.0 s" in lines[3]
    assert lines[4].split()[:3] == ["N16", "fa4_dense", "Unavailable:"]
