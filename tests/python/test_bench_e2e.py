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


def _portable_switches(script_line):
    """What one line of device_run.sh's bash makes of PORTABLE_SWITCHES (the portable path's switches),
    run by bash after the script's own definition of the array, with envs="" as the steps start."""
    text = (ROOT / "tests" / "gpu" / "device_run.sh").read_text()
    definition = re.search(r"^PORTABLE_SWITCHES=\(.*\)$", text, re.M).group(0)
    out = subprocess.run(["bash", "-c", f'{definition}; envs=""; {script_line.strip()}; echo "$sw|$envs"'],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


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
    portable = next(line for line in ab.splitlines() if "portable)" in line)
    sw = _portable_switches(portable.replace("case $path in", 'path=portable; case $path in')).split("|")[0]
    assert sw == "DUALKV_DISABLE_SM90=1 DUALKV_DISABLE_SM90_BWD=1" and "env $sw " in ab
    assert "cat /tmp/fa4/part_aa" in install
    assert "pip install -q --no-index --no-deps --no-compile --target /tmp/site" in install
    assert "tar -xJf /tmp/fa4/cu13.tar.xz -C /tmp/site" in install
    assert "/tmp/site/nvidia_cutlass_dsl/dsl_packages" in install


def test_device_run_ab_check_step():
    """ab-check: tools/ab_libraries.py with $AB_LIBRARY as the base and the package's library as the
    candidate, both modes and every modifier, the portable path's switches on both sides, the main
    kernel profiled per path; each (path, dim) cut inside the call, its log a file."""
    step = _device_run_step("ab-check")
    assert 'tools/ab_libraries.py --base "$AB_LIBRARY" --cand "$DUALKV_LIBRARY"' in step
    assert "--deterministic" in step and '"${AB_MODS:-window,softcap,sinks,prefix}"' in step
    loop = next(line for line in step.splitlines() if "PORTABLE_SWITCHES" in line)
    envs = _portable_switches(loop).split("|")[1].split()
    for side in ("base", "cand"):
        switches = [envs[i + 1] for i in range(0, len(envs), 2) if envs[i] == f"--{side}-env"]
        assert switches == ["DUALKV_DISABLE_SM90=1", "DUALKV_DISABLE_SM90_BWD=1"], envs
    assert "$envs" in step
    assert "kern=bwd_kv_kernel" in step and "kern=bwd_sm90_kernel" in step
    assert '> "$OUT/ab_check_${path}_d$d.log"' in step and 'timeout -k 10 "${AB_TIMEOUT:-200}"' in step
    assert '--rounds "${AB_ROUNDS:-3}" ${AB_AA:+--aa}' in step  # a 1-3% change: 7 rounds beside an A/A copy


def test_gpu_sampler_parses_nvidia_smi(tmp_path, monkeypatch):
    """--sample-clocks: the sampler reads nvidia-smi's csv lines (skipping '[N/A]' ones) into medians;
    without nvidia-smi, or on a CPU device, it records nothing and summary() is None."""
    import torch
    telemetry = _load_bench("telemetry")
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1980, 650.5, 60\\n1700, 700.0, 66\\n[N/A], [N/A], [N/A]\\n1830, 690.0, 63\\n'\n"
                    "sleep 30\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    sampler = telemetry.GpuSampler(torch.device("cuda", 0))
    assert sampler._gpu_id() == "3"
    with sampler:
        deadline = time.time() + 10
        while len(sampler.samples) < 3 and time.time() < deadline:
            time.sleep(0.05)
    assert sampler.summary() == {"samples": 3, "sm_clock_mhz_median": 1830.0, "sm_clock_mhz_min": 1700.0,
                                 "power_w_median": 690.0, "temperature_c_max": 66.0}
    with telemetry.GpuSampler(torch.device("cpu")) as cpu_sampler:
        pass
    assert cpu_sampler.summary() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with telemetry.GpuSampler(torch.device("cuda", 0)) as no_smi:
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
    assert flex["dualkv_speedup_interleaved"] == pytest.approx(
        flex["seconds_interleaved"] / dualkv["seconds_interleaved"])
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


# ---- issue 16's models (gpt-oss-20b, Gemma-4-31B shapes) on their tiny CPU shapes ----

MODS = ["--device", "cpu", "--tiny", "--dtype", "bfloat16", "--micro-batches", "2", "--iters", "1",
        "--models", "gpt-oss-tiny,gemma-4-tiny"]


def _by(results):
    return {(r["model"], r["method"]): r for r in results}


def test_issue16_models_run_every_method_and_pass_the_tolerance_rule(tmp_path, monkeypatch):
    """Both tiny shapes in bf16: std (gpt-oss on its eager attention, here one row per pass as a
    large model's eager scores need), dualkv, flex_fa4 (no FA4 on a CPU: skipped, flex on Triton's
    path runs in its place); every log-prob within the tolerance rule against the fp32 truth (MoE
    routing replayed for gpt-oss); the depth cut and layer kinds in the JSON and the table."""
    e2e = _load_bench("e2e")
    monkeypatch.setattr(e2e, "EAGER_SCORE_BUDGET_BYTES", 1)
    out = tmp_path / "mods.json"
    assert e2e.main(MODS + ["--methods", "std,dualkv,flex_fa4", "--out", str(out)]) == 0  # ~4 s alone
    data = json.loads(out.read_text())
    res = _by(data["results"])
    for model in ("gpt-oss-tiny", "gemma-4-tiny"):
        assert [r["method"] for r in data["results"] if r["model"] == model] == ["std", "dualkv", "flex_fa4", "flex"]
        assert res[(model, "flex_fa4")]["status"] == "skipped"
        for method in ("std", "dualkv", "flex"):
            r = res[(model, method)]
            assert r["status"] == "ok", r
            assert r["within_tolerance"] is True and r["max_abs_dlogp_vs_truth"] <= r["tolerance_bound"], r
            assert r["layers"] == r["published_layers"] == data["environment"]["models"][model]["layers"]
    assert res[("gpt-oss-tiny", "std")]["std_attention"] == "eager"
    assert res[("gpt-oss-tiny", "std")]["std_rows_per_pass"] == 1
    assert res[("gemma-4-tiny", "std")]["std_attention"] == "sdpa"
    assert res[("gpt-oss-tiny", "dualkv")]["truth_routing"].startswith("replayed")
    assert "truth_routing" not in res[("gemma-4-tiny", "dualkv")]  # dense: nothing to replay
    gpt, gemma = data["environment"]["models"]["gpt-oss-tiny"], data["environment"]["models"]["gemma-4-tiny"]
    assert gpt["depth_cut"] == "all 2 layers" and gpt["experts_implementation"]
    assert [(k["window"], k["head_dim"], k["sinks"]) for k in gpt["layer_kinds"]] == [(8, 16, True), (None, 16, True)]
    assert [(k["window"], k["head_dim"], k["kv_heads"], k["layers"]) for k in gemma["layer_kinds"]] == [
        (8, 16, 2, 2), (None, 32, 1, 1)]
    flex = res[("gemma-4-tiny", "flex")]
    assert [b["backend"] for b in flex["flex_layer_backends"]] == ["TRITON", "TRITON"]
    assert flex["mask_build_s"] > 0 and "compile_s" in flex
    table = out.with_suffix(".txt").read_text()
    assert "model gpt-oss-tiny: random weights, all 2 layers" in table and "sinks" in table
    assert table.count(": PASS") == 6 and "FAIL" not in table and "MoE routing replayed" in table


def test_issue16_depth_cuts_are_stated():
    """The published shapes cut to fit: gpt-oss-20b 16 of 24 layers (alternating sliding / full),
    Gemma-4-31B 18 of 60 (5 sliding : 1 global, the last global); the record says so."""
    import torch
    from transformers import AutoModelForCausalLM
    e2e = _load_bench("e2e")
    for name, layers, types in (("gpt-oss-20b", 16, ["sliding_attention", "full_attention"] * 8),
                                ("gemma-4-31b", 18, (["sliding_attention"] * 5 + ["full_attention"]) * 3)):
        cfg = e2e.mod_model_config(name)
        assert cfg.num_hidden_layers == layers and cfg.layer_types == types
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation=e2e.MOD_MODELS[name]["stock"])
        spec = e2e.MOD_MODELS[name]
        rec = e2e.ModelSpec(name, model, spec["stock"], spec["published_layers"]).record(model)
        assert rec["depth_cut"] == f"depth cut to {layers} of {e2e.MOD_MODELS[name]['published_layers']} layers"
        assert rec["layers"] == layers
    kinds = [(k["window"], k["head_dim"], k["kv_heads"]) for k in rec["layer_kinds"]]
    assert kinds == [(1024, 256, 16), (None, 512, 4)]
    assert 10.0e9 < rec["params"] < 10.5e9 and rec["final_logit_softcapping"] == 30.0


def test_flex_without_the_sinks_fails_the_tolerance_rule(tmp_path, monkeypatch):
    """The rule can fail: Flex with the sinks dropped (apply_sinks a no-op) is out of bounds."""
    e2e = _load_bench("e2e")
    monkeypatch.setattr(e2e, "apply_sinks", lambda out, lse, sinks: out)
    out = tmp_path / "nosinks.json"
    assert e2e.main(MODS[:-1] + ["gpt-oss-tiny", "--methods", "std,flex", "--out", str(out)]) == 0
    flex = _by(json.loads(out.read_text())["results"])[("gpt-oss-tiny", "flex")]
    assert flex["status"] == "ok" and flex["within_tolerance"] is False
    assert "FAIL" in out.with_suffix(".txt").read_text()


def test_dualkv_without_head_dim_512_is_unavailable_not_a_crash(tmp_path, monkeypatch):
    """A library without Gemma-4's global head dim raises its typed UnsupportedError from the first
    attention call at that head dim: dualkv is recorded as unavailable with the library's message,
    the other methods run and the process exits 0. (Simulated: the tiny global layers' head dim 32
    plays 512.)"""
    import dualkv
    from dualkv.integrations import transformers as dkt
    e2e = _load_bench("e2e")
    real = dkt._dualkv_attention

    def without_32(q, k, v, layout, **kw):
        if q.shape[-1] == 32:
            raise dualkv.UnsupportedError("cuda: head_dim 32 is not built for CUDA bfloat16 (built head dims: 64, "
                                          "128, 256; supported: 64, 128, 256, 512 via -DDUALKV_HEAD_DIMS)")
        return real(q, k, v, layout, **kw)
    monkeypatch.setattr(dkt, "_dualkv_attention", without_32)
    out = tmp_path / "d512.json"
    assert e2e.main(MODS[:-1] + ["gemma-4-tiny", "--methods", "std,dualkv,flex", "--out", str(out)]) == 0
    res = _by(json.loads(out.read_text())["results"])
    dkv = res[("gemma-4-tiny", "dualkv")]
    assert dkv["status"] == "unavailable"
    assert dkv["error"].startswith("UnsupportedError: cuda: head_dim 32 is not built")
    assert res[("gemma-4-tiny", "std")]["status"] == res[("gemma-4-tiny", "flex")]["status"] == "ok"
    assert res[("gemma-4-tiny", "flex")]["within_tolerance"] is True
    assert "unavailable" in out.with_suffix(".txt").read_text()


def test_flex_sinks_check_catches_a_backward_without_the_lse_gradient():
    """check_flex_sinks (run before a Flex method on a model with sinks): a Flex whose backward drops
    the returned lse's gradient is Unsupported, naming it; one that keeps it passes, and the check
    can tell the two apart (the lse term is far above the tolerance)."""
    import math
    import types
    import torch
    from transformers import AutoModelForCausalLM
    e2e = _load_bench("e2e")
    cfg = e2e.mod_model_config("gpt-oss-tiny")
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    spec = e2e.ModelSpec("gpt-oss-tiny", model, "eager", 2)

    def fake_flex(keep_lse_grad, lse_base=None):
        def flex(q, k, v, block_mask=None, scale=None, enable_gqa=True, kernel_options=None, return_aux=None,
                 score_mod=None):
            out, lse = e2e._dense_attention_lse(q.float(), k.float(), v.float(), block_mask, scale, None)
            if lse_base is not None:
                lse = lse / math.log(lse_base)
            return out.to(q.dtype), types.SimpleNamespace(lse=lse if keep_lse_grad else lse.detach())
        return flex
    report = e2e.check_flex_sinks(spec, "flex", (256, 128), torch.device("cpu"), flex=fake_flex(True))
    assert len(report) == 2
    for r in report.values():
        assert max(r["dq_rel_err"], r["dk_rel_err"]) <= e2e.SINKS_CHECK_TOLERANCE < r["lse_term_rel"] / 4, r
    with pytest.raises(e2e.Unsupported, match="does not take the gradient of the returned lse"):
        e2e.check_flex_sinks(spec, "flex", (256, 128), torch.device("cpu"), flex=fake_flex(False))
    with pytest.raises(e2e.Unsupported, match="not the natural-log logsumexp"):
        e2e.check_flex_sinks(spec, "flex", (256, 128), torch.device("cpu"), flex=fake_flex(True, lse_base=2))
    assert e2e.check_flex_sinks(spec, "flex", (256, 128), torch.device("cpu")) == {}  # no Flex backward on a CPU


def test_flex_fa4_per_layer_kind_and_unavailable_above_fa4s_head_dims(tmp_path, monkeypatch):
    """With FA4 present (stubbed; the CPU runs the same math densely): gpt-oss's layer kinds (head dim
    16 here, 64 in the real shape) run flex_fa4 on FLASH through the block-size warm-up; Gemma-4's
    (16 and 32 here; 256 and 512 real) with --flex-fa4-max-head-dim 8 have no layer FA4 trains under
    Flex: flex_fa4 is unavailable with the reason, and flex (Triton) runs in its place."""
    e2e = _load_bench("e2e")
    monkeypatch.setattr(e2e, "fa4", lambda: None)
    out = tmp_path / "fa4.json"
    assert e2e.main(MODS[:-1] + ["gpt-oss-tiny", "--methods", "flex_fa4", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())["results"][0]
    assert rec["status"] == "ok" and rec["flash_block_size"] == list(e2e.FLEX_BLOCK["FLASH"])
    assert [b["backend"] for b in rec["flex_layer_backends"]] == ["FLASH", "FLASH"]
    assert e2e.main(MODS[:-1] + ["gemma-4-tiny", "--methods", "std,flex_fa4", "--flex-fa4-max-head-dim", "8",
                                 "--out", str(out)]) == 0
    res = _by(json.loads(out.read_text())["results"])
    fa4_rec = res[("gemma-4-tiny", "flex_fa4")]
    assert fa4_rec["status"] == "unavailable" and "no attention layer of gemma-4-tiny" in fa4_rec["error"]
    assert "head dims [16, 32]" in fa4_rec["error"]
    assert res[("gemma-4-tiny", "flex")]["status"] == "ok"


def test_flex_fa4_head_dim_reason_without_fa4(tmp_path, monkeypatch):
    """Without FA4 installed, a model none of whose layers FA4 trains under Flex still records the
    head-dim reason (the one that holds either way), not the missing install."""
    e2e = _load_bench("e2e")

    def missing():
        raise e2e.Unavailable("skipped: FlashAttention-4 (flash_attn.cute) is not importable (stub)")
    monkeypatch.setattr(e2e, "fa4", missing)
    out = tmp_path / "nofa4.json"
    assert e2e.main(MODS[:-1] + ["gemma-4-tiny", "--methods", "flex_fa4", "--flex-fa4-max-head-dim", "8",
                                 "--no-flex-fallback", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())["results"][0]
    assert rec["status"] == "unavailable" and "no attention layer of gemma-4-tiny" in rec["error"]
    assert "not importable" not in rec["error"]


def test_device_run_e2e_mods_step():
    """tests/gpu/device_run.sh e2e-mods: one bench/e2e.py process per model of $MODS_E2E_MODELS (both
    by default), each cut so that both fit one device call (<= 540 s with the kill grace), the
    per-method timeout a knob, the output in a file (not a pipe), progress lines and the table printed."""
    step = _device_run_step("e2e-mods")
    assert 'for m in ${MODS_E2E_MODELS:-gpt-oss-20b gemma-4-31b}' in step
    assert '--methods "${MODS_E2E_METHODS:-std,dualkv,flex_fa4}"' in step
    assert '--method-timeout "${MODS_E2E_METHOD_TIMEOUT:-120}"' in step
    assert '> "$OUT/e2e_mods_$m.log" 2>&1' in step and 'cat "$OUT/e2e_mods_$m.txt"' in step
    cap = int(re.search(r'timeout -k 10 "\$\{MODS_E2E_CAP:-(\d+)\}"', step).group(1))
    assert 2 * (cap + 10) <= 540
    e2e = _load_bench("e2e")
    for m in ("gpt-oss-20b", "gemma-4-31b"):
        assert m in e2e.MOD_MODELS


def test_router_replay_keeps_the_routers_output_form():
    """RouterTape.replay returns the recorded experts with their softmax weights in the router's own
    form: (logits, weights, indices) as transformers 5.x's GptOssTopKRouter, (dense weights,
    indices) as the 4.5x one; record() collects each call's indices."""
    import torch
    e2e = _load_bench("e2e")

    class NewTopKRouter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.randn(4, 6)), torch.nn.Parameter(torch.randn(4))

        def forward(self, h):
            logits = torch.nn.functional.linear(h, self.weight, self.bias)
            top, idx = logits.topk(2, dim=-1)
            return logits, torch.softmax(top, dim=1), idx

    class OldTopKRouter(NewTopKRouter):
        def forward(self, h):
            logits, top, idx = super().forward(h)
            return torch.zeros_like(logits).scatter_(1, idx, top), idx

    h = torch.randn(5, 6)
    for cls in (NewTopKRouter, OldTopKRouter):
        router = cls()
        tape = e2e.RouterTape(torch.nn.ModuleList([router]))
        with tape.record() as calls:
            free = router(h)
        assert torch.equal(calls[0][0], free[-1])
        forced = torch.tensor([[0, 1]] * 5)
        with tape.replay([forced]):
            out = router(h)
        assert len(out) == len(free) and torch.equal(out[-1], forced)
        weights = out[1] if len(out) == 3 else out[0].gather(1, forced)
        logits = torch.nn.functional.linear(h, router.weight, router.bias)
        assert torch.allclose(weights, torch.softmax(logits[:, :2], dim=1))
        assert "forward" not in router.__dict__  # restored


def test_fp32_truth_mode_restores_the_model_bit_for_bit():
    """After the fp32 truth every parameter and buffer is back, bit for bit and in its own dtype: the
    bf16 weights, and the fp32 RoPE inv_freq buffer that model.to(bfloat16) would have rounded (which
    changed later methods' MoE routing)."""
    import torch
    from transformers import AutoModelForCausalLM
    e2e = _load_bench("e2e")
    model = AutoModelForCausalLM.from_config(e2e.mod_model_config("gpt-oss-tiny"), attn_implementation="eager",
                                             dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in list(model.named_parameters()) + list(model.named_buffers())}
    assert any(v.dtype == torch.float32 for v in before.values())  # the RoPE buffer
    with e2e.fp32_truth_mode(model, "eager"):
        assert all(p.dtype == torch.float32 for p in model.parameters())
    after = dict(list(model.named_parameters()) + list(model.named_buffers()))
    for k, v in before.items():
        assert after[k].dtype == v.dtype and torch.equal(after[k], v), k


def test_device_run_ncu_stalls_step():
    """ncu-stalls: per method, Nsight Compute's per-instruction stall sampling of one warmed-up call
    (tools/kernel_counters.py brackets it: --profile-from-start off) with the clocks left alone, the
    SASS source page exported and summarised; documented in the header."""
    step = _device_run_step("ncu-stalls")
    text = (ROOT / "tests" / "gpu" / "device_run.sh").read_text()
    profile = text[text.index("\nncu_profile() {"):text.index("\n}\n", text.index("\nncu_profile() {"))]
    assert "--profile-from-start off --clock-control none" in profile and "timeout -k 10 240" in profile
    assert "python3 tools/kernel_counters.py --case" in profile and '-f -o "$(ncu_report "$name" "$m")"' in profile
    # The report's path is spelled once (ncu_report) and read back through it (ncu_import).
    assert 'ncu_report() { echo "/tmp/ncu_$1_$2"; }' in text
    assert '"$NCU" -i "$(ncu_report "$name" "$m").ncu-rep" "$@"' in text
    assert 'ncu_profile stalls "$m" --section SourceCounters --section WarpStateStats' in step
    assert "${NCU_METHODS:-dualkv,fa4_dense}" in step
    assert 'ncu_import stalls "$m" --page source --csv --print-source sass' in step
    assert "tests/gpu/ncu_source_summary.py" in step
    units = _device_run_step("ncu-units")
    assert 'ncu_profile units "$m" -c 1 --section SpeedOfLight' in units and 'ncu_import units "$m" --page raw' in units
    assert "#   ncu-stalls " in text and "[ncu-stalls]" in text
    assert (ROOT / "tools" / "kernel_counters.py").exists() and (ROOT / "tests" / "gpu" / "ncu_source_summary.py").exists()
