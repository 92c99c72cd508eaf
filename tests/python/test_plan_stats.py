"""tools/plan_stats.py reads the library's plan on any machine: with a window (--window) its count of
the visible pairs the Hopper backward's steps hold (read through the plan's items and distance
biases) equals the reference mask's, also on a layout class's forest (--classes), and the scheduler
model places every step of every item."""
from __future__ import annotations

import pathlib
import random
import sys

import pytest

import dualkv
from dualkv.reference import visibility_mask

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import plan_stats  # noqa: E402


@pytest.mark.parametrize("window", [0, 1, 100, 333])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_visible_pairs_of_the_plan_match_the_reference_mask(window, head_dim):
    P, N, R = 300, 3, 200
    layout = dualkv.Layout.from_groups([P], [[R] * N])
    plan = plan_stats.build_plan(layout, head_dim, 132, window)
    _, masked, pairs, per_item = plan_stats.masking(plan)
    assert pairs == int(visibility_mask(layout, window or None).sum())
    assert len(per_item) == len(plan["bwd"]) and sum(per_item) == masked > 0


def test_schedule_places_every_step():
    plan = plan_stats.build_plan(dualkv.Layout.from_groups([1024], [[512] * 4]), 128, 132, 256)
    H, Hk = 8, 2
    starts, makespan, mean = plan_stats.schedule(plan, H, Hk, 16, 2.0)
    assert len(starts) == len(plan["bwd"]) * Hk
    steps = sum(tiles for _, _, _, tiles, _ in starts) * (H // Hk)
    assert mean * 16 == pytest.approx(steps + 2.0 * len(starts))
    assert mean <= makespan


def test_a_layout_class_plan_holds_its_visible_pairs():
    """--classes: a forest of bench/layout_classes.py is planned as given (a tree's visible pairs, read
    through the plan's items, are the reference mask's)."""
    lens, parents = plan_stats.layout_classes.random_tree(300, (2, 2), ((50, 120), (1, 70)), random.Random(3))
    layout = dualkv.Layout.from_tree(lens, parents)
    plan = plan_stats.build_plan(layout, 128, 132)
    _, _, pairs, _ = plan_stats.masking(plan)
    assert plan["T"] == layout.num_tokens
    assert pairs == int(visibility_mask(layout, None).sum())


def test_main_prints_a_line_per_class(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["plan_stats.py", "--configs", "", "--classes", "tree", "--head-dims", "128"])
    plan_stats.main()
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("D=128 tree: T ") and "steps per item" in out[0]
