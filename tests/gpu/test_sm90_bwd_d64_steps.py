"""The Hopper backward's 128-row query steps at head dim 64 (2026-12-02, issue 23 #4;
docs/notes/2026-12-02-d64-bwd-steps.md) against the float64 dense reference.

At D = 64 (without softcap) bwd_sm90_kernel takes 128 query rows per step, two 64-row halves per
consumer warpgroup pair, while the plan still cuts query ranges at multiples of 64 rows. So a step
can end anywhere in its 128 rows: inside the first half, exactly at 64 (the second half wholly past
qb: staged as zeros, its dQ reduce skipped), inside the second half, or at 128. The cases here put
every query range's length, every split piece's length and every window edge on those positions,
for both dQ modes, GQA groups of 1 to 8 heads (the step loop walks heads inside an item), the
window and sinks kernels, the external-prefix kernels, and the softcap kernels (which keep 64-row
steps at D 64) as a control. Rule: tests/gpu/test_sm90_bwd.py's (max error at most 2 x PyTorch's
own low-precision error + 1e-5); deterministic mode bit-identical run to run.
"""
from __future__ import annotations

import random

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import cuda_kernels_run, kernel_grads, make_inputs

pytestmark, DIMS = cases.arch_test_marks("sm90", "bwd")
if torch.cuda.is_available() and 64 not in DIMS:
    pytestmark = pytestmark + [pytest.mark.skip(reason="needs a library with the sm90 head-dim-64 backward")]

if torch.cuda.is_available():
    import dualkv
    from test_cuda_modifiers import run_case as run_modifier_case  # the modifier tests' rule
    from test_prefix_cuda import Case, check_case, flat_inputs, prefixed_grads, prefixed_inputs, references
    from test_sm90_bwd import run

D = 64
DTYPES = [torch.bfloat16, torch.float16]
# Query range lengths around the 128-row step: r mod 128 in {1, 63, 64, 65, 127, 0}, and longer.
STEP_EDGES = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 383, 384, 385]


def step_edge_forest(rng: random.Random, n_groups: int = 4, budget: int = 2000):
    """Prompts with responses whose lengths sit on the step edges: a KV tile of a prompt sees the
    prompt's rest plus every response, so its query ranges end at all of those positions. At most
    `budget` tokens (the dense float64 reference)."""
    lens, parents = [], []
    for _ in range(n_groups):
        root = len(lens)
        lens.append(rng.choice(STEP_EDGES))
        parents.append(-1)
        for _ in range(rng.randint(1, 5)):
            n = rng.choice(STEP_EDGES)
            if sum(lens) + n > budget:
                break
            lens.append(n)
            parents.append(root)
        if sum(lens) >= budget:
            break
    return lens, parents


def check_ragged_steps(H, Hk, dtype, deterministic):
    """Forests whose query ranges end on every step edge (shared with the portable kernel's test)."""
    for i in range(3):
        lens, parents = step_edge_forest(random.Random(640 + 10 * i + H + Hk))
        run(lens, parents, H, Hk, D, dtype, seed=i, deterministic=deterministic, with_dlse=(i == 1))


def check_split_pieces(split, deterministic, monkeypatch):
    """Pieces of 64, 192, 320 rows end in a half step (the plan's split granularity is 64 rows); 128
    in whole steps. fp32 partial slots, reduced by the sm80 kernel."""
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", split)
    lens = [700, 300, 257, 1, 400, 65, 129]
    parents = [-1, 0, 0, 0, 3, -1, 5]
    run(lens, parents, 8, 2, D, torch.bfloat16, seed=11, deterministic=deterministic)
    run(lens, parents, 4, 1, D, torch.float16, seed=12, deterministic=deterministic, with_dlse=True)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hk", [(4, 4), (8, 2), (8, 1)])
def test_ragged_steps(H, Hk, dtype, deterministic):
    check_ragged_steps(H, Hk, dtype, deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("split", ["64", "128", "192", "320"])
def test_split_pieces_of_odd_64_row_blocks(split, deterministic, monkeypatch):
    check_split_pieces(split, deterministic, monkeypatch)


@pytest.mark.parametrize("split", [None, "192"])
def test_deterministic_bitwise(split, monkeypatch):
    if split is not None:
        monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", split)
    lens = [900, 300, 200, 257, 1, 640, 191, 65]
    parents = [-1, 0, 0, 0, 0, -1, 5, 5]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 1, D, torch.bfloat16, seed=19)
    first = kernel_grads(q, k, v, dout, layout, deterministic=True)
    for _ in range(3):
        again = kernel_grads(q, k, v, dout, layout, deterministic=True)
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
            assert torch.equal(a, b), f"{name}: deterministic mode not bit-identical run to run (split={split})"


# Windows whose edges fall inside, at and past the 128-row step (the window test of a step uses its
# last query row, qt + 127).
WINDOWS = [1, 63, 64, 65, 127, 128, 129, 200, 1000]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_steps(window, with_sinks, deterministic):
    lens, parents = step_edge_forest(random.Random(6400 + window), n_groups=3)
    run_modifier_case(lens, parents, 8, 2, D, torch.bfloat16, seed=window, softcap=None, with_sinks=with_sinks,
                      deterministic=deterministic, with_dlse=True, window=window)


@pytest.mark.parametrize("deterministic", [False, True])
def test_windowed_split_pieces(deterministic, monkeypatch):
    monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", "64")
    lens = [700, 300, 257, 1, 400]
    parents = [-1, 0, 0, 0, 3]
    for window in (65, 200):
        run_modifier_case(lens, parents, 4, 1, D, torch.bfloat16, seed=window, softcap=None, with_sinks=True,
                          deterministic=deterministic, window=window)


@pytest.mark.parametrize("window", [None, 100])
def test_softcap_kernels_keep_64_row_steps(window):
    # Control: the softcap kernels are the 64-row-step kernel as before (tile_size.h
    # sm90_bwd_block_m); the same ragged forests must pass.
    lens, parents = step_edge_forest(random.Random(77), n_groups=3)
    for det in (False, True):
        run_modifier_case(lens, parents, 8, 2, D, torch.bfloat16, seed=3, softcap=5.0, with_sinks=bool(det),
                          deterministic=det, with_dlse=True, window=window)


@pytest.mark.parametrize("split", [None, "64", "192"])
@pytest.mark.parametrize("i", range(6))
def test_external_prefix_steps(i, split, monkeypatch):
    # The prefix kernels (their items see whole query ranges of the subtree: only ragged ends
    # masked), both dQ modes, split prefix items.
    if split is not None:
        monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", split)
    case = Case(random.Random(6464 + i))
    H, Hk = [(4, 4), (8, 2), (8, 1)][i % 3]
    dtype = DTYPES[i % 2]
    prefixed = case.prefixed.to("cuda")
    q, k, v, dout, unused = flat_inputs(case, H, Hk, D, dtype, seed=i)
    ref64, refpt = references(case, q, k, v, dout, dtype)
    lq, lk, lv, pk, pv = prefixed_inputs(case, q, k, v, unused)
    local = case.local.cuda()
    for det in (False, True):
        got = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dout[local], deterministic=det)
        check_case(case, got, None, ref64, refpt, f"(D 64 steps, split={split}, deterministic={det}, {case.desc})")
        if det:
            again = prefixed_grads(case, prefixed, lq, lk, lv, pk, pv, dout[local], deterministic=True)
            for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "prefix_dk", "prefix_dv"), got, again):
                assert torch.equal(a, b), f"{name}: deterministic prefix call not bit-identical ({case.desc})"


def test_the_d64_sm90_kernel_runs():
    lens, parents = [513, 200, 129, 64, 1], [-1, 0, 0, 0, 0]
    names = cuda_kernels_run(lambda: run(lens, parents, 8, 2, D, torch.bfloat16, seed=29))
    assert any("bwd_sm90_kernel" in n and ", 64," in n for n in names), f"no D 64 sm90 backward: {sorted(names)}"
