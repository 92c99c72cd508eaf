"""tools/kernel_counters.py's layouts and its refusal without a GPU (the profiled call itself runs on
the device, under ncu)."""
from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

TOOL = pathlib.Path(__file__).resolve().parents[2] / "tools" / "kernel_counters.py"


@pytest.fixture
def tool(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the tool and bench/attention.py prepend paths
    spec = importlib.util.spec_from_file_location("kernel_counters", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cases_are_classes_or_grpo_groups(tool):
    bench = tool._bench_module("attention")
    tree = tool.case_of(bench, "tree")
    lens, parents = bench.layout_classes.layout_class("tree")
    assert tree.name == "tree" and tree.lens == lens and tree.parents == parents
    group = tool.case_of(bench, "2,256,64")
    assert group.name == "N2_P256_R64" and group.T == 256 + 2 * 64 and group.prompts == [256]
    with pytest.raises(ValueError):
        tool.case_of(bench, "2,256")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(tool, capsys):
    with pytest.raises(SystemExit) as e:
        tool.main(["--case", "tree"])
    assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err
