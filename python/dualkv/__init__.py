"""dualkv: exact shared-prompt attention for RL post-training (GRPO, DAPO).

Pack each group as ``prompt once + N responses`` (:class:`Layout`), run the model over
P + N·R tokens instead of N·(P+R), and use :func:`attention` where the model computes attention.
"""
from ._native import (ArgumentError, CudaError, DualKVError, LayoutError, LibraryNotFoundError,
                      UnsupportedError, VersionError, WorkspaceError, build_info)
from .grpo import group_advantages, policy_loss
from .layout import Layout
from .logprobs import response_logprobs, response_logprobs_from_logits
from .microbatch import MicroBatch, MicroBatchPlan, PromptPhase, plan_micro_batches
from .ops import attention
from .packing import PackedBatch, pack, pack_groups, pack_padded, unpack
from . import schedule  # prompt once across micro-batches

__version__ = "0.1.0"

__all__ = [
    "ArgumentError", "CudaError", "DualKVError", "Layout", "LayoutError", "LibraryNotFoundError",
    "MicroBatch", "MicroBatchPlan", "PackedBatch", "PromptPhase", "UnsupportedError", "VersionError", "WorkspaceError",
    "attention", "build_info", "group_advantages", "policy_loss", "pack", "pack_groups", "pack_padded", "plan_micro_batches",
    "response_logprobs", "response_logprobs_from_logits", "schedule", "unpack", "__version__",
]
