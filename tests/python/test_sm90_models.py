"""The CPU models of the Hopper kernels' barrier protocols and index arithmetic (tests/models),
run in CI so a protocol change that breaks them is caught without a GPU. Each model must pass its
random schedules and catch every planted bug (a model that catches nothing proves nothing)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

MODELS = pathlib.Path(__file__).resolve().parents[2] / "tests" / "models"
RUNS = "150"


def run_model(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(MODELS / script), *args], capture_output=True, text=True, timeout=300)


# The kernel's forms: two stages with the split K / V release; three consumer warpgroups and two Q
# buffers at D 64 (fwd_kernel.cuh Sm90FwdConfig::kQBuffers).
FWD_MODES = [[], ["--split"], ["--no-pingpong"], ["--split", "--stages", "3"], ["--split", "--wgs", "3"],
             ["--split", "--q-buffers", "2"], ["--split", "--wgs", "3", "--q-buffers", "2"],
             ["--wgs", "3", "--q-buffers", "2"], ["--split", "--wgs", "3", "--q-buffers", "2", "--no-pingpong"],
             ["--split", "--wgs", "3", "--q-buffers", "2", "--stages", "3"],
             # D 256 and D 128's short-walk build: K one tile ahead of V, the V wait after the S issue
             # (fwd_kernel.cuh kKAhead, kLateVWait); D 64's short-walk build: the same with three
             # consumer warpgroups and two Q buffers
             ["--split", "--k-ahead", "--late-v"], ["--split", "--k-ahead", "--late-v", "--stages", "3"],
             ["--split", "--wgs", "3", "--q-buffers", "2", "--k-ahead", "--late-v"]]


@pytest.mark.parametrize("flags", FWD_MODES, ids=lambda f: " ".join(f) or "default")
def test_forward_protocol(flags):
    res = run_model("protocol_model.py", "--runs", RUNS, *flags)
    assert res.returncode == 0, res.stdout[-1500:] + res.stderr[-1500:]


# Planted bugs in the Q protocol (protocol_model.py Q_MUTANTS). An early q_empty release is masked
# by two K stages with two Q buffers (item n + 2's Q load follows its first K load, whose stage wait
# already comes after item n's last S retired: docs/notes/2026-12-04-d64-fwd-q-double-buffer.md), so
# it is planted with one Q buffer, and with two over three stages.
FWD_MUTANTS = [
    (["--split"], "q_release_early"),
    (["--split", "--wgs", "3", "--q-buffers", "2", "--stages", "3"], "q_release_early"),
] + [
    (["--split", "--wgs", "3", "--q-buffers", "2"], m) for m in ("q_parity_iter", "q_one_empty", "q_same_buffer")
] + [
    (["--split", "--k-ahead", "--late-v"], m) for m in ("q_release_early", "k_ahead_no_wait", "v_before_empty")
] + [
    (["--split", "--wgs", "3", "--q-buffers", "2", "--k-ahead", "--late-v"], m)
    for m in ("q_parity_iter", "q_one_empty", "k_ahead_no_wait", "v_before_empty")
]


@pytest.mark.parametrize("flags,mutant", FWD_MUTANTS, ids=lambda x: x if isinstance(x, str) else " ".join(x))
def test_forward_protocol_catches_planted_bug(flags, mutant):
    res = run_model("protocol_model.py", "--runs", RUNS, *flags, "--mutant", mutant)
    assert res.returncode == 0 and f"mutant {mutant} caught" in res.stdout, res.stdout[-1500:] + res.stderr[-1500:]


def test_forward_protocol_finds_the_one_stage_deadlock():
    res = run_model("protocol_model.py", "--runs", "20", "--stages", "1")
    assert res.returncode != 0 and "deadlock" in res.stdout + res.stderr


BWD_MODES = [[], ["--deterministic"], ["--bulk"], ["--bulk", "--deterministic"], ["--bulk", "--wide"], ["--d256"],
             ["--d256", "--deterministic"], ["--d256", "--no-stagger"], ["--d256", "--bulk"],
             ["--d256", "--bulk", "--deterministic"]]


@pytest.mark.parametrize("flags", BWD_MODES, ids=lambda f: " ".join(f) or "default")
def test_backward_protocol(flags):
    res = run_model("bwd_protocol_model.py", "--runs", RUNS, *flags)
    assert res.returncode == 0 and "ok:" in res.stdout, res.stdout[-1500:] + res.stderr[-1500:]


BWD_MUTANTS = [
    ([], m) for m in ("single_ds", "count32", "early_kv", "no_ds_bar", "early_qdo", "dk_first", "qdo_at_wait1",
                      "ds_fence_after_bar")
] + [
    (["--bulk"], m) for m in ("single_ds", "early_qdo", "dq_no_wait_read", "dq_no_empty_wait", "dq_full4",
                              "dq_missing_arrive", "item_empty8", "dk_first", "qdo_at_wait1", "ds_fence_after_bar")
] + [
    (["--bulk", "--wide"], m) for m in ("dq_stage_parity", "dq_no_wait_read", "dq_no_empty_wait", "dq_full4",
                                        "dq_missing_arrive", "single_ds", "qdo_at_wait1")
] + [
    (["--d256"], m) for m in ("count32", "early_kv", "p_no_bar", "p_arrive_early", "d256_early_qdo", "d256_no_ds_bar")
] + [(["--d256", "--deterministic"], "det_no_end_bar")] + [
    (["--d256", "--bulk"], m) for m in ("d256_consumer_release", "d256_qdo_empty8", "d256_stage_no_bar",
                                        "dq_no_wait_read", "dq_full4", "dq_missing_arrive", "item_empty8")
]


@pytest.mark.parametrize("flags,mutant", BWD_MUTANTS, ids=lambda x: x if isinstance(x, str) else " ".join(x) or "default")
def test_backward_protocol_catches_planted_bug(flags, mutant):
    res = run_model("bwd_protocol_model.py", "--runs", RUNS, *flags, "--mutant", mutant)
    assert res.returncode == 0 and f"mutant {mutant} caught" in res.stdout, res.stdout[-1500:] + res.stderr[-1500:]


def test_d256_fragment_index_model():
    pytest.importorskip("numpy")
    res = run_model("bwd_d256_fragment_model.py")
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1].startswith("ok:"), res.stdout[-1500:]


@pytest.mark.parametrize("mutant", ["stage_no_xor", "stage_row8", "stage_box", "stage_no_zero", "stage_same_buf",
                                    "rowstat_rowmajor"])
def test_d256_fragment_index_model_catches_planted_bug(mutant):
    pytest.importorskip("numpy")
    res = run_model("bwd_d256_fragment_model.py", "--mutant", mutant)
    assert res.returncode == 0 and f"mutant {mutant} caught" in res.stdout, res.stdout[-1500:]


def test_dq_staging_model():
    """The Hopper backward's dQ staging stores (bwd_stage_dq_fragment, every head dim): every element
    where the dQ writer's TMA reduce reads it through its 32 x 64 boxes, and no bank conflict within a
    half-warp."""
    res = run_model("dq_staging_model.py")
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1].startswith("ok:"), res.stdout[-1500:]


@pytest.mark.parametrize("mutant", ["rows_in_place", "no_xor", "no_block_phase", "no_b0", "box_per_block"])
def test_dq_staging_model_catches_planted_bug(mutant):
    res = run_model("dq_staging_model.py", "--mutant", mutant)
    assert res.returncode == 0 and f"mutant {mutant} caught" in res.stdout, res.stdout[-1500:]
