"""Spawned ranks under a deadline, for the gloo tests that run several processes.

Each rank's worker writes its outcome as JSON to ``<out_dir>/rank<r>.json``; a rank that hangs in a
collective (ranks out of step) is killed at the deadline, so the test fails instead of hanging CI.
A suite of several cases per world size launches each world once (importing torch dominates the
cost): :func:`run_cases` is a rank's part, :class:`CaseWorlds` the tests' side.
"""
from __future__ import annotations

import datetime
import json
import pathlib
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch
import torch.distributed as dist
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


def run_cases(rank: int, world: int, init_file: str, out_dir, cases: Sequence[str],
              run_case: Callable[[str], Optional[dict]], timeout_s: float) -> None:
    """A rank's part of a launch of several cases (called by the worker :func:`spawn_ranks` starts):
    a gloo process group through ``init_file`` whose collectives time out after ``timeout_s``, then
    ``run_case(name)`` for each case in order (it returns a report, a JSON-able dict, or None). Each
    outcome is written to ``out_dir/rank<r>.json`` as it ends: ``{"ok": True, "seconds", "report"}``
    or ``{"ok": False, "error"}``. After a case that failed on any rank every rank stops (the ranks
    may be out of step)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    results: Dict[str, dict] = {}
    path = pathlib.Path(out_dir) / f"rank{rank}.json"
    for name in cases:
        t0 = time.monotonic()
        try:
            report = run_case(name)
            results[name] = {"ok": True, "seconds": round(time.monotonic() - t0, 1), "report": report}
        except BaseException:  # noqa: BLE001 - recorded, read by the test
            results[name] = {"ok": False, "error": traceback.format_exc()}
        path.write_text(json.dumps(results))
        failed = torch.tensor([0 if results[name]["ok"] else 1])
        dist.all_reduce(failed)
        if int(failed):
            break
    dist.destroy_process_group()


class CaseWorlds:
    """The tests' side of :func:`run_cases`: ``cases`` maps a world size to its case names, and
    ``worker(rank, world, init_file, out_dir, cases)`` runs them (through :func:`run_cases`). Each world
    is launched once, at its first test, and killed after ``deadline_s``."""

    def __init__(self, worker: Callable, cases: Dict[int, List[str]], deadline_s: float, name: str):
        self.worker, self.cases, self.deadline_s, self.name = worker, cases, deadline_s, name
        self._found: Dict[int, Tuple[List[dict], str]] = {}

    def params(self) -> List[Tuple[int, str]]:
        """(world, case) of every case, for ``pytest.mark.parametrize``."""
        return [(w, c) for w, cs in self.cases.items() for c in cs]

    def check(self, world: int, case: str, tmp_path_factory) -> None:
        """The test of ``case``: skipped without gloo, failed with :meth:`problems` if any rank has one."""
        if not dist.is_gloo_available():
            pytest.skip("torch.distributed without gloo")
        problems = self.problems(world, case, tmp_path_factory)
        assert not problems, "\n".join(problems)

    def problems(self, world: int, case: str, tmp_path_factory) -> List[str]:
        """Per rank that did not pass ``case``: why (its error, or that it did not run or finish)."""
        if world not in self._found:
            tmp = tmp_path_factory.mktemp(f"{self.name}{world}")
            found, note, _ = spawn_ranks(self.worker, world, tmp, (world, str(tmp / "init"), str(tmp),
                                                                   self.cases[world]), self.deadline_s)
            self._found[world] = ([o if o is not None else {} for o in found], note)
        per_rank, note = self._found[world]
        out = []
        for r, res in enumerate(per_rank):
            outcome = res.get(case)
            if outcome is None:
                out.append(f"rank {r}: did not run or finish ({note or 'an earlier case failed'})")
            elif not outcome["ok"]:
                out.append(f"rank {r}:\n{outcome['error']}")
        return out
