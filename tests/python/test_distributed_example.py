"""examples/grpo_fsdp_ulysses.py runs under torchrun on the CPU (gloo, tiny model), and its --check
(the update equals one process by the same method) passes: dualkv on 4 ranks as DP=2 x SP=2 with
FSDP2 and an empty micro-batch on one DP rank (attention bit-equal per head shard in deterministic
mode); the standard unpacked path on the same grid with its rows cut over the SP ranks and run three
at a time; the Flex wiring (the CPU stand-in of flex_fa4: the dense mask of the same rule) DP=2.
Arguments that cannot run stop before any process group with a clear message (exit status 2)."""
import importlib.util
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
EXAMPLE = ROOT / "examples" / "grpo_fsdp_ulysses.py"


def run_example(nproc: int, args, timeout: int = 300) -> str:
    """The example under torchrun on ``nproc`` CPU ranks; its log (the test fails on a non-zero exit
    status or a hang)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(EXAMPLE), "--device", "cpu"] + list(args)
    # a session of its own, so that a hang kills torchrun's workers too, not torchrun alone
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"the example did not finish in {timeout} s (deadlock?):\n" + log[-6000:])
    assert proc.returncode == 0, log[-6000:]
    return log


def test_example_runs_and_checks_under_torchrun(tmp_path):
    out = tmp_path / "result.json"
    log = run_example(4, ["--sp", "2", "--groups", "5", "--steps", "1", "--check", "--deterministic", "--json",
                          str(out)])
    assert "1 empty micro-batch(es)" in log and "check: PASSED" in log, log[-6000:]
    assert "attention outputs bit-equal per head shard (deterministic): True" in log
    result = json.loads(out.read_text())
    assert result["world"] == 4 and result["check"]["ok"] and len(result["updates"]) == 2
    assert result["method"] == "dualkv" and result["samples_tokens_per_s"] > 0 and result["packed_tokens_per_s"] > 0


def test_moe_shape_checks_under_sp(tmp_path):
    """A Qwen3-MoE shape (tiny-moe: 8 experts, 2 per token) at SP=2: each rank routes its own half of
    the packed tokens through the experts; loss, log-probs and every gradient (experts and routers
    included) equal the one-process run's, and the attention is bit-equal per head shard."""
    out = tmp_path / "moe.json"
    log = run_example(2, ["--model-size", "tiny-moe", "--sp", "2", "--groups", "3", "--steps", "1", "--check",
                          "--deterministic", "--json", str(out)])
    assert "Qwen3-shaped tiny-moe" in log and "check: PASSED" in log, log[-6000:]
    assert "attention outputs bit-equal per head shard (deterministic): True" in log
    result = json.loads(out.read_text())
    assert result["args"]["model_size"] == "tiny-moe" and result["check"]["ok"] and result["world"] == 2


def test_std_method_checks_under_torchrun(tmp_path):
    """--method std, DP=2 x SP=2: every row split over the two SP ranks with Ulysses all-to-alls around
    SDPA, three rows per pass (a DP rank with fewer rows, or with the empty micro-batch, runs
    placeholder passes), equal to the one-process unpacked run."""
    out = tmp_path / "std.json"
    log = run_example(4, ["--method", "std", "--sp", "2", "--groups", "5", "--std-rows", "3", "--steps", "1",
                          "--check", "--json", str(out)])
    assert "1 empty micro-batch(es)" in log and "5 pass(es) per rank (3 rows per pass)" in log, log[-6000:]
    assert "check: PASSED" in log, log[-6000:]
    result = json.loads(out.read_text())
    assert result["method"] == "std" and result["check"]["ok"] and result["world"] == 4
    assert result["padded_tokens"] >= result["unpacked_tokens"] > result["packed_tokens"]
    assert result["samples_tokens_per_s"] == pytest.approx(result["unpacked_tokens"] / result["median_seconds_fwd_bwd"])


def test_flex_wiring_checks_under_torchrun(tmp_path):
    """--method flex, DP=2 (the wiring flex_fa4 runs on the GPU; on a CPU the dense mask of the forest
    rule with SDPA): equal to one process, with the compile and mask-build costs recorded."""
    out = tmp_path / "flex.json"
    log = run_example(2, ["--method", "flex", "--groups", "5", "--steps", "1", "--check", "--json", str(out)])
    assert "check: PASSED" in log and "mask builds" in log, log[-6000:]
    result = json.loads(out.read_text())
    assert result["method"] == "flex" and result["check"]["ok"] and result["args"]["dp"] == 2
    assert result["mask_build_s"] > 0 and result["compile_s"] >= 0
    assert result["seconds_excl_mask"] == pytest.approx(result["median_seconds_fwd_bwd"] - result["mask_build_s"])


def _example_module():
    spec = importlib.util.spec_from_file_location("grpo_fsdp_ulysses_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fa4_importable() -> bool:
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except Exception:  # noqa: BLE001  (not installed, or a CuTe DSL that does not load)
        return False
    return True


@pytest.mark.parametrize("argv,message", [
    (["--method", "flex_fa4", "--sp", "2"], "--method flex_fa4: FlexAttention has no Ulysses"),
    (["--method", "flex", "--sp", "2", "--dp", "1"], "--method flex: FlexAttention has no Ulysses"),
    (["--method", "std", "--deterministic"], "--deterministic: a bit-reproducible attention backward is dualkv's"),
    (["--method", "dualkv", "--std-rows", "2"], "--std-rows K: K >= 1 unpacked rows per pass, with --method std"),
])
def test_arguments_that_cannot_run_stop_clearly(argv, message, capsys):
    """Refused while parsing (exit status 2, the reason on stderr): before torchrun's ranks start a
    process group, so none is left waiting."""
    example = _example_module()
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--device", "cpu"] + argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_flex_fa4_without_flash_attention_4_stops_clearly(capsys):
    if _fa4_importable():
        pytest.skip("FlashAttention-4 is installed here")
    example = _example_module()
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--device", "cpu", "--method", "flex_fa4"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--method flex_fa4 needs FlashAttention-4" in err and "flash_attn" in err, err


def test_baseline_json_must_be_a_world_of_one_run_of_the_same_batch(tmp_path, capsys):
    example = _example_module()
    args = vars(example.parse_args(["--device", "cpu", "--method", "std"]))
    base = tmp_path / "w1.json"
    base.write_text(json.dumps({"method": "std", "world": 1, "args": args, "samples_tokens_per_s": 500.0}))
    assert example.parse_args(["--device", "cpu", "--method", "std", "--baseline-json", str(base)]
                              ).baseline_tokens_per_s == 500.0
    for wrong, text in [(["--method", "dualkv"], "method std"), (["--method", "std", "-N", "3"], "differs in n")]:
        with pytest.raises(SystemExit):
            example.parse_args(["--device", "cpu", "--baseline-json", str(base)] + wrong)
        assert text in capsys.readouterr().err


def test_check_of_a_batch_without_advantages_stops_clearly():
    """Two groups of 4 whose rewards are all equal (the default seed's draw at these lengths): every advantage, the loss and every
    gradient would be 0, so --check would compare zeros and pass whatever the method computed."""
    example = _example_module()
    argv = ["--device", "cpu", "--groups", "2", "-N", "4", "-P", "1024", "-R", "256", "--max-tokens", "8192"]
    args = example.parse_args(argv + ["--check"])
    args.dp = 1
    with pytest.raises(SystemExit, match="every group's rewards are equal"):
        example.Batch(args, 1000)
    args = example.parse_args(argv)
    args.dp = 1
    assert not example.Batch(args, 1000).adv.any()  # without --check the run goes on (a timing run may)


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
