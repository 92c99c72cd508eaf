"""Peak bytes of the tensors a computation creates, on any device (the CPU has no allocator
statistics): a TorchDispatchMode that counts every op output's storage from its creation until it is
freed. Used where ``torch.cuda.max_memory_allocated`` is not available (CPU runs of
bench/prompt_once_e2e.py, tests/python/test_schedule.py's memory comparison).

What it counts: storages created by operators while the mode is active (activations, saved
tensors, gradients, buffers a custom op returns), each once, until freed. What it does not: tensors
that existed before (parameters, and views of them), scratch memory inside an operator that never reaches Python (a
library workspace), allocator caching and fragmentation.
"""
from __future__ import annotations

import weakref
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorBytes(TorchDispatchMode):
    """``with LiveTensorBytes() as m: ...`` then ``m.peak`` (bytes) and ``m.live`` (bytes still held).
    ``m.reset_peak()`` starts a new peak from the bytes live now."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: Dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._sizes:  # a view of a storage already counted
            return
        self._sizes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key)  # storages keep their Python object: fires on free

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or in-place result of an input (a parameter's transpose) is no new memory
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and not t.is_meta}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.untyped_storage().data_ptr() not in inputs:
                self._track(t)
        return out
