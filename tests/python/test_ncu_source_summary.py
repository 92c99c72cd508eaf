"""tests/gpu/ncu_source_summary.py reads an Nsight Compute SASS source page on any machine: a small
hand-made page checks the sums it prints (stall-reason split, opcode shares, top instruction) and
the clear message for a CSV that is not a source page."""
from __future__ import annotations

import csv
import pathlib
import subprocess
import sys

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tests" / "gpu" / "ncu_source_summary.py"
COLS = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
        "Instructions Executed", "stall_short_sb", "stall_wait", "stall_barrier", "stall_short_sb (Not Issued)"]


def write_page(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(["Kernel Name", "void k(int)"])
        w.writerow(COLS)
        for r in rows:
            w.writerow(r)


def run(*args):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_summary_sums(tmp_path):
    page = tmp_path / "page.csv"
    write_page(page, [
        ["0x10", "      HMMA.16816.F32.BF16 R4, R8, R12, R4", "60", "50", "300", "40", "20", "0", "35"],
        ["0x20", "@!P3  IMAD.MOV.U32 R1, RZ, RZ, R2", "30", "25", "100", "30", "0", "0", "25"],
        ["0x30", "      BAR.SYNC.DEFER_BLOCKING 0x0", "10", "10", "100", "0", "0", "10", "0"],
    ])
    res = run(page, "--top", "2", "--block", "2", "--min-block-share", "0")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "3 SASS lines, 100 stall samples" in out
    assert "short_sb 70.0%, wait 20.0%, barrier 10.0%" in out
    # Executed share / sample share per opcode; predicated IMAD counted as IMAD.
    assert "HMMA 60.0/60.0" in out and "IMAD 20.0/30.0" in out and "BAR 20.0/10.0" in out
    top = out.split("top 2 instructions:")[1].strip().splitlines()
    assert "60.00%" in top[0] and "HMMA" in top[0] and "IMAD" in top[1]
    assert "(Not Issued)" not in out  # the not-issued columns are not double-counted as reasons


def test_not_a_source_page(tmp_path):
    page = tmp_path / "other.csv"
    page.write_text('"a","b"\n"1","2"\n')
    res = run(page)
    assert res.returncode == 1 and "no header row" in res.stdout
