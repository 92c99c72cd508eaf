"""tools/sass_compare.py's search for cuobjdump: $CUOBJDUMP first; with none anywhere, an exit that
names what it tried (not a ModuleNotFoundError from the last fallback)."""
import importlib.util
import pathlib

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "sass_compare.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("sass_compare", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_cuobjdump_env_first(tmp_path, monkeypatch):
    fake = tmp_path / "cuobjdump"
    fake.write_text("")
    monkeypatch.setenv("CUOBJDUMP", str(fake))
    assert load_tool().cuobjdump() == str(fake)


def test_no_cuobjdump_names_what_it_tried(tmp_path, monkeypatch):
    tool = load_tool()
    monkeypatch.setenv("CUOBJDUMP", str(tmp_path / "missing"))
    monkeypatch.setattr(tool.shutil, "which", lambda name: None)
    monkeypatch.setattr(tool.os.path, "isfile", lambda p: False)
    with pytest.raises(SystemExit, match="no cuobjdump .*tried: " + str(tmp_path / "missing")):
        tool.cuobjdump()


def listing(name: str, extra: int) -> str:
    """cuobjdump -sass text of one kernel: a loop of an HGMMA, `extra` ISETPs and a branch back to its
    top, after a loop without wgmmas."""
    body = ["MOV R1, c[0x0][0x28]", "IADD3 R2, R2, 0x1, RZ", "@P1 BRA 0x0010", "HGMMA.64x80x16.F32.BF16 R24, gdesc[UR4], RZ"]
    body += ["ISETP.GE.AND P0, PT, R2, R3, PT"] * extra + ["@!P0 BRA 0x0030", "EXIT"]
    lines = ["arch = sm_90a", f"\t\tFunction : {name}"]
    lines += [f"        /*{16 * k:04x}*/                   {ins} ;   /* 0x000000000000 */" for k, ins in enumerate(body)]
    return "\n".join(lines) + "\n"


def test_wgmma_loops_finds_the_loop_with_the_wgmma():
    tool = load_tool()
    ins = tool.instructions(listing("k", 2).splitlines())
    assert [t for _, t in ins][3].startswith("HGMMA") and tool.opcode("@!P0 BRA 0x0030") == "BRA"
    # the first backward branch (0x0020 -> 0x0010) spans no HGMMA; the second (0x0060 -> 0x0030) does
    assert tool.wgmma_loops(ins) == [(4, 1, 3, 6)]


def test_loop_report_counts_what_the_loop_gained(monkeypatch):
    tool = load_tool()
    texts = {"a.so": listing("_Z6kernelv", 1), "b.so": listing("_Z6kernelv", 3)}
    monkeypatch.setattr(tool, "cuobjdump", lambda: "cuobjdump")
    monkeypatch.setattr(tool.subprocess, "run",
                        lambda cmd, **kw: type("Done", (), {"stdout": texts[cmd[-1]]})())
    lines = tool.loop_report("a.so", "b.so", "kernel")
    assert lines[1:] == ["  A: 3 (1 HGMMA)", "  B: 5 (1 HGMMA)", "  shortest (1 HGMMA), B - A: ISETP +2"]
