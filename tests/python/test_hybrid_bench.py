"""bench/hybrid_e2e.py on a CPU (tiny hybrid model, fp32): every method runs and computes the same
log-probs as the unpacked path (the flex baseline's unpacked GDN layers included), the fp32 truth of
the tolerance rule is wired up, and the result records its provenance and Flex set-up."""
import json

import pytest

pytest.importorskip("transformers")

from test_demo import _load_bench  # noqa: E402


def test_hybrid_bench_cpu_smoke(tmp_path, monkeypatch):
    bench = _load_bench("hybrid_e2e")
    out = tmp_path / "hybrid.json"
    # FA4 under Flex at head dim 256 (H200): refuses 256 x 128 (not a multiple of tile_n = 80), then 256 x 160 (the
    # block-sparse kernels want the block equal to the tile); the warm-up must end at 256 x 80, as peers' search does
    refusals = {128: RuntimeError("CuteDSL template failed: sparse_block_size[1] must be a multiple of tile_n=80"),
                160: ValueError("Block sparsity requires sparse_block_size[1]=160 to match tile_n=80.")}
    logprobs_of = bench.logprobs_of

    def fa4_at_head_dim_256(method, model, mb, args, device):
        if method == "flex" and args.flex_block[1] in refusals:
            raise refusals[args.flex_block[1]]
        return logprobs_of(method, model, mb, args, device)
    monkeypatch.setattr(bench, "logprobs_of", fa4_at_head_dim_256)
    monkeypatch.delenv("DUALKV_GDN_BACKEND", raising=False)
    rc = bench.main(["--device", "cpu", "--tiny", "--configs", "3,24,7", "--micro-batches", "2", "--iters", "1",
                     "--warmup", "1", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    env, results = report["environment"], report["results"]
    assert env["commit"] and len(env["dualkv_library"]["sha256"]) == 64 and env["packages"]["torch"]  # provenance
    # the GDN recurrence that ran: the exact recurrence in the fork on a CPU, transformers' chunked rule in the
    # stock layers (the fork's chunk backend runs the same function)
    assert env["gdn"]["backend"] == "recurrent" and "cpu" in env["gdn"]["reason"] and not env["gdn"]["forced"]
    assert env["gdn"]["stock"].startswith("chunk")
    assert [(r["method"], r["gdn"]) for r in results] == [("dualkv", "recurrent"), ("std", "chunk"), ("flex", "chunk")]
    flex = results[2]  # FA4 under Flex by default
    assert flex["flex_backend"] == "FLASH" and flex["block_size"] == [256, 80]
    assert [t["block_size"] for t in flex["block_size_tried"]] == [[256, 128], [256, 160]]
    for r in results:
        assert r["status"] == "ok", r
        assert r["max_abs_dlogp_vs_std"] < 1e-4, r
        assert r["within_tolerance"] and r["max_abs_dlogp_vs_truth"] < 1e-4, r
        assert r["rho_tokens"] > 1 and r["target_speedup"] == pytest.approx(0.8 * r["rho_tokens"])
    table = out.with_suffix(".txt").read_text().splitlines()
    assert len(table) == 6  # header, rule, three methods, the GDN recurrence
    assert table[-1].startswith("GDN recurrence: state fork on recurrent")


def test_hybrid_bench_chunk_backend(tmp_path, monkeypatch):
    """--gdn-backend chunk: the state fork on transformers' PyTorch chunked rule (the H200's backend without
    fla), recorded as forced; its log-probs equal the stock model's."""
    bench = _load_bench("hybrid_e2e")
    out = tmp_path / "hybrid.json"
    monkeypatch.setenv("DUALKV_GDN_BACKEND", "auto")  # restored after the test (the bench sets it to chunk)
    rc = bench.main(["--device", "cpu", "--tiny", "--configs", "3,80,70", "--methods", "dualkv,std", "--iters", "1",
                     "--warmup", "0", "--truth-rows", "0", "--gdn-backend", "chunk", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    env, results = report["environment"], report["results"]
    assert env["gdn"]["backend"] == "chunk" and env["gdn"]["forced"] and "--gdn-backend" in env["gdn"]["reason"]
    assert env["switches"]["DUALKV_GDN_BACKEND"] == "chunk"
    assert [(r["method"], r["gdn"], r["status"]) for r in results] == [("dualkv", "chunk", "ok"),
                                                                       ("std", "chunk", "ok")]
    assert results[0]["max_abs_dlogp_vs_std"] < 1e-4
