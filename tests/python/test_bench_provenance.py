"""bench/provenance.py: a result records the exact commit and refuses (or, when allowed, marks) a
tree that is not a commit; the switches and the library build are recorded."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import provenance  # noqa: E402


def _repo(tmp_path):
    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    git("-c", "user.email=b@x", "-c", "user.name=b", "commit", "-q", "--allow-empty", "-m", "x")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.email=b@x", "-c", "user.name=b", "commit", "-q", "-m", "a")
    (tmp_path / ".gitignore").write_text("build/\n")
    git("add", ".gitignore")
    git("-c", "user.email=b@x", "-c", "user.name=b", "commit", "-q", "-m", "ignore")
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()


def test_clean_and_dirty_trees(tmp_path, monkeypatch):
    monkeypatch.delenv("DUALKV_ALLOW_DIRTY", raising=False)
    monkeypatch.delenv("DUALKV_COMMIT", raising=False)  # the device runs declare theirs, which would take precedence
    head = _repo(tmp_path)
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "libdualkv.so").write_text("ignored")
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "attention.json").write_text("{}")  # a run's own output
    (tmp_path / ".fa4").mkdir()
    (tmp_path / ".fa4" / "flash_attn_4-4.0.0b36-py3-none-any.whl").write_text("")  # carried wheels
    state = provenance.git_state(tmp_path)
    assert state == {"commit": head, "dirty": False, "changes": [], "verified": True} and len(head) == 40
    provenance.check_tree(state, allow_dirty=False)  # clean: no error

    (tmp_path / "a.py").write_text("x = 2\n")  # a tracked change
    (tmp_path / "new_module.py").write_text("")  # an untracked file a run could import
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "CMakeLists.txt").write_text("")
    state = provenance.git_state(tmp_path)
    assert state["dirty"] and sorted(state["changes"]) == [" M a.py", "?? new_module.py", "?? sub/CMakeLists.txt"]
    with pytest.raises(provenance.DirtyTreeError, match="differs from .* M a.py.*--allow-dirty"):
        provenance.check_tree(state, allow_dirty=False)
    provenance.check_tree(state, allow_dirty=True)
    monkeypatch.setenv("DUALKV_ALLOW_DIRTY", "1")
    provenance.check_tree(state, allow_dirty=False)
    rec = provenance.record(state)
    assert rec["commit"] == head + "-dirty" and rec["dirty"] and rec["changes"] == state["changes"]


def test_no_git_needs_a_declared_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("DUALKV_ALLOW_DIRTY", raising=False)
    monkeypatch.delenv("DUALKV_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp_path either
    state = provenance.git_state(tmp_path)
    assert state["commit"] is None and not state["verified"]
    with pytest.raises(provenance.DirtyTreeError, match="no git"):
        provenance.check_tree(state, allow_dirty=False)
    monkeypatch.setenv("DUALKV_COMMIT", "0123456789abcdef0123456789abcdef01234567")
    state = provenance.git_state(tmp_path)
    provenance.check_tree(state, allow_dirty=False)
    rec = provenance.record(state)
    assert rec["commit"] == "0123456789abcdef0123456789abcdef01234567" and rec["commit_verified"] is False


def test_measured_state_checks_gpu_runs_only(monkeypatch):
    """A GPU run is a measurement (a dirty tree is refused); a CPU run is a smoke test (recorded dirty)."""
    monkeypatch.delenv("DUALKV_ALLOW_DIRTY", raising=False)
    dirty = {"commit": "0" * 40, "dirty": True, "changes": [" M a.py"], "verified": True}
    monkeypatch.setattr(provenance, "git_state", lambda: dirty)
    assert provenance.measured_state("cpu", allow_dirty=False) is dirty
    with pytest.raises(provenance.DirtyTreeError, match="M a.py"):
        provenance.measured_state("cuda:0", allow_dirty=False)
    assert provenance.measured_state("cuda", allow_dirty=True) is dirty


def test_record_holds_switches_versions_and_the_library(monkeypatch):
    monkeypatch.setenv("DUALKV_DISABLE_SM90", "1")
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    rec = provenance.record({"commit": "f" * 40, "dirty": False, "changes": [], "verified": True})
    assert rec["switches"]["DUALKV_DISABLE_SM90"] == "1" and rec["switches"]["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"
    assert "UNRELATED_VARIABLE" not in rec["switches"]
    assert rec["commit"] == "f" * 40 and rec["packages"]["torch"] and rec["date"].endswith("+00:00")
    lib = rec["dualkv_library"]
    assert len(lib["sha256"]) == 64 and lib["build"]["abi_version"] == 2 and pathlib.Path(lib["path"]).is_file()
