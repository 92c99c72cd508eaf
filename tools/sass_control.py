#!/usr/bin/env python3
"""List one kernel's SASS with each instruction's scheduling control codes decoded.

    tools/sass_control.py LIB_OR_CUBIN KERNEL [--arch sm_90a] [--match REGEX [--context N]]

KERNEL is a substring of the mangled name (cuobjdump's "Function :" line) that must pick exactly
one kernel of the arch. Each line reads

    address  S<stall> <y> W<write barrier> R<read barrier> B<waited barriers> <reuse>  instruction

from the top bits of the instruction's second 64-bit word (the Volta-to-Hopper layout): stall
cycles before the warp's next instruction issues (bits 41-44), the yield hint (bit 45, `y` when
set), the scoreboard a variable-latency result sets (46-48) and the one its source reads release
(49-51; `-` for none, 7 in the field), the scoreboards waited for before issue (mask, 52-57) and the
operand reuse flags (58-61, hex). --match keeps only the instructions matching REGEX and --context
lines around each.

Why: ncu puts stall samples on an instruction; the stall counts say which waits the compiler
scheduled there (a fixed latency: `wait`) and which are on a scoreboard (`B..`: long or short
scoreboard). Session 46 read the D-256 forward's P·V NOPs this way (docs/notes/2026-12-04-device-queue.md
§0 item 4): 28 cycles between HGMMAs, the latency of a uniform descriptor register.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_compare import cuobjdump, functions  # noqa: E402  (tools/)

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s*(.*?)\s*;?\s*/\* (0x[0-9a-f]{16}) \*/\s*$")
SECOND_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")


@dataclass(frozen=True)
class Control:
    stall: int
    yield_hint: bool
    write_barrier: int | None
    read_barrier: int | None
    wait_mask: int
    reuse: int

    def __str__(self) -> str:
        waits = "".join(str(b) for b in range(6) if self.wait_mask >> b & 1) or "-"
        bar = lambda b: "-" if b is None else str(b)  # noqa: E731
        return (f"S{self.stall:02d} {'y' if self.yield_hint else '-'} W{bar(self.write_barrier)} "
                f"R{bar(self.read_barrier)} B{waits:<6} {self.reuse:x}")


def control(second_word: int) -> Control:
    """The control fields of an instruction's second 64-bit word."""
    field = lambda lo, bits: (second_word >> lo) & ((1 << bits) - 1)  # noqa: E731
    wb, rb = field(46, 3), field(49, 3)
    return Control(stall=field(41, 4), yield_hint=bool(field(45, 1)), write_barrier=None if wb == 7 else wb,
                   read_barrier=None if rb == 7 else rb, wait_mask=field(52, 6), reuse=field(58, 4))


def listing(sass: str, kernel: str, arch: str):
    """[(address, Control, instruction)] of the one kernel of `arch` whose name contains `kernel`."""
    found = {}
    for arch_of, name, lines in functions(sass):
        # A kernel instantiated in several translation units is listed once per unit: the first copy.
        if arch_of != arch or kernel not in name or name in found:
            continue
        body, pending = found.setdefault(name, []), None
        for line in lines:
            m = INSTRUCTION.match(line)
            if m:
                pending = (m.group(1), m.group(2))
            elif pending and (m := SECOND_WORD.match(line)):
                body.append((pending[0], control(int(m.group(1), 16)), pending[1]))
                pending = None
    if len(found) != 1:
        raise SystemExit(f"sass_control: {len(found)} kernels of {arch} contain {kernel!r}"
                         + (": " + ", ".join(sorted(found)) if found else ""))
    return next(iter(found.values()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("binary", help="a libdualkv.so or a cubin")
    ap.add_argument("kernel", help="a substring of one mangled kernel name")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--match", default="", help="only the instructions matching this regular expression")
    ap.add_argument("--context", type=int, default=0, help="instructions shown around each --match")
    args = ap.parse_args()
    sass = subprocess.run([cuobjdump(), "-sass", args.binary], check=True, capture_output=True, text=True).stdout
    rows = listing(sass, args.kernel, args.arch)
    keep = range(len(rows))
    if args.match:
        hits = [i for i, (_, _, ins) in enumerate(rows) if re.search(args.match, ins)]
        keep = sorted({j for i in hits for j in range(max(0, i - args.context), min(len(rows), i + args.context + 1))})
    last = None
    for i in keep:
        if last is not None and i != last + 1:
            print("--")
        address, ctl, ins = rows[i]
        print(f"{address}  {ctl}  {ins}")
        last = i


if __name__ == "__main__":
    main()
