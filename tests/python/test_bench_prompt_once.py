"""bench/prompt_once_e2e.py on a CPU (tiny model, one timed update per method): every method runs
through policy_update, the cell's ratios and memory are recorded, the control cell (the group fits)
has once == split, and the device step is planned within one call."""
import json
import re

import pytest

pytest.importorskip("transformers")

from test_bench_e2e import _device_run_step  # noqa: E402
from test_demo import ROOT, _load_bench  # noqa: E402


def test_prompt_once_bench_runs_on_cpu(tmp_path):
    bench = _load_bench("prompt_once_e2e")
    out = tmp_path / "prompt_once_e2e_tiny.json"
    rc = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--iters", "1",
                     "--methods",
                     "split,once,flex_split,flex_fa4_split,once_offload,once_keep,once_recompute,once_budget",
                     "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["environment"]["device"] == "cpu" and "commit" in data["environment"]
    assert set(data["protocol"]) >= {"split", "once", "flex_fa4_split", "ideal"}
    cells = {}
    for r in data["results"]:
        cells.setdefault(r["k"], {})[r["method"]] = r
    assert sorted(cells) == [1, 2]  # the control first, then k = 2
    for k, m in cells.items():
        for name in ("split", "once", "flex_split", "once_offload", "once_keep", "once_recompute", "once_budget"):
            assert m[name]["status"] == "ok", m[name]
            assert m[name]["peak_bytes"] > 0 and m[name]["seconds"] > 0
        # FA4 is not installed on a CPU host: skipped with the reason, not an error
        assert m["flex_fa4_split"]["status"] in ("skipped", "ok")
        assert m["split"]["micro_batches"] == k
        # fp32: the three ways give the same log-probs (the first response) up to summation order
        for name in ("once", "flex_split", "once_offload", "once_keep", "once_recompute", "once_budget"):
            assert m[name]["max_abs_dlogp_vs_split"] <= 1e-4, (k, name, m[name]["max_abs_dlogp_vs_split"])
        assert m["once_offload"]["loss"] == pytest.approx(m["once"]["loss"], rel=1e-6)
    once1, once2 = cells[1]["once"], cells[2]["once"]
    P, N, R = once2["P"], once2["N"], once2["R"]
    assert once2["max_tokens"] == P + -(-N * R // 2)
    assert once2["ideal_ratio"] == pytest.approx((2 * P + N * R) / (P + N * R))
    assert once2["quotient_vs_ideal"] == pytest.approx(once2["split_over_once"] / once2["ideal_ratio"])
    assert once2["prompt_phases"] == 1 and once1["prompt_phases"] == 0  # the control has no prompt phase
    kv = once2["prompt_kv_memory"]
    assert kv["kv"] == 2 * 2 * (P - 1) * 2 * 16 * 4  # (k, v) x layers x prompt rows x kv heads x dim x fp32
    assert kv["grad"] == kv["kv"]  # fp32 model: the gradient buffers in the model's dtype
    assert "prompt_kv_memory" not in once1
    table = out.with_suffix(".txt").read_text()
    assert "split/once" in table and "acceptance" in table and "verdict" in table
    assert "once_recompute s" in table and "once_budget s" in table  # the variants' columns


def test_device_run_prompt_once_step():
    step = _device_run_step("prompt-once")
    assert "bench/prompt_once_e2e.py" in step and "timeout -k 10 \"${ONCE_CAP:-570}\"" in step
    assert '--iters "${ONCE_ITERS:-3}"' in step and '--warmup "${ONCE_WARMUP:-2}" --method-timeout 240' in step
    assert 'cat "$OUT/prompt_once_e2e_$m.txt"' in step  # the acceptance table, verdicts included, comes back
    assert '"$OUT/prompt_once_e2e_$m.json"' in step
    bench = _load_bench("results_index")
    assert "prompt_once_e2e_1.7b" in bench.BENCHMARKS and "prompt_once_e2e_8b" in bench.BENCHMARKS
    assert re.search(r"--methods \"\$\{ONCE_METHODS:-split,once,flex_fa4_split\}\"", step)
    assert (ROOT / "bench" / "prompt_once_e2e.py").exists()


def test_once_on_a_backend_without_external_prefixes_is_skipped(tmp_path, monkeypatch):
    """Before the CUDA kernels run external prefixes, the library's UnsupportedError makes once a
    named skip (the run goes on and exits 0), not an error."""
    import dualkv
    from dualkv import schedule
    bench = _load_bench("prompt_once_e2e")

    def refuse(*args, **kwargs):
        raise dualkv.UnsupportedError("external prefix segments are not supported by the CUDA backend yet")
    monkeypatch.setattr(schedule, "run_prompt_phase", refuse)
    out = tmp_path / "p.json"
    assert bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--iters", "1", "--no-controls",
                       "--methods", "split,once", "--out", str(out)]) == 0
    split, once = json.loads(out.read_text())["results"]
    assert split["status"] == "ok" and once["status"] == "skipped"
    assert once["error"].startswith("skipped: UnsupportedError: external prefix segments")
