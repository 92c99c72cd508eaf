import os
import pathlib
import random
import shutil
import subprocess
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The start of issue 15, whose A/B base it is: C ABI 1, params without the appended blocks.
ABI1_COMMIT = "72977b909db1fb4c3fe88eaf9c898964ff64d2e1"


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


def cpu_time_growth(run, small, large, rounds=3):
    """How many times longer run(large) takes than run(small), in CPU seconds of this process: the
    best of `rounds` interleaved calls each. Both sides are measured in one process at one moment,
    so a slow or busy machine (CI's two shared cores ran a 0.2 s plan in 1.1 s) scales them alike,
    where a bound in seconds fails. Returns (ratio, best small seconds, best large seconds)."""
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for i, arg in enumerate((small, large)):
            t0 = time.process_time()
            run(arg)
            best[i] = min(best[i], time.process_time() - t0)
    return best[1] / max(best[0], 1e-6), best[0], best[1]


@pytest.fixture(autouse=True)
def _seeded_torch():
    """Every test starts from the same torch generator state, so what it draws without a generator
    of its own does not depend on which tests ran before it (CI's order and a single test's run
    then see the same inputs)."""
    torch.manual_seed(0)


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


@pytest.fixture(scope="session")
def abi1_library(tmp_path_factory) -> pathlib.Path:
    """A libdualkv of C ABI 1: $DUALKV_ABI1_LIBRARY, else a CPU-only build of ABI1_COMMIT from this
    repository's history (~5 s on 2 cores). A checkout without git or cmake (the device machine's
    copy) or a history without the commit (a shallow clone, as some CI checkouts are) skips, naming why."""
    if os.environ.get("DUALKV_ABI1_LIBRARY"):
        return pathlib.Path(os.environ["DUALKV_ABI1_LIBRARY"])
    if not (ROOT / ".git").exists() or not shutil.which("git") or not shutil.which("cmake"):
        pytest.skip("an ABI-1 library: no git checkout and cmake here to build it (set DUALKV_ABI1_LIBRARY)")
    if subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", ABI1_COMMIT + "^{commit}"],
                      capture_output=True).returncode:
        pytest.skip(f"the git history lacks {ABI1_COMMIT} (a shallow clone?): fetch it, or set "
                    "DUALKV_ABI1_LIBRARY to an ABI-1 build")
    work = tmp_path_factory.mktemp("abi1")
    src, build = work / "src", work / "build"
    src.mkdir()
    tree = subprocess.run(["git", "-C", str(ROOT), "archive", ABI1_COMMIT], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=tree, check=True)
    for cmd in (["cmake", "-S", str(src), "-B", str(build), "-DDUALKV_CUDA=OFF", "-DDUALKV_BUILD_TESTS=OFF"],
                ["cmake", "--build", str(build), "-j2"]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, f"building the ABI-1 library: {' '.join(cmd)}\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    return build / "libdualkv.so"
