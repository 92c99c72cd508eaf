"""dualkv: exact shared-prompt attention for RL post-training (GRPO, DAPO).

Pack each group as ``prompt once + N responses`` (:class:`Layout`), run the model over
P + N·R tokens instead of N·(P+R), and use :func:`attention` where the model computes attention.
"""
from ._native import (ArgumentError, CudaError, DualKVError, LayoutError, LibraryNotFoundError,
                      UnsupportedError, VersionError, WorkspaceError, build_info)
from .layout import Layout
from .ops import attention

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "CudaError", "DualKVError", "Layout", "LayoutError", "LibraryNotFoundError",
    "UnsupportedError", "VersionError", "WorkspaceError", "attention", "build_info", "__version__",
]
