"""tools/plan_stats.py reads the library's plan on any machine: with a window (--window) its count of
the visible pairs the Hopper backward's steps hold (read through the plan's items and distance
biases) equals the reference mask's, and the scheduler model places every step of every item."""
from __future__ import annotations

import pathlib
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
    plan = plan_stats.build_plan(P, N, R, head_dim, 132, window)
    _, masked, pairs, per_item = plan_stats.masking(plan)
    layout = dualkv.Layout.from_groups([P], [[R] * N])
    assert pairs == int(visibility_mask(layout, window or None).sum())
    assert len(per_item) == len(plan["bwd"]) and sum(per_item) == masked > 0


def test_schedule_places_every_step():
    plan = plan_stats.build_plan(1024, 4, 512, 128, 132, 256)
    H, Hk = 8, 2
    starts, makespan, mean = plan_stats.schedule(plan, H, Hk, 16, 2.0)
    assert len(starts) == len(plan["bwd"]) * Hk
    steps = sum(tiles for _, _, _, tiles, _ in starts) * (H // Hk)
    assert mean * 16 == pytest.approx(steps + 2.0 * len(starts))
    assert mean <= makespan
