"""bench/e2e.py on a CPU: the summary table without std, the time limits (a hang in FlexAttention's
mask build or in a compiler child process is cut and the run goes on; a section stuck beyond the
soft limit ends the process), and the JSON saved method by method."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("transformers")

from test_demo import ROOT, _env, _load_bench  # noqa: E402

TINY = ["--device", "cpu", "--tiny", "--dtype", "float32", "--micro-batches", "2", "--iters", "1"]


def _rec(method, **kw):
    r = {"model": "tiny", "N": 3, "P": 40, "R": 16, "rho_tokens": 2.1, "method": method, "status": "ok",
         "seconds": 1.0, "tokens_per_s": 1000.0}
    r.update(kw)
    return r


def test_summary_without_std():
    """No std in the run (or std failed): speedup and max|dlogp| print as '-', no TypeError."""
    e2e = _load_bench("e2e")
    table = e2e.summary([
        _rec("flex", seconds=1.2, dualkv_speedup=1.2, mask_build_s=0.01, seconds_excl_mask=1.19,
             dualkv_speedup_excl_mask=1.19, compile_s=15.0),
        _rec("dualkv"),
        _rec("std", status="timeout", error="MethodTimeout: std warm-up exceeded its time limit"),
    ])
    lines = table.splitlines()
    flex, dualkv = lines[2].split(), lines[4].split()
    assert flex[6:10] == ["1.200", "1,000", "-", "1.20x"], table
    assert dualkv[8:9] == ["-"] and dualkv[-2:] == ["-", "-"], table
    assert "dualkv speedup over that 1.19x" in lines[3] and "eager mask build" in lines[3]
    assert "timeout" in lines[5] and "MethodTimeout" in lines[5]


def test_run_without_std_prints_table(tmp_path):
    """--methods flex,dualkv end to end: the table is printed and written next to the JSON; flex's
    record says how much faster dualkv is (with and without the mask builds) and the mask was built
    eagerly (the default)."""
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    assert e2e.main(TINY + ["--configs", "3,40,16", "--methods", "flex,dualkv", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["args"]["flex_mask_compile"] is False
    flex, dualkv = data["results"]
    assert flex["status"] == dualkv["status"] == "ok"
    assert "speedup_vs_std" not in flex and flex["dualkv_speedup"] > 0 and flex["dualkv_speedup_excl_mask"] > 0
    assert flex["max_abs_dlogp_vs_dualkv"] <= 1e-4 and flex["flex_mask_compile"] is False
    table = out.with_suffix(".txt").read_text()
    assert "flex" in table and "dualkv" in table and "mask builds" in table


def test_hung_mask_build_is_cut_and_run_goes_on(tmp_path, monkeypatch):
    """A mask build that never returns (time.sleep, or a child process such as a stuck ptxas) is cut
    at --method-timeout; flex is recorded as a timeout, the next method and the next config run."""
    e2e = _load_bench("e2e")
    children = []

    def hung_build(mb, device, backend):
        if not children:  # first config: a stuck compiler child process
            children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            children[-1].wait()  # what subprocess.run does; the timeout interrupts it
        time.sleep(60)
    monkeypatch.setattr(e2e, "build_block_mask", hung_build)
    out = tmp_path / "e2e.json"
    t0 = time.monotonic()
    rc = e2e.main(TINY + ["--configs", "3,40,16;2,24,8", "--methods", "flex,dualkv", "--method-timeout", "2",
                          "--out", str(out)])
    assert rc == 0 and time.monotonic() - t0 < 40
    res = json.loads(out.read_text())["results"]
    assert [(r["N"], r["method"], r["status"]) for r in res] == [
        (3, "flex", "timeout"), (3, "dualkv", "ok"), (2, "flex", "timeout"), (2, "dualkv", "ok")]
    assert "flex warm-up exceeded" in res[0]["error"]
    assert e2e.TIMED_OUT == ["flex warm-up", "flex warm-up"]
    children[0].kill()
    children[0].wait()


def test_results_saved_before_and_after_each_method(tmp_path, monkeypatch):
    """The JSON on disk names the method in progress (status "running") and holds every finished one,
    so a process killed from outside loses nothing it had finished."""
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    seen = []
    real = e2e.measure

    def spy(method, *a, **kw):
        res = json.loads(out.read_text())["results"]
        seen.append([(r["method"], r["status"]) for r in res])
        return real(method, *a, **kw)
    monkeypatch.setattr(e2e, "measure", spy)
    assert e2e.main(TINY + ["--configs", "3,40,16", "--methods", "std,dualkv", "--out", str(out)]) == 0
    assert seen == [[("std", "running")], [("std", "ok"), ("dualkv", "running")]]
    assert [r["status"] for r in json.loads(out.read_text())["results"]] == ["ok", "ok"]


def test_time_limit_restores_an_outer_alarm():
    """An outer SIGALRM timer (pytest-timeout's) keeps its remaining time after a limited section."""
    e2e = _load_bench("e2e")
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 100)
        with e2e._time_limit(5, "quick section"):
            pass
        remaining = signal.getitimer(signal.ITIMER_REAL)[0]
        assert 90 < remaining <= 100 and not fired
        with pytest.raises(e2e.MethodTimeout):
            with e2e._time_limit(0.2, "slow section"):
                time.sleep(5)
        assert 90 < signal.getitimer(signal.ITIMER_REAL)[0] <= 100
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_method_timeout_is_not_swallowed_by_except_exception():
    """Compiler code catches Exception broadly; MethodTimeout is a BaseException and gets through."""
    e2e = _load_bench("e2e")
    with pytest.raises(e2e.MethodTimeout):
        with e2e._time_limit(0.2, "section"):
            try:
                time.sleep(5)
            except Exception:  # noqa: BLE001  (what a fallback in library code would do)
                pass
            time.sleep(5)


def test_stuck_section_ends_the_process():
    """When the soft timeout cannot interrupt (here SIGALRM is blocked, as if stuck inside C code),
    the hard watchdog prints the stacks and ends the process soon after the grace period."""
    code = textwrap.dedent(f"""
        import importlib.util, signal, sys, time
        sys.path.insert(0, {str(ROOT / 'bench')!r})
        spec = importlib.util.spec_from_file_location("e2e_bench", {str(ROOT / 'bench' / 'e2e.py')!r})
        e2e = importlib.util.module_from_spec(spec); spec.loader.exec_module(e2e)
        e2e.HARD_TIMEOUT_GRACE_S = 1.0
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGALRM}})
        print("start", flush=True)
        with e2e._time_limit(0.5, "stuck"):
            time.sleep(60)
        print("not reached", flush=True)
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "start" in proc.stdout and "not reached" not in proc.stdout
    assert "Timeout" in proc.stderr
    assert time.monotonic() - t0 < 60


def _device_run_step(name):
    """The body of one step of tests/gpu/device_run.sh (up to the next step's label)."""
    text = (ROOT / "tests" / "gpu" / "device_run.sh").read_text()
    body = text[text.index(f"\n    {name}) ") + 1:]
    end = re.search(r"\n    [\w-]+\) |\n    \*\) ", body)
    return body[:end.start()]


def test_device_run_e2e_steps_are_planned():
    """tests/gpu/device_run.sh: e2e-all is issue 23's acceptance (P 8K-16K, >= 4 micro-batches, >= 3
    timed updates, Flex-FA4 last) for one model per call, e2e-grid times >= 3 updates per cell, and
    every process is cut inside one 600 s device call."""
    e2e_all, grid = _device_run_step("e2e-all"), _device_run_step("e2e-grid")
    assert '"${E2E_CONFIGS:-16,8192,1024;8,16384,2048}"' in e2e_all
    assert '--methods "${E2E_METHODS:-std,dualkv,flex_fa4}"' in e2e_all
    assert "--micro-batches 4 --iters 3 --warmup 1" in e2e_all and "timeout -k 10" in e2e_all
    assert "> \"$OUT/e2e_all_$m.log\"" in e2e_all  # a file, not a pipe a stuck child could hold open
    assert "--iters 3" in grid and "flex_fa4" in grid
    text = (ROOT / "tests" / "gpu" / "device_run.sh").read_text()
    caps = [int(c) for c in re.findall(r"timeout(?: -k 10)? \"\$\{\w+:-(\d+)\}\"", text)]
    caps += [int(c) for c in re.findall(r"timeout(?: -k 10)? (\d+) ", text)]
    assert len(caps) >= 10 and max(caps) <= 590, caps


def test_device_run_ab_and_fa4_steps():
    """The A/B step runs both paths at head dims 64/128/256 with 3 interleaved rounds against
    $AB_LIBRARY; fa4-install runs the install lines of ../shared/tools/fa4-wheels.sh."""
    ab, install = _device_run_step("ab"), _device_run_step("fa4-install")
    assert "--ab-library \"$AB_LIBRARY\"" in ab and "--rounds 3" in ab
    assert "${AB_PATHS:-sm90 portable}" in ab and "${AB_DIMS:-64 128 256}" in ab
    assert "DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1" in ab
    assert "cat /tmp/fa4/part_aa" in install
    assert "pip install -q --no-index --no-deps --no-compile --target /tmp/site" in install
    assert "tar -xJf /tmp/fa4/cu13.tar.xz -C /tmp/site" in install
    assert "/tmp/site/nvidia_cutlass_dsl/dsl_packages" in install


def test_gpu_sampler_parses_nvidia_smi(tmp_path, monkeypatch):
    """--sample-clocks: the sampler reads nvidia-smi's csv lines (skipping '[N/A]' ones) into medians;
    without nvidia-smi, or on a CPU device, it records nothing and summary() is None."""
    import torch
    e2e = _load_bench("e2e")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1980, 650.5, 60\\n1700, 700.0, 66\\n[N/A], [N/A], [N/A]\\n1830, 690.0, 63\\n'\n"
                    "sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    sampler = e2e.GpuSampler(torch.device("cuda", 0))
    assert sampler._gpu_id() == "3"
    with sampler:
        deadline = time.time() + 10
        while len(sampler.samples) < 3 and time.time() < deadline:
            time.sleep(0.05)
    assert sampler.summary() == {"samples": 3, "sm_clock_mhz_median": 1830.0, "sm_clock_mhz_min": 1700.0,
                                 "power_w_median": 690.0, "temperature_c_max": 66.0}
    with e2e.GpuSampler(torch.device("cpu")) as cpu_sampler:
        pass
    assert cpu_sampler.summary() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with e2e.GpuSampler(torch.device("cuda", 0)) as no_smi:
        pass
    assert no_smi.summary() is None


def test_interleaved_rounds(tmp_path):
    """--rounds 2: after the per-method blocks, two rounds of one update per method (order rotated);
    each record gets its interleaved times and median, flex the dualkv speedup over them (with and
    without the mask builds), and the table a line per method."""
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    assert e2e.main(TINY + ["--configs", "3,40,16", "--methods", "flex,dualkv", "--rounds", "2",
                            "--out", str(out)]) == 0
    flex, dualkv = json.loads(out.read_text())["results"]
    for r in (flex, dualkv):
        assert len(r["interleaved_times"]) == 2 and r["seconds_interleaved"] > 0, r
    assert flex["dualkv_speedup_interleaved"] == pytest.approx(flex["seconds_interleaved"] / dualkv["seconds_interleaved"])
    assert flex["dualkv_speedup_interleaved_excl_mask"] == pytest.approx(
        (flex["seconds_interleaved"] - flex["mask_build_s"]) / dualkv["seconds_interleaved"])
    assert "dualkv_speedup_interleaved" not in dualkv
    table = out.with_suffix(".txt").read_text()
    assert "flex: interleaved" in table and "dualkv: interleaved" in table and "excluding mask builds" in table


def test_probe_bisects_to_the_largest_micro_batch_that_fits(tmp_path, monkeypatch):
    """--probe-max-mb doubles the groups until a step runs out of memory, then bisects between the
    last count that fitted and the first that failed: with steps failing above 5 groups it tries
    1, 2, 4, 8 (OOM), 6 (OOM), 5 and reports 5, and the OOM of the smallest failing count (6) with
    the allocator's message; any other error stops the probe as probe_error."""
    import torch
    e2e = _load_bench("e2e")
    real = e2e.micro_step
    fits_up_to = {"groups": 5}

    def step(method, model, mb, args, device, scale):
        groups = len(mb.adv) // 3  # N = 3
        if groups > fits_up_to["groups"]:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {groups}.00 GiB. GPU 0 has ...")
        return real(method, model, mb, args, device, scale)
    monkeypatch.setattr(e2e, "micro_step", step)

    def probe(limit):
        out = tmp_path / f"e2e_{limit}.json"
        assert e2e.main(TINY + ["--configs", "3,40,16", "--micro-batches", "1", "--methods", "dualkv",
                                "--probe-max-mb", "--probe-limit", str(limit), "--out", str(out)]) == 0
        return json.loads(out.read_text())["results"][0]
    rec = probe(32)
    assert rec["max_mb_groups"] == 5 and rec["probe_first_fail"] == 6 and rec["probe_limit_reached"] is False
    assert [g for g, _ in rec["probe_tried"]] == [1, 2, 4, 8, 6, 5]
    assert rec["probe_oom"].startswith("6 groups: CUDA out of memory. Tried to allocate 6.00 GiB")
    assert "probe_error" not in rec
    fits_up_to["groups"] = 2  # fails at 4 after 1, 2: bisection tries 3
    rec = probe(32)
    assert rec["max_mb_groups"] == 2 and [g for g, _ in rec["probe_tried"]] == [1, 2, 4, 3]
    fits_up_to["groups"] = 100  # nothing fails up to a limit that is not a power of two
    rec = probe(6)
    assert rec["max_mb_groups"] == 6 and rec["probe_limit_reached"]
    assert [g for g, _ in rec["probe_tried"]] == [1, 2, 4, 6]

    def broken(method, model, mb, args, device, scale):  # the timed updates (1 group) run; 2 groups fail
        if len(mb.adv) > 3:
            raise RuntimeError("no kernel for this shape")
        return real(method, model, mb, args, device, scale)
    monkeypatch.setattr(e2e, "micro_step", broken)
    rec = probe(8)
    assert rec["max_mb_groups"] == 1 and rec["probe_error"].startswith("RuntimeError: no kernel")
    assert rec["probe_limit_reached"] is False and rec["probe_tried"] == [[1, "ok"], [2, "error"]]

def test_tiny_time_limits_leave_nothing_armed():
    """Regression (flaky `make test`): an alarm that fires while _time_limit is still arming itself
    must not skip the clean-up. Hundreds of sections with limits from 1 us to 2 ms (so the alarm lands
    in every step of the set-up) each end in MethodTimeout or normally, with the SIGALRM handler
    restored and no timer left; and the process outlives the hard watchdog's grace period, i.e. no
    watchdog was left armed (it would end the process with exit code 1)."""
    code = textwrap.dedent(f"""
        import importlib.util, signal, sys, time
        sys.path.insert(0, {str(ROOT / 'bench')!r})
        spec = importlib.util.spec_from_file_location("e2e_bench", {str(ROOT / 'bench' / 'e2e.py')!r})
        e2e = importlib.util.module_from_spec(spec); spec.loader.exec_module(e2e)
        e2e.HARD_TIMEOUT_GRACE_S = 0.5
        original = signal.getsignal(signal.SIGALRM)
        timeouts = 0
        for i in range(400):
            limit = 1e-6 * (1 + i % 40) ** 2  # 1 us .. 1.6 ms
            try:
                with e2e._time_limit(limit, "tiny"):
                    time.sleep(0.003)
            except e2e.MethodTimeout:
                timeouts += 1
            assert signal.getsignal(signal.SIGALRM) is original, i
            assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), i
        time.sleep(2.0)  # four grace periods: a watchdog left armed would have ended the process
        print("survived", timeouts, flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("survived") and int(proc.stdout.split()[1]) > 300, proc.stdout


def test_fa4_methods_are_skipped_without_fa4_and_the_protocol_is_recorded(tmp_path):
    """Without FlashAttention-4 (any CPU machine) fa4_dense and flex_fa4 are recorded as skipped with
    the reason and the run succeeds; the default method list on a CPU leaves them out. Every result
    states the protocol (optimizer step excluded, std on right-padded rows) and its provenance."""
    e2e = _load_bench("e2e")
    out = tmp_path / "e2e.json"
    assert e2e.main(TINY + ["--configs", "3,40,16", "--methods", "std,fa4_dense,flex_fa4,dualkv",
                            "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    status = {r["method"]: r["status"] for r in data["results"]}
    assert status == {"std": "ok", "fa4_dense": "skipped", "flex_fa4": "skipped", "dualkv": "ok"}
    skipped = next(r for r in data["results"] if r["method"] == "flex_fa4")
    assert "FlashAttention-4" in skipped["error"] and "fa4-install" in skipped["error"]
    assert "optimizer step is excluded" in data["protocol"]["update"] and "right-padded" in data["protocol"]["std"]
    env = data["environment"]
    assert len(env["commit"].removesuffix("-dirty")) == 40 and "switches" in env and "torch" in env["packages"]
    table = out.with_suffix(".txt").read_text()
    assert "optimizer step is excluded" in table and "skipped" in table
    assert e2e.main(TINY + ["--configs", "3,40,16", "--out", str(out)]) == 0
    assert [r["method"] for r in json.loads(out.read_text())["results"]] == ["std", "flex", "dualkv"]


def test_grid_needs_three_timed_updates():
    e2e = _load_bench("e2e")
    with pytest.raises(SystemExit):
        e2e.main(["--device", "cpu", "--tiny", "--grid", "--iters", "2"])
