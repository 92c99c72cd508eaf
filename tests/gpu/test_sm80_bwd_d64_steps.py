"""The portable backward's 128-row query steps at head dim 64 (tile_size.h sm80_bwd_block_m) against
the float64 dense reference, the portable kernels forced (DUALKV_DISABLE_SM90 / _BWD).

The plan still cuts query ranges at multiples of 64 rows, so a 128-row step of bwd_kv_kernel can end
anywhere in its rows (rows past the range zero-filled, lse = +inf, so P = 0). The forests and split
pieces are test_sm90_bwd_d64_steps.py's (every range, piece and window edge on those positions). Also:
which instantiation runs (128-row steps, two Q buffers where the device holds 162,864 B; 64-row steps
with one Q buffer on sm_86/89's 99 KiB, via DUALKV_CUDA_SMEM_LIMIT), and that the two give bitwise
the same gradients in deterministic mode (dK/dV add the same k16 query blocks in the same order; dQ
is the separate dQ kernel's). Rule: tests/gpu/test_sm90_bwd.py's.
"""
from __future__ import annotations

import random

import pytest
import torch

import cases  # tests/gpu/cases.py (pytest puts this directory on sys.path)
from cases import built_head_dims, cuda_kernels_run, kernel_grads, make_inputs

D = 64
SM86_SMEM = 101376  # 99 KiB: sm_86/89's opt-in shared memory per block
WIDE_SMEM = 162864  # the 128-row kernel with two Q buffers (sm80/bwd_launch.cuh bwd_kv_smem)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or D not in built_head_dims(),
                                 reason="needs a CUDA GPU and a library with head dim 64")]

# the Hopper module's cases and checks (it imports without a GPU: the parametrize lists below need them)
from test_sm90_bwd_d64_steps import DTYPES, WINDOWS, check_ragged_steps, check_split_pieces, step_edge_forest

if torch.cuda.is_available():
    import dualkv
    from test_cuda_modifiers import run_case as run_modifier_case  # the modifier tests' rule
    from test_sm90_bwd import run


def device_smem_optin() -> int:
    # 0 where this PyTorch does not report it: then only the 64-row cases run
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "shared_memory_per_block_optin", 0))


@pytest.fixture(autouse=True)
def portable(monkeypatch):
    cases.use_path(monkeypatch, "portable")


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H,Hk", [(4, 4), (8, 2), (8, 1)])
def test_ragged_steps(H, Hk, dtype, deterministic):
    check_ragged_steps(H, Hk, dtype, deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("split", ["64", "128", "192", "320"])
def test_split_pieces_of_odd_64_row_blocks(split, deterministic, monkeypatch):
    check_split_pieces(split, deterministic, monkeypatch)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("window", WINDOWS)
def test_windowed_steps(window, deterministic):
    # The window test of a step uses its last query row, qt + 127.
    lens, parents = step_edge_forest(random.Random(6400 + window), n_groups=3)
    run_modifier_case(lens, parents, 8, 2, D, torch.bfloat16, seed=window, softcap=None, with_sinks=True,
                      deterministic=deterministic, with_dlse=True, window=window)


def step_kernels(names):
    """The (Q stages, step rows) of the D-64 portable main kernels among the launched `names`."""
    found = set()
    for n in names:
        if "bwd_kv_kernel<64," in n:
            args = [a.strip() for a in n.split("bwd_kv_kernel<", 1)[1].split(",")]
            found.add((int(args[3]), int(args[4])))  # <D, T, kAtomicDq, kQStages, kStepM, Mods..., kPrefix>
    return found


@pytest.mark.parametrize("deterministic", [False, True])
def test_step_rows_by_shared_memory(deterministic, monkeypatch):
    lens, parents = [513, 200, 129, 64, 1], [-1, 0, 0, 0, 0]
    if device_smem_optin() >= WIDE_SMEM:
        names = cuda_kernels_run(lambda: run(lens, parents, 8, 2, D, torch.bfloat16, seed=29,
                                             deterministic=deterministic))
        assert step_kernels(names) == {(2, 128)}, sorted(names)
    monkeypatch.setenv("DUALKV_CUDA_SMEM_LIMIT", str(SM86_SMEM))
    names = cuda_kernels_run(lambda: run(lens, parents, 8, 2, D, torch.bfloat16, seed=29,
                                         deterministic=deterministic))
    assert step_kernels(names) == {(1, 64)}, sorted(names)


def test_softcap_keeps_64_row_steps():
    lens, parents = step_edge_forest(random.Random(77), n_groups=3)
    names = cuda_kernels_run(lambda: run_modifier_case(lens, parents, 8, 2, D, torch.bfloat16, seed=3, softcap=5.0,
                                                       with_sinks=False, deterministic=False, with_dlse=True))
    assert {rows for _, rows in step_kernels(names)} == {64}, sorted(names)


@pytest.mark.skipif(torch.cuda.is_available() and device_smem_optin() < WIDE_SMEM,
                    reason="needs a device that holds the 128-row kernel")
@pytest.mark.parametrize("split", [None, "192"])
def test_128_and_64_row_steps_bitwise_equal(split, monkeypatch):
    if split is not None:
        monkeypatch.setenv("DUALKV_CUDA_SPLIT_ROWS", split)
    lens = [900, 300, 200, 257, 1, 640, 191, 65]
    parents = [-1, 0, 0, 0, 0, -1, 5, 5]
    layout_cpu = dualkv.Layout.from_tree(lens, parents)
    layout = layout_cpu.to("cuda")
    q, k, v, dout = make_inputs(layout_cpu, 8, 2, D, torch.bfloat16, seed=19)
    wide = kernel_grads(q, k, v, dout, layout, deterministic=True)
    monkeypatch.setenv("DUALKV_CUDA_SMEM_LIMIT", str(SM86_SMEM))
    narrow = kernel_grads(q, k, v, dout, layout, deterministic=True)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), wide, narrow):
        assert torch.equal(a, b), f"{name}: 128-row steps differ from 64-row steps (split={split})"
