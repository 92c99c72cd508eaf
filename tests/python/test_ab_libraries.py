"""tools/ab_libraries.py, the A/B of two libdualkv builds in one process, in its CPU smoke mode: with
the test suite's library as base and as candidate every check passes and it exits 0; with one output
of the candidate perturbed (the tool's test-only --self-test-perturb) it reports DIFF and exits 1,
for an output under the bitwise rule (lse) and one under the reduce-noise rule (dq); --fwd-rule
reference judges a forward by the float64 reference instead of bits. The profile's
bookkeeping (rotating rounds, medians, a kernel no library ran) with fixed times in place of the
profiler, which needs a GPU."""
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from dualkv import _native

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "ab_libraries.py"


@pytest.fixture(scope="module")
def library() -> pathlib.Path:
    """The libdualkv the suite runs on (every build has the CPU backend the smoke mode uses)."""
    try:
        handle = _native.lib()
    except _native.LibraryNotFoundError as e:
        pytest.skip(f"no libdualkv for the tool to compare (set DUALKV_LIBRARY): {e}")
    return pathlib.Path(handle._name).resolve()


def run_tool(library: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join(p for p in (str(ROOT / "python"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, DUALKV_LIBRARY=str(library), PYTHONPATH=path)
    cmd = [sys.executable, str(TOOL), "--base", str(library), "--cand", str(library), "--device", "cpu",
           "--dims", "64", "--runs", "2", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)


def test_same_library_passes_every_check(library):
    r = run_tool(library, "--check", "both", "--deterministic", "--mods", "prefix", "--cases",
                 "tiny T,prefix ragged")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for expected in ("ok    fwd cand | tiny T D64", "ok    bwd default cand | tiny T D64",
                     "ok    bwd deterministic cand | tiny T D64", "ok    ref64 bwd default cand | tiny T D64",
                     "ok    bwd default cand | prefix ragged D64", "ok    ref64 bwd default cand | prefix ragged D64"):
        assert expected in out, out
    assert not [line for line in out.splitlines() if line.startswith(("DIFF", "ERROR"))], out
    # the prefix gradients are compared too
    assert "prefix ragged D64 (T 472, H 8/2, prefix 300 rows): out/lse/dk/dv/dprefix_k/dprefix_v bitwise" in out, out
    assert out.rstrip().splitlines()[-1].endswith("all ok"), out


def test_aa_control_is_a_second_library(library):
    """--aa loads a copy of the base's file as candidate aa: a library of its own (another path,
    not the self-comparison note), checked like any candidate; a label aa given twice is refused."""
    r = run_tool(library, "--check", "fwd", "--cases", "tiny T", "--aa")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ok    fwd cand | tiny T D64" in out and "ok    fwd aa | tiny T D64" in out, out
    assert "note: aa is the base's file" not in out and "ab_libraries_aa_" in out, out
    r = subprocess.run([sys.executable, str(TOOL), "--base", str(library), "--cand", f"aa={library}", "--aa",
                        "--check", "fwd", "--device", "cpu"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, DUALKV_LIBRARY=str(library)), cwd=ROOT, check=False)
    assert r.returncode == 2 and "--aa: a candidate is already labelled aa" in r.stderr, r.stderr


def test_perturbed_candidate_fails_the_bitwise_rule(library):
    r = run_tool(library, "--check", "fwd", "--cases", "tiny T", "--self-test-perturb", "lse")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "DIFF  fwd cand | tiny T D64" in out and "lse differs on 1 tokens" in out, out
    assert out.rstrip().splitlines()[-1].endswith("FAILED"), out


def test_fwd_rule_reference(library):
    """--fwd-rule reference (a forward that is not bitwise by design): the same library passes with its
    ref64 line; a perturbed out fails both the distance to the base and the reference's bound."""
    r = run_tool(library, "--check", "fwd", "--fwd-rule", "reference", "--cases", "tiny T")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "ok    fwd cand | tiny T D64" in out and "run to run bitwise x2" in out, out
    assert "ok    ref64 fwd cand | tiny T D64" in out, out
    r = run_tool(library, "--check", "fwd", "--fwd-rule", "reference", "--cases", "tiny T",
                 "--self-test-perturb", "out")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "DIFF  fwd cand | tiny T D64" in out and "above max |base| / 64" in out, out
    assert "DIFF  ref64 fwd cand | tiny T D64" in out and "ABOVE THE BOUND" in out, out


def load_tool(monkeypatch):
    """The tool as a module of this process (sys.path and sys.modules restored afterwards)."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # it prepends python/ and bench/
    spec = importlib.util.spec_from_file_location("ab_libraries", TOOL)
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, tool)  # its dataclasses look their module up
    spec.loader.exec_module(tool)
    return tool


def test_perturbed_candidate_fails_the_noise_rule(library, monkeypatch, capsys):
    """In this process (the CLI's exit status is the test above's): main()'s return value."""
    tool = load_tool(monkeypatch)
    monkeypatch.setenv("DUALKV_LIBRARY", str(library))
    status = tool.main(["--base", str(library), "--cand", str(library), "--device", "cpu", "--dims", "64",
                        "--runs", "2", "--check", "bwd", "--cases", "tiny T", "--self-test-perturb", "dq"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "DIFF  bwd default cand | tiny T D64" in out and "OUTSIDE THE NOISE" in out, out


def test_dkdv_noise_judges_dsinks_by_the_noise_rule(library, monkeypatch, capsys):
    """--dkdv noise: dsinks (moved by any change to delta's rounding) is judged as dK / dV are, by the
    noise rule, not bit for bit; a perturbed dsinks still fails it."""
    tool = load_tool(monkeypatch)
    monkeypatch.setenv("DUALKV_LIBRARY", str(library))
    common = ["--base", str(library), "--cand", str(library), "--device", "cpu", "--dims", "64", "--runs", "2",
              "--check", "bwd", "--mods", "sinks", "--cases", "sinks ragged", "--dkdv", "noise"]
    assert tool.main(common) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "dsinks |c-b| 0 " in out, out
    status = tool.main(common + ["--self-test-perturb", "dsinks"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "dsinks |c-b|" in out and "OUTSIDE THE NOISE" in out, out


def test_profile_rounds_and_a_kernel_no_library_ran(library, monkeypatch, capsys):
    """The profile's bookkeeping without a GPU: kernel_ms replaced by fixed device times. Libraries in
    rotating order, medians per library, cand/base; a substring no library ran is an ERROR."""
    tool = load_tool(monkeypatch)
    calls = []

    def fake_kernel_ms(build, case, T, D, dtype, backward, n_calls, kernels):
        calls.append((build.label, case.name, T, D, backward))
        ms = {"main": 2.0 if build.label == "base" else 1.5, "gone": 0.0, "all kernels": 3.0}
        return {k: ms[k] for k in list(kernels) + ["all kernels"]}, ["main_kernel"]

    monkeypatch.setattr(tool, "kernel_ms", fake_kernel_ms)
    base = tool.Build("base", library, {})
    cand = tool.Build("cand", library, {})
    args = tool.argparse.Namespace(device="cuda", check="bwd", kernels="main,gone", profile_mods="window=64",
                                   profile="2,256,64;1,128,32,128", rounds=3, profile_calls=2, heads=4,
                                   kv_heads=2, verbose=False)
    tally = tool.Tally()
    tool.run_profile(args, tally, [base, cand], [64], None)
    out = capsys.readouterr().out
    assert [c[0] for c in calls[:6]] == ["base", "cand", "cand", "base", "base", "cand"], calls
    assert {(c[2], c[3]) for c in calls} == {(384, 64), (160, 128)} and all(c[4] for c in calls), calls
    assert "profile N2 P256 R64 D64 window 64 fwd+bwd 'main' ms/call: base 2.000 (2.000 2.000 2.000), " \
           "cand 1.500 (1.500 1.500 1.500); cand/base 0.750 (per round: median 0.750, quartiles 0.750-0.750)" \
           in out, out
    assert tally.error == 2 and "no kernel matching 'gone' ran in any library" in out, out


def test_paired_ratio_reads_each_round_on_its_own(monkeypatch):
    """The per-round ratios of a long-walk run (session 32, N8 P16K R2K at D 128, the first 5 of its
    11 rounds): the ratio of the medians says 0.990, the rounds themselves 0.927-1.069, so the
    quartiles show that the run does not settle a 1% change. Fewer than 3 rounds: nothing printed."""
    tool = load_tool(monkeypatch)
    base = [{"k": t} for t in (9.712, 10.527, 10.300, 10.060, 10.645)]
    cand = [{"k": t} for t in (10.379, 10.221, 10.195, 10.421, 9.864)]
    # ratios 1.069, 0.971, 0.990, 1.036, 0.927
    assert tool.paired_ratio(cand, base, "k") == " (per round: median 0.990, quartiles 0.971-1.036)"
    assert tool.paired_ratio(cand[:2], base[:2], "k") == ""
    assert tool.paired_ratio([{"k": 1.0}] * 3, [{"k": 0.0}] * 3, "k") == ""  # a kernel the base did not run


def test_profile_takes_layout_classes_and_grpo_groups(monkeypatch):
    """--profile items: N,P,R[,D] (one GRPO group) or a bench/layout_classes.py class name[,D]; without
    D every head dim of --dims; anything else is a ValueError naming the item."""
    tool = load_tool(monkeypatch)
    items = tool.parse_profile("tree,64; 2,256,64 ;long_responses", [128, 256], 4, 2, {"window": 64})
    lens, parents = tool.layout_classes.layout_class("tree")
    assert [(c.name, t, D) for c, t, D in items] == [
        ("tree", sum(lens), 64), ("N2 P256 R64", 384, 128), ("N2 P256 R64", 384, 256),
        ("long_responses", sum(tool.layout_classes.layout_class("long_responses")[0]), 128),
        ("long_responses", sum(tool.layout_classes.layout_class("long_responses")[0]), 256)]
    assert items[0][0].tree == (lens, parents) and items[0][0].window == 64 and items[1][0].groups == ([256], [[64] * 2])
    assert all((c.heads, c.kv_heads) == (4, 2) for c, _, _ in items)
    for bad in ("trees", "2,256", "2,256,64,128,1", "tree,64,128"):
        with pytest.raises(ValueError, match="--profile"):
            tool.parse_profile(bad, [128], 4, 2, {})


def test_cand_env_per_label(monkeypatch):
    """--cand-env KEY=VALUE reaches every candidate, LABEL:KEY=VALUE only that one (and wins)."""
    tool = load_tool(monkeypatch)
    items = ["A=1", "b:A=2", "b:B=3", "c:C=4"]
    assert tool.cand_env(items, "a") == {"A": "1"}
    assert tool.cand_env(items, "b") == {"A": "2", "B": "3"}
    assert tool.cand_env(items, "c") == {"A": "1", "C": "4"}
    assert tool.cand_env(None, "a") == {}


def test_profile_only_skips_the_checks_and_exits_by_the_profile(library, monkeypatch, capsys):
    """--profile-only: no check runs, and main() returns 0 unless the profile reported an ERROR (the
    profiler itself needs a GPU: run_profile is replaced by one that tallies a given outcome)."""
    tool = load_tool(monkeypatch)
    monkeypatch.setenv("DUALKV_LIBRARY", str(library))
    monkeypatch.setattr(tool.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tool.torch.cuda, "get_device_name", lambda *a: "no GPU (test)")

    def no_checks(*a):
        raise AssertionError("--profile-only ran the checks")

    monkeypatch.setattr(tool, "run_checks", no_checks)
    argv = ["--base", str(library), "--cand", str(library), "--check", "fwd", "--dims", "64",
            "--profile", "2,256,64", "--kernels", "fwd", "--profile-only"]
    for errors, status in ((0, 0), (1, 1)):
        def fake_profile(args, tally, builds, dims, dtype, errors=errors):
            for _ in range(errors):
                tally.line("ERROR", "profile: a kernel no library ran")

        monkeypatch.setattr(tool, "run_profile", fake_profile)
        assert tool.main(argv) == status
        assert f"summary: profile only, {errors} ERROR" in capsys.readouterr().out


def test_profile_only_needs_a_profile_on_cuda(library):
    r = run_tool(library, "--check", "fwd", "--profile-only")
    assert r.returncode == 2 and "--profile-only needs --profile and --device cuda" in r.stderr, r.stderr


def test_a_candidate_lacking_a_case_is_skipped_alone(library, monkeypatch, capsys):
    """Candidates built with different head dims: each case compares the candidates that have it and
    skips the others by name (before, one lacking candidate skipped the case for all of them)."""
    tool = load_tool(monkeypatch)
    monkeypatch.setenv("DUALKV_LIBRARY", str(library))
    lacks = tool.Build.lacks

    def partial_lacks(self, device, head_dim, case):
        return "head dim 64 not built (test)" if self.label == "narrow" else lacks(self, device, head_dim, case)

    monkeypatch.setattr(tool.Build, "lacks", partial_lacks)
    argv = ["--base", str(library), "--cand", f"wide={library}", "--cand", f"narrow={library}", "--device", "cpu",
            "--check", "fwd", "--dims", "64", "--cases", "tiny T", "--runs", "1"]
    assert tool.main(argv) == 0
    out = capsys.readouterr().out
    assert "ok    fwd wide | tiny T D64" in out, out
    assert "skip  tiny T D64: narrow: head dim 64 not built (test)" in out, out
    assert "fwd narrow |" not in out, out
