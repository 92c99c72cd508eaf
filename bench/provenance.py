"""What every result file of bench/ records, so that each number traces to the code that made it.

``record()`` gives the exact commit (40 hex digits) and whether the tree was clean, the command
line, the versions of every package that decides a method's speed (torch, CUDA, cuDNN, triton,
transformers, FlashAttention-4 and its CuTe DSL, flash-linear-attention's fla-core, TRL, veRL), the GPU,
the libdualkv build that ran (path, sha256 of the file, its build info) and every environment
switch that changes behaviour (``DUALKV_DISABLE_SM90``, ``DUALKV_DISABLE_SM90_BWD``,
``DUALKV_CUDA_SPLIT_ROWS``, torch / CUDA / triton settings, ...).

``check_tree()`` (through ``measured_state()`` on a GPU) refuses a measurement from a tree that is
not a commit: tracked changes, or untracked source files that git does not ignore (a new module the
run would import; outputs, wheels and other untracked data do not count). ``--allow-dirty`` (or
``DUALKV_ALLOW_DIRTY=1``) runs it anyway; the result then says ``dirty: true``, lists the changes,
and its commit ends in ``-dirty``. Without git (a copy of the tree), ``DUALKV_COMMIT`` may declare
the commit; the record marks it unverified.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
#: environment variables that change what runs or how fast (prefix match)
SWITCH_PREFIXES = ("DUALKV_", "CUDA_", "CUBLAS", "CUDNN", "NVIDIA_TF32", "PYTORCH_", "TORCH", "TRITON_",
                   "CUTE_DSL", "FLASH_ATTENTION", "OMP_NUM_THREADS", "NCCL_")
#: distributions whose version decides a method's speed (the pip name; absent ones are left out)
PACKAGES = ("torch", "triton", "transformers", "flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-cu13",
            "quack-kernels", "numpy", "fla-core", "trl", "accelerate", "verl", "tensordict")
#: untracked files with these suffixes (or names) make a tree dirty: code the run could load
SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp", ".cmake", ".sh", ".toml")
SOURCE_NAMES = ("CMakeLists.txt", "Makefile")


class DirtyTreeError(RuntimeError):
    """The tree is not a commit (or its commit is unknown) and --allow-dirty was not given."""


def _git(root, *args) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                          timeout=30).stdout


def git_state(root=REPO) -> dict:
    """{"commit": full hash or None, "dirty": bool, "changes": [porcelain lines], "verified": bool}.

    DUALKV_COMMIT, when set, declares the commit and is taken over git (unverified): the device
    machine gets a copy of the working tree whose .git may be an older snapshot of the repository."""
    declared = os.environ.get("DUALKV_COMMIT")
    if declared:
        return {"commit": declared, "dirty": False, "changes": [], "verified": False}
    try:
        commit = _git(root, "rev-parse", "HEAD").strip()
        # mode-only differences (a copy of the tree that lost executable bits) change no code
        lines = _git(root, "-c", "core.fileMode=false", "status", "--porcelain=v1",
                     "--untracked-files=all").splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": True, "changes": [], "verified": False}
    changes = [ln for ln in lines if not ln.startswith("??") or ln.endswith(SOURCE_SUFFIXES)
               or pathlib.PurePath(ln[3:]).name in SOURCE_NAMES]
    return {"commit": commit, "dirty": bool(changes), "changes": changes, "verified": True}


def check_tree(state: dict, allow_dirty: bool) -> None:
    """Raises DirtyTreeError for a dirty or unknown tree unless allowed (then warns on stderr)."""
    allow_dirty = allow_dirty or os.environ.get("DUALKV_ALLOW_DIRTY") == "1"
    if state["commit"] is None:
        problem = "no git here and no DUALKV_COMMIT: the result would belong to no commit"
    elif state["dirty"]:
        shown = "; ".join(state["changes"][:8]) + (" ..." if len(state["changes"]) > 8 else "")
        problem = f"the tree differs from {state['commit'][:12]} ({shown}): the result would belong to no commit"
    else:
        return
    if not allow_dirty:
        raise DirtyTreeError(f"{problem}. Commit first, or pass --allow-dirty (DUALKV_ALLOW_DIRTY=1) to run "
                             "anyway with the result marked dirty.")
    print(f"WARNING: {problem}; running anyway (--allow-dirty), the result is marked dirty", file=sys.stderr,
          flush=True)


def measured_state(device, allow_dirty: bool) -> dict:
    """git_state(), checked by check_tree() when ``device`` is a GPU: a GPU run is a measurement, a
    CPU run a smoke test (its result records dirty: true)."""
    state = git_state()
    if str(device).startswith("cuda"):
        check_tree(state, allow_dirty)
    return state


def switches() -> dict:
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(SWITCH_PREFIXES)}


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def library_record(path) -> dict:
    """A libdualkv file: its path, sha256 and modification time (UTC)."""
    path = pathlib.Path(path).resolve()
    mtime = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.timezone.utc)
    return {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "mtime": mtime.isoformat(timespec="seconds")}


def record(state: dict, device=None) -> dict:
    """The provenance block of a result file (``state`` from git_state(), checked by check_tree())."""
    import torch
    commit = state["commit"] or "unknown"
    rec = {"commit": commit + ("-dirty" if state["dirty"] else ""), "dirty": state["dirty"],
           "commit_verified": state["verified"], "changes": state["changes"][:50],
           "argv": [pathlib.Path(sys.argv[0]).name] + sys.argv[1:],
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(), "packages": package_versions(),
           "torch": torch.__version__, "switches": switches()}
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        rec.update(gpu=props.name, sms=props.multi_processor_count, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    try:
        import dualkv
        lib = dualkv._native.lib()
        rec["dualkv_library"] = dict(library_record(lib._name), build=dualkv._native.build_info())
    except Exception as exc:  # noqa: BLE001  (a pure-PyTorch run still gets its provenance)
        rec["dualkv_library"] = f"unavailable: {exc}"
    return rec
