"""examples/grpo_fsdp_ulysses.py runs under torchrun on the CPU (gloo, tiny model): 4 ranks as
DP=2 x SP=2 with FSDP2, a plan with an empty micro-batch on one DP rank, and its --check (the update
equals one process; attention bit-equal per head shard in deterministic mode) passes."""
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
if torch.cuda.is_available():  # device time is scarce: the GPU machine runs the NCCL example instead
    pytest.skip("the gloo multi-process suite runs in CI on the CPU (docs/distributed.md section 6 lists the GPU runs)",
                allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_example_runs_and_checks_under_torchrun(tmp_path):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(ROOT / "examples" / "grpo_fsdp_ulysses.py"), "--device", "cpu", "--sp", "2", "--groups", "5",
           "--steps", "1", "--check", "--deterministic", "--json", str(out)]
    # a session of its own, so that a hang kills torchrun's workers too, not torchrun alone
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail("the example did not finish in 300 s (deadlock?):\n" + log[-6000:])
    assert proc.returncode == 0, log[-6000:]
    assert "1 empty micro-batch(es)" in log and "check: PASSED" in log, log[-6000:]
    assert "attention outputs bit-equal per head shard (deterministic): True" in log
    result = json.loads(out.read_text())
    assert result["world"] == 4 and result["check"]["ok"] and len(result["updates"]) == 2


def test_overhead_benchmark_smoke(tmp_path):
    """bench/distributed_overhead.py (the 1% check of the single-rank path, run on the GPU) runs on a
    CPU with a tiny model, and both paths give the same log-probs."""
    out = tmp_path / "overhead.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "distributed_overhead.py"), "--device", "cpu",
                           "--tiny", "--rounds", "1", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["max_abs_dlogp"] == 0.0 and len(result["times"]["distributed"]) == 1
