"""Spawned ranks under a deadline, for the gloo tests that run several processes.

Each rank's worker writes its outcome as JSON to ``<out_dir>/rank<r>.json``; a rank that hangs in a
collective (ranks out of step) is killed at the deadline, so the test fails instead of hanging CI.
"""
from __future__ import annotations

import json
import pathlib
import time
from typing import Callable, List, Optional, Sequence, Tuple

import torch.multiprocessing as mp


def spawn_ranks(worker: Callable, world: int, out_dir, args: Sequence = (),
                deadline_s: float = 300.0) -> Tuple[List[Optional[dict]], str, bool]:
    """Start ``worker(rank, *args)`` on ``world`` spawned processes and wait for them, at most
    ``deadline_s`` seconds; kill what is still running then. Returns per rank the JSON it wrote to
    ``out_dir/rank<r>.json`` (None where it wrote none), a note saying why ranks may be missing
    ("" when every process ended by itself) and whether the deadline killed them."""
    ctx = mp.start_processes(worker, args=tuple(args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + deadline_s
    note, timed_out = "", False
    try:
        while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                note, timed_out = f"killed after {deadline_s:g} s (deadlock?)", True
                break
    except Exception as exc:  # a rank died outside its own error handling
        note = f"{type(exc).__name__}: {exc}"
    for p in ctx.processes:
        if p.is_alive():
            p.kill()
            p.join()
    outcomes: List[Optional[dict]] = []
    for r in range(world):
        f = pathlib.Path(out_dir) / f"rank{r}.json"
        outcomes.append(json.loads(f.read_text()) if f.exists() else None)
    return outcomes, note, timed_out
