"""bench/logprob_noise.py's low-memory fp32 truth: exact causal attention by query chunks, the std path
row by row on the same weights upcast in place, equal to the first version's truth (the batched fp32
std path through SDPA) up to fp32 rounding, so the tolerance check means what it meant."""
import json

import pytest
import torch

pytest.importorskip("transformers")

from test_demo import _load_bench  # noqa: E402


@pytest.fixture(scope="module")
def noise():
    return _load_bench("logprob_noise")


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
def test_exact_causal_attention_matches_sdpa(noise, heads, kv_heads):
    """Chunked (several query chunks, GQA) = SDPA causal in fp64, to fp32 rounding."""
    g = torch.Generator().manual_seed(heads + kv_heads)
    B, L, D = 2, 37, 16
    q = torch.randn(B, heads, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, L, D, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    budget = 4 * B * heads * L * 5  # 5 queries per chunk: 8 chunks, the last one short
    assert noise.chunk_queries(B, heads, L, budget) == 5
    out = noise.exact_causal_attention(q, k, v, 0.3, budget)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert (out.double() - ref).abs().max() < 2e-6
    one = noise.exact_causal_attention(q, k, v, 0.3, 1e12)  # one chunk
    assert (out - one).abs().max() < 2e-6


def _tiny_fp32_model_and_batch(e2e, n=3, P=40, R=16):
    from transformers import AutoModelForCausalLM

    from dualkv.demo import qwen3_config
    cfg = qwen3_config("tiny")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32).eval()
    mb = e2e.make_micro_batches(n, P, R, 1, 1, cfg.vocab_size, 0, torch.device("cpu"))[0]
    return model, mb


@pytest.mark.parametrize("rows_per_pass", [1, 2, 5])
def test_truth_rows_equals_batched_sdpa_truth(noise, rows_per_pass):
    """The row-by-row truth with chunked attention (1 query per chunk here) = the batched std path with
    SDPA in fp32, on every response token; rows come back in the packed order."""
    import types
    e2e = noise.e2e
    noise.register_truth()
    model, mb = _tiny_fp32_model_and_batch(e2e, n=5)
    ns = types.SimpleNamespace(flex_compile=False)
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = e2e.logprobs_of("std", model, mb, ns, torch.device("cpu")).float()
        noise._BUDGET["bytes"] = 1.0  # one query per chunk
        model.set_attn_implementation(noise.TRUTH_IMPL)
        got = noise.truth_rows(model, mb, rows_per_pass)
    assert got.shape == ref.shape == mb.mask.shape
    assert (got - ref).abs()[mb.mask].max() < 2e-5
    assert (got[~mb.mask] == 0).all()


def test_exact_attention_refuses_a_mask(noise):
    q = torch.zeros(1, 2, 3, 4)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="no attention mask"):
        noise.exact_attention_forward(module, q, q, q, torch.zeros(1, 1, 3, 3))


def test_noise_main_chunked_truth_equals_sdpa_truth(noise, tmp_path):
    """End to end on a CPU: the default (chunked, row by row, tiny chunk budget) and the first
    version's truth (--truth sdpa) give the same distances, and the rule still passes and is not vacuous."""
    reps = {}
    for truth in ("chunked", "sdpa"):
        out = tmp_path / f"{truth}.json"
        assert noise.main(["--tiny", "--device", "cpu", "--config", "4,48,16", "--truth", truth,
                           "--truth-chunk-mib", "0.001", "--out", str(out)]) == 0
        reps[truth] = json.loads(out.read_text())
    c, s = reps["chunked"], reps["sdpa"]
    assert c["truth"]["method"] == "chunked" and c["truth"]["max_chunk_queries"] < 10
    assert s["truth"]["method"] == "sdpa" and "max_chunk_queries" not in s["truth"]
    for name in ("std_default", "dualkv"):
        for stat in ("max", "mean"):
            assert abs(c["vs_fp32"][name][stat] - s["vs_fp32"][name][stat]) < 1e-5
        assert c["vs_fp32"][name]["max"] > 1e-5  # bf16 vs fp32 differs: the rule is not vacuous
    assert c["passes"] and s["passes"] and abs(c["bound"] - s["bound"]) < 2e-5
    assert c["truth"]["float32_matmul_precision"] == "highest"


@pytest.mark.gpu
@pytest.mark.cuda_head_dims(128)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_noise_gpu_tiny_reports_phase_peaks(noise, tmp_path):
    """On the GPU (0.6b shape: head dim 128, which every build has): both std backends and dualkv are
    checked and each phase's peak memory is reported (what the 8B run's estimate is checked against)."""
    out = tmp_path / "noise.json"
    # --allow-dirty: this checks the tool, not a result (the device copy of a tree has no .git)
    rc = noise.main(["--model", "0.6b", "--device", "cuda", "--config", "4,300,100", "--out", str(out),
                     "--allow-dirty"])
    rep = json.loads(out.read_text())
    assert rc == 0 and rep["passes"], rep
    assert set(rep["vs_fp32"]) == {"std_cudnn", "std_flash", "dualkv"}
    assert set(rep["peak_gib"]) == {"bf16_paths", "fp32_truth"}
