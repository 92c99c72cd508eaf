"""bench/results/: INDEX.md is generated from the files and current, every file is a named benchmark,
and every result README.md or docs/benchmarks.md quotes as a claim has a clean commit."""
from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import results_index  # noqa: E402


def test_index_is_current():
    assert results_index.main(["--check"]) == 0, "run python3 bench/results_index.py"


def _cited(text: str) -> set[str]:
    """The result files a text names: `name.json`, names with hyphens (gpt-oss-20b), and brace sets
    (`never_lose_d{64,128}.json` names two files), so no cited file escapes the check."""
    names = set()
    for name in re.findall(r"([\w.{},-]*\w\.json)", text):
        parts = [""]
        for literal, options in re.findall(r"([^{]*)(?:\{([^}]*)\})?", name):
            parts = [p + literal + o for p in parts for o in (options.split(",") if options else [""])]
        names.update(p for p in parts if re.fullmatch(r"[\w.-]+\.json", p))
    return names


def test_cited_expands_brace_sets():
    assert _cited("`classes_h{64,128}_h100.json` and e2e_gpt-oss-20b.json") == {
        "classes_h64_h100.json", "classes_h128_h100.json", "e2e_gpt-oss-20b.json"}


def test_claims_rest_on_clean_results():
    readme = (ROOT / "README.md").read_text()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    claims = _cited(readme) | _cited(docs[:docs.index("## Kept but not claimable")])
    assert {"attention_h128.json", "e2e_1.7b.json", "e2e_8b.json"} <= claims
    for name in sorted(claims):
        path = ROOT / "bench" / "results" / name
        assert path.is_file(), name
        assert results_index.entry(path)["clean"] == "yes", f"{name} is quoted as a claim but its tree was not clean"


def test_rows_of_new_and_old_files(tmp_path, monkeypatch):
    new = {"env": {"commit": "ab" * 20, "dirty": False, "gpu": "NVIDIA H200", "date": "2026-12-02T10:00:00+00:00",
                   "argv": ["attention.py", "--head-dim", "64"]}}
    (tmp_path / "attention_h64.json").write_text(json.dumps(new))
    (tmp_path / "attention_h64.png").write_bytes(b"")
    old = {"environment": {"git_commit": "cd" * 20 + "-dirty", "gpu": "NVIDIA H200", "time": "2026-11-30T01:30:16"},
           "results": []}
    (tmp_path / "e2e_grid_0.6b.json").write_text(json.dumps(old))
    rows = results_index.render(tmp_path).splitlines()[-2:]
    assert rows[0].startswith("| attention_h64: ")
    assert "| " + "ab" * 6 + " | yes | NVIDIA H200 | 2026-12-02T10:00:00 |" in rows[0]
    assert "attention.py --head-dim 64 | attention_h64.png |" in rows[0]
    assert "| " + "cd" * 6 + " | no (dirty tree) |" in rows[1] and "| not recorded |" in rows[1]
    (tmp_path / "attention_full_20261202.json").write_text(json.dumps(new))
    with pytest.raises(ValueError, match="not a benchmark"):
        results_index.render(tmp_path)
