"""What every test directory shares: the `cuda_head_dims` marker.

A GPU test that runs a model or case at fixed head dims says so with
``@pytest.mark.cuda_head_dims(128)``; on a library built for other head dims
(``-DDUALKV_HEAD_DIMS=64``, as the device A/B runs build them) it is skipped, naming the missing
dims, instead of failing on the library's UnsupportedError."""
from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda_head_dims(*dims): the head dims the test's CUDA kernels need")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        return  # GPU tests are skipped there anyway (tests/python/conftest.py)
    built = None
    for item in items:
        marker = item.get_closest_marker("cuda_head_dims")
        if marker is None:
            continue
        if built is None:
            from dualkv import _native
            built = {int(d) for d in _native.build_info().get("cuda", {}).get("head_dims", [])}
        missing = sorted(d for d in marker.args if d not in built)
        if missing:
            item.add_marker(pytest.mark.skip(
                reason=f"the library's CUDA kernels lack head dim(s) {missing} (built: {sorted(built)}; -DDUALKV_HEAD_DIMS)"))
