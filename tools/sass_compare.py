#!/usr/bin/env python3
"""Compare the machine code (SASS) of two builds of libdualkv, kernel by kernel.

    tools/sass_compare.py A/libdualkv.so B/libdualkv.so [--regs] [--rename OLD=NEW ...]

Every kernel of every arch in either library is listed as "same", "DIFF", "only in A" or "only
in B"; the exit status is 1 if any kernel differs or is missing. Addresses and encodings are
dropped, so "same" means the same instructions in the same order. --regs also ignores register
and predicate numbers (the same instructions, possibly other registers). --rename OLD=NEW is a
regular-expression substitution applied to B's kernel names (mangled), for a kernel that moved to
another name or namespace without changing its code. --params also ignores the offsets of kernel
parameters in the constant bank (c[0x0][...]), for a params struct that grew fields before the ones
a kernel reads.

Why: a refactor that keeps the SASS of a kernel identical keeps its measured speed, so it needs no
device run. A kernel instantiated in several translation units appears once per unit: the copies
of A and B must match as a whole.

--loops SUBSTR then lists, for each kernel whose mangled name contains SUBSTR, the loops that hold
wgmmas (a backward branch's span with an HGMMA inside; the instruction count and the HGMMAs of each,
shortest first) in A and in B, and the opcodes whose counts differ between A's shortest one (usually
the KV-tile loop) and B's shortest with as many HGMMAs: where a changed kernel's per-tile work grew,
before any device run (e.g. the window kernels' loops after packed query heads,
docs/notes/2026-12-07-fwd-packed-query-heads.md §7).
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import shutil
import subprocess
import sys


def cuobjdump() -> str:
    """$CUOBJDUMP, then PATH, /usr/local/cuda, the CUDA 13 wheel (nvidia/cu13/bin) and the triton
    wheel's copy; a clear error when none is there."""
    cands = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump"]
    for module, parts in (("nvidia", ("cu13", "bin")), ("triton", ("backends", "nvidia", "bin"))):
        try:
            pkg = __import__(module)
        except ImportError:
            continue
        for root in list(getattr(pkg, "__path__", [])) or [os.path.dirname(pkg.__file__)]:
            cands.append(os.path.join(root, *parts, "cuobjdump"))
    for cand in cands:
        if cand and os.path.isfile(cand):
            return cand
    sys.exit("sass_compare: no cuobjdump (set CUOBJDUMP, put one on PATH, or install nvidia-cuda-nvcc / triton); "
             "tried: " + ", ".join(c for c in cands if c))


ADDRESS = re.compile(r"/\*[0-9a-f]{4,}\*/")
ANON_NAMESPACE = re.compile(r"_GLOBAL__N__[0-9a-f]+_")  # per-unit hash of an anonymous namespace
ENCODING = re.compile(r"/\* 0x[0-9a-f]+ \*/")
REGISTER = re.compile(r"\bU?R[0-9]+\b|\bU?P[0-9]\b")
PARAM = re.compile(r"c\[0x0\]\[0x[0-9a-f]+\]")


def functions(sass: str):
    """(arch, mangled name, lines) of each kernel copy in cuobjdump -sass text, in listing order: the
    lines between its "Function :" header and the next header or arch."""
    arch, name, body = None, None, []
    for line in sass.splitlines():
        if line.startswith("arch = ") or "Function : " in line:
            if name is not None:
                yield arch, name, body
            if line.startswith("arch = "):
                arch, name = line.split("=", 1)[1].strip(), None
            else:
                name = line.split("Function : ", 1)[1].strip()
            body = []
        elif name is not None:
            body.append(line)
    if name is not None:
        yield arch, name, body


@functools.lru_cache(maxsize=None)
def sass(lib: str) -> str:
    """cuobjdump -sass of a library, once per run (the compare and --loops both read it)."""
    return subprocess.run([cuobjdump(), "-sass", lib], check=True, capture_output=True, text=True).stdout


def kernels(lib: str, ignore_regs: bool, renames, ignore_params: bool = False):
    """{(arch, kernel name): [listing, ...]} with one listing (a tuple of instructions) per copy."""
    out = collections.defaultdict(list)
    for arch, name, lines in functions(sass(lib)):
        name = ANON_NAMESPACE.sub("_GLOBAL__N__", name)
        for old, new in renames:
            name = re.sub(old, new, name)
        body = []
        for line in lines:
            if not ADDRESS.search(line):  # a header or label, not an instruction
                continue
            ins = ENCODING.sub("", ADDRESS.sub("", line)).strip()
            if ignore_regs:
                ins = " ".join(REGISTER.sub("R", ins).split())
            if ignore_params:
                ins = PARAM.sub("c[0x0][P]", ins)
            body.append(ins)
        out[(arch, name)].append(tuple(body))
    return out


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;")
PREDICATE = re.compile(r"^@!?U?P[T0-9]+\s+")


def instructions(lines):
    """[(address, text)] of one listing's instructions (cuobjdump -sass lines, encodings dropped)."""
    out = []
    for line in lines:
        m = INSTRUCTION.search(ENCODING.sub("", line))
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(text: str) -> str:
    """An instruction's opcode without its predicate and modifiers: '@!P0 HGMMA.64x80x16.F32' -> 'HGMMA'."""
    return PREDICATE.sub("", text).split()[0].split(".")[0]


def wgmma_loops(ins):
    """The loops of a listing that hold a wgmma: (instructions, HGMMAs, first, last index) per backward
    branch whose span [target, branch] has an HGMMA, shortest first."""
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    loops = set()
    for i, (addr, text) in enumerate(ins):
        if opcode(text) != "BRA":
            continue
        m = re.search(r"0x([0-9a-f]+)", text.split("BRA", 1)[1])
        j = index.get(int(m.group(1), 16)) if m else None
        if j is None or j > i:
            continue
        hgmma = sum(opcode(t) == "HGMMA" for _, t in ins[j:i + 1])
        if hgmma:
            loops.add((i - j + 1, hgmma, j, i))
    return sorted(loops)


def loop_report(lib_a: str, lib_b: str, substr: str) -> list[str]:
    """--loops: each matching kernel's wgmma loops in A and B, and the opcode counts that differ in
    the shortest one (B's minus A's)."""
    listings = {}
    for side, lib in (("A", lib_a), ("B", lib_b)):
        for arch, name, lines in functions(sass(lib)):
            if substr in name:
                listings.setdefault((arch, name), {}).setdefault(side, instructions(lines))  # first copy
    out = []
    for (arch, name), sides in sorted(listings.items()):
        out.append(f"loops   {arch:7s} {name}")
        inner, hgmmas = {}, None
        for side in ("A", "B"):
            loops = wgmma_loops(sides.get(side, []))
            out.append(f"  {side}: " + (", ".join(f"{n} ({h} HGMMA)" for n, h, _, _ in loops) or "none"))
            # A's shortest loop, and in B the shortest with as many HGMMAs (the same loop, if it is there)
            match = [lp for lp in loops if hgmmas is None or lp[1] == hgmmas]
            if match:
                _, hgmmas, j, i = match[0]
                inner[side] = collections.Counter(opcode(t) for _, t in sides[side][j:i + 1])
        if len(inner) == 2:
            delta = {op: inner["B"][op] - inner["A"][op] for op in set(inner["A"]) | set(inner["B"])}
            moved = sorted((d for d in delta.items() if d[1]), key=lambda d: (-abs(d[1]), d[0]))
            out.append(f"  shortest ({hgmmas} HGMMA), B - A: "
                       + (", ".join(f"{op} {d:+d}" for op, d in moved) or "the same opcodes"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--regs", action="store_true", help="ignore register and predicate numbers")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="regex substitution on B's mangled kernel names")
    ap.add_argument("--params", action="store_true", help="ignore kernel-parameter offsets (c[0x0][...])")
    ap.add_argument("--loops", metavar="SUBSTR", help="the wgmma loops of the kernels whose name contains SUBSTR")
    args = ap.parse_args()
    renames = [tuple(r.split("=", 1)) for r in args.rename]
    a = kernels(args.a, args.regs, [], args.params)
    b = kernels(args.b, args.regs, renames, args.params)
    bad = 0
    for key in sorted(set(a) | set(b)):
        arch, name = key
        if key not in a or key not in b:
            state = "only in B" if key not in a else "only in A"
        else:
            state = "same" if sorted(a[key]) == sorted(b[key]) else "DIFF"
        bad += state != "same"
        print(f"{state:9s} {arch:7s} {name}")
    print(f"{len(set(a) | set(b))} kernels, {bad} not the same")
    if args.loops:
        print("\n".join(loop_report(args.a, args.b, args.loops)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
