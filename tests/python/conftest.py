import random

import pytest
import torch


def random_forest(rng: random.Random, roots=2, max_depth=2, max_children=4, max_len=9):
    """Random segment forest in DFS pre-order: (segment_lens, parents)."""
    lens, parents = [], []

    def emit(parent, level):
        me = len(lens)
        parents.append(parent)
        lens.append(1 if rng.random() < 0.15 else rng.randint(1, max_len))
        if level + 1 < max_depth:
            for _ in range(rng.randint(0, max_children)):
                emit(me, level + 1)

    for _ in range(roots):
        emit(-1, 0)
    return lens, parents


@pytest.fixture
def rng():
    return random.Random(1234)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
