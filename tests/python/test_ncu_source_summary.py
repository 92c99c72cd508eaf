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


def test_regions_and_lines(tmp_path):
    """Units are each region's share of the regions' samples times --scale; instructions per step divide the
    executed counts by the executed count of the --steps @LINE line."""
    page = tmp_path / "page.csv"
    write_page(page, [
        ["0x10", "      HGMMA.64x64x16.F32.BF16 R1, gdesc[UR4], R1", "30", "20", "40", "0", "30", "0", "0"],
        ["0x20", "      WARPGROUP.DEPBAR.LE gsb0, 0x0", "50", "50", "20", "0", "0", "50", "0"],
        ["0x30", "@!P0  BRA 0x10", "20", "10", "20", "20", "0", "0", "10"],
    ])
    res = run(page, "--steps", "@2", "--scale", "108", "--regions", "issue:0-0;wait and branch:1-2", "--lines", "1-2")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "regions (108 units in all; 20 steps)" in out
    issue = next(line for line in out.splitlines() if line.strip().startswith("issue"))
    assert " 32.4 " in issue and " 2.0 " in issue and "wait 32.4" in issue  # 30 of 100 samples x 108; 40 / 20
    rest = next(line for line in out.splitlines() if line.strip().startswith("wait and branch"))
    assert " 75.6 " in rest and "barrier 54.0" in rest and "short_sb 21.6" in rest
    listing = out.split("per line:")[1].splitlines()[1:3]
    assert "71.43" in listing[0] and "DEPBAR" in listing[0] and "28.57" in listing[1]


def test_regions_outside_the_page(tmp_path):
    page = tmp_path / "page.csv"
    write_page(page, [["0x10", "      NOP", "1", "1", "1", "1", "0", "0", "0"]])
    res = run(page, "--regions", "a:0-5")
    assert res.returncode != 0 and "outside the page's 1 SASS lines" in (res.stdout + res.stderr)
