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
