#!/usr/bin/env python3
r"""A/B of two libdualkv builds in one process: are the candidate's results the base's, and are its
kernels faster?

    PYTHONPATH=python python3 tools/ab_libraries.py --base A.so --cand B.so --check fwd|bwd|both \
        [--dims 64,128,256] [--mods window,softcap,sinks,prefix] [--deterministic] \
        [--profile "16,4096,1024;8,16384,2048" --kernels bwd_sm90_kernel,bwd_dq_convert] [--rounds 2]

Both libraries are loaded side by side (``dualkv._native.open_library``: separate copies of the .so,
each with its own CUDA runtime; either may be of C ABI 1 or 2) and ``_native.using`` points the
package at one or the other around each call, so each library derives its own layout and builds its
own plans. Every case runs the same seeded inputs through the base and the candidate.

Checks (a line ``ok ...``, ``DIFF ...`` or ``ERROR ...`` per case, head dim, check and candidate,
``skip ...`` for a case a library cannot run; a summary line; exit status 1 on any DIFF or ERROR, or
when nothing was compared):

* ``--check fwd`` (a forward-only change): the forward (no autograd), out and lse of each of
  ``--runs`` candidate runs bit for bit equal to the base's (a race can show in one run only).
  ``--fwd-rule reference`` (a forward that is not bitwise by design, e.g. an emulated exp2): each
  candidate's runs bit for bit equal to each other, out/lse within max |base| / 64 of the base, and
  the ref64 lines (below) judge the accuracy; run it with the default --ref-max-elements or more.
* ``--check bwd`` (a backward change): forward + backward of sum(out * dout) in the default mode, two
  base runs and ``--runs`` candidate runs: out, lse, dK, dV and, where the case has them, the
  prefix rows' dK/dV and dsinks of every candidate run bit for bit equal to the base's (none of
  them is summed through atomics: split items are reduced in a fixed order); dQ (fp32 atomics)
  within the reduce-order noise: max |cand - base| <= max(4 x floor, max |base| / 64) over the
  candidate runs, the floor being max |base run 2 - base run 1|. ``--dkdv noise`` puts the K/V
  gradients under that rule too (a change that may reorder their sums, e.g. other query steps).
  ``--deterministic`` repeats it all in the deterministic mode and adds: every output bit for bit
  equal across the candidate's runs (there the floor is the base's deterministic run-to-run
  difference, 0, so dQ's limit is max |dQ| / 64).
* ``--check both``: the fwd check, then the bwd check, per case.
* With every check: errors against the float64 dense reference (``dualkv.reference.attention_ref``)
  on the cases small enough for it (T^2 H <= --ref-max-elements; external prefixes through the flat
  forest, the prefix rows as a local root):
  per output max |X - ref64| <= 2 max |X_ref_in_dtype - ref64| + 1e-5 (the tests' rule), required
  of each candidate's first run, printed for the base. dsinks is not checked against the reference
  (its fp32 bound is in tests/gpu/test_cuda_modifiers.py).

Cases (over every head dim of --dims that both libraries are built for; --cases filters by name):
full-tile GRPO groups (one with a 16K prompt, whose KV tiles are split items), ragged GRPO groups
(segment starts that are not multiples of 8 or 64, a 1-token response), MHA and GQA (groups 4, 8),
a last segment ending at T, a tiny T, independent sequences, random forests (several roots, chains)
and forests whose query ranges end anywhere in a 128-row step; --layouts N,P,R;... adds GRPO
layouts (--heads, --kv-heads); with --mods the sliding
window (1024 and small ones), the logit softcap, attention sinks and their combinations, and
external prefixes (--mods prefix; not combined with the others, which CUDA refuses together).

Profile (--profile "N,P,R[,D];CLASS[,D];...", CUDA): per GRPO layout (one prompt of P tokens, N
responses of R tokens) or layout class of bench/layout_classes.py (small_groups, tiny_responses,
long_responses, tree), --heads/--kv-heads, each head dim of --dims unless D is given, --rounds rounds of every
library in rotating order, each --profile-calls calls (fwd for --check fwd, else fwd+bwd) under
torch.profiler after one warm-up call: the median device ms per call of the kernels whose name
contains each --kernels substring (summed), and of all kernels of the step, per library, and
cand/base: the ratio of the medians and, with 3 or more rounds, the median and quartiles of the
per-round ratios (how far one run settles a change). A substring that matches no kernel of any library is an ERROR (that path did not run);
one that only some libraries run (a kernel added or removed) is printed with its zeros.
--profile-only skips the checks (--check then only says fwd or fwd+bwd): the exit status is 0 when
the profile ran without an ERROR.

On the device machine (a copy of the working tree): carry both libraries, which are ignored files
(e.g. ``run(carry=[".dev/lib"])`` with main's and the branch's builds as ``.so.xz``, decompressed
there to /tmp), and declare the tree's commit with DUALKV_COMMIT (the copy's .git may be stale; the
header line prints the commit, each library's path, sha256, C ABI and head dims). DUALKV_LIBRARY,
the package's own library, defaults to the (first) candidate: the package needs one of its own C ABI
loaded to switch from. Cost: per case, head dim and mode 2 base runs + --runs runs of each
candidate (+ the float64 reference); the profile, rounds x libraries x layouts x (1 +
--profile-calls) steps.

    xz -dc .dev/lib/libdualkv_main.so.xz > /tmp/base.so; xz -dc .dev/lib/libdualkv_new.so.xz > /tmp/new.so
    DUALKV_COMMIT=<sha> PYTHONPATH=python python3 tools/ab_libraries.py --base /tmp/base.so \
        --cand /tmp/new.so --check bwd --dims 64,128 --deterministic \
        --profile "16,4096,1024;8,16384,2048" --kernels bwd_sm90_kernel,bwd_dq_convert

More candidates: --cand LABEL=PATH, repeated (each compared with the base; the profile rotates all).
--aa adds the A/A control: a copy of the base's file loaded as candidate ``aa`` (a second library in
the process like any candidate; the same file twice would be one library). Its ratios are what an
unchanged kernel reads in this run: a candidate's change inside the A/A's quartiles is not settled
(docs/benchmarks.md, Timing).
--base-env / --cand-env KEY=VALUE set an environment switch around one side's calls (e.g.
DUALKV_DISABLE_SM90=1 for the portable kernels). --profile-mods window=W,softcap=C,sinks profiles
with modifiers.

--device cpu runs the same checks on the CPU backend (a smoke test of the tool; base and candidate
may be the same CPU build, then they are one loaded library; cases above --max-tokens, 6000 there,
are skipped). --self-test-perturb NAME is for the tool's own test only: it changes one element of
output NAME of every candidate run, so a correct tool must report DIFF and exit 1.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import importlib.util
import os
import pathlib
import random
import shutil
import statistics
import sys
import tempfile
import traceback
import zlib
from typing import Optional

ROOT = pathlib.Path(__file__).absolute().parents[1]  # the tree it is run in (not a symlink target)
sys.path.insert(0, str(ROOT / "python"))

import torch  # noqa: E402

import dualkv  # noqa: E402
from dualkv import _native  # noqa: E402
from dualkv.reference import attention_ref, flatten_prefixes  # noqa: E402


def _bench_module(name: str):
    """bench/<name>.py loaded from its file (bench/ stays off sys.path: its scripts' names, e.g.
    provenance, are also names of PyPI packages)."""
    spec = importlib.util.spec_from_file_location(f"dualkv_bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


provenance = _bench_module("provenance")  # the tree's commit, a library file's sha256
layout_classes = _bench_module("layout_classes")  # issue 23's layout classes, for --profile

# The outputs. The bwd check holds every output but dq to the bitwise rule: the forward's, dK/dV and
# the prefix rows' dK/dV (no atomics; split items are reduced in a fixed order) and dsinks (a fixed
# tree over delta from out) are the same bits on every run in both modes (docs/cuda.md). dQ is
# summed with fp32 atomics in the default mode: the noise rule. --dkdv noise moves the K/V
# gradients to the noise rule.
FORWARD_OUTPUTS = ("out", "lse")
GRAD_OUTPUTS = ("dq", "dk", "dv", "dprefix_k", "dprefix_v", "dsinks")
KV_GRAD_OUTPUTS = ("dk", "dv", "dprefix_k", "dprefix_v")
REF_ATOL = 1e-5  # the tests' absolute slack of the float64-reference rule
NOISE_FLOOR_FACTOR = 4  # cand-vs-base may be this many times the base-vs-base difference
NOISE_SCALE_FRACTION = 1 / 64  # ... or this fraction of max |base| (a few bf16 ulps at the largest values)


# ---------------------------------------------------------------------------------------------
# the libraries


class Build:
    """One libdualkv loaded into this process, with the environment its calls run under (env
    switches such as DUALKV_DISABLE_SM90 are read per launch)."""

    def __init__(self, label: str, path: str, env: dict):
        self.label = label
        self.path = pathlib.Path(path).resolve()
        self.env = dict(env)
        self.handle = _native.open_library(self.path)
        with self.active():
            self.info = _native.build_info()

    @contextlib.contextmanager
    def active(self):
        """Every dualkv call inside goes to this library, under its environment."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            with _native.using(self.handle):
                yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def lacks(self, device: str, head_dim: int, case: Case) -> Optional[str]:
        """Why this library cannot run ``case`` at ``head_dim`` (None: it can)."""
        backend = self.info.get(device)
        if backend is None:
            return f"no {device} backend"
        if device == "cuda" and "head_dims" in backend and head_dim not in backend["head_dims"]:
            return f"head dim {head_dim} not built (built: {backend['head_dims']})"
        if device == "cpu" and head_dim > backend.get("max_head_dim", head_dim):
            return f"head dim {head_dim} above the CPU backend's {backend['max_head_dim']}"
        missing = [m for m in case.modifiers() if m not in backend.get("modifiers", ())]
        if missing:
            return f"no {'/'.join(missing)} on {device}"
        if case.modifiers() and head_dim in backend.get("plain_head_dims", ()):
            return f"head dim {head_dim} has the default kernels only (no mask modifiers)"
        if case.prefix_rows and self.handle.abi_version < _native.FEATURE_ABI["external prefix segments"]:
            return f"C ABI {self.handle.abi_version} has no external prefix segments"
        return None

    def describe(self, device: str) -> str:
        rec = provenance.library_record(self.path)
        backend = self.info.get(device, {})
        dims = backend.get("head_dims", f"<= {backend.get('max_head_dim')}" if device == "cpu" else "?")
        env = f", env {' '.join(f'{k}={v}' for k, v in self.env.items())}" if self.env else ""
        return (f"{self.label}: {self.path} sha256 {rec['sha256'][:12]} ({rec['mtime']}), C ABI "
                f"{self.handle.abi_version}, {device} head dims {dims}{env}")


# ---------------------------------------------------------------------------------------------
# the cases


def random_forest(seed: int, n_seg: int):
    """(lens, parents) of ``n_seg`` segments in depth-first order (every subtree contiguous): each
    one's parent is the previous segment or one of its ancestors, or none (a new root); lengths
    around the 64/128-row tile edges, and 1."""
    rng = random.Random(seed)
    lens, parents, path = [], [], []  # path: the previous segment and its ancestors, root first
    for s in range(n_seg):
        lens.append(rng.choice([1, 5, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 383, 700]))
        depth = 0 if not path or rng.random() < 0.15 else rng.randint(1, len(path))
        path = path[:depth]
        parents.append(path[-1] if path else -1)
        path.append(s)
    return lens, parents


# Small forests whose query ranges end anywhere in a 128-row step (and fit the float64 reference).
FOREST_STEPS_A = ([700, 191, 65, 1, 257, 128], [-1, 0, 0, 0, 0, 0])
FOREST_STEPS_B = ([383, 63, 64, 129, 300, 255, 1], [-1, 0, 0, 0, -1, 4, 4])
RAGGED_GROUPS = ([1000, 333], [[777, 129, 1, 64, 1025, 300], [300, 5, 130]])
RAGGED_ONE_GROUP = ([1000], [[777, 129, 1, 300]])


@dataclasses.dataclass(frozen=True)
class Case:
    """One layout with its heads and modifiers. ``groups``: (prompt_lens, response_lens[,
    prompt_prefix, prefix_lens]) for Layout.from_groups; ``tree``: (lens, parents[, seg_prefix,
    prefix_lens]) for Layout.from_tree."""
    name: str
    heads: int
    kv_heads: int
    groups: tuple = ()
    tree: tuple = ()
    window: Optional[int] = None
    softcap: Optional[float] = None
    sinks: bool = False
    prefix_rows: int = 0

    def layout(self) -> dualkv.Layout:
        """The host layout, derived by the library in use."""
        return dualkv.Layout.from_groups(*self.groups) if self.groups else dualkv.Layout.from_tree(*self.tree)

    def modifiers(self) -> list:
        return [m for m, on in (("window", self.window), ("softcap", self.softcap), ("sinks", self.sinks)) if on]

    def mods_text(self) -> str:
        parts = [f"window {self.window}" if self.window else "", f"softcap {self.softcap:g}" if self.softcap else "",
                 "sinks" if self.sinks else "", f"prefix {self.prefix_rows} rows" if self.prefix_rows else ""]
        return ", ".join(p for p in parts if p) or "plain"


def grpo(n: int, p: int, r: int) -> tuple:
    return ([p], [[r] * n])


def build_cases(mods: set, layouts: list, heads: int, kv_heads: int) -> list:
    """The case set: the plain cases, the GRPO ``layouts`` [(N, P, R)] asked for, then the cases of
    each modifier asked for."""
    cases = [
        Case("grpo N16 P4096 R1024 (full tiles)", 32, 8, groups=grpo(16, 4096, 1024)),
        Case("grpo N8 P16384 R2048 (long prompt: split items)", 32, 8, groups=grpo(8, 16384, 2048)),
        Case("grpo N5 P1001 R333 (ragged starts)", 32, 8, groups=grpo(5, 1001, 333)),
        Case("ragged groups", 32, 8, groups=RAGGED_GROUPS),
        Case("ragged MHA", 8, 8, groups=([2049], [[191, 64, 127, 65]])),
        Case("last segment ends at T", 8, 1, groups=([512], [[256, 384]])),
        Case("tiny T", 4, 1, groups=([3], [[2]])),
        Case("varlen (independent sequences)", 32, 8, tree=([1500, 700, 129, 64, 1, 2048, 333], [-1] * 7)),
        Case("forest steps a", 8, 2, tree=FOREST_STEPS_A),
        Case("forest steps b", 8, 2, tree=FOREST_STEPS_B),
    ]
    cases += [Case(f"random forest {i} ({n} segments)", 8, 2, tree=random_forest(17 + i, n))
              for i, n in enumerate((12, 30, 60))]
    cases += [Case(f"grpo N{n} P{p} R{r} (--layouts)", heads, kv_heads, groups=grpo(n, p, r)) for n, p, r in layouts]
    if "window" in mods:
        cases += [
            Case("window 1024 grpo N16 P4096 R1024", 32, 8, groups=grpo(16, 4096, 1024), window=1024),
            Case("window 1024 ragged groups", 32, 8, groups=([3000, 333], [[1777, 129, 1, 1025], [300, 5]]),
                 window=1024),
            Case("window 100 random forest", 8, 2, tree=random_forest(5, 40), window=100),
            Case("window 100 forest steps a", 8, 2, tree=FOREST_STEPS_A, window=100),
        ]
    if "softcap" in mods:
        cases.append(Case("softcap 30 ragged", 8, 2, groups=RAGGED_ONE_GROUP, softcap=30.0))
    if "sinks" in mods:
        cases.append(Case("sinks ragged", 8, 2, groups=RAGGED_ONE_GROUP, sinks=True))
        if "window" in mods:
            cases.append(Case("sinks + window 256 ragged", 8, 2, groups=RAGGED_ONE_GROUP, sinks=True, window=256))
    if {"window", "softcap", "sinks"} <= mods:
        cases.append(Case("window 128 + softcap 50 + sinks forest steps b", 8, 2, tree=FOREST_STEPS_B, window=128,
                          softcap=50.0, sinks=True))
    if "prefix" in mods:
        cases += [
            # one 300-row external prompt, ragged responses
            Case("prefix ragged", 8, 2, prefix_rows=300,
                 tree=([0, 130, 1, 64, 200, 77], [-1, 0, 0, 0, 0, 0], [0, -1, -1, -1, -1, -1], [300])),
            # two groups whose prompts start with external prefixes (in the other order in the buffers),
            # each followed by local prompt tokens
            Case("prefix groups (two prefixes)", 8, 2, prefix_rows=365,
                 groups=([200, 7], [[100, 3, 64], [129]], [1, 0], [65, 300])),
        ]
    return cases


@dataclasses.dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    prefix_k: Optional[torch.Tensor] = None
    prefix_v: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None


def make_inputs(case: Case, T: int, D: int, dtype, seed: int, device: str) -> Inputs:
    """Standard normal q [T, H, D], k, v [T, Hk, D], dout [T, H, D] (+ prefix buffers, fp32 sinks
    [H]) from one seeded generator."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(rows, heads, dt=dtype):
        return torch.randn(rows, heads, D, device=device, dtype=dt, generator=g)

    x = Inputs(rnd(T, case.heads), rnd(T, case.kv_heads), rnd(T, case.kv_heads), rnd(T, case.heads))
    if case.prefix_rows:
        x.prefix_k, x.prefix_v = rnd(case.prefix_rows, case.kv_heads), rnd(case.prefix_rows, case.kv_heads)
    if case.sinks:
        x.sinks = torch.randn(case.heads, device=device, dtype=torch.float32, generator=g)
    return x


def run_case(build: Build, case: Case, x: Inputs, device: str, backward: bool, deterministic: bool) -> dict:
    """{output name: tensor} of one forward (+ backward of sum(out * dout)) through ``build``, with
    the layout and plans that library derives."""
    with build.active():
        layout = case.layout().to(device, windows=(case.window,))
        leaves = {name: t.detach().clone().requires_grad_(backward)
                  for name, t in (("q", x.q), ("k", x.k), ("v", x.v), ("prefix_k", x.prefix_k),
                                  ("prefix_v", x.prefix_v), ("sinks", x.sinks)) if t is not None}
        with torch.set_grad_enabled(backward):
            out, lse = dualkv.attention(leaves["q"], leaves["k"], leaves["v"], layout, deterministic=deterministic,
                                        return_lse=True, prefix_k=leaves.get("prefix_k"),
                                        prefix_v=leaves.get("prefix_v"), window=case.window, softcap=case.softcap,
                                        sinks=leaves.get("sinks"))
            if backward:
                out.backward(x.dout)
        if device == "cuda":
            torch.cuda.synchronize()
    res = {"out": out.detach(), "lse": lse.detach()}
    if backward:
        grads = (("dq", "q"), ("dk", "k"), ("dv", "v"), ("dprefix_k", "prefix_k"), ("dprefix_v", "prefix_v"),
                 ("dsinks", "sinks"))
        res.update({name: leaves[leaf].grad for name, leaf in grads if leaf in leaves})
    return res


def dense_reference(case: Case, layout_cpu, q, k, v, dout, sinks, dtype, backward: bool) -> dict:
    """{output name: float64 tensor} of the dense reference computed in ``dtype``."""
    q, k, v = (t.detach().to(dtype).requires_grad_(backward) for t in (q, k, v))
    with torch.set_grad_enabled(backward):
        out, lse = attention_ref(q, k, v, layout_cpu, window=case.window, softcap=case.softcap, sinks=sinks)
        if backward:
            (out.to(dtype) * dout.to(dtype)).sum().backward()
    res = {"out": out.detach().double(), "lse": lse.detach().double()}
    if backward:
        res.update(dq=q.grad.double(), dk=k.grad.double(), dv=v.grad.double())
    return res


def reference(case: Case, layout_cpu, x: Inputs, dtype, backward: bool) -> dict:
    """{output name: float64 tensor} of the dense reference computed in ``dtype``; a layout with
    external prefixes through its flat forest (the prefix rows as queries with dout 0)."""
    if not case.prefix_rows:
        return dense_reference(case, layout_cpu, x.q, x.k, x.v, x.dout, x.sinks, dtype, backward)
    flat, local, rows = flatten_prefixes(layout_cpu)
    local, rows = local.to(x.q.device), rows.to(x.q.device)
    held = rows >= 0

    def scatter(tokens, prefix_rows):
        full = tokens.new_zeros((flat.num_tokens, *tokens.shape[1:]))
        full[local] = tokens
        if prefix_rows is not None:
            full[rows[held]] = prefix_rows[held]
        return full

    ref = dense_reference(case, flat, scatter(x.q, None), scatter(x.k, x.prefix_k), scatter(x.v, x.prefix_v),
                          scatter(x.dout, None), x.sinks, dtype, backward)
    res = {"out": ref["out"][local], "lse": ref["lse"][:, local]}
    if backward:
        res.update(dq=ref["dq"][local], dk=ref["dk"][local], dv=ref["dv"][local])
        for name, grad in (("dprefix_k", ref["dk"]), ("dprefix_v", ref["dv"])):
            res[name] = grad.new_zeros((len(rows), *grad.shape[1:]))
            res[name][held] = grad[rows[held]]
    return res


# ---------------------------------------------------------------------------------------------
# the comparisons


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over the elements (0 where both are equal, infinities included)."""
    if a.numel() == 0 or torch.equal(a, b):
        return 0.0
    return torch.where(a == b, 0.0, a.double() - b.double()).abs().max().item()


def describe_diff(name: str, got: torch.Tensor, want: torch.Tensor) -> str:
    """Where ``got`` differs from ``want``: tokens (rows) and the largest difference."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name} {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype}"
    ne = got != want
    if name == "lse":  # [H, T]
        where, unit = ne.any(dim=0), "tokens"
    elif ne.dim() == 1:  # dsinks [H]
        where, unit = ne, "heads"
    else:  # [rows, heads, D]
        where, unit = ne.flatten(1).any(dim=1), "rows"
    idx = torch.nonzero(where).flatten()
    return (f"{name} differs on {idx.numel()} {unit} (first {idx[:6].tolist()}), "
            f"max |diff| {max_abs_diff(got, want):.3g}")


def perturb(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first element moved by max |t| / 8 (+ 1e-3): a change every rule must catch."""
    t = t.clone()
    flat = t.view(-1)
    flat[0] += t.abs().max().float().item() / 8 + 1e-3
    return t


class Tally:
    def __init__(self):
        self.ok = self.diff = self.error = self.skip = 0

    def line(self, status: str, text: str) -> None:
        setattr(self, status.lower(), getattr(self, status.lower()) + 1)
        print(f"{status:5s} {text}", flush=True)


def seed_of(case: Case, D: int) -> int:
    return zlib.crc32(case.name.encode()) % 100_000 + D


def check_forward(args, tally, base, cands, case, title, x):
    """The fwd check; returns (base run, {cand label: first run}) for the reference."""
    want = run_case(base, case, x, args.device, backward=False, deterministic=False)
    firsts = {}
    for cand in cands:
        bad = []
        if args.fwd_rule == "reference":
            # A forward that is not meant to be bitwise (e.g. another exp2): its runs bitwise equal to
            # each other (a race shows there), its distance to the base printed and held to the
            # noise rule's max |base| / 64; the ref64 line (the tests' rule) judges its accuracy.
            dist = {n: 0.0 for n in FORWARD_OUTPUTS}
            for rep in range(args.runs):
                got = run_candidate(args, cand, case, x, backward=False, deterministic=False)
                first = firsts.setdefault(cand.label, got)
                bad += [f"run {rep} vs run 0: " + describe_diff(n, got[n], first[n]) for n in FORWARD_OUTPUTS
                        if not torch.equal(got[n], first[n])]
                for n in FORWARD_OUTPUTS:
                    dist[n] = max(dist[n], max_abs_diff(got[n], want[n]))
            limit = {n: want[n].double().abs().max().item() / 64 for n in FORWARD_OUTPUTS}
            bad += [f"{n}: max |cand - base| {dist[n]:.2e} above max |base| / 64 = {limit[n]:.2e}"
                    for n in FORWARD_OUTPUTS if not dist[n] <= limit[n]]
            text = " ".join(f"{n} {dist[n]:.2e}" for n in FORWARD_OUTPUTS)
            if bad:
                tally.line("DIFF", f"fwd {cand.label} | {title}: " + "; ".join(bad))
            else:
                tally.line("ok", f"fwd {cand.label} | {title}: out/lse run to run bitwise x{args.runs}; "
                                 f"max |cand - base| {text} (--fwd-rule reference: not bitwise by design)")
            continue
        for rep in range(args.runs):
            got = run_candidate(args, cand, case, x, backward=False, deterministic=False)
            firsts.setdefault(cand.label, got)
            bad += [f"run {rep}: " + describe_diff(n, got[n], want[n]) for n in FORWARD_OUTPUTS
                    if not torch.equal(got[n], want[n])]
        if bad:
            tally.line("DIFF", f"fwd {cand.label} | {title}: " + "; ".join(bad))
        else:
            tally.line("ok", f"fwd {cand.label} | {title}: out/lse bitwise equal to base x{args.runs}")
    return want, firsts


def run_candidate(args, cand, case, x, backward, deterministic):
    got = run_case(cand, case, x, args.device, backward, deterministic)
    if args.self_test_perturb in got:
        got[args.self_test_perturb] = perturb(got[args.self_test_perturb])
    return got


def check_backward(args, tally, base, cands, case, title, x, deterministic):
    """One mode of the bwd check; returns (base run, {cand label: first run}) for the reference."""
    mode = "deterministic" if deterministic else "default"
    b1 = run_case(base, case, x, args.device, True, deterministic)
    b2 = run_case(base, case, x, args.device, True, deterministic)
    noise = ("dq",) + (KV_GRAD_OUTPUTS + ("dsinks",) if args.dkdv == "noise" else ())
    bitwise = [n for n in b1 if n not in noise]
    firsts = {}
    for cand in cands:
        runs = [run_candidate(args, cand, case, x, True, deterministic) for _ in range(args.runs)]
        firsts[cand.label] = runs[0]
        bad, notes = [], []
        for n in b1:
            if n in bitwise:
                unequal = [i for i, r in enumerate(runs) if not torch.equal(r[n], b1[n])]
                if unequal:
                    i = unequal[0]
                    base_note = "" if torch.equal(b2[n], b1[n]) else " (the base's two runs differ too)"
                    bad.append(f"{n}: {len(unequal)} of {len(runs)} runs differ from base, run {i}: "
                               + describe_diff(n, runs[i][n], b1[n]) + base_note)
            else:
                floor = max_abs_diff(b2[n], b1[n])
                scale = b1[n].abs().max().float().item() if b1[n].numel() else 0.0
                limit = max(NOISE_FLOOR_FACTOR * floor, scale * NOISE_SCALE_FRACTION)
                worst = max(max_abs_diff(r[n], b1[n]) for r in runs)
                text = f"{n} |c-b| {worst:.3g} (limit {limit:.3g}: floor {floor:.3g}, max|{n}| {scale:.3g})"
                (bad if not worst <= limit else notes).append(text + (" OUTSIDE THE NOISE" if not worst <= limit
                                                                      else ""))
            if deterministic:
                unstable = [i for i, r in enumerate(runs[1:], 1) if not torch.equal(r[n], runs[0][n])]
                if unstable:
                    bad.append(f"{n}: deterministic run {unstable[0]} differs from run 0: "
                               + describe_diff(n, runs[unstable[0]][n], runs[0][n]))
        head = f"bwd {mode} {cand.label} | {title}: "
        if bad:
            tally.line("DIFF", head + "; ".join(bad + notes))
        else:
            same = "/".join(n for n in b1 if n in bitwise)
            rerun = f", run to run bitwise x{args.runs}" if deterministic else ""
            tally.line("ok", head + "; ".join([f"{same} bitwise equal to base x{args.runs}{rerun}"] + notes))
    return b1, firsts


def reference_bounds(case: Case, layout_cpu, x: Inputs, backward: bool):
    """(float64 reference, {output: bound}): the tests' rule, bound = 2 max |X_ref_in_dtype - ref64| + 1e-5."""
    ref64 = reference(case, layout_cpu, x, torch.float64, backward)
    refdt = reference(case, layout_cpu, x, x.q.dtype, backward)
    return ref64, {n: 2 * max_abs_diff(refdt[n], ref64[n]) + REF_ATOL for n in ref64}


class LazyReference:
    """A case's reference and bounds, computed on first use (once per case and head dim: with the
    gradients when a bwd check will need them, the fwd check then reads its out/lse)."""

    def __init__(self, case: Case, layout_cpu, x: Inputs, with_grads: bool):
        self.args = (case, layout_cpu, x, with_grads)
        self.value = None

    def get(self, names=None):
        if self.value is None:
            self.value = reference_bounds(*self.args)
        ref64, bounds = self.value
        names = list(ref64) if names is None else names
        return {n: ref64[n] for n in names}, {n: bounds[n] for n in names}


def check_reference(tally, title, direction, ref, base_run, cand_runs):
    """Every candidate's first run within the reference's bounds (the base's errors printed)."""
    ref64, bounds = ref

    def errors(run):
        return {n: max_abs_diff(run[n].double(), ref64[n]) for n in ref64}

    base_err = errors(base_run)
    base_text = " ".join(f"{n} {base_err[n]:.2e}" for n in ref64)
    for label, run in cand_runs.items():
        err = errors(run)
        over = [n for n in ref64 if not err[n] <= bounds[n]]
        text = " ".join(f"{n} {err[n]:.2e}/{bounds[n]:.2e}" for n in ref64)
        tally.line("DIFF" if over else "ok",
                   f"ref64 {direction} {label} | {title}: err/bound {text} (base: {base_text})"
                   + (f"; {', '.join(over)} ABOVE THE BOUND" if over else ""))


def run_checks(args, tally, base, cands, cases, dims, dtype):
    directions = {"fwd": ["fwd"], "bwd": ["bwd"], "both": ["fwd", "bwd"]}[args.check]
    for case in cases:
        for D in dims:
            title = f"{case.name} D{D}"
            try:
                why = base.lacks(args.device, D, case)
                if why:
                    tally.line("skip", f"{title}: {base.label}: {why}")
                    continue
                # a candidate that lacks the case (e.g. a build with other head dims) is skipped alone
                lacking = {c.label: c.lacks(args.device, D, case) for c in cands}
                for label, why in lacking.items():
                    if why:
                        tally.line("skip", f"{title}: {label}: {why}")
                active = [c for c in cands if not lacking[c.label]]
                if not active:
                    continue
                with base.active():
                    layout_cpu = case.layout()
                T = layout_cpu.num_tokens
                title += f" (T {T}, H {case.heads}/{case.kv_heads}, {case.mods_text()})"
                if args.max_tokens and T > args.max_tokens:
                    tally.line("skip", f"{title}: T above --max-tokens {args.max_tokens}")
                    continue
                x = make_inputs(case, T, D, dtype, seed_of(case, D), args.device)
                ref_tokens = T + case.prefix_rows  # the flat forest's, with external prefixes
                with_ref = ref_tokens * ref_tokens * case.heads <= args.ref_max_elements
                ref = LazyReference(case, layout_cpu, x, with_grads="bwd" in directions)
                for direction in directions:
                    if direction == "fwd":
                        want, firsts = check_forward(args, tally, base, active, case, title, x)
                        if with_ref:
                            check_reference(tally, title, "fwd", ref.get(FORWARD_OUTPUTS), want, firsts)
                        continue
                    for deterministic in (False, True) if args.deterministic else (False,):
                        b1, firsts = check_backward(args, tally, base, active, case, title, x, deterministic)
                        if with_ref:
                            mode = "bwd deterministic" if deterministic else "bwd default"
                            check_reference(tally, title, mode, ref.get(), b1, firsts)
            except Exception as e:  # noqa: BLE001  (reported: the run fails)
                tally.line("ERROR", f"{title}: {type(e).__name__}: {e}")
                if args.verbose:
                    traceback.print_exc()
            finally:
                if args.device == "cuda":
                    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the profile


def parse_profile(text: str, dims: list, heads: int, kv_heads: int, mods: dict) -> list:
    """[(Case, tokens, D)] from "N,P,R[,D];CLASS[,D];..." (N,P,R: one GRPO group; CLASS: a layout class of
    bench/layout_classes.py; no D: every head dim of --dims)."""
    out = []
    for item in (s.strip() for s in text.split(";") if s.strip()):
        fields = item.split(",")
        try:
            if fields[0] in layout_classes.CLASSES:
                lens, parents = layout_classes.layout_class(fields[0])
                case, tokens = Case(fields[0], heads, kv_heads, tree=(lens, parents), **mods), sum(lens)
                ds = [int(d) for d in fields[1:]]
            else:
                n, p, r = (int(v) for v in fields[:3])  # fewer than three fields: a ValueError too
                case, tokens = Case(f"N{n} P{p} R{r}", heads, kv_heads, groups=grpo(n, p, r), **mods), p + n * r
                ds = [int(d) for d in fields[3:]]
        except ValueError:
            raise ValueError(f"--profile: {item!r} is not N,P,R[,D] or a layout class "
                             f"({', '.join(layout_classes.CLASSES)})[,D]") from None
        if len(ds) > 1:
            raise ValueError(f"--profile: {item!r} has more than one head dim")
        out += [(case, tokens, D) for D in (ds or dims)]
    return out


def parse_profile_mods(text: str) -> dict:
    """{"window": int, "softcap": float, "sinks": bool} from "window=1024,softcap=30,sinks"."""
    mods = {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        key, _, val = item.partition("=")
        if key == "window":
            mods["window"] = int(val)
        elif key == "softcap":
            mods["softcap"] = float(val)
        elif key == "sinks" and not val:
            mods["sinks"] = True
        else:
            raise ValueError(f"--profile-mods: {item!r} (window=W, softcap=C, sinks)")
    return mods


def kernel_ms(build, case, T, D, dtype, backward, calls, kernels) -> tuple:
    """({substring or "all kernels": device ms per call}, names of the kernels that ran) over
    ``calls`` steps after one warm-up."""
    from torch.profiler import ProfilerActivity, profile
    x = make_inputs(case, T, D, dtype, seed_of(case, D), "cuda")
    with build.active():
        layout = case.layout().to("cuda", windows=(case.window,))
        leaves = [t.detach().clone().requires_grad_(backward) for t in (x.q, x.k, x.v)]
        sinks = x.sinks.clone().requires_grad_(backward) if x.sinks is not None else None

        def step():
            for t in leaves + ([sinks] if sinks is not None else []):
                t.grad = None
            with torch.set_grad_enabled(backward):
                out = dualkv.attention(*leaves, layout, window=case.window, softcap=case.softcap, sinks=sinks)
                if backward:
                    out.backward(x.dout)

        step()  # warm-up: plans, workspace, module loads
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                step()
            torch.cuda.synchronize()
    us = dict.fromkeys(list(kernels) + ["all kernels"], 0.0)
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)
        us["all kernels"] += t
        for k in kernels:
            if k in e.key:
                us[k] += t
    seen = sorted({e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA})
    return {k: v / 1e3 / calls for k, v in us.items()}, seen


def paired_ratio(cand: list, base: list, kernel: str) -> str:
    """The per-round ratios cand/base of one kernel (each round runs both libraries back to back):
    their median and quartiles, printed after the ratio of the medians. Long KV walks vary by 3-6%
    from one call to the next (docs/notes/2026-12-04-d128-fwd-order.md); a 1% change whose quartiles
    straddle 1.0 is not settled by that run (more --rounds or --profile-calls narrow them)."""
    rs = sorted(c[kernel] / b[kernel] for c, b in zip(cand, base) if b[kernel] and c[kernel])
    if len(rs) < 3:
        return ""
    q1, med, q3 = statistics.quantiles(rs, n=4, method="inclusive")
    return f" (per round: median {med:.3f}, quartiles {q1:.3f}-{q3:.3f})"


def run_profile(args, tally, builds, dims, dtype):
    if args.device != "cuda":
        tally.line("skip", "profile: needs --device cuda")
        return
    backward = args.check != "fwd"
    kernels = [k for k in args.kernels.split(",") if k]
    mods = parse_profile_mods(args.profile_mods)
    for case, tokens, D in parse_profile(args.profile, dims, args.heads, args.kv_heads, mods):
        title = f"profile {case.name} D{D} {case.mods_text()} {'fwd+bwd' if backward else 'fwd'}"
        try:
            times = {b.label: [] for b in builds}
            seen = set()
            for i in range(args.rounds):
                for b in builds[i % len(builds):] + builds[:i % len(builds)]:  # rotating order
                    ms, names = kernel_ms(b, case, tokens, D, dtype, backward, args.profile_calls, kernels)
                    times[b.label].append(ms)
                    seen.update(names)
            base_label = builds[0].label
            for k in kernels + ["all kernels"]:
                med = {label: statistics.median(t[k] for t in ts) for label, ts in times.items()}
                if not any(med.values()):  # a kernel only one library runs is a result, none at all is not
                    tally.line("ERROR", f"{title}: no kernel matching {k!r} ran in any library (that path did "
                                        f"not run; kernels seen: {', '.join(x[:60] for x in sorted(seen)[:12])})")
                    continue
                parts = [f"{label} {med[label]:.3f} ({' '.join(f'{t[k]:.3f}' for t in times[label])})"
                         for label in times]
                ratios = [f"{label}/{base_label} "
                          + (f"{med[label] / med[base_label]:.3f}{paired_ratio(ts, times[base_label], k)}"
                             if med[base_label] else "n/a (none in base)")
                          for label, ts in times.items() if label != base_label]
                print(f"{title} '{k}' ms/call: " + ", ".join(parts) + "; " + ", ".join(ratios), flush=True)
        except Exception as e:  # noqa: BLE001  (reported: the run fails)
            tally.line("ERROR", f"{title}: {type(e).__name__}: {e}")
            if args.verbose:
                traceback.print_exc()
        finally:
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------


def cand_env(items, label: str) -> dict:
    """The environment of candidate ``label``: the --cand-env items KEY=VALUE (every candidate's) and
    LABEL:KEY=VALUE (that candidate's alone), e.g. one library under two settings of a launch switch:
    --cand a=lib.so --cand b=lib.so --cand-env a:X=1 --cand-env b:X=2."""
    shared, own = [], []
    for item in items or ():
        key = item.partition("=")[0]
        if ":" in key:
            who, _, rest = item.partition(":")
            if who == label:
                own.append(rest)
        else:
            shared.append(item)
    return {**parse_env(shared), **parse_env(own)}


def parse_env(items) -> dict:
    env = {}
    for item in items or ():
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: environment switch {item!r} is not KEY=VALUE")
        env[key] = val
    return env


def base_copy(path: str) -> str:
    """A copy of the library at ``path`` in a temporary directory removed at exit: loaded beside the
    original it is a second library (dlopen of the same file returns the same one)."""
    folder = tempfile.mkdtemp(prefix="ab_libraries_aa_")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return shutil.copy(path, os.path.join(folder, "aa_" + os.path.basename(path)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the base libdualkv (e.g. main's build)")
    ap.add_argument("--cand", action="append", required=True,
                    help="a candidate libdualkv: PATH or LABEL=PATH (repeatable: each is compared with the base)")
    ap.add_argument("--aa", action="store_true",
                    help="the A/A control: a copy of the base's file as one more candidate, labelled aa")
    ap.add_argument("--check", choices=("fwd", "bwd", "both"), required=True,
                    help="fwd: out/lse bitwise; bwd: out/lse/dK/dV bitwise, dQ within the noise; both")
    ap.add_argument("--dims", default="64,128,256", help="head dims (those a library lacks are skipped)")
    ap.add_argument("--mods", default="", help="cases with these modifiers too: window,softcap,sinks,prefix")
    ap.add_argument("--deterministic", action="store_true", help="bwd: the deterministic mode too")
    ap.add_argument("--fwd-rule", choices=("bitwise", "reference"), default="bitwise",
                    help="fwd: out/lse bitwise equal to base (default), or (a forward that differs by design, "
                         "e.g. an emulated exp2) run to run bitwise, within max |base| / 64 of the base and "
                         "judged by the ref64 lines (the tests' rule against the float64 reference)")
    ap.add_argument("--dkdv", choices=("bitwise", "noise"), default="bitwise",
                    help="bwd: dK/dV (and the prefix gradients and dsinks) bitwise equal to base (default), or "
                         "within the noise rule of dQ (a backward whose rounding changes by design: a new delta "
                         "moves dsinks too)")
    ap.add_argument("--runs", type=int, default=3, help="candidate runs per case (races show in some runs)")
    ap.add_argument("--layouts", default="", help="N,P,R;... more GRPO cases to check (--heads, --kv-heads)")
    ap.add_argument("--cases", default="", help="only the cases whose name contains one of these comma-separated texts")
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="skip cases with more tokens (default: none on cuda, 6000 on cpu)")
    ap.add_argument("--ref-max-elements", type=int, default=2 ** 26,
                    help="float64 reference on cases with T^2 H at most this (0: no reference)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test of the tool")
    ap.add_argument("--profile", default="", help="N,P,R[,D] or CLASS[,D];... GRPO layouts or layout classes whose kernel times to profile (cuda)")
    ap.add_argument("--kernels", default="", help="comma-separated kernel name substrings to time")
    ap.add_argument("--profile-only", action="store_true",
                    help="time --profile without the checks (exit 0 unless the profile reports an ERROR)")
    ap.add_argument("--profile-mods", default="", help="modifiers of the profiled layouts: window=W,softcap=C,sinks")
    ap.add_argument("--rounds", type=int, default=2, help="profile rounds (libraries in rotating order)")
    ap.add_argument("--profile-calls", type=int, default=3, help="profiled calls per library and round")
    ap.add_argument("--heads", type=int, default=32, help="query heads of the profiled layouts and of --layouts")
    ap.add_argument("--kv-heads", type=int, default=8, help="KV heads of the profiled layouts and of --layouts")
    ap.add_argument("--base-env", action="append", help="KEY=VALUE set around the base's calls (repeatable)")
    ap.add_argument("--cand-env", action="append",
                    help="KEY=VALUE set around the candidates' calls, LABEL:KEY=VALUE around one candidate's (repeatable)")
    ap.add_argument("--verbose", action="store_true", help="tracebacks of errors")
    ap.add_argument("--self-test-perturb", default=None, choices=FORWARD_OUTPUTS + GRAD_OUTPUTS,
                    help="TEST ONLY (the tool's own test): change one element of this output of every "
                         "candidate run; the run must then report DIFF and exit 1")
    args = ap.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = 6000 if args.device == "cpu" else 0
    dims = [int(d) for d in args.dims.split(",") if d]
    mods = {m for m in args.mods.split(",") if m}
    unknown = mods - {"window", "softcap", "sinks", "prefix"}
    if unknown:
        ap.error(f"--mods: unknown {', '.join(sorted(unknown))} (window, softcap, sinks, prefix)")
    if args.profile and not args.kernels:
        ap.error("--profile needs --kernels (substrings of the kernel names to time)")
    if args.profile_only and (not args.profile or args.device != "cuda"):
        ap.error("--profile-only needs --profile and --device cuda (the profiler times CUDA kernels)")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here (--device cpu runs the smoke test)")
    dtype = getattr(torch, args.dtype)

    cand_specs = []
    for i, item in enumerate(args.cand):
        label, sep, path = item.partition("=")
        if not sep:
            label, path = ("cand" if len(args.cand) == 1 else f"cand{i + 1}"), item
        cand_specs.append((label, path))
    if args.aa:
        if any(label == "aa" for label, _ in cand_specs):
            ap.error("--aa: a candidate is already labelled aa")
        cand_specs.append(("aa", base_copy(args.base)))
    # The package must have a library of its own C ABI loaded to switch from (_native.using).
    os.environ.setdefault("DUALKV_LIBRARY", str(pathlib.Path(cand_specs[0][1]).resolve()))

    tally = Tally()
    try:
        base = Build("base", args.base, parse_env(args.base_env))
        cands = [Build(label, path, cand_env(args.cand_env, label)) for label, path in cand_specs]
    except _native.DualKVError as e:
        print(f"ERROR loading the libraries: {e}", flush=True)
        return 1
    state = provenance.git_state(ROOT)
    commit = (state["commit"] or "unknown") + ("-dirty" if state["dirty"] else "")
    gpu = f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""
    print(f"ab_libraries: tree {commit}{'' if state['verified'] else ' (DUALKV_COMMIT, unverified)'}, "
          f"device {args.device}{gpu}, torch {torch.__version__}, check {args.check}, dims {dims}, "
          f"mods {sorted(mods) or 'none'}, dtype {args.dtype}", flush=True)
    for b in [base] + cands:
        print("  " + b.describe(args.device), flush=True)
        if b is not base and b.path == base.path:
            print(f"  note: {b.label} is the base's file: one loaded library (a self-comparison)", flush=True)
    if args.self_test_perturb:
        print(f"  TEST ONLY: output {args.self_test_perturb!r} of every candidate run is perturbed", flush=True)

    wanted = [w for w in args.cases.split(",") if w]
    layouts = [tuple(int(v) for v in item.split(",")) for item in args.layouts.split(";") if item.strip()]
    if any(len(lay) != 3 for lay in layouts):
        ap.error(f"--layouts: {args.layouts!r} is not N,P,R;...")
    cases = [c for c in build_cases(mods, layouts, args.heads, args.kv_heads)
             if not wanted or any(w in c.name for w in wanted)]
    if not args.profile_only:
        run_checks(args, tally, base, cands, cases, dims, dtype)
    if args.profile:
        run_profile(args, tally, [base] + cands, dims, dtype)
    if args.profile_only:
        print(f"summary: profile only, {tally.error} ERROR ({len(cands)} candidate(s) against {base.path.name})",
              flush=True)
        return 1 if tally.error else 0

    compared = tally.ok + tally.diff
    failed = tally.diff + tally.error
    print(f"summary: {tally.ok} ok, {tally.diff} DIFF, {tally.error} ERROR, {tally.skip} skipped "
          f"({len(cands)} candidate(s) against {base.path.name}): "
          + ("all ok" if compared and not failed else "FAILED" if failed else "NOTHING COMPARED"), flush=True)
    return 0 if compared and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
