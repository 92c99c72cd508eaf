"""tools/sass_control.py: the control fields decoded from real sm_90a encodings (main's D-256 forward,
session 46), one kernel picked by a substring, and a clear exit for none or several."""
import importlib.util
import pathlib
import sys

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "sass_control.py"

# cuobjdump -sass as it prints two kernels of one arch, padding shortened (encodings from
# fwd_sm90_kernel<bf16, 256, ...>).
SASS = """
Fatbin elf code:
================
arch = sm_90a
code version = [1,8]

        Function : _Z6kernelILb0EEvv
        /*47d0*/  SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R20+UR5+0x38010], R19 ;  /* 0x03801013140075a7 */
            /* 0x000e620008000145 */
        /*4830*/  @!P0 BRA 0xe5a0 ;  /* 0x0000009c00588947 */
            /* 0x003ff60003800000 */
        /*4880*/  HGMMA.64x256x16.F32.BF16 R24, R208, gdesc[UR12].tnspB, R24 ;  /* 0x43e0000cd0187df0 */
            /* 0x000fde0008701818 */
        /*4890*/  NOP ;  /* 0x0000000000007918 */
            /* 0x000fda0000000000 */
        Function : _Z6kernelILb1EEvv
        /*0000*/  NOP ;  /* 0x0000000000007918 */
            /* 0x000fda0000000000 */
"""


def load_tool():
    spec = importlib.util.spec_from_file_location("sass_control", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # its dataclass looks its module up there
    spec.loader.exec_module(tool)
    return tool


def test_control_fields_of_real_encodings():
    tool = load_tool()
    rows = tool.listing(SASS, "ILb0E", "sm_90a")
    assert [(a, i.split()[0]) for a, _, i in rows] == [("47d0", "SYNCS.PHASECHK.TRANS64.TRYWAIT"), ("4830", "@!P0"),
                                                       ("4880", "HGMMA.64x256x16.F32.BF16"), ("4890", "NOP")]
    syncs, bra, hgmma, nop = (c for _, c, _ in rows)
    assert (syncs.stall, syncs.write_barrier, syncs.read_barrier, syncs.wait_mask) == (1, 1, None, 0)
    assert (bra.stall, bra.yield_hint, bra.write_barrier, bra.wait_mask) == (11, True, None, 0b11)  # waits on 0 and 1
    assert (hgmma.stall, hgmma.yield_hint, hgmma.write_barrier, hgmma.wait_mask, hgmma.reuse) == (15, False, None, 0, 0)
    assert nop.stall == 13
    assert str(bra) == "S11 y W- R- B01     0"


def test_kernel_must_match_exactly_one():
    tool = load_tool()
    with pytest.raises(SystemExit, match="2 kernels of sm_90a contain 'kernel'"):
        tool.listing(SASS, "kernel", "sm_90a")
    with pytest.raises(SystemExit, match="0 kernels of sm_80 contain"):
        tool.listing(SASS, "ILb0E", "sm_80")
