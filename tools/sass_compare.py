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
"""
from __future__ import annotations

import argparse
import collections
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


def kernels(lib: str, ignore_regs: bool, renames, ignore_params: bool = False):
    """{(arch, kernel name): [listing, ...]} with one listing (a tuple of instructions) per copy."""
    text = subprocess.run([cuobjdump(), "-sass", lib], check=True, capture_output=True, text=True).stdout
    out = collections.defaultdict(list)
    for arch, name, lines in functions(text):
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--regs", action="store_true", help="ignore register and predicate numbers")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                    help="regex substitution on B's mangled kernel names")
    ap.add_argument("--params", action="store_true", help="ignore kernel-parameter offsets (c[0x0][...])")
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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
