"""tools/workspace_placement.py's summary: placements that keep their own times apart (between >> within)
against placements that all wander between the same modes (within as large as between). The tool
itself needs a CUDA device (docs/notes/2026-12-04-device-queue.md §0 item 6)."""
import importlib.util
import pathlib
import sys

import pytest

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "workspace_placement.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("workspace_placement", TOOL)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool
    spec.loader.exec_module(tool)
    return tool


def test_placement_bound_modes_read_as_between():
    s = load_tool().summarize({"buf0": [80.0, 81.0, 79.5], "buf1": [184.0, 185.0, 183.0],
                               "fresh": [80.5, 80.0, 81.0]})
    assert s["workspaces"]["buf1"]["median_ms"] == 184.0
    assert s["between"] == pytest.approx(184.0 / 80.0) and s["within"] == pytest.approx(81.0 / 79.5)


def test_wandering_modes_read_as_within():
    s = load_tool().summarize({"buf0": [80.0, 184.0, 81.0], "buf1": [183.0, 80.0, 82.0]})
    assert s["between"] == pytest.approx(82.0 / 81.0) and s["within"] == pytest.approx(184.0 / 80.0)


def test_needs_cuda_says_so(capsys):
    tool = load_tool()
    if tool.torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the tool would run")
    with pytest.raises(SystemExit):
        tool.main(["--case", "long_responses"])
    assert "needs a CUDA device" in capsys.readouterr().err
