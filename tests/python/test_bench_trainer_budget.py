"""bench/trainer_budget_e2e.py on a CPU (tiny model, one timed update per method): under a budget
smaller than a group the split plan repeats each split group's prompt and the once plan does not; under
a budget that holds every group both plans are the same; every method computes the same loss."""
import json

import pytest

pytest.importorskip("transformers")

from test_demo import _load_bench  # noqa: E402


def test_trainer_budget_bench_runs_on_cpu(tmp_path):
    bench = _load_bench("trainer_budget_e2e")
    out = tmp_path / "trainer_budget_tiny.json"
    rc = bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--iters", "1", "--warmup", "1",
                     "--methods", "once,split,flex_split,flex_fa4_split", "--out", str(out), "--allow-dirty"])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["protocol"]) >= {"batch", "budget", "once", "split", "flex_fa4_split"}
    cells = {}
    for r in data["results"]:
        cells.setdefault(r["max_tokens"], {})[r["method"]] = r
    assert sorted(cells) == [64, 128]
    for B, m in cells.items():
        for name in ("once", "split", "flex_split"):
            assert m[name]["status"] == "ok", m[name]
            assert m[name]["seconds"] > 0 and m[name]["peak_bytes"] > 0
        assert m["flex_fa4_split"]["status"] in ("skipped", "ok")  # no FA4 on a CPU host: skipped, named
        # the same update: fp32 losses agree up to summation order
        assert m["split"]["loss"] == pytest.approx(m["once"]["loss"], rel=1e-5)
        assert m["flex_split"]["loss"] == pytest.approx(m["once"]["loss"], rel=1e-5)
        assert m["flex_split"]["packed_tokens"] == m["split"]["packed_tokens"]  # Flex runs the split plan
        once = m["once"]
        assert once["split_over_once"] == pytest.approx(m["split"]["seconds"] / once["seconds"])
        assert once["flex_split_over_once"] == pytest.approx(m["flex_split"]["seconds"] / once["seconds"])
    # B 64 < a group (prompts of 40-48 tokens + 4 responses of 4-8): groups split; the split plan carries
    # every extra piece's prompt again, the once plan runs each prompt once
    small, whole = cells[64], cells[128]
    assert small["split"]["split_groups"] >= 1
    assert small["split"]["packed_tokens"] > small["once"]["packed_tokens"]
    assert small["once"]["prompt_phases"] >= 1
    # B 128 holds every group: nothing split, the same packed tokens, no prompt phase
    assert whole["split"]["split_groups"] == 0 and whole["once"]["prompt_phases"] == 0
    assert whole["split"]["packed_tokens"] == whole["once"]["packed_tokens"]
    table = out.with_suffix(".txt").read_text()
    assert "flex/once" in table and "bar:" in table


def test_trainer_budget_refuses_a_budget_below_one_row(tmp_path):
    bench = _load_bench("trainer_budget_e2e")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--device", "cpu", "--prompts", "64", "--responses", "16", "--budgets", "70",
                    "--out", str(tmp_path / "x.json"), "--allow-dirty"])
    assert exc.value.code == 2


def test_batch_draws_as_e2e(rng):
    """The groups come from bench/e2e.py's draw: prompts in [0.85 P, P], responses in [R/2, R]."""
    import torch
    bench = _load_bench("trainer_budget_e2e")
    prompts, responses, old, adv = bench.batch(3, 5, 100, 20, 50, 0, torch.device("cpu"))
    assert len(prompts) == 3 and all(85 <= p.numel() <= 100 for p in prompts)
    assert all(len(rs) == 5 and all(10 <= r.numel() <= 20 for r in rs) for rs in responses)
    assert all(o.numel() == r.numel() for os_, rs in zip(old, responses) for o, r in zip(os_, rs))
    assert all(len(a) == 5 for a in adv)


def test_device_run_trainer_budget_step():
    """The device step runs the benchmark into $OUT under its own cap and prints the table, whose name
    the results index knows."""
    from test_bench_e2e import _device_run_step
    step = _device_run_step("trainer-budget")
    assert "bench/trainer_budget_e2e.py" in step and 'timeout -k 10 "${BUDGET_CAP:-570}"' in step
    assert '--budgets "${BUDGET_TOKENS:-16384,32768}"' in step
    assert '--out "$OUT/trainer_budget_e2e_$m.json"' in step and 'cat "$OUT/trainer_budget_e2e_$m.txt"' in step
    assert "trainer_budget_e2e_1.7b" in _load_bench("results_index").BENCHMARKS
