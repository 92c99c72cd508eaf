"""The peer kernels of the benchmarks, set up the way their users set them up: FlashAttention-4
(``flash_attn.cute``, CuTe DSL) and compiled FlexAttention on its Triton or its FLASH (FA4) backend.

FA4 is not on PyPI for this project's machines; ``tests/gpu/device_run.sh fa4-install`` installs
the wheels that ``../shared/tools/fa4-wheels.sh`` prepares. Without it, ``fa4()`` raises
``Unavailable`` and the benchmarks record the method as skipped.
"""
from __future__ import annotations

import functools
import math
import pathlib
import re

import torch


class Unavailable(RuntimeError):
    """A peer this machine cannot run (its package is not installed): recorded as skipped."""


def fa4():
    """FlashAttention-4's (flash_attn_func, flash_attn_varlen_func); Unavailable if not installed."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001  (ImportError, or a CuTe DSL that fails to load)
        raise Unavailable(f"skipped: FlashAttention-4 (flash_attn.cute) is not importable ({type(e).__name__}: "
                          f"{str(e)[:120]}); install it with tests/gpu/device_run.sh fa4-install") from None
    return flash_attn_func, flash_attn_varlen_func


def first_output(out):
    """FA4's functions return out or (out, lse), depending on the version."""
    return out[0] if isinstance(out, tuple) else out


#: FlexAttention backends by method name, and their kernel_options
FLEX_BACKENDS = {"flex": "TRITON", "flex_fa4": "FLASH"}
#: BlockMask BLOCK_SIZE (query, key) of each Flex backend: Triton's default; FA4's sm90 kernels want
#: multiples of their tiles (256 x 128 works at head dims 64 / 128, baselines-h200.md section 11;
#: head dim 256 has tile_n = 80, see next_block_size).
FLEX_BLOCK = {"TRITON": (128, 128), "FLASH": (256, 128)}
_TILE_ERROR = re.compile(r"sparse_block_size\[([01])\][^\n]*?multiple of (?:tile_[mn]=)?(\d+)")
# FA4's block-sparse backward (4.0.0b36) wants the block to equal the tile, not a multiple of it:
# "Block sparsity requires sparse_block_size[1]=160 to match tile_n=80" (H200, head dim 256).
_TILE_EQUAL_ERROR = re.compile(r"sparse_block_size\[([01])\]=\d+ to match tile_[mn]=(\d+)")
# and its backward names the size itself: "Block sparsity expects sparse_block_size[1]=64 for
# kv_subtile_factor=1" (H200, head dim 256, after the forward took 80: no one size serves both).
_EXPECTED_SIZE_ERROR = re.compile(r"expects sparse_block_size\[([01])\]=(\d+)")


def kernel_options(backend: str):
    return {"BACKEND": backend} if backend == "FLASH" else None


def next_block_size(block, tiles, message):
    """The BLOCK_SIZE to try after a kernel refused ``block`` with ``message`` ("sparse_block_size[i]
    must be a multiple of tile_x=t", or "... sparse_block_size[i]=b to match tile_x=t" / "expects
    sparse_block_size[i]=t": then exactly t),
    or None if the message names no tile. ``tiles`` ([set(), set()],
    per side) collects every tile asked for, so the next size is a multiple of all of them."""
    m = _TILE_EQUAL_ERROR.search(message) or _EXPECTED_SIZE_ERROR.search(message)
    if m is not None:
        side, tile = int(m.group(1)), int(m.group(2))
        out = list(block)
        out[side] = tile
        return None if out[side] == block[side] else tuple(out)
    m = _TILE_ERROR.search(message)
    if m is None:
        return None
    side, tile = int(m.group(1)), int(m.group(2))
    tiles[side].add(tile)
    step = functools.reduce(math.lcm, tiles[side])
    out = list(block)
    out[side] = -(-block[side] // step) * step
    if out[side] == block[side]:
        out[side] += step
    return tuple(out)


#: tries at finding a block size a Flex backend's kernels accept (each one compiles)
FLEX_BLOCK_TRIES = 4


def accepted_block_size(attempt, block, tries=FLEX_BLOCK_TRIES):
    """``attempt(block)``, run again with next_block_size's next size while a kernel refuses the block
    size (the refusal is raised by the first, compiling call). Returns (what attempt returned, the
    block size it ran with, the refusals [{"block_size", "error"}]); an error that names no tile is
    raised as it is."""
    tiles, refused = [set(), set()], []
    for _ in range(tries):
        try:
            return attempt(block), block, refused
        except Exception as e:  # noqa: BLE001  (a refused block size is data, and maybe retried)
            msg = " ".join(str(e).split())
            refused.append({"block_size": list(block), "error": msg[:400]})
            block = next_block_size(block, tiles, msg)
            if block is None:
                raise
    raise RuntimeError(f"no block size accepted after {tries} tries: {refused}")


def compile_cache_state() -> dict:
    """torch inductor's on-disk cache directory and whether it held anything at the time of the call
    (call it at process start). Warm, an earlier process on this machine compiled graphs that Flex's
    first block mask and first calls may read back instead of compiling, so their "first" costs are
    then not a cold start's; the results record which."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        path = pathlib.Path(cache_dir())
    except Exception as e:  # noqa: BLE001 (a torch without the helper: say so, do not guess)
        return {"inductor_cache_dir": None, "warm": None, "note": f"cache dir unknown: {e}"}
    return {"inductor_cache_dir": str(path), "warm": path.is_dir() and any(path.iterdir())}


#: what a results table says next to Flex's first-build and compile figures when compile_cache_state()
#: found the cache warm (bench/attention.py per case, bench/e2e.py under its table)
WARM_CACHE_NOTE = "torch's compile cache was warm at process start"


def compile_cache_was_warm(env: dict) -> bool:
    """Whether the results' env records a warm inductor cache at process start (compile_cache_state)."""
    return bool(env.get("compile_cache_at_start", {}).get("warm"))


_COMPILED = {}


def compiled_flex(backend: str, dynamic):
    """torch.compile'd flex_attention, one per (backend, dynamic). dynamic=None is torch's default
    (automatic dynamic shapes: a second packed length recompiles with symbolic shapes), what a
    training framework gets; dynamic=False recompiles per shape (the best kernel rate)."""
    from torch.nn.attention.flex_attention import flex_attention
    key = (backend, dynamic)
    if key not in _COMPILED:
        # every micro-batch has a new packed length: torch's default limit (8) would fall back to eager
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        _COMPILED[key] = torch.compile(flex_attention, dynamic=dynamic)
    return _COMPILED[key]


def apply_sinks(out, lse, sinks):
    """Attention sinks on a result computed without them: each row's softmax gains one more term,
    exp(sink_h), so the output scales by exp(lse - logaddexp(lse, sink_h)). ``out`` [B, H, T, D] and
    ``lse`` [B, H, T] (natural log), ``sinks`` [H]. Differentiable in all three."""
    lse = lse.float()
    scale = torch.exp(lse - torch.logaddexp(lse, sinks.float()[None, :, None]))
    return (out.float() * scale[..., None]).to(out.dtype)


def flex_with_lse(flex, *args, **kwargs):
    """(out, lse) of a FlexAttention call: return_aux=AuxRequest(lse=True) where torch has it (2.9+;
    return_lse is deprecated there and goes in 2.10), else return_lse=True."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return flex(*args, return_lse=True, **kwargs)
    out, aux = flex(*args, return_aux=AuxRequest(lse=True), **kwargs)
    return out, aux.lse


_SOFTCAP_MODS = {}


def softcap_score_mod(cap: float):
    """The score_mod ``cap * tanh(score / cap)`` with ``cap`` a literal of its code (one function per
    value). Neither capture works on every backend: a captured 0-dim tensor fails FA4's CuTe lowering
    ("Expected TensorSSA, but got <class 'int'>", H200, FA4 4.0.0b36), and a captured float becomes a
    SymFloat when a second value re-traces it, which Flex refuses among a score_mod's captured values."""
    cap = float(cap)
    if cap not in _SOFTCAP_MODS:
        source = (f"def score_mod(score, b, h, q_idx, kv_idx):\n"
                  f"    return torch.tanh(score * {1.0 / cap!r}) * {cap!r}\n")
        scope = {"torch": torch}
        exec(compile(source, f"<softcap {cap!r}>", "exec"), scope)  # noqa: S102  (our own two-line source)
        _SOFTCAP_MODS[cap] = scope["score_mod"]
    return _SOFTCAP_MODS[cap]


class Unsupported(Unavailable):
    """A peer that is installed but cannot run this model as asked (a head dim, or a modifier's
    backward, its kernels lack): recorded as unavailable, with the reason."""
