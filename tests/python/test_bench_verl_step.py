"""bench/verl_step.py on a CPU (tiny model, fp32, gloo, FSDP2, one timed round): the five methods run
veRL's engine on the same rollout batch (stock_fa4 on its per-sequence sdpa stand-in, flex_fa4 on the
dense-mask stand-in of Flex); under a budget every group exceeds, prompt once packs fewer
tokens in fewer micro-batches than prompt copies, flex_fa4 runs copies' packed stream, the stock engine
runs the unpadded rows, and every method's log-probs meet the fp32-truth rule. The bench runs in a process
of its own (it opens its own process group; test_verl.py holds one in this process)."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: 3 groups of a 24-32 token prompt + 4 responses of 4-12 (seed 0: 191 packed tokens), each over the
#: budget of 48 (which holds the longest row, 44 tokens: veRL's row micro-batches need that)
SMOKE = ["--device", "cpu", "--model", "tiny", "--groups", "3", "-N", "4", "--prompt-len", "24,32",
         "--response-len", "4,12", "--max-tokens", "48", "--dtype", "fp32", "--rounds", "1", "--seed", "0"]


def _run(tmp_path, *extra, ranks=1):
    """The smoke run in a process of its own (under torchrun with ``ranks`` > 1): (JSON, stdout)."""
    out = tmp_path / "verl_step_tiny.json"
    env = {k: v for k, v in os.environ.items() if k != "DUALKV_VERL_PROMPT_ONCE"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "python"), env.get("PYTHONPATH", "")]))
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
                                 if ranks > 1 else [])
    proc = subprocess.run([*launch, str(ROOT / "bench" / "verl_step.py"), *SMOKE, *extra, "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_verl_step_bench_runs_on_cpu(tmp_path):
    data, stdout = _run(tmp_path, "--methods", "once,copies,stock,stock_fa4,flex_fa4")
    assert {"env", "args", "protocol", "tokens", "passes", "logprob_error", "verdict",
            "flex_fa4_vs_copies"} <= set(data)
    assert data["complete"] is True and data["verdict"]["methods_ok"] is True
    assert data["env"]["dirty"] in (True, False) and data["env"]["commit"]
    tokens = data["tokens"]
    assert tokens["groups"] == 3 and tokens["split_groups"] == 3  # every group over the budget
    assert tokens["unpadded"] == tokens["packed"] + 3 * tokens["prompt_tokens"]  # 4 rows per group share a prompt
    passes = data["passes"]
    assert list(passes) == ["once", "copies", "stock", "stock_fa4", "flex_fa4"]
    for m, r in passes.items():
        assert r["status"] == "ok", r
        assert len(r["update_s"]) == len(r["logprobs_s"]) == 1 and r["update_median_s"] > 0, m
        assert r["logprobs_tokens"] == r["update_tokens"] and r["logprobs_micro_batches"] == r["update_micro_batches"]
        assert r["update_first_s"] > 0 and r["logprobs_first_s"] > 0, m
        # every method optimises the same batch loss (fp32: the micro-batch losses summed agree)
        assert r["update_loss"] == pytest.approx(passes["stock"]["update_loss"], rel=1e-5, abs=1e-6), m
    once, copies, stock = passes["once"], passes["copies"], passes["stock"]
    # prompt once: every prompt once (phase A: all but its last token; the last token with each response
    # subset); copies: each piece of a split group with its whole prompt; stock: the unpadded rows
    assert tokens["packed"] <= once["update_tokens"] < copies["update_tokens"] < stock["update_tokens"]
    assert copies["update_tokens"] >= tokens["packed"] + 24 * 3  # at least one extra copy (>= 24 tokens) per group
    assert stock["update_tokens"] == passes["stock_fa4"]["update_tokens"] == tokens["unpadded"]
    assert passes["stock_fa4"]["update_micro_batches"] == stock["update_micro_batches"]
    assert once["update_micro_batches"] < copies["update_micro_batches"] < stock["update_micro_batches"]
    _check_flex_fa4(data, "dense boolean mask")
    err = data["logprob_error"]
    assert err["rows"] == 4 and err["tokens"] > 0
    for m in ("once", "copies", "stock", "stock_fa4", "flex_fa4"):
        assert 0 <= err[m]["max"] < 1e-4, (m, err[m])  # fp32 against the fp32 truth
    verdict = data["verdict"]
    assert verdict["logprob_once_ok"] is True and verdict["logprob_copies_ok"] is True
    assert verdict["logprob_flex_fa4_ok"] is True
    assert verdict["update_speedup_once_flex_fa4"] == pytest.approx(
        passes["flex_fa4"]["update_median_s"] / once["update_median_s"])
    assert verdict["logprobs_speedup_copies_flex_fa4"] == pytest.approx(
        passes["flex_fa4"]["logprobs_median_s"] / copies["logprobs_median_s"])
    assert verdict["update_speedup_once"] == pytest.approx(stock["update_median_s"] / once["update_median_s"])
    assert verdict["update_speedup_once_fa4"] == pytest.approx(
        passes["stock_fa4"]["update_median_s"] / once["update_median_s"])
    assert verdict["update_copies_over_once"] == pytest.approx(copies["update_median_s"] / once["update_median_s"])
    assert "once" in stdout and "peak GiB" in stdout and "first pass compiles" in stdout
    assert data["protocol"]["stock_logprobs"].startswith(("chunked", "veRL's"))


def test_verl_step_bench_fixed_size_micro_batches(tmp_path):
    """--micro-batch-rows 2: veRL's own loop over 2-row chunks for every method (the groups' rows shuffled, so
    the chunks cut every group): once runs each cut prompt once (phase A, then the prompt's last token per
    further chunk and the whole prompt in its closing chunk), copies a prompt per chunk; the same losses."""
    data, _ = _run(tmp_path, "--methods", "once,copies,stock", "--micro-batch-rows", "2", "--no-accuracy")
    assert data["args"]["micro_batch_rows"] == 2
    assert data["protocol"]["entropy"] == ["entropy_from_logits"]  # veRL's default (--entropy-chunking: chunked)
    passes, tokens = data["passes"], data["tokens"]
    for m in ("once", "copies", "stock"):
        assert passes[m]["status"] == "ok" and passes[m]["update_micro_batches"] == 6, (m, passes[m])
        assert passes[m]["update_loss"] == pytest.approx(passes["stock"]["update_loss"], rel=1e-5, abs=1e-6), m
    once, copies = passes["once"], passes["copies"]
    assert tokens["packed"] < once["update_tokens"] < copies["update_tokens"] <= passes["stock"]["update_tokens"]
    # log-probs read the recorded prompt in every chunk: no closing chunk carries a whole prompt
    assert once["logprobs_tokens"] < once["update_tokens"]


def test_verl_step_bench_entropy_chunking(tmp_path):
    """--entropy-chunking: every engine computes the log-prob pass's entropy with veRL's chunked function
    (called, as veRL's engine calls it with that config, with its chunk size), the same losses as without."""
    data, _ = _run(tmp_path, "--methods", "once,stock", "--micro-batch-rows", "2", "--no-accuracy", "--entropy-chunking")
    assert data["args"]["entropy_chunking"] is True
    assert data["protocol"]["entropy"] == ["entropy_from_logits_with_chunking"]
    passes = data["passes"]
    for m in ("once", "stock"):
        assert passes[m]["status"] == "ok" and passes[m]["logprobs_micro_batches"] == 6, (m, passes[m])
    assert passes["once"]["update_loss"] == pytest.approx(passes["stock"]["update_loss"], rel=1e-5, abs=1e-6)


def _check_flex_fa4(data, ran):
    """flex_fa4 runs copies' packed stream (the same tokens and micro-batches, log-probs within fp32 noise of
    copies' over every response token), builds one BlockMask per micro-batch (not per layer, not again in
    the checkpointed recompute) and reports its costs beside the steady state; ``ran``: what it ran."""
    flex, copies = data["passes"]["flex_fa4"], data["passes"]["copies"]
    for key in ("update", "logprobs"):
        assert flex[f"{key}_tokens"] == copies[f"{key}_tokens"]
        assert flex[f"{key}_micro_batches"] == copies[f"{key}_micro_batches"]
        assert flex["mask_builds"][key] == flex[f"{key}_micro_batches"]
        assert flex["mask_build_s"][key] > 0 and flex["compile_s"][key] >= 0
        assert flex["excl_mask_s"][key] == pytest.approx(flex[f"{key}_median_s"] - flex["mask_build_s"][key])
    assert ran in flex["ran"] and ran in data["protocol"]["flex_fa4"]
    assert flex["flex_compile"] is False  # a CPU: the stand-in, no compile
    agree = data["flex_fa4_vs_copies"]
    assert agree["tokens"] == data["tokens"]["response_tokens"] and 0 <= agree["logprobs_max_abs"] < 1e-5, agree


def test_verl_step_bench_runs_on_two_ranks(tmp_path):
    """Under torchrun (gloo, world 2) the ranks are veRL's data-parallel workers: each its contiguous share of
    the shuffled rows, FSDP2 over both; tokens summed over the ranks (the stock engines': every unpadded row
    once), rank 0 writes the JSON and checks the log-probs of its first row's group; flex_fa4 runs there as
    copies does, a mask per micro-batch on each rank."""
    # flex_fa4 first: once and copies after it switch the engine they share with it back to dualkv
    data, stdout = _run(tmp_path, "--methods", "flex_fa4,once,copies,stock_fa4", ranks=2)
    assert data["complete"] is True and data["verdict"]["methods_ok"] is True
    assert "world size 2" in data["protocol"]["engine"]
    tokens, passes = data["tokens"], data["passes"]
    once, copies, stock = passes["once"], passes["copies"], passes["stock_fa4"]
    assert stock["update_tokens"] == tokens["unpadded"]  # 6 rows per rank, all of them
    # groups spread over the two ranks: each rank runs its part of a group with the prompt (once each)
    assert tokens["packed"] < once["update_tokens"] < copies["update_tokens"] < stock["update_tokens"]
    assert once["update_micro_batches"] <= copies["update_micro_batches"] <= stock["update_micro_batches"]
    _check_flex_fa4(data, "dense boolean mask")
    err = data["logprob_error"]
    assert 1 <= err["rows"] <= 4 and all(err[m]["max"] < 1e-4 for m in ("once", "copies", "stock_fa4", "flex_fa4"))
    assert stdout.count("tokens {") == 1  # rank 0 prints, rank 1 is silent


def test_verl_step_bench_runs_ulysses_on_two_ranks(tmp_path):
    """--sp 2 on two ranks (gloo): one SP group holding all rows, each micro-batch (--max-tokens x 2 = the
    smoke run's 48 packed tokens) sharded over both; the tokens through the embeddings, summed over the
    ranks, are each micro-batch once (plus its pad), and the log-probs meet the fp32 truth."""
    data, _ = _run(tmp_path, "--methods", "once,copies", "--sp", "2", "--max-tokens", "24", ranks=2)
    assert data["complete"] is True and data["verdict"]["methods_ok"] is True
    assert "1 data parallel x 2 Ulysses" in data["protocol"]["engine"]
    tokens, once, copies = data["tokens"], data["passes"]["once"], data["passes"]["copies"]
    assert tokens["split_groups"] == 3  # the budget of the whole micro-batch: 24 x sp
    # every rank embeds its half of a micro-batch (a micro-batch's pad: at most one token)
    assert tokens["packed"] <= once["update_tokens"] <= tokens["packed"] + 2 * once["update_micro_batches"] + 3 * 2
    assert once["update_tokens"] < copies["update_tokens"]
    err = data["logprob_error"]
    assert err["rows"] == 4 and all(err[m]["max"] < 1e-4 for m in ("once", "copies"))


def test_verl_step_bench_runs_the_moe_shape_on_cpu(tmp_path):
    """--model tiny-moe (Qwen3MoeForCausalLM, the class of issue 24 item 2's 30b-a3b) through the script:
    prompt once against stock, every group over the budget. veRL's apply_fsdp2 makes each
    Qwen3MoeDecoderLayer a unit (recorded); the model's config is in the JSON; the tokens are the dense
    run's (the same batch); the log-probs meet the fp32-truth rule as the dense run's."""
    data, _ = _run(tmp_path, "--model", "tiny-moe", "--methods", "once,stock")
    assert data["complete"] is True and data["verdict"]["methods_ok"] is True
    model = data["model"]
    assert model["name"] == "tiny-moe" and model["model_type"] == "qwen3_moe"
    assert (model["layers"], model["layers_of_shape"]) == (2, 2)
    assert (model["num_experts"], model["num_experts_per_tok"]) == (8, 2)
    assert model["router_aux_loss_coef"] == 0.0 and model["output_router_logits"] is False
    assert model["parameters"] > 0 and model["experts_implementation"]
    assert data["args"]["model"] == "tiny-moe" and data["args"]["layers"] is None
    assert data["protocol"]["fsdp2_units"] == {"Qwen3MoeForCausalLM": 1, "Qwen3MoeDecoderLayer": 2, "Embedding": 1,
                                               "Linear": 1}
    assert "no expert parallelism" in data["protocol"]["experts"]
    tokens, once, stock = data["tokens"], data["passes"]["once"], data["passes"]["stock"]
    assert tokens["split_groups"] == 3 and once["status"] == stock["status"] == "ok"
    assert tokens["packed"] <= once["update_tokens"] < stock["update_tokens"] == tokens["unpadded"]
    assert once["update_micro_batches"] < stock["update_micro_batches"]
    err = data["logprob_error"]
    assert err["rows"] == 4 and all(0 <= err[m]["max"] < 1e-4 for m in ("once", "stock")), err
    assert data["verdict"]["logprob_once_ok"] is True


def test_verl_step_model_and_layers_arguments(tmp_path):
    """--model takes the dense and the MoE shapes; --layers K cuts the shape to 1 <= K <= its layers (the
    result file names the cut); an unknown model and a K outside that range are refused by the parser."""
    from test_demo import _load_bench
    bench = _load_bench("verl_step")
    args = bench.parse_args(["--model", "30b-a3b", "--layers", "12", "--out", str(tmp_path)])
    cfg = bench.model_config(args)
    assert cfg.model_type == "qwen3_moe" and cfg.num_hidden_layers == 12 and cfg.num_experts == 128
    assert bench.model_record(args, cfg)["layers_of_shape"] == 48
    assert bench.out_path(args).name == "verl_step_30b-a3b_l12.json"
    dense = bench.parse_args(["--model", "8b", "--layers", "36", "--out", str(tmp_path)])
    assert bench.model_config(dense).num_hidden_layers == 36 and bench.out_path(dense).name == "verl_step_8b_l36.json"
    assert bench.out_path(bench.parse_args(["--model", "tiny-moe", "--out", str(tmp_path)])).name == \
        "verl_step_tiny-moe.json"
    for bad in (["--model", "30b"], ["--model", "30b-a3b", "--layers", "0"], ["--model", "30b-a3b", "--layers", "49"],
                ["--model", "tiny-moe", "--layers", "3"], ["--layers", "-1"]):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2, bad


def test_rank_share_is_veRLs_dispatch():
    """DataProto.chunk's contiguous equal shares; a batch that does not divide among the ranks is refused."""
    from test_demo import _load_bench
    bench = _load_bench("verl_step")
    v = bench._verl()
    args = bench.parse_args(["--groups", "3", "-N", "4", "--prompt-len", "5,8", "--response-len", "2,4"])
    proto, _, _, rows = bench.rollout_batch(v, args, 100)
    share, local = bench.rank_share(proto, rows, 2, 1)
    assert len(share) == 6 and local == rows[6:]
    assert torch.equal(share.batch["input_ids"], proto.batch["input_ids"][6:])
    with pytest.raises(ValueError, match="do not divide among 5 ranks"):
        bench.rank_share(proto, rows, 5, 0)


def test_verl_step_refuses_unknown_methods():
    from test_demo import _load_bench
    bench = _load_bench("verl_step")
    assert bench.parse_args([]).methods == ["once", "copies", "stock"]
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(["--methods", "once,flex"])
    assert bench.parse_args(["--methods", "once,stock_fa4"]).methods == ["once", "stock_fa4"]
    assert bench.parse_args(["--methods", "copies,flex_fa4"]).methods == ["copies", "flex_fa4"]
    assert exc.value.code == 2


def test_verl_step_sp_argument(monkeypatch, capsys):
    """--sp divides the world size and runs the dualkv methods only (veRL's stock path shards attention
    only through its patched flash_attention_2, which the stock methods here do not use)."""
    from test_demo import _load_bench
    bench = _load_bench("verl_step")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert bench.parse_args(["--sp", "2", "--methods", "once,copies"]).sp == 2
    for argv, message in ((["--sp", "3", "--methods", "once"], "must divide the world size 4"),
                          (["--sp", "2"], "runs the dualkv methods (once, copies) only")):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err


def test_stock_fa4_attention_runs_each_sequence_causally():
    """stock_fa4's attention function: cu_seqlens from the position restarts of one packed row, each
    sequence causal on its own (against sdpa on the sequences one by one), GQA; a row that does not
    start a sequence, or a padded batch, is refused."""
    from test_demo import _load_bench
    bench = _load_bench("verl_step")
    lens = [5, 1, 7, 3]
    pos = torch.cat([torch.arange(n) for n in lens]).unsqueeze(0)
    cu, longest = bench.sequence_bounds(pos)
    assert cu.tolist() == [0, 5, 6, 13, 16] and cu.dtype == torch.int32 and longest == 7
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(2))
    out, weights = bench.VarlenAttention(bench.per_sequence_sdpa)(None, q, k, v, None, scaling=0.3, position_ids=pos)
    assert weights is None and out.shape == (1, 16, 4, 8)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        want = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b].repeat_interleave(2, 1), v[:, :, a:b].repeat_interleave(2, 1),
            is_causal=True, scale=0.3)
        torch.testing.assert_close(out[:, a:b], want.transpose(1, 2))
    with pytest.raises(ValueError, match="must start a sequence"):
        bench.sequence_bounds(pos[:, 1:])
    with pytest.raises(ValueError, match="one packed row"):
        bench.VarlenAttention(bench.per_sequence_sdpa)(None, q.expand(2, -1, -1, -1), k, v, None, position_ids=pos)


def test_chunked_logprobs_match_log_softmax():
    """The stock engines' log-probs without flash-attn: chunks of rows, any leading shape, bf16 logits in
    fp32, gradients through the logits as log_softmax's."""
    from test_demo import _load_bench
    bench = _load_bench("verl_step")
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 7, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 7), generator=g)
    got = bench.chunked_logprobs(logits.float(), labels, rows=3)
    want = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert got.shape == (2, 7) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    (g1,) = torch.autograd.grad(bench.chunked_logprobs(logits, labels, rows=4).sum(), logits)
    (g2,) = torch.autograd.grad(want.sum(), logits)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-6)
    half = bench.chunked_logprobs(logits.detach().bfloat16(), labels, rows=5)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half.double(), torch.log_softmax(logits.detach().bfloat16().double(), -1)
                               .gather(-1, labels[..., None]).squeeze(-1), rtol=1e-5, atol=1e-5)


def test_device_run_verl_steps():
    """verl-step runs the bench into $OUT under its own cap; verl-stage stages part a of the split wheels,
    which the wheels step joins with part b."""
    from test_bench_e2e import _device_run_step
    step = _device_run_step("verl-step")
    assert "bench/verl_step.py" in step and 'timeout -k 10 "${VERL_CAP:-570}"' in step and '--out "$OUT"' in step
    assert "cp .whl-verl/a/part_aa /tmp/whl-verl/" in _device_run_step("verl-stage")
    wheels = _device_run_step("wheels")
    assert 'cat /tmp/whl-verl/part_aa "$d/b/part_ab"' in wheels and '"$src"/deps/*.whl' in wheels
    script = (ROOT / "tools" / "verl-wheels.sh").read_text()
    assert "verl==0.9.1" in script and "--only-binary=:all:" in script and "--python-version 3.12" in script
    assert subprocess.run(["bash", "-n", str(ROOT / "tools" / "verl-wheels.sh")]).returncode == 0
    assert "/.whl-verl/" in (ROOT / ".gitignore").read_text().split()
