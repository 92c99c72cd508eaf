"""bench/attention.py's round logic (--rounds): rotated method orders, the median round and the
same-round ratios. Pure Python; the timing itself needs a GPU and runs on the device."""
from __future__ import annotations

import argparse
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import attention  # noqa: E402
import layout_classes  # noqa: E402
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
    # deterministic mode: its forward+backward compared as det_fwdbwd, next to the default mode's
    det = attention.ab_summary({"dualkv": [res(1, 4)] * 2, "dualkv_ab": [res(1, 4)] * 2,
                                "dualkv_det": [res(1, 5)] * 2, "dualkv_ab_det": [res(1, 4)] * 2}, 0.02)
    assert set(det) == {"fwd", "fwdbwd", "det_fwdbwd"}
    assert det["det_fwdbwd"]["median"] == pytest.approx(1.25) and det["det_fwdbwd"]["slower_every_round"]


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
    case = attention.Case.groups("c", [5, 3], [[2, 4, 1], [3]])
    end = case.key_end()
    idx = torch.arange(case.T)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])
    assert torch.equal(mask, visibility_mask(case.layout_cpu))
    assert int(mask.sum()) == case.shared_pairs


def test_key_end_is_the_forest_rule_on_a_tree():
    """The same on a three-level tree (a layout class's shape), and its unpacked rows are the
    root-to-leaf paths: their causal pairs count every visible pair once per path through it."""
    import torch

    from dualkv.reference import visibility_mask
    lens, parents = [4, 3, 2, 2, 5, 1], [-1, 0, 1, 1, 0, -1]
    case = attention.Case("t", lens, parents)
    end = case.key_end()
    idx = torch.arange(case.T)
    mask = (idx[None, :] <= idx[:, None]) & (idx[:, None] < end[None, :])
    assert torch.equal(mask, visibility_mask(case.layout_cpu))
    assert case.seq_lens == [9, 9, 9, 1] and case.prompts is None and not case.uniform
    assert case.describe()["paths"] == 4 and case.describe()["segment_lens"] == lens


@pytest.mark.parametrize("name", layout_classes.CLASSES)
def test_layout_classes_are_fixed_forests_of_their_shape(name):
    """Each class is one layout (same lengths on every call), a valid forest in DFS order, with the
    lengths its docstring names."""
    lens, parents = layout_classes.layout_class(name)
    assert (lens, parents) == layout_classes.layout_class(name)
    assert all(p < s for s, p in enumerate(parents))  # parents come first (DFS order)
    case = attention.Case(name, lens, parents)
    assert 30_000 <= case.T <= 90_000, case.T  # a micro-batch: thousands of tiles, all SMs busy
    roots = [s for s, p in enumerate(parents) if p < 0]
    leaves = [s for s in range(len(lens)) if s not in parents]
    if name == "small_groups":
        assert len(roots) == 24 and all(100 <= lens[r] <= 600 for r in roots)
        assert all(50 <= lens[s] <= 400 for s in leaves)
    elif name == "tiny_responses":
        assert all(lens[r] == 4096 for r in roots) and all(1 <= lens[s] <= 64 for s in leaves)
        assert case.expanded_pairs > 10 * case.shared_pairs
    elif name == "long_responses":
        assert all(lens[r] == 256 for r in roots) and all(2048 <= lens[s] <= 8192 for s in leaves)
        assert case.expanded_pairs < 1.1 * case.shared_pairs  # rho ~ 1: nothing shared to save
    else:
        assert len(roots) == 4 and len(leaves) == 64 and len(case.seq_lens) == 64
        assert case.layout_cpu.max_depth == 3


def test_classes_option_names_the_classes():
    assert attention.class_list("all") == ",".join(layout_classes.CLASSES)
    assert attention.class_list("tree,small_groups") == "tree,small_groups"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown layout class trees"):
        attention.class_list("tree,trees")
    with pytest.raises(ValueError, match="unknown layout class"):
        layout_classes.layout_class("nope")


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
    # FA4's backward then names its own size, 64, which the forward refuses: the sizes alternate until
    # accepted_block_size runs out of tries, every refusal recorded
    expects = "ValueError: Block sparsity expects sparse_block_size[1]=64 for kv_subtile_factor=1."
    assert peers.next_block_size((256, 80), [set(), {80}], expects) == (256, 64)


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
    assert "warm" not in lines[3]
    results["env"] = {"compile_cache_at_start": {"inductor_cache_dir": "/tmp/x", "warm": True}}
    assert attention.summary_table(results).splitlines()[3].endswith(
        "(outside the times above; torch's compile cache was warm at process start)")


def test_compile_cache_state_says_whether_the_inductor_cache_held_anything(tmp_path, monkeypatch):
    """A missing or empty cache directory is cold, one with anything in it warm (TORCHINDUCTOR_CACHE_DIR
    is where torch's cache_dir() looks first; it creates the directory)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cache"))
    assert peers.compile_cache_state() == {"inductor_cache_dir": str(tmp_path / "cache"), "warm": False}
    assert peers.compile_cache_state()["warm"] is False  # torch's cache_dir() made it: still empty
    (tmp_path / "cache" / "fxgraph").mkdir(parents=True)
    assert peers.compile_cache_state()["warm"] is True


def test_summary_table_states_the_sustained_rate_with_its_clock():
    """--sustain: a line per direction under the method with the sustained rate, its duration and
    the median clock / power, or that nvidia-smi gave nothing."""
    tel = {"samples": 80, "sm_clock_mhz_median": 1650.0, "sm_clock_mhz_min": 1380.0, "power_w_median": 689.6,
           "temperature_c_max": 65.0}
    dk = dict(res(1.0, 4.0), sustained={"fwd": {"seconds": 4.01, "calls": 1700, "ms": 2.37, "tflops": 579.1,
                                                 "telemetry": tel},
                                         "fwdbwd": {"seconds": 4.2, "calls": 1000, "ms": 4.2, "tflops": 480.0,
                                                    "telemetry": None}})
    lines = attention.summary_table({"cases": [{"case": {"name": "N16"}, "results": {"dualkv": dk}}]}).splitlines()
    assert "dualkv: sustained fwd 579.1 TF/s over 4.0 s at SM clock 1650 MHz (min 1380), 690 W" in lines[2]
    assert "dualkv: sustained fwd+bwd 480.0 TF/s over 4.2 s (no nvidia-smi telemetry)" in lines[3]


# ---- head dim 512: the peers without a kernel there, the best dense rate ----

@pytest.mark.parametrize("method", ["sdpa_flash", "sdpa_cudnn", "fa4_dense", "flex_fa4"])
def test_peers_above_their_head_dim_are_skipped_before_any_work(method):
    """At head dim 512 SDPA's FlashAttention and cuDNN backends and FA4 (dense and under Flex) have
    no kernel: build_method raises Unavailable naming the limit (measure_case records it as
    skipped), before touching a device or importing FA4; at 256 the check passes."""
    case = attention.Case.groups("c", [9], [[3, 4]])
    with pytest.raises(peers.Unavailable, match=f"skipped: {method} has no kernel above head dim 256 \\(got 512\\)"):
        attention.build_method(method, case, 4, 2, 512, None, {})
    attention.check_head_dim(method, 256)
    for other in ("dualkv", "sdpa_efficient", "flex", "pgrouper"):
        attention.check_head_dim(other, 512)
    per = attention.measure_case([method], 2, lambda m: attention.build_method(m, case, 4, 2, 512, None, {}))
    assert per[method] == [{"error": f"Unavailable: skipped: {method} has no kernel above head dim 256 (got 512)"}]


def test_best_dense_is_the_fastest_dense_peer_that_ran():
    """best_dense: per direction the dense peer (unpacked batch) with the highest useful rate among
    those that ran (Flex, on the packed layout, and failed peers are not candidates), and dualkv's
    rate over it; the case entry and the summary table carry it."""
    per = {"dualkv": [res(1.0, 4.0, pairs=3000)],
           "sdpa_flash": [{"error": "Unavailable: skipped: sdpa_flash has no kernel above head dim 256 (got 512)"}],
           "sdpa_efficient": [res(2.0, 8.0, pairs=4000)],
           "fa4_dense": [res(1.0, 9.0, pairs=1000)],
           "flex": [res(0.5, 1.0, pairs=3000)]}
    entry = attention.case_results(per, 0.02)
    best = entry["best_dense"]
    assert best["fwd"]["method"] == "sdpa_efficient"  # 4000 pairs in 2 ms beats 1000 in 1 ms
    assert best["fwd"]["dualkv_over_best"] == pytest.approx((3000 / 1.0) / (4000 / 2.0))
    assert best["fwdbwd"]["method"] == "sdpa_efficient"
    assert best["fwdbwd"]["dualkv_over_best"] == pytest.approx((3000 / 4.0) / (4000 / 8.0))
    assert "best_dense" not in attention.case_results({"dualkv": per["dualkv"], "flex": per["flex"]}, 0.02)
    lines = attention.summary_table({"cases": [dict(entry, case={"name": "N16"})]}).splitlines()
    assert any("best dense fwd: sdpa_efficient" in line and "dualkv 1.50x its rate" in line for line in lines)
    assert any("best dense fwd+bwd: sdpa_efficient" in line and "dualkv 1.50x its rate" in line for line in lines)
    only_peer = attention.best_dense(attention.case_results({"fa4_dense": [res(1.0, 4.0)]}, 0.02)["results"])
    assert only_peer["fwd"]["method"] == "fa4_dense" and "dualkv_over_best" not in only_peer["fwd"]


# ---- mask modifiers (issue 16): --window, --softcap, --sinks ----

def test_window_pairs_count_the_visible_pairs():
    """The useful pairs under a window: the packed layout's (sum of min(position + 1, W)) equal the
    dense reference mask's count, and the expanded sequences' a brute-force count."""
    from dualkv.reference import visibility_mask
    case = attention.Case.groups("c", [7, 3], [[2, 5, 1], [4]])
    for window in (1, 3, 6, 100):
        assert case.window_pairs(window) == int(visibility_mask(case.layout_cpu, window).sum())
        brute = sum(min(i + 1, window) for n in case.seq_lens for i in range(n))
        assert case.expanded_window_pairs(window) == brute
    assert case.window_pairs(None) == case.shared_pairs and case.expanded_window_pairs(None) == case.expanded_pairs


def test_mods_flags_and_names():
    m = attention.Mods(128, None, True)
    assert m.active and m.used() == {"window": 128, "sinks": None} and m.tag() == "w128_sinks"
    assert attention.Mods(None, 50.0).tag() == "cap50" and not attention.NO_MODS.active
    with pytest.raises(ValueError, match="--window"):
        attention.Mods(0)
    with pytest.raises(ValueError, match="--softcap"):
        attention.Mods(None, -1.0)


@pytest.mark.parametrize("mods", [(4, None, False), (None, 5.0, False), (None, None, True), (3, 2.0, True)])
def test_flex_modifiers_equal_dualkv_on_the_cpu(mods):
    """Flex's window mask_mod, softcap score_mod and the lse sink correction (forward, eager Flex on
    the CPU: it has no CPU backward) give dualkv's CPU output with the same modifiers (fp32)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    import dualkv
    mods = attention.Mods(*mods)
    case = attention.Case.groups("c", [9, 4], [[3, 6, 1], [5, 2]])
    H, Hk, D, T = 4, 2, 16, case.T
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (H, Hk, Hk))
    sinks = torch.randn(H, generator=g) if mods.sinks else None
    ref = dualkv.attention(q, k, v, case.layout_cpu, window=mods.window, softcap=mods.softcap, sinks=sinks)
    mask_mod, score_mod = attention.flex_mods(case, mods, "cpu")
    block_mask = create_block_mask(mask_mod, 1, 1, T, T, device="cpu")
    qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out, lse = attention.flex_with_lse(flex_attention, qf, kf, vf, block_mask=block_mask, score_mod=score_mod,
                                       enable_gqa=True)
    if mods.sinks:
        out = attention.apply_sinks(out, lse, sinks)
    torch.testing.assert_close(out[0].transpose(0, 1), ref, rtol=1e-5, atol=1e-5)


def test_dualkv_method_runs_the_modifiers_and_skips_where_unsupported(monkeypatch):
    """build_method("dualkv") with window + softcap + sinks runs forward and backward on the CPU
    backend (the sinks get their gradient; the pairs count the window); a backend without the
    modifiers (as CUDA before the kernel branch) is recorded as skipped with the library's reason,
    and SDPA and pgrouper, which have no modifiers, are skipped too."""
    import torch

    import dualkv
    monkeypatch.setattr(attention, "DEVICE", "cpu")
    case = attention.Case.groups("c", [8], [[3, 5, 2]])
    mods = attention.Mods(4, 30.0, True)
    libraries = {"dualkv": attention.Library.default()}
    setup, fwd, fwdbwd, pairs, _ = attention.build_method("dualkv", case, 4, 2, 16, torch.float32, libraries, mods)
    x = setup(1)
    assert len(x) == 5 and x[3].shape == (4,) and x[3].requires_grad
    fwdbwd(x)
    assert all(t.grad is not None for t in x[:4]) and pairs == case.window_pairs(4) < case.shared_pairs
    ref = dualkv.attention(x[0].detach(), x[1].detach(), x[2].detach(), case.layout_cpu, window=4, softcap=30.0,
                           sinks=x[3].detach())
    torch.testing.assert_close(fwd(x), ref)

    monkeypatch.setattr(dualkv._native, "backend_modifiers", lambda device_type: ())
    per = attention.measure_case(["dualkv", "sdpa_flash", "pgrouper"], 1, lambda m: attention.build_method(
        m, case, 4, 2, 16, torch.float32, libraries, mods))
    assert per["dualkv"][0]["error"].startswith("Unavailable: skipped: attention: the CPU backend does not implement")
    assert per["sdpa_flash"][0]["error"].startswith("Unavailable: skipped: sdpa_flash has no sliding window")
    assert per["pgrouper"][0]["error"].startswith("Unavailable: skipped: pgrouper")


def test_fa4_modifier_arguments_are_probed(monkeypatch):
    """fa4_dense passes window_size=(W - 1, 0), softcap and learnable_sink to FA4; a version whose
    function lacks one of them is a skip that names it."""
    def new_fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                softcap=0.0):
        pass

    def old_fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0):
        pass
    assert attention.fa4_modifier_kwargs(new_fa4, attention.Mods(128, 50.0, True)) == {
        "window_size": (127, 0), "softcap": 50.0}
    assert attention.fa4_modifier_kwargs(old_fa4, attention.Mods(128)) == {"window_size": (127, 0)}
    with pytest.raises(peers.Unavailable, match="skipped: this FlashAttention-4's old_fa4 takes no learnable_sink"):
        attention.fa4_modifier_kwargs(old_fa4, attention.Mods(None, None, True))


def test_fa4_dense_nopack_turns_pack_gqa_off(monkeypatch):
    """fa4_dense_nopack is fa4_dense with pack_gqa=False passed to FA4 (its sm90 default packs a KV
    head's query heads when H > Hk); fa4_dense passes none (FA4's default)."""
    seen = []

    def fake_dense(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                   pack_gqa=None):
        seen.append(pack_gqa)
        return q
    monkeypatch.setattr(attention, "fa4", lambda: (fake_dense, fake_dense))
    case = attention.Case.groups("c", [5], [[3, 3]])  # two sequences of 8: flash_attn_func on the batch
    x = [torch.zeros(2, 8, 4, 64), torch.zeros(2, 8, 2, 64), torch.zeros(2, 8, 2, 64)]
    for name, want in (("fa4_dense_nopack", False), ("fa4_dense", None)):
        _, fwd, _, pairs, extras = attention.build_method(name, case, 4, 2, 64, None, {})
        fwd(x)
        assert seen.pop() is want and extras == {"call": "flash_attn_func"}
        assert pairs == case.expanded_pairs


def test_device_run_bench_mods_step():
    """tests/gpu/device_run.sh bench-mods: the three modifier shapes, each process capped (170 s: one
    shape per device call, or the three in one ~9 min call), selectable with MODS_SHAPES."""
    import re
    text = (pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpu" / "device_run.sh").read_text()
    body = text[text.index("\n    bench-mods) ") + 1:]
    body = body[:re.search(r"\n    [\w-]+\) ", body).start()]
    assert "--heads 64 --kv-heads 8 --head-dim 64 --window 128 --sinks" in body
    assert "--softcap 50" in body and "--window 1024" in body and "--no-varlen" in body
    assert 'timeout -k 10 "${MODS_TIMEOUT:-170}"' in body and body.count("--head-dim") == 3  # 3 x 170 s + kill grace
    assert '${MODS_SHAPES:-gptoss cap50 w1024}' in body
