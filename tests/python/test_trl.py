"""TRL's GRPOTrainer vs dualkv's DualKVGRPOTrainer on a tiny random Qwen3 (fp32, CPU).

Both trainers start from the same checkpoint and get the same completions (a deterministic rollout
function, the way vLLM output is fed in), so every logged number and every parameter after a few
GRPO steps must agree up to summation order. Plus: the log-prob path itself (budget-split forwards,
masked rows, gradients), whole-group slicing, transformers generation, and bad input.
"""
import importlib.util
import json
import pathlib

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import transformers  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import dualkv  # noqa: E402
from dualkv.demo import qwen3_config  # noqa: E402
from dualkv.integrations.trl import DualKVGRPOConfig, DualKVGRPOTrainer, group_slices  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = _load(REPO / "examples" / "trl_grpo.py")  # its tokenizer and rollout function serve the tests too
VOCAB = 64
MAX_COMPLETION = 8
PROMPTS = ["t5 t9 t13", "t7 t2 t40 t33 t8", "t11", "t20 t21 t22 t23"]
rollout = example.synthetic_rollout((1, MAX_COMPLETION), VOCAB)


def make_tokenizer():
    return example.word_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen3 with random norms, saved with its tokenizer (TRL loads the reference model by path)."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(qwen3_config("tiny", vocab_size=VOCAB, max_position_embeddings=256))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    return str(path)


def reward(prompts, completions, completion_ids, **kwargs):
    return [float(sum(c) % 7) - 0.5 * len(c) for c in completion_ids]


def make_trainer(checkpoint, tmp_path, dualkv_on, rollout_func=rollout, **overrides):
    kw = dict(output_dir=str(tmp_path / ("dualkv" if dualkv_on else "stock")), per_device_train_batch_size=8,
              num_generations=4, max_completion_length=MAX_COMPLETION, max_steps=3, learning_rate=0.1, optim="sgd",
              report_to="none", use_cpu=True, logging_steps=1, save_strategy="no", seed=0,
              gradient_checkpointing=False, model_init_kwargs={"dtype": torch.float32}, disable_tqdm=True,
              bf16=False)
    kw.update(overrides)
    args = DualKVGRPOConfig(**kw) if dualkv_on else GRPOConfig(**kw)
    cls = DualKVGRPOTrainer if dualkv_on else GRPOTrainer
    return cls(model=checkpoint, reward_funcs=reward, args=args, train_dataset=datasets.Dataset.from_dict(
        {"prompt": PROMPTS}), processing_class=make_tokenizer(), rollout_func=rollout_func)


def train_both(checkpoint, tmp_path, **overrides):
    out = []
    for dualkv_on in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(checkpoint, tmp_path, dualkv_on, **overrides)
        trainer.train()
        out.append(trainer)
    return out


LOGGED = ("loss", "grad_norm", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean",
          "clip_ratio/region_mean", "reward", "completions/mean_length")


def assert_same_run(stock, packed, checkpoint, keys=LOGGED):
    steps = [(a, b) for a, b in zip(stock.state.log_history, packed.state.log_history) if "loss" in a]
    assert len(steps) == stock.args.max_steps
    for a, b in steps:
        for k in keys:
            if k in a:
                assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (k, a["step"], a[k], b[k])
    # the parameter update, relative to its size (plain SGD: AdamW divides each gradient element by its own
    # running scale, which turns 1e-7 summation-order noise of a near-zero element into a visible step)
    start = transformers.Qwen3ForCausalLM.from_pretrained(checkpoint).state_dict()
    diff = update = 0.0
    for name, p in stock.model.named_parameters():
        diff += float((dict(packed.model.named_parameters())[name] - p).double().pow(2).sum())
        update += float((p - start[name]).double().pow(2).sum())
    assert (diff / update) ** 0.5 <= 1e-5


def test_grpo_steps_match_stock(checkpoint, tmp_path):
    # grpo loss (per-sequence means), a reference model (KL), 2 PPO iterations (old log-probs, clipping active),
    # truncated completions masked out, a high-entropy token mask (entropies enter the loss)
    stock, packed = train_both(checkpoint, tmp_path, loss_type="grpo", beta=0.1, num_iterations=2,
                               mask_truncated_completions=True, top_entropy_quantile=0.5)
    assert_same_run(stock, packed, checkpoint)
    clipped = [h["clip_ratio/region_mean"] for h in stock.state.log_history if "clip_ratio/region_mean" in h]
    assert max(clipped) > 0.05  # the comparison covers the clipped branch of the loss


def test_group_slices_match_stock_dapo(checkpoint, tmp_path):
    # two gradient-accumulation slices per generation: stock slices by shuffled rows, dualkv by whole groups;
    # with dapo's global token normalisation the accumulated update does not depend on the partition
    stock, packed = train_both(checkpoint, tmp_path, loss_type="dapo", per_device_train_batch_size=4,
                               steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=1)
    assert_same_run(stock, packed, checkpoint, keys=("loss", "grad_norm", "reward"))
    for piece in packed._buffered_inputs:  # one group of 4 identical prompts per slice
        ids = piece["prompt_ids"].masked_fill(piece["prompt_mask"] == 0, -1)
        assert torch.equal(ids, ids[:1].expand_as(ids))


class CountingTrainer(DualKVGRPOTrainer):
    """Counts the tokens the policy's embedding sees with and without gradients, and keeps every generation
    batch's slices."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tokens = {True: 0, False: 0}
        self.generations = []
        self.model.model.embed_tokens.register_forward_hook(self._count)

    def _count(self, module, inputs, output):
        self.tokens[torch.is_grad_enabled()] += inputs[0].numel()

    def _prepare_inputs(self, generation_batch):
        out = super()._prepare_inputs(generation_batch)
        if not self.generations or self.generations[-1] is not self._buffered_inputs:
            self.generations.append(self._buffered_inputs)
        return out


def split_prompt_tokens(trainer):
    """(prompt tokens the forwards with gradients skip, prompt tokens phase A runs) over the run: a group whose
    rows sit in k > 1 slices of one accumulation window, with a prompt of P > 1 tokens, runs P - 1 tokens in
    phase A and packs one prompt token instead of P in k - 1 of its slices."""
    steps, saved, phase_a = trainer.args.gradient_accumulation_steps, 0, 0
    for slices in trainer.generations:
        for w in range(0, len(slices), steps):
            where = {}
            for i, piece in enumerate(slices[w:w + steps]):
                for b in range(piece["prompt_ids"].shape[0]):
                    if piece["completion_mask"][b].sum() > 0:
                        sig = tuple(piece["prompt_ids"][b][piece["prompt_mask"][b].bool()].tolist())
                        where.setdefault(sig, set()).add(i)
            for sig, used in where.items():
                if len(used) > 1 and len(sig) > 1:
                    saved += (len(sig) - 1) * (len(used) - 1)
                    phase_a += len(sig) - 1
    return saved, phase_a


@pytest.mark.parametrize("generations, rows, steps, iterations, checkpointing, stream", [
    (4, 2, 4, 1, False, False),  # two groups, each in two slices
    (6, 2, 6, 1, True, True),  # two groups, each in three slices (two read the recorded prompt, one closes it)
    (3, 2, 3, 1, False, True),  # the middle slice closes one group and reads the next
    (4, 2, 2, 2, True, False),  # two windows per generation batch (steps_per_generation 4), two PPO iterations
])
def test_prompt_once_across_slices_matches_stock(checkpoint, tmp_path, generations, rows, steps, iterations,
                                                 checkpointing, stream):
    # slices smaller than a group: a group's prompt runs once per optimizer step (phase A without gradients,
    # the prompt live in the group's last slice), and the update is the one of a copy of the prompt per slice
    # (and stock TRL's where an optimizer step sees the whole generation batch: then the partition into
    # slices does not change dapo's update)
    per_generation = 4 if iterations > 1 else steps
    overrides = dict(loss_type="dapo", num_generations=generations, per_device_train_batch_size=rows,
                     steps_per_generation=per_generation, gradient_accumulation_steps=steps,
                     num_iterations=iterations, max_steps=2, gradient_checkpointing=checkpointing)
    runs = {}
    for once in (False, True):
        torch.manual_seed(0)
        args = make_trainer(checkpoint, tmp_path, True, **overrides).args
        args.dualkv_prompt_once, args.dualkv_stream_prompt_state = once, stream  # (the state in host memory)
        trainer = CountingTrainer(model=checkpoint, reward_funcs=reward, args=args, processing_class=make_tokenizer(),
                                  train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}), rollout_func=rollout)
        trainer.train()
        runs[once] = trainer
    assert_same_run(runs[False], runs[True], checkpoint, keys=("loss", "grad_norm", "reward"))
    if per_generation == steps:
        torch.manual_seed(0)
        stock = make_trainer(checkpoint, tmp_path, False, **overrides)
        stock.train()
        assert_same_run(stock, runs[True], checkpoint, keys=("loss", "grad_norm", "reward"))
    saved, phase_a = split_prompt_tokens(runs[True])
    assert saved > 0 and phase_a > 0
    assert runs[False].tokens[True] - runs[True].tokens[True] == saved
    assert runs[True].tokens[False] - runs[False].tokens[False] == phase_a


def _ddp_worker(rank, world, port, checkpoint, out_dir):
    """A rank of the two-process run (gloo, accelerate's MULTI_CPU): stock TRL, then dualkv with prompt once
    across slices, then with a prompt copy per slice, on the same rollouts. Rank 1's rollouts keep only the
    last prompt token, so it has no split group and runs a placeholder prompt phase beside rank 0's."""
    import os
    import traceback

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = pathlib.Path(out_dir) / f"rank{rank}.json"
    try:
        from dualkv import schedule

        def rollout_of_rank(prompts, trainer):
            out = rollout(prompts, trainer)
            if trainer.accelerator.process_index == 1:
                out["prompt_ids"] = [p[-1:] for p in out["prompt_ids"]]
            return out

        phases = []
        run_prompt_phase = schedule.run_prompt_phase

        def counted(model, prompts, *args, **kwargs):
            phases.append([int(p.numel()) for p in prompts])
            return run_prompt_phase(model, prompts, *args, **kwargs)

        schedule.run_prompt_phase = counted
        report = {}
        for name, on, once in (("stock", False, None), ("once", True, True), ("copies", True, False)):
            torch.manual_seed(0)
            trainer = make_trainer(checkpoint, pathlib.Path(out_dir) / name, on, rollout_func=rollout_of_rank,
                                   loss_type="dapo", num_generations=4, per_device_train_batch_size=2,
                                   steps_per_generation=4, gradient_accumulation_steps=4, max_steps=2,
                                   **({"dualkv_prompt_once": once} if on else {}))
            phases.clear()
            trainer.train()
            report[name] = {"loss": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                            "params": torch.cat([p.detach().double().flatten() for p in trainer.model.parameters()]
                                                ).tolist(),
                            "phases": list(phases), "distributed": str(trainer.accelerator.distributed_type)}
        path.write_text(json.dumps({"ok": True, "report": report}))
    except BaseException:  # noqa: BLE001 - read by the test
        path.write_text(json.dumps({"ok": False, "error": traceback.format_exc()}))


def test_prompt_once_across_slices_two_processes(checkpoint, tmp_path):
    """Two processes (DDP over gloo): the gradient sync inside each window's last backward carries the prompt
    gradients that closing slices handed over (phase C inside the slice), rank 1 runs placeholder prompt
    phases in step with rank 0's, and the update equals stock TRL's and the per-slice-copy run's."""
    import socket

    from spawned_ranks import spawn_ranks
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    found, note, _ = spawn_ranks(_ddp_worker, 2, tmp_path, (2, port, checkpoint, str(tmp_path)), deadline_s=240)
    for r, res in enumerate(found):
        assert res is not None and res["ok"], f"rank {r}: {res['error'] if res else note}"
    reports = [res["report"] for res in found]
    for report in reports:
        assert report["once"]["distributed"] == "DistributedType.MULTI_CPU"
        stock = torch.tensor(report["stock"]["params"])
        start = torch.cat([p.detach().double().flatten() for p in
                           transformers.Qwen3ForCausalLM.from_pretrained(checkpoint).parameters()])
        for name in ("once", "copies"):
            assert report[name]["loss"] == pytest.approx(report["stock"]["loss"], rel=1e-5, abs=1e-6), name
            got = torch.tensor(report[name]["params"])
            assert float((got - stock).norm() / (stock - start).norm()) <= 1e-5, name
        assert report["copies"]["phases"] == []
    assert reports[0]["once"]["params"] == reports[1]["once"]["params"]  # DDP: one update on both ranks
    rank0, rank1 = reports[0]["once"]["phases"], reports[1]["once"]["phases"]
    assert len(rank0) == len(rank1) == 2  # one prompt phase per window (= optimizer step) on both ranks
    assert all(len(p) > 0 and min(p) > 1 for p in rank0) and rank1 == [[2], [2]]  # rank 1: placeholders


def test_prompt_once_window_plan():
    """The window plan: a group in several slices reads its recorded prompt in all but its last slice and closes
    it there; one-token prompts, empty completions and groups within one slice are packed as before."""
    from dualkv.integrations.trl import _Window

    def piece(prompts, completion_lens):
        Lp, Lc = max(len(p) for p in prompts), max(completion_lens) + 1
        pm = torch.tensor([[0] * (Lp - len(p)) + [1] * len(p) for p in prompts])
        ids = torch.tensor([[0] * (Lp - len(p)) + list(p) for p in prompts])
        cm = torch.tensor([[1] * n + [0] * (Lc - n) for n in completion_lens])
        return {"prompt_ids": ids, "prompt_mask": pm, "completion_mask": cm}

    a, b, c, d = (5, 6, 7), (8, 9), (4,), (3, 3)
    slices = [piece([a, a, b], [2, 3, 1]), piece([a, b, c], [1, 2, 2]), piece([b, c, c], [4, 1, 2]),
              piece([b, d, d], [0, 2, 2])]
    w = _Window.plan(slices, 5, "cpu")
    assert w.steps == 5 and len(w.calls) == 4 and w.phase_a
    assert [p.tolist() for p in w.prompts] == [list(a), list(b)]  # c: one token; d: one slice
    ka, kb = w.calls[0].keys[0], w.calls[0].keys[2]
    assert w.calls[0].roles == {ka: ("read", 0), kb: ("read", 1)}
    assert w.calls[1].roles == {ka: ("close", 0), kb: ("read", 1)}
    assert w.calls[2].roles == {kb: ("close", 1)}  # b's row in slice 3 has no completion: not packed
    assert w.calls[3].keys[0] is None and w.calls[3].roles == {}
    assert w.calls[2].lens == [4, 1, 2]
    single = _Window.plan(slices[:1], 2, "cpu")
    assert not single.phase_a and single.prompts == []
    holes = piece([a, a], [2, 2])
    holes["completion_mask"][0, 0] = 0
    with pytest.raises(ValueError, match="right-padded"):
        _Window.plan([holes, slices[1]], 2, "cpu")


def test_prompt_once_window_left_open_stops_the_run(checkpoint, tmp_path, monkeypatch):
    """A window whose plan never closes a split group stops at its last step's forward, before the backward
    and the optimizer step (the group's prompt would miss the other slices' gradients)."""
    from dualkv.integrations import trl as dtrl
    plan = dtrl._Window.plan.__func__

    def plan_without_closes(cls, *args, **kwargs):
        window = plan(cls, *args, **kwargs)
        for call in window.calls:
            call.roles = {k: r for k, r in call.roles.items() if r[0] == "read"}
        return window

    monkeypatch.setattr(dtrl._Window, "plan", classmethod(plan_without_closes))
    trainer = make_trainer(checkpoint, tmp_path, True, loss_type="dapo", per_device_train_batch_size=2,
                           steps_per_generation=4, gradient_accumulation_steps=4, max_steps=1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(RuntimeError, match="not closed"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_logprobs_and_gradients_match_stock(checkpoint, tmp_path):
    stock = make_trainer(checkpoint, tmp_path, False)
    packed = make_trainer(checkpoint, tmp_path, True)
    tok = stock.processing_class
    # 3 prompts, repeated non-adjacently; row 5's completion is fully masked (a truncated completion)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    order = [0, 1, 0, 2, 1, 0, 2, 1]
    g = torch.Generator().manual_seed(3)
    comps = [torch.randint(2, VOCAB, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g) for _ in order]
    Lp, Lc = max(len(p) for p in prompts), max(len(c) for c in comps)
    ids = torch.zeros(len(order), Lp + Lc, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (k, c) in enumerate(zip(order, comps)):
        p = torch.tensor(prompts[k])
        ids[b, Lp - len(p):Lp], mask[b, Lp - len(p):Lp] = p, 1
        ids[b, Lp:Lp + len(c)], mask[b, Lp:Lp + len(c)] = c, 1
    mask[5, Lp:] = 0
    for batch_size in (None, 2):  # one forward; forwards of whole groups under a 2-row token budget
        results = []
        for trainer in (stock, packed):
            trainer.model.zero_grad()
            logp, ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, Lc,
                                                                      batch_size=batch_size, compute_entropy=True)
            ((logp * mask[:, Lp:]).sum() + 0.1 * (ent * mask[:, Lp:]).sum()).backward()
            grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
            results.append((logp.detach(), ent.detach(), grads))
        (lp_s, en_s, gr_s), (lp_d, en_d, gr_d) = results
        torch.testing.assert_close(lp_d, lp_s, rtol=0, atol=1e-5)
        torch.testing.assert_close(en_d, en_s, rtol=0, atol=1e-5)
        assert torch.count_nonzero(lp_d[5]) == 0 and torch.count_nonzero(lp_d[:5]) > 0
        for name, g_s in gr_s.items():
            assert float((gr_d[name] - g_s).norm()) <= 1e-5 * float(g_s.norm()), name


def test_transformers_generation_matches_stock(checkpoint, tmp_path):
    # no rollout function: completions sampled by model.generate, which must run on the stock attention
    stock, packed = train_both(checkpoint, tmp_path, rollout_func=None, max_steps=1, temperature=1.0)
    assert_same_run(stock, packed, checkpoint)
    assert packed.model.config._attn_implementation == "dualkv"


def test_group_slices_balance_whole_groups():
    rows = []  # 4 groups of 2 rows; group g has a prompt of g + 1 tokens and completions of 3g + 1 tokens
    for g in range(4):
        rows += [(g, g + 1, 3 * g + 1)] * 2
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist()
    rows = [rows[i] for i in order]
    Lp, Lc = 4, 10
    batch = {"prompt_ids": torch.zeros(8, Lp, dtype=torch.long), "prompt_mask": torch.zeros(8, Lp, dtype=torch.long),
             "completion_mask": torch.zeros(8, Lc, dtype=torch.long), "advantages": torch.arange(8.0),
             "num_items_in_batch": torch.tensor(5), "tag": list(range(8))}
    for b, (g, p, c) in enumerate(rows):
        batch["prompt_ids"][b, Lp - p:] = 10 + g
        batch["prompt_mask"][b, Lp - p:] = 1
        batch["completion_mask"][b, :c] = 1
    slices = group_slices(batch, 2)
    cost = []
    for s in slices:
        assert s["num_items_in_batch"] is batch["num_items_in_batch"]
        groups = [rows[t][0] for t in s["tag"]]
        assert len(set(groups)) == 2 and all(groups.count(g) == 2 for g in groups)  # 2 whole groups
        assert s["advantages"].tolist() == [float(t) for t in s["tag"]]  # rows stay aligned across keys
        cost.append(sum(rows[t][1] / 2 + rows[t][2] for t in s["tag"]))
    assert cost == [27.0, 27.0]  # groups cost 3, 10, 17, 24 packed tokens: {24, 3} and {17, 10}


def test_bad_input_is_refused(checkpoint, tmp_path):
    def too_long(prompts, trainer):
        out = rollout(prompts, trainer)
        out["completion_ids"][3] = [5] * (MAX_COMPLETION + 2)
        return out

    trainer = make_trainer(checkpoint, tmp_path, True, rollout_func=too_long, max_steps=1)
    with pytest.raises(ValueError, match="longer than max_completion_length=8: rows \\[3\\]"):
        trainer.train()


TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, vocab_size=VOCAB)


@pytest.mark.parametrize("config, message", [
    (transformers.Qwen3Config(**dict(TINY, head_dim=1024)), "head dim 1024"),
    (transformers.Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
     "router_aux_loss_coef"),  # TRL turns the router loss on for MoE models by default
    (transformers.Qwen3NextConfig(**TINY, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
                                  linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                  layer_types=["linear_attention", "full_attention"]), "linear_attention layers"),
])
def test_unservable_models_are_refused(tmp_path, config, message):
    path = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    with pytest.raises(dualkv.UnsupportedError, match=message):
        make_trainer(str(path), tmp_path, True)


@pytest.mark.parametrize("slices", ["2", "4"])  # 4: slices of 2 rows split the groups of 4 (prompt once across them)
def test_example_runs_and_matches_stock(slices):
    argv = ["--steps", "2", "--groups", "2", "--slices", slices]
    stock, packed = example.main(argv + ["--stock"]), example.main(argv)
    assert [h["loss"] for h in packed] == pytest.approx([h["loss"] for h in stock], rel=1e-5, abs=1e-7)


def test_bench_smoke(tmp_path):
    bench = _load(REPO / "bench" / "trl_step.py")
    bench.main(["--device", "cpu", "--model", "tiny", "--dtype", "fp32", "--groups", "2", "-N", "4", "--prompt-len",
                "8,16", "--completion-len", "2,8", "--slices", "2", "--out", str(tmp_path)])
    report = json.loads(next(tmp_path.glob("trl_step-*.json")).read_text())
    assert report["tokens"]["rho"] > 1.5 and report["verdict"]["logprob_ok"]
    assert report["logprob_error"]["dualkv"]["max"] < 1e-5  # fp32: summation order only
    assert report["verdict"]["speed_ok"] in (True, False) and "update_s" in report["times"]["stock"]


def test_bench_flex_fa4(tmp_path):
    """--methods stock,dualkv,flex_fa4: a third trainer packing as the dualkv trainer does but with a prompt copy
    per slice (slices of 2 rows split the groups of 4: dualkv runs each prompt once), whose attention is Flex's
    (on a CPU the dense-mask stand-in): the same log-probs as dualkv's within fp32 noise, one mask build per
    slice of the timed update (each slice one packed forward), its compiles and mask builds reported beside
    its steady state, and its ratio to dualkv in the verdict."""
    bench = _load(REPO / "bench" / "trl_step.py")
    bench.main(["--device", "cpu", "--model", "tiny", "--dtype", "fp32", "--groups", "2", "-N", "4", "--prompt-len",
                "8,16", "--completion-len", "2,8", "--slices", "4", "--methods", "flex_fa4,dualkv,stock,dualkv_copies",
                "--out", str(tmp_path)])
    report = json.loads(next(tmp_path.glob("trl_step-*.json")).read_text())
    assert list(report["times"]) == ["stock", "dualkv", "dualkv_copies", "flex_fa4"]
    assert report["verdict"]["update_speedup_dualkv_copies"] == pytest.approx(
        report["times"]["dualkv_copies"]["update_s"] / report["times"]["dualkv"]["update_s"])
    assert report["logprob_error"]["dualkv_copies"]["max"] < 1e-5
    tok = report["tokens"]
    assert tok["packed"] < tok["packed_slices"] < tok["unpadded"] and report["args"]["prompt_once"] is True
    flex = report["times"]["flex_fa4"]
    assert flex["mask_builds"] == 4 and flex["mask_build_s"] > 0 and set(flex["compile_s"]) == {"update", "logprobs"}
    assert flex["excl_mask_update_s"] == pytest.approx(flex["update_s"] - flex["mask_build_s"])
    assert "dense boolean mask" in report["flex_fa4"]["ran"] and report["flex_fa4"]["flex_compile"] is False
    errors = report["logprob_error"]
    assert errors["flex_fa4"]["max"] < 1e-5 and abs(errors["flex_fa4"]["max"] - errors["dualkv"]["max"]) < 1e-5
    verdict = report["verdict"]
    assert verdict["logprob_flex_fa4_ok"] is True
    assert verdict["update_speedup_flex_fa4"] == pytest.approx(flex["update_s"] / report["times"]["dualkv"]["update_s"])
    for bad in ("stock,flex_fa4", "stock,dualkv,dualkv", "stock,dualkv,flex", "stock,dualkv_copies"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--methods", bad])


def test_bench_parts_run_apart(tmp_path):
    """--parts accuracy measures the log-probs without the timed updates (the H200's G8 step needs two calls)."""
    bench = _load(REPO / "bench" / "trl_step.py")
    bench.main(["--device", "cpu", "--model", "tiny", "--dtype", "fp32", "--groups", "2", "-N", "2", "--prompt-len",
                "8,16", "--completion-len", "2,8", "--slices", "2", "--parts", "accuracy", "--out", str(tmp_path)])
    report = json.loads(next(tmp_path.glob("trl_step-*.json")).read_text())
    assert "times" not in report and set(report["verdict"]) == {"logprob_bound", "logprob_ok"}
    assert report["logprob_error"]["dualkv"]["max"] < 1e-5
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--model", "tiny", "--parts", "speed", "--out", str(tmp_path)])


def test_packed_forward_under_fsdp2(tmp_path):
    """The packed log-prob forward on an FSDP2-sharded model (CPU mesh, gloo, one rank: parameters are
    DTensors, the root group holding the LM head is gathered by FSDP's hooks) equals the plain model."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dualkv.integrations import transformers as dkt
    from dualkv.integrations._packed_forward import forward_kwargs, install
    from dualkv.packing import pack

    torch.manual_seed(0)
    plain = transformers.Qwen3ForCausalLM(qwen3_config("tiny", vocab_size=VOCAB))
    install(dkt.enable(plain))
    sharded = copy.deepcopy(plain)  # the forward install() added is a bound method: the copy calls its own modules
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        g = torch.Generator().manual_seed(1)
        packed = pack([torch.randint(2, VOCAB, (5,), generator=g), torch.randint(2, VOCAB, (2,), generator=g)],
                      [[torch.randint(2, VOCAB, (n,), generator=g) for n in (3, 1, 4)], [torch.randint(2, VOCAB, (2,))]])
        results = []
        for model in (plain, sharded):
            out = model(**forward_kwargs(packed, 0.7, True))
            (out.log_probs.sum() + 0.1 * out.entropy.sum()).backward()
            grads = {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for n, p in model.named_parameters()}
            results.append((out.log_probs.detach(), out.entropy.detach(), grads))
        (lp_a, en_a, gr_a), (lp_b, en_b, gr_b) = results
        assert type(sharded.lm_head.weight).__name__ == "DTensor"
        torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=1e-6)
        torch.testing.assert_close(en_b, en_a, rtol=0, atol=1e-6)
        for name, g_a in gr_a.items():
            assert gr_b[name] is not None and float((gr_b[name] - g_a).norm()) <= 1e-6 * float(g_a.norm()), name
    finally:
        dist.destroy_process_group()
