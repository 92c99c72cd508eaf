"""One TRL GRPO policy update: stock ``GRPOTrainer`` vs ``DualKVGRPOTrainer`` (issue 20's GPU acceptance),
and against Flex-FA4 packing in the same process (``--methods stock,dualkv,flex_fa4``).

One process, one random-weight Qwen3-shaped model (bf16, gradient checkpointing) copied into both
trainers, the same generation batch fed to both (the rollout function of examples/trl_grpo.py stands in
for vLLM): G prompts x N completions, prompt lengths uniform in --prompt-len, completion lengths in
--completion-len. Each trainer builds its generation batch with TRL's own ``_generate_and_score_completions``
and splits it the way its ``_prepare_inputs`` does (stock: shuffled rows; dualkv: whole groups) into
--slices gradient-accumulation slices. Measured, with CUDA events after one warm-up slice:

* update: forward + backward (``compute_loss`` + backward, TRL's dapo loss) of every slice;
* logprobs: the no-grad log-prob pass over the whole batch (old / reference log-probs), in
  micro-batches of ``per_device_train_batch_size`` rows (stock) or the same padded-token budget (dualkv).

``flex_fa4`` (not in the default methods; FlashAttention-4 on a GPU: tests/gpu/device_run.sh fa4-install):
the strongest peer on the same packed stream. A third trainer, ``DualKVGRPOTrainer`` on a copy of the same
weights with the same slices, whose attention is bench/layout_flex.py's layout attention: compiled
FlexAttention with ``BACKEND=FLASH`` and the forest rule's BlockMask built per micro-batch inside the pass.
It packs as a Flex user packs in TRL: whole groups per slice, and where a slice holds fewer rows than a group
(--slices above G: ``per_device_train_batch_size < num_generations``) each slice's piece of a group with a
copy of its prompt (``dualkv_prompt_once=False``; Flex reads no recorded keys and values), while dualkv runs
such a prompt once per update (the plug-in's prompt once across slices; ``--no-prompt-once`` turns it off).
``dualkv_copies`` (not in the default methods): the plug-in with ``dualkv_prompt_once=False`` in the same
process, on a copy of the weights: a prompt copy per slice with dualkv's attention, which splits
dualkv's margin over flex_fa4 into prompt once (dualkv_copies over dualkv) and kernel (flex_fa4 over
dualkv_copies).
Where slices hold whole groups the two run one packed stream and only the attention differs. Its first update
and log-prob pass are counted apart (compiles: ``compile_s``), then timed as the others; its BlockMask
builds of the timed update are counted and timed alone (``mask_builds``, ``mask_build_s``, inside
``update_s``). On a CPU the project's Flex stand-in (a dense boolean mask through SDPA).

Accuracy (the tolerance rule of DESIGN.md section 7, as bench/logprob_noise.py applies it): on the rows
of the first group, each trainer's bf16 log-probs against an fp32 truth (the same weights upcast, exact
fp32 attention, row by row): max|dualkv - truth| <= 2 max|stock - truth| + 1e-3.
Speed: rho = unpadded tokens (sum over rows of P + C) / packed tokens (sum over groups of P + sum C);
the acceptance is update speedup >= 0.85 rho (with --no-prompt-once: 0.85 rho_slices, the packed tokens
counting a prompt copy per slice). JSON (environment, tokens, times, errors, verdict) to
--out; the environment is bench/e2e.py's provenance (provenance.py: exact commit, versions including
TRL, switches, the library). A GPU run refuses a tree that is not a commit unless --allow-dirty; a
copy without .git (the device machine) declares it with DUALKV_COMMIT.

    python bench/trl_step.py                       # G8 x N16, P 2K-8K, C 0.5K-2K, 1.7B, on the GPU
    python bench/trl_step.py --methods stock,dualkv,flex_fa4 --groups 4   # with Flex-FA4 (after fa4-install)
    python bench/trl_step.py --device cpu --model tiny --groups 2 -N 4 --prompt-len 8,16 \\
        --completion-len 2,8 --slices 2 --dtype fp32          # smoke test
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import sys
import types

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "python"))
sys.path.insert(0, str(HERE.parent / "examples"))

import logprob_noise  # noqa: E402  (exact fp32 truth, row by row)
import provenance  # noqa: E402
from e2e import environment, int_range  # noqa: E402
from layout_flex import (FLEX_FA4_ATTENTION, FLEX_FA4_IMPL, flex_fa4_protocol, recorded_mask_builds,  # noqa: E402
                         register_flex_fa4)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict  # noqa: E402
from trl_grpo import length_reward, random_prompts, synthetic_rollout, word_tokenizer  # noqa: E402

from dualkv.demo import _Timer as Clock  # noqa: E402  (CUDA events on a GPU, wall clock otherwise)
from dualkv.demo import qwen3_config  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.integrations.trl import DualKVGRPOConfig, DualKVGRPOTrainer, group_slices  # noqa: E402


#: the trainers: TRL's own, the dualkv plug-in, and the plug-in's packed stream on Flex-FA4
METHODS = ("stock", "dualkv", "dualkv_copies", "flex_fa4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.7b", help="dualkv.demo size (tiny, 0.6b, 1.7b, 4b, 8b)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("-N", dest="n", type=int, default=16)
    p.add_argument("--prompt-len", type=int_range, default=(2048, 8192))
    p.add_argument("--completion-len", type=int_range, default=(512, 2048))
    p.add_argument("--slices", type=int, default=8, help="gradient-accumulation slices (steps_per_generation)")
    p.add_argument("--no-prompt-once", dest="prompt_once", action="store_false",
                   help="dualkv packs a copy of the prompt per slice where a group spans slices (as flex_fa4 does)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default="stock,dualkv",
                   help="stock and dualkv (always), and dualkv_copies (the plug-in with a prompt copy per slice) and "
                        "flex_fa4 (Flex-FA4 packing with a prompt copy per slice)")
    p.add_argument("--parts", default="timing,accuracy",
                   help="what to run: timing (the timed updates and log-prob passes), accuracy (first group's log-probs "
                        "against the fp32 truth), or both; a G8 step's stock update takes ~150 s on the H200, so the two "
                        "fit one device call only apart (same seed and config: the same rollouts)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="measure on a GPU from a tree that is not a commit (the result is marked dirty)")
    p.add_argument("--out", default=str(HERE / "results"))
    args = p.parse_args(argv)
    if set(args.parts.split(",")) - {"timing", "accuracy"}:
        p.error(f"--parts takes timing and/or accuracy, got {args.parts!r}")
    methods = args.methods.split(",")
    if set(methods) - set(METHODS) or not {"stock", "dualkv"} <= set(methods) or len(set(methods)) != len(methods):
        p.error(f"--methods takes stock and dualkv, and optionally dualkv_copies and flex_fa4, each once; got "
                f"{args.methods!r}")
    args.methods = [m for m in METHODS if m in methods]
    return args


def make_trainer(cls, config_cls, model, args, vocab, dataset, extra):
    rows = args.groups * args.n
    config = config_cls(output_dir="/tmp/trl_step", num_generations=args.n, per_device_train_batch_size=rows // args.slices,
                        steps_per_generation=args.slices, gradient_accumulation_steps=args.slices,
                        max_completion_length=args.completion_len[1], report_to="none", save_strategy="no",
                        use_cpu=args.device == "cpu", bf16=args.dtype == "bf16", gradient_checkpointing=True,
                        loss_type="dapo", seed=args.seed, disable_tqdm=True, **extra)
    trainer = cls(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset,
                  processing_class=word_tokenizer(vocab), rollout_func=synthetic_rollout(args.completion_len, vocab))
    trainer.model.train()
    # both are set up by Trainer.train(), which this benchmark does not run: checkpointing (non-reentrant, TRL's
    # default) and the accumulation count that compute_loss reads
    dkt.enable_checkpointing(trainer.model)
    trainer.current_gradient_accumulation_steps = args.slices
    return trainer


def update(trainer, slices):
    """compute_loss + backward over every slice (one optimizer step's worth), gradients dropped after. The
    slices are one accumulation window, as Trainer.train() would run them: a dualkv trainer's prompt once
    across slices plans it at its first slice (DualKVGRPOTrainer.window_slice, what its _prepare_inputs does per
    training step)."""
    for i in range(len(slices)):
        piece = trainer.window_slice(slices, i) if hasattr(trainer, "window_slice") else slices[i]
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(trainer.model, piece)
        trainer.accelerator.backward(loss)
    trainer.model.zero_grad(set_to_none=True)


def logprob_pass(trainer, batch, rows=None):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    if rows is not None:
        ids, mask = ids[rows], mask[rows]
    with torch.no_grad():
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, batch["completion_ids"].shape[1],
                                                          batch_size=trainer.args.per_device_train_batch_size)[0]


def tokens(batch, n, slices):
    """Token counts of the update: unpadded rows, packed with each prompt once (dualkv's prompt once), packed
    with a prompt copy in every slice holding a piece of its group (``packed_slices``: flex_fa4, and dualkv
    with --no-prompt-once), and padded."""
    plen, clen = batch["prompt_mask"].sum(1).tolist(), batch["completion_mask"].sum(1).tolist()
    unpadded = sum(plen) + sum(clen)
    packed = sum(plen[g] for g in range(0, len(plen), n)) + sum(clen)  # rows g..g+n-1 share prompt g
    per_slice = 0
    for piece in slices:
        prompts = {tuple(ids[m.bool()].tolist()) for ids, m in zip(piece["prompt_ids"], piece["prompt_mask"])}
        per_slice += sum(len(p) for p in prompts) + int(piece["completion_mask"].sum())
    padded = batch["prompt_ids"].numel() + batch["completion_ids"].numel()
    return dict(unpadded=unpadded, packed=packed, packed_slices=per_slice, padded=padded, rho=unpadded / packed,
                rho_slices=unpadded / per_slice, rho_padded=padded / packed)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    tree = provenance.measured_state(device, args.allow_dirty)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    cfg = qwen3_config(args.model)
    torch.manual_seed(args.seed)
    from transformers import AutoModelForCausalLM
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    prompts = random_prompts(args.groups, args.prompt_len, cfg.vocab_size, seed=args.seed)
    from datasets import Dataset
    dataset = Dataset.from_dict({"prompt": prompts})
    report = {"env": environment(device, tree), "args": vars(args)}  # env["date"]: when it ran
    if "flex_fa4" in args.methods:
        register_flex_fa4(device)  # FA4 missing on a GPU: peers.Unavailable, before any model is built
    trainers = {"stock": make_trainer(GRPOTrainer, GRPOConfig, copy.deepcopy(base), args, cfg.vocab_size, dataset, {})}
    if "flex_fa4" in args.methods:
        trainers["flex_fa4"] = make_trainer(DualKVGRPOTrainer, DualKVGRPOConfig, copy.deepcopy(base), args,
                                            cfg.vocab_size, dataset, {"use_dualkv": True, "dualkv_prompt_once": False})
    if "dualkv_copies" in args.methods:
        trainers["dualkv_copies"] = make_trainer(DualKVGRPOTrainer, DualKVGRPOConfig, copy.deepcopy(base), args,
                                                 cfg.vocab_size, dataset, {"use_dualkv": True, "dualkv_prompt_once": False})
    trainers["dualkv"] = make_trainer(DualKVGRPOTrainer, DualKVGRPOConfig, base, args, cfg.vocab_size, dataset,
                                      {"use_dualkv": True, "dualkv_prompt_once": args.prompt_once})
    trainers = {m: trainers[m] for m in args.methods}
    inputs = [{"prompt": p} for p in prompts for _ in range(args.n)]  # RepeatSampler's order
    batches, slices = {}, {}
    for name, trainer in trainers.items():
        batches[name] = trainer._generate_and_score_completions(inputs)
        torch.manual_seed(args.seed)  # both draw the same row permutation
        slices[name] = (group_slices(batches[name], args.slices) if name != "stock"
                        else split_tensor_dict(shuffle_sequence_dict(batches[name]), args.slices))
        assert torch.equal(batches["stock"]["completion_ids"], batches[name]["completion_ids"])
    if "flex_fa4" in trainers:  # after the rollouts: only the attention of its packed forwards changes
        for model in trainers["flex_fa4"]._hf_models():
            model.set_attn_implementation(FLEX_FA4_IMPL)
        report["flex_fa4"] = flex_fa4_protocol(device)
    report["tokens"] = tokens(batches["stock"], args.n, slices["dualkv"])
    print(f"tokens {report['tokens']}", flush=True)

    parts = set(args.parts.split(","))
    report["verdict"] = {}
    if "timing" in parts:
        report["times"] = timing(trainers, batches, slices, device)
        times = report["times"]
        speedup = times["stock"]["update_s"] / times["dualkv"]["update_s"]
        target = 0.85 * report["tokens"]["rho" if args.prompt_once else "rho_slices"]
        report["verdict"].update(update_speedup=speedup, logprobs_speedup=times["stock"]["logprobs_s"] /
                                 times["dualkv"]["logprobs_s"], target_speedup=target, speed_ok=speedup >= target)
        if "dualkv_copies" in times:  # the prompt copies' update over prompt once's (above 1: prompt once faster)
            report["verdict"].update(
                update_speedup_dualkv_copies=times["dualkv_copies"]["update_s"] / times["dualkv"]["update_s"])
        if "flex_fa4" in times:  # Flex-FA4's steady state over dualkv's (above 1: dualkv faster)
            report["verdict"].update(
                update_speedup_flex_fa4=times["flex_fa4"]["update_s"] / times["dualkv"]["update_s"],
                logprobs_speedup_flex_fa4=times["flex_fa4"]["logprobs_s"] / times["dualkv"]["logprobs_s"])
    if "accuracy" in parts:
        report["logprob_error"] = accuracy(trainers, batches, args.n)
        bound = 2 * report["logprob_error"]["stock"]["max"] + 1e-3
        report["verdict"].update(logprob_bound=bound, logprob_ok=report["logprob_error"]["dualkv"]["max"] <= bound)
        if "flex_fa4" in report["logprob_error"]:
            report["verdict"]["logprob_flex_fa4_ok"] = report["logprob_error"]["flex_fa4"]["max"] <= bound
        print(json.dumps(report["logprob_error"]), flush=True)
    print(json.dumps(report["verdict"]), flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"trl_step-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
    return 0 if all(v for k, v in report["verdict"].items() if k.endswith("_ok")) else 1


def timing(trainers, batches, slices, device):
    """One warm-up slice, then the timed update over every slice and a log-prob pass, per trainer.
    flex_fa4 first runs a whole counted update and log-prob pass (its compiles: one graph per pass kind
    for the first packed length, a dynamic one for the next), so that its timed passes are its steady
    state as well; its mask builds are recorded in the timed update and timed alone after it."""
    times = {}
    for name, trainer in trainers.items():
        first = {}
        if name == "flex_fa4":
            with Clock(device) as c:
                update(trainer, slices[name])
            with Clock(device) as lp:
                logprob_pass(trainer, batches[name])
            first = {"update_first_s": c.seconds, "logprobs_first_s": lp.seconds}
        else:
            update(trainer, slices[name][:1])  # warm-up: kernels, allocator, planner
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with recorded_mask_builds(name) as built, Clock(device) as c:
            update(trainer, slices[name])
        with Clock(device) as lp:
            logprob_pass(trainer, batches[name])
        times[name] = {"update_s": c.seconds, "logprobs_s": lp.seconds,
                       "gradient_checkpointing": dkt.is_checkpointing(trainer.model), **first}
        if first:
            mask_s = FLEX_FA4_ATTENTION.build_seconds(built, device)
            times[name].update(compile_s={k: max(0.0, first[f"{k}_first_s"] - times[name][f"{k}_s"])
                                          for k in ("update", "logprobs")},
                               mask_builds=len(built), mask_build_s=mask_s, excl_mask_update_s=c.seconds - mask_s)
        if device.type == "cuda":
            times[name]["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"{name}: {times[name]}", flush=True)
    return times


def accuracy(trainers, batches, n):
    """Both trainers' log-probs on the first group's rows against the fp32 truth (max and mean error)."""
    rows = list(range(n))
    got = {name: logprob_pass(trainer, batches[name], rows).float() for name, trainer in trainers.items()}
    batch = batches["stock"]
    prompt = batch["prompt_ids"][0][batch["prompt_mask"][0].bool()]
    completions = [batch["completion_ids"][r][batch["completion_mask"][r].bool()] for r in rows]
    mask = batch["completion_mask"][rows].bool()
    truth_model = trainers["stock"].model.float()  # last use of the stock model: upcast in place (exact)
    logprob_noise.register_truth()
    logprob_noise._fp32_ieee()
    truth_model.set_attn_implementation(logprob_noise.TRUTH_IMPL)
    mb = types.SimpleNamespace(prompts=[prompt], responses=[completions], mask=mask)
    with torch.no_grad():
        truth = logprob_noise.truth_rows(truth_model, mb, 1)
    err = {name: (v[:, :truth.shape[1]] - truth).abs()[mask[:, :truth.shape[1]]] for name, v in got.items()}
    return {name: {"max": float(e.max()), "mean": float(e.mean())} for name, e in err.items()}


if __name__ == "__main__":
    sys.exit(main())
