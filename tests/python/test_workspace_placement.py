"""tools/workspace_placement.py: its summary (placements that keep their own times apart, between >> within,
against placements that all wander between the same modes) and the stand-in workspace that hands the
library a view of the chosen buffer. The tool itself needs a CUDA device (docs/notes/2026-12-04-device-queue.md
§0 item 6)."""
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


def test_placement_hands_the_library_a_view_of_the_chosen_buffer():
    tool = load_tool()
    torch = tool.torch

    def dualkv_bwd_workspace_size():  # stands for the library's query (only its name is read)
        pass

    def dualkv_fwd_workspace_size():
        pass

    def library_workspace(query, params, device, size=4096):  # dualkv.ops._workspace: allocates and points
        ws = torch.empty(size, dtype=torch.uint8)
        params.workspace, params.workspace_bytes = ws.data_ptr(), ws.numel()
        return ws

    params = type("Params", (), {})()
    placement = tool.Placement(library_workspace)
    fresh = placement(dualkv_bwd_workspace_size, params, "cpu")
    assert placement.size == 4096 and params.workspace == fresh.data_ptr()
    placement.pool["buf0"] = torch.empty(4096 + 512, dtype=torch.uint8)[512:]
    placement.chosen = "buf0"
    view = placement(dualkv_bwd_workspace_size, params, "cpu")
    assert view.data_ptr() == placement.pool["buf0"].data_ptr() == params.workspace
    assert view.numel() == params.workspace_bytes == 4096
    fwd = placement(dualkv_fwd_workspace_size, params, "cpu")  # the forward's workspace: the library's own
    assert params.workspace == fwd.data_ptr() != view.data_ptr()
    placement.library_workspace = lambda q, p, d: library_workspace(q, p, d, size=8192)
    with pytest.raises(RuntimeError, match="grew from 4096 to 8192 bytes"):
        placement(dualkv_bwd_workspace_size, params, "cpu")
