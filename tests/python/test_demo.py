"""``python -m dualkv demo`` runs on the CPU with the tiny config and passes its own check."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT / "python") + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_demo_cli_cpu_tiny(size):
    """The demo's equivalence check, dense and MoE (MOE_SIZES are choices of --model-size too)."""
    proc = subprocess.run([sys.executable, "-m", "dualkv", "demo", "--model-size", size, "--device", "cpu",
                           "--steps", "1"], capture_output=True, text=True, env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"Qwen3-shaped {size} " in out, out
    for what in ("rho", "max |delta log-prob|", "|delta loss|", "grad diff norm", "speedup",
                 "where the gain comes from", "equivalence check: PASSED"):
        assert what in out, out


def test_demo_cpu_default_is_the_packing_regime():
    """Without arguments on a CPU the demo runs the ``small`` model on long prompts with many responses
    (where packing pays: rho > 4); the GPU default is unchanged."""
    import argparse

    import dualkv.demo as demo
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    cpu = parser.parse_args(["--device", "cpu"])
    demo._defaults(cpu)
    assert (cpu.model_size, cpu.groups, cpu.n, cpu.prompt_len, cpu.response_len) == ("small", 2, 8, 512, 64)
    assert cpu.dtype == "float32" and not cpu.gradient_checkpointing
    ro = demo.make_rollouts(cpu.groups, cpu.n, cpu.prompt_len, cpu.response_len, 1024, seed=1)
    assert ro.unpacked_tokens / ro.packed_tokens > 4
    gpu = parser.parse_args(["--device", "cuda"])
    demo._defaults(gpu)
    assert (gpu.model_size, gpu.groups, gpu.n, gpu.prompt_len, gpu.response_len) == ("0.6b", 2, 16, 2048, 512)
    assert gpu.dtype == "bfloat16" and gpu.gradient_checkpointing


def test_qwen3_config_moe_shapes():
    """dualkv.demo.qwen3_config picks the config class by shape: Qwen3Config for MODEL_SIZES, Qwen3MoeConfig
    (model_type qwen3_moe, which the transformers integration lists as tested) for MOE_SIZES; 30b-a3b is
    Qwen3-30B-A3B's published shape (30.53 B parameters, 48 layers of 0.623 B), cut by num_hidden_layers;
    the router's aux loss is off; build_model builds tiny-moe and it runs; MoE keys on a dense shape and
    unknown sizes are refused."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from dualkv.demo import MODEL_SIZES, MOE_SIZES, build_model, qwen3_config
    from dualkv.integrations.transformers import TESTED_MODEL_TYPES
    assert not set(MODEL_SIZES) & set(MOE_SIZES)
    assert type(qwen3_config("8b")) is Qwen3Config
    cfg = qwen3_config("30b-a3b")
    assert type(cfg) is Qwen3MoeConfig and cfg.model_type == "qwen3_moe" and cfg.model_type in TESTED_MODEL_TYPES
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.vocab_size) == (
        2048, 48, 32, 4, 128, 128, 8, 768, 151936)
    assert cfg.norm_topk_prob is True and cfg.tie_word_embeddings is False and cfg.mlp_only_layers == []
    assert cfg.decoder_sparse_step == 1 and cfg.rope_parameters["rope_theta"] == 1e6 and cfg.rms_norm_eps == 1e-6
    assert cfg.output_router_logits is False and cfg.router_aux_loss_coef == 0.0
    counts = {}
    for k in (1, 2):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(qwen3_config("30b-a3b", num_hidden_layers=k))
        counts[k] = sum(p.numel() for p in model.parameters())
    per_layer, outside = counts[2] - counts[1], 2 * counts[1] - counts[2]
    assert per_layer == 128 * 3 * 2048 * 768 + 2048 * (4096 + 2 * 512) + 4096 * 2048 + 128 * 2048 + 2 * 2048 + 2 * 128
    assert outside == 2 * 151936 * 2048 + 2048  # embedding, untied head, final norm
    assert outside + 48 * per_layer == 30_532_122_624
    tiny = qwen3_config("tiny-moe")
    assert (tiny.num_experts, tiny.num_experts_per_tok, tiny.hidden_size) == (8, 2, MODEL_SIZES["tiny"]["hidden_size"])
    model = build_model(tiny, "cpu", torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.config.num_hidden_layers == 2
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, tiny.vocab_size, (1, 9)))
    assert out.logits.shape == (1, 9, tiny.vocab_size) and getattr(out, "aux_loss", None) is None
    with pytest.raises(ValueError, match="is dense"):
        qwen3_config("8b", num_experts=8)
    with pytest.raises(ValueError, match="unknown model size '30b'.*30b-a3b"):
        qwen3_config("30b")


def test_demo_detects_a_wrong_attention(monkeypatch):
    """The self-check is not vacuous: with a layout that hides the prompt from responses it fails."""
    import argparse

    import dualkv.demo as demo
    from dualkv import Layout
    from dualkv.integrations import transformers as dkt

    real = dkt.model_inputs

    def broken(packed, layout=None):
        kw = real(packed, layout)
        kw["dualkv_layout"] = Layout.varlen(packed.layout.segment_lens)  # every segment on its own
        return kw

    monkeypatch.setattr(dkt, "model_inputs", broken)
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--model-size", "tiny", "--steps", "1", "--quiet", "--groups", "2"])
    res = demo.run_demo(args)
    assert not res["ok"] and res["max_dlogp"] > 1e-3


def test_info_cli(capsys):
    from dualkv.__main__ import main
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "dualkv" in out and "abi_version" in out and "transformers" in out


def test_bench_e2e_cpu_smoke(tmp_path):
    """bench/e2e.py runs end to end on a CPU (--tiny); the three methods agree (fp32)."""
    import json
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--configs", "3,40,16", "--micro-batches", "2",
                   "--iters", "1", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["method"] for r in res] == ["std", "flex", "dualkv"]
    for r in res:
        assert r["status"] == "ok", r
        assert r["max_abs_dlogp_vs_std"] <= 1e-4, r
        assert r["rho_tokens"] > 1.5 and len(set(r["packed_lengths"])) == 2
    flex = res[1]
    assert flex["mask_build_s"] > 0 and abs(flex["seconds_excl_mask"] + flex["mask_build_s"] - flex["seconds"]) < 1e-9


def _load_bench(name):
    import importlib.util
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"dualkv_bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_e2e_method_timeout_is_recorded(tmp_path):
    """A method past --method-timeout is recorded as a timeout and the run goes on to the next one."""
    import json
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--configs", "3,40,16", "--micro-batches", "2",
                   "--iters", "1", "--methods", "std,dualkv", "--method-timeout", "1e-4", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    assert [r["status"] for r in res] == ["timeout", "timeout"]
    assert "method-timeout" in res[0]["error"]


def test_bench_logprob_noise_cpu_smoke(tmp_path):
    """bench/logprob_noise.py: dualkv's bf16 log-probs are no farther from the fp32 truth than the rule allows."""
    import json
    noise = _load_bench("logprob_noise")
    out = tmp_path / "noise.json"
    assert noise.main(["--tiny", "--device", "cpu", "--config", "3,40,16", "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["passes"] and 0 < rep["vs_fp32"]["dualkv"]["max"] <= rep["bound"]
    assert rep["vs_fp32"]["std_default"]["max"] > 0  # bf16 vs fp32 differs: the rule is not vacuous


def test_bench_e2e_probe_and_plot(tmp_path):
    """--probe-max-mb records the largest micro-batch tried that fit (a CPU never runs out, so the
    probe stops at its limit and says so); the run writes a plot next to its JSON."""
    import json
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    rc = e2e.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--configs", "3,40,16", "--micro-batches", "1",
                   "--iters", "1", "--methods", "std,dualkv", "--probe-max-mb", "--probe-limit", "2", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())["results"]
    for r in res:
        assert r["max_mb_groups"] == 2 and r["probe_limit_reached"], r
        assert r["max_mb_unpacked_tokens"] > r["max_mb_packed_tokens"] > 0
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


def test_bench_e2e_kernel_categories():
    """The breakdown's name patterns put the kernels of every method where they belong."""
    e2e = _load_bench("e2e")
    cases = {
        "void dualkv::cuda::sm90::bwd_sm90_kernel<__nv_bfloat16, 128, true>(...)": "attention",
        "void dualkv::cuda::fwd_kernel<128, __half>(dualkv::cuda::FwdArgs)": "attention",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3": "attention",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>": "attention",
        "triton_tem_fused_flex_attention_backward_0": "attention",
        "nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "gemm",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64": "gemm",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel...>": "other",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "other",
    }
    for name, cat in cases.items():
        assert e2e.kernel_category(name) == cat, name


def test_bench_e2e_equal_responses():
    """--equal-responses: every response is exactly R tokens; prompts still vary, so the packed
    lengths of the micro-batches differ."""
    import torch
    e2e = _load_bench("e2e")
    mbs = e2e.make_micro_batches(4, 64, 32, 3, 2, 1000, 0, torch.device("cpu"), equal_responses=True)
    assert all(r.numel() == 32 for mb in mbs for rs in mb.responses for r in rs)
    assert len({mb.T for mb in mbs}) > 1
