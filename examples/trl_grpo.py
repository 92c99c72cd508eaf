"""GRPO with TRL on dualkv: ``DualKVGRPOTrainer`` in place of ``GRPOTrainer``, nothing else changes.

Random-weight Qwen3-shaped model, a word-level tokenizer (``t0 .. t{V-1}``, no downloads) and a
rollout function that stands in for vLLM: it returns prompt and completion ids with random lengths,
the way TRL's vLLM path hands them to the trainer. A real run passes ``model="Qwen/Qwen3-1.7B"`` and
``use_vllm=True`` instead.

    python examples/trl_grpo.py                                   # tiny model, CPU, fp32, a few steps
    python examples/trl_grpo.py --stock                           # the same run on stock GRPOTrainer
    python examples/trl_grpo.py --model-size 1.7b --device cuda --groups 8 -N 16 \\
        --prompt-len 2048,8192 --completion-len 512,2048 --steps 1   # a real GPU shape (bf16)
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import zlib
from typing import Callable, Dict, List, Sequence, Tuple

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "python"))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is marked experimental in TRL

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from dualkv.demo import qwen3_config  # noqa: E402
from dualkv.integrations.trl import DualKVGRPOConfig, DualKVGRPOTrainer  # noqa: E402

EOS = 1


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Token ``i`` is the word ``t{i}``; ``t0`` pads, ``t1`` ends a completion. Left padding, as TRL wants."""
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token=f"t{EOS}", unk_token="t0")
    out.padding_side = "left"
    return out


def random_prompts(count: int, lengths: Tuple[int, int], vocab_size: int, seed: int = 0) -> List[str]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
        out.append(" ".join(f"t{t}" for t in torch.randint(2, vocab_size, (n,), generator=g).tolist()))
    return out


def synthetic_rollout(lengths: Tuple[int, int], vocab_size: int) -> Callable:
    """A TRL ``rollout_func``: completions of random length in ``lengths``, a fixed function of (step, row,
    prompt), so two trainers fed the same prompts get the same completions. A completion that reaches
    the upper length has no EOS (a truncated one)."""
    def rollout(prompts: Sequence[str], trainer) -> Dict[str, list]:
        tok = trainer.processing_class
        prompt_ids, completion_ids = [], []
        for i, p in enumerate(prompts):
            g = torch.Generator().manual_seed(zlib.crc32(f"{trainer.state.global_step}/{i}/{p[:64]}".encode()))
            n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=g))
            c = torch.randint(2, vocab_size, (n,), generator=g).tolist()
            if n < lengths[1]:
                c[-1] = EOS
            prompt_ids.append(tok(p)["input_ids"])
            completion_ids.append(c)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
    return rollout


def length_reward(prompts, completions, completion_ids, **kwargs) -> List[float]:
    """Toy reward: prefer completions that end early."""
    return [1.0 / len(c) for c in completion_ids]


def build_trainer(args, output_dir: str):
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    cfg = qwen3_config(args.model_size)
    vocab = cfg.vocab_size
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    rows = args.groups * args.n
    common = dict(output_dir=output_dir, num_generations=args.n, per_device_train_batch_size=rows // args.slices,
                  steps_per_generation=args.slices, gradient_accumulation_steps=args.slices,
                  max_completion_length=args.completion_len[1], max_steps=args.steps, learning_rate=1e-5,
                  logging_steps=1, report_to="none", save_strategy="no", use_cpu=args.device == "cpu",
                  bf16=args.dtype == "bf16", gradient_checkpointing=args.device != "cpu", disable_tqdm=True,
                  seed=args.seed)
    config = GRPOConfig(**common) if args.stock else DualKVGRPOConfig(**common, use_dualkv=True)
    trainer_cls = GRPOTrainer if args.stock else DualKVGRPOTrainer
    dataset = Dataset.from_dict({"prompt": random_prompts(args.groups * args.steps, tuple(args.prompt_len), vocab)})
    return trainer_cls(model=model, reward_funcs=length_reward, args=config, train_dataset=dataset,
                       processing_class=word_tokenizer(vocab),
                       rollout_func=synthetic_rollout(tuple(args.completion_len), vocab))


def _range(text: str) -> List[int]:
    lo, _, hi = text.partition(",")
    return [int(lo), int(hi or lo)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-size", default="tiny", help="a dualkv.demo size: tiny, 0.6b, 1.7b, 4b, 8b")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32"], help="default: fp32 on CPU, bf16 on CUDA")
    p.add_argument("--groups", type=int, default=4, help="prompts per step")
    p.add_argument("-N", dest="n", type=int, default=4, help="completions per prompt (num_generations)")
    p.add_argument("--prompt-len", type=_range, default=[8, 24], help="MIN,MAX prompt tokens")
    p.add_argument("--completion-len", type=_range, default=[4, 16], help="MIN,MAX completion tokens")
    p.add_argument("--slices", type=int, default=2, help="gradient-accumulation slices per generation batch")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stock", action="store_true", help="run TRL's GRPOTrainer instead")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("fp32" if args.device == "cpu" else "bf16")
    if (args.groups * args.n) % args.slices:
        p.error("--groups x -N must be a multiple of --slices")
    return args


def main(argv=None) -> List[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(args, out)
        trainer.train()
    history = [h for h in trainer.state.log_history if "loss" in h]
    for h in history:
        print(f"step {h['step']}: loss {h['loss']:.6f}  entropy {h['entropy']:.4f}  reward {h['reward']:.4f}  "
              f"step_time {h.get('step_time', float('nan')):.2f} s")
    return history


if __name__ == "__main__":
    main()
