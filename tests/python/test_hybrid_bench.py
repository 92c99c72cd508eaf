"""bench/hybrid_e2e.py on a CPU (tiny hybrid model, fp32): every method runs and computes the same
log-probs as the unpacked path (the flex baseline's unpacked GDN layers included), the fp32 truth of
the tolerance rule is wired up, and the result records its provenance and Flex set-up."""
import json

import pytest

pytest.importorskip("transformers")

from test_demo import _load_bench  # noqa: E402


def test_hybrid_bench_cpu_smoke(tmp_path):
    bench = _load_bench("hybrid_e2e")
    out = tmp_path / "hybrid.json"
    rc = bench.main(["--device", "cpu", "--tiny", "--configs", "3,24,7", "--micro-batches", "2", "--iters", "1",
                     "--warmup", "0", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    env, results = report["environment"], report["results"]
    assert env["commit"] and len(env["dualkv_library"]["sha256"]) == 64 and env["packages"]["torch"]  # provenance
    assert [r["method"] for r in results] == ["dualkv", "std", "flex"]
    flex = results[2]  # FA4 under Flex by default, with FA4's block size until a kernel refuses it
    assert flex["flex_backend"] == "FLASH" and flex["block_size"] == [256, 128] and flex["block_size_tried"] == []
    for r in results:
        assert r["status"] == "ok", r
        assert r["max_abs_dlogp_vs_std"] < 1e-4, r
        assert r["within_tolerance"] and r["max_abs_dlogp_vs_truth"] < 1e-4, r
        assert r["rho_tokens"] > 1 and r["target_speedup"] == pytest.approx(0.8 * r["rho_tokens"])
    assert out.with_suffix(".txt").read_text().count("\n") == 5  # header, rule, three methods
