"""The layout classes issue 23 measures the kernels on, as forests of segments (lengths, parents).

Besides the aligned GRPO groups (one prompt, N equal responses: bench/attention.py's configs), a
trainer's micro-batches come in shapes that stress other parts of a kernel:

  small_groups    many short groups: prompts 100-600 tokens, N 8 responses of 50-400 (short items,
                  most tiles on a diagonal or a segment edge)
  tiny_responses  long prompts with responses of 1-64 tokens (almost all work is the prompts' own
                  causal attention; the responses are a few query rows reading the whole prompt)
  long_responses  a short prompt under long responses (P 256, R 2K-8K): rho ~ 1, nothing shared to
                  save, where packing must not lose to the dense kernel on the unpacked batch
  tree            multi-turn rollouts: prompt -> 4 first turns (answer + next user message) -> 4
                  answers each, three levels, every root-to-leaf path one unpacked sequence

Lengths are drawn from a seeded generator, so a class names one fixed layout (the same on every
machine and run). ``root_paths`` gives the unpacked rows (what a dense kernel computes).
"""
from __future__ import annotations

import random

import dualkv

CLASSES = ("small_groups", "tiny_responses", "long_responses", "tree")


def root_paths(lens, parents):
    """Token count of every root-to-leaf path of the forest: the rows of the unpacked batch."""
    children = {s: [] for s in range(len(lens))}
    for s, p in enumerate(parents):
        if p >= 0:
            children[p].append(s)
    rows = []

    def walk(s, prefix):
        total = prefix + lens[s]
        if not children[s]:
            rows.append(total)
        for c in children[s]:
            walk(c, total)

    for s, p in enumerate(parents):
        if p < 0:
            walk(s, 0)
    return rows


def _groups(prompts, responses):
    """(lens, parents) of GRPO groups, as dualkv lays them out (each prompt, then its responses)."""
    layout = dualkv.Layout.from_groups(prompts, responses)
    return layout.segment_lens, layout.parents


def random_tree(root, fanouts, level_lens, rng):
    """One tree in DFS order: a root of ``root`` tokens; level i has fanouts[i] children per node,
    each of a length drawn from level_lens[i] = (lo, hi)."""
    lens, parents = [root], [-1]

    def grow(node, level):
        if level == len(fanouts):
            return
        for _ in range(fanouts[level]):
            lens.append(rng.randint(*level_lens[level]))
            parents.append(node)
            grow(len(lens) - 1, level + 1)

    grow(0, 0)
    return lens, parents


def layout_class(name: str, seed: int = 0):
    """(segment lengths, parents) of class ``name`` (CLASSES), in DFS order."""
    rng = random.Random(f"{name}:{seed}")
    if name == "small_groups":  # 24 groups: ~52K packed tokens
        prompts = [rng.randint(100, 600) for _ in range(24)]
        return _groups(prompts, [[rng.randint(50, 400) for _ in range(8)] for _ in prompts])
    if name == "tiny_responses":  # 8 groups of P 4096, N 16: ~37K packed tokens
        return _groups([4096] * 8, [[rng.randint(1, 64) for _ in range(16)] for _ in range(8)])
    if name == "long_responses":  # 2 groups of P 256, N 8: ~82K packed tokens
        return _groups([256, 256], [[rng.randint(2048, 8192) for _ in range(8)] for _ in range(2)])
    if name == "tree":  # 4 trees of 1 + 4 + 16 segments: ~39K packed tokens, 64 paths of ~2K
        lens, parents = [], []
        for _ in range(4):
            t_lens, t_parents = random_tree(rng.randint(768, 1280), (4, 4), ((384, 896), (192, 576)), rng)
            parents += [p + len(lens) if p >= 0 else -1 for p in t_parents]
            lens += t_lens
        return lens, parents
    raise ValueError(f"unknown layout class {name!r}; the classes are {', '.join(CLASSES)}")
