"""GRPO convergence: 30 training steps the standard way and with dualkv give the same curves.

A tiny Qwen3-shaped model (random init, fixed seed) is trained for 30 GRPO steps (2 PPO epochs per
step, AdamW, gradient clipping, DAPO clip-higher) on a synthetic task whose rollouts are a fixed
function of the step (see :mod:`dualkv.convergence`), along runs that differ only in the update
path, advanced in lockstep from the same weights:

* ``truth``   the standard path in higher precision (fp64 for the fp32 runs, fp32 for bf16);
* ``std``     unpacked N x (P+R) rows, stock sdpa, one micro-batch, rows in order (the reference);
* ``std_alt`` the same math summed in another order: eager attention, rows permuted, 3 micro-batches
  with gradient accumulation;
* ``dualkv``  packed groups, ``attn_implementation="dualkv"``, micro-batches from plan_micro_batches;
* ``lr+0.1%`` (CPU only) the standard path with the learning rate 0.1% higher: a small but real
  change of the update that the checks must catch (they are not vacuous).

Checked per step s, for the curves loss (2nd epoch), mean log-prob of the batch, expected reward
(the policy's mean probability of the rewarded token) and gradient norm, with env(x)(s) the running
maximum of x up to step s and tiny a small term relative to max |curve|:

  (a) |dualkv - truth| <= 3 * env(max(|std - truth|, |std_alt - truth|)) + tiny
      dualkv is no farther from the higher-precision run than the stock paths are;
  (b) |dualkv - std|   <= 3 * env(max(|std - std_alt|, |std - truth|)) + tiny
      dualkv is as close to the reference as the noise between the stock runs;

and the final parameters: dualkv's distance to truth <= 3 x the stock paths'. In fp32 also
``|std - dualkv| <= bound * max|std curve|``.

Why a higher-precision run in the floor: the gap between two runs of one precision underestimates
that precision's noise. In bf16 std and std_alt share most of their rounding (same rows, same
GEMMs). In fp32, with std_alt as the only floor, the check failed on the H200 host's CPU (torch 2.11,
16 cores; also with 2 threads) at step 28 of 30: |std - dualkv| 8.0e-7 in expected reward against an
envelope of 9.2e-8 (grad norm 9.8e-4 vs 1.1e-4), while on the CI machine the same check passed with
a worst ratio of ~1 — the one twin happened to stay close to std there. Measured here (2-core AVX2
CPU, torch 2.15, seeds 0-2, 1 and 2 threads): worst ratio to the allowed deviation (a) 0.53, (b)
0.71, against up to 1.03 for the old single-twin check; the lr+0.1% run exceeds the allowance by
67-18,500x.
"""
import time

import pytest
import torch

pytest.importorskip("transformers")

from dualkv.convergence import CURVES, Run, Setup, deviation, noise_envelope, standard_runs, train  # noqa: E402

NOISE_FACTOR = 3.0
#: the "tiny" term of the noise-floor checks in fp32, relative to max |reference curve|: early steps
#: can have a floor of exactly 0 (e.g. the same gradient norm bit for bit) while dualkv differs by
#: one rounding. With the higher-precision floor the measured need is below 1e-6 (ratios above).
TINY_FP32 = 3e-6
#: fp32 bounds on max_s |std - dualkv| / max_s |std curve|. The two paths are the same math, so they
#: differ by summation order only: ~1e-7 in the first step, amplified by 30 optimizer steps (the
#: training is stable, not chaotic, at lr 1e-3: the gap grows ~10x, not exponentially). Measured
#: worst: CI machine (seeds 0-2) loss 1.7e-5, logp 1.2e-6, expected reward 2.9e-6, grad norm 7.0e-5;
#: H200 host (seed 0) loss 3.5e-6, logp 3.1e-6, expected reward 8.2e-6, grad norm 1.9e-4. (At lr 2e-3
#: the setup is chaotic: gaps reach O(1) after ~20 steps for std_alt too, which is why lr is 1e-3.)
#: Bounds: ~3x the worst measurement.
FP32_REL_BOUND = {"loss": 5e-5, "logp": 1e-5, "expected_reward": 3e-5, "grad_norm": 6e-4}
FP32_PARAM_BOUND = 1e-5


def _noise_floor_violations(hist, curve, tiny_rel, test="dualkv", ref="std", floor=(("std", "std_alt"),)):
    """Steps where |ref - test| exceeds NOISE_FACTOR x the noise envelope + tiny_rel * max|ref curve|.
    The envelope is the running maximum of max over the ``floor`` pairs (a, b) of |a - b|."""
    dev = deviation(hist[ref], hist[test], curve)
    per_step = [max(vals) for vals in zip(*(deviation(hist[a], hist[b], curve) for a, b in floor))]
    env = noise_envelope(per_step)
    scale = max(abs(x) for x in hist[ref][curve])
    return [(s, d, e) for s, (d, e) in enumerate(zip(dev, env)) if d > NOISE_FACTOR * e + tiny_rel * scale]


def _violations(hist, curve, tiny_rel, test="dualkv"):
    """Checks (a) and (b) of the module docstring for one curve: {check: [(step, deviation, envelope)]}
    of the steps that fail."""
    return {"(a) vs truth": _noise_floor_violations(hist, curve, tiny_rel, test=test, ref="truth",
                                                    floor=(("truth", "std"), ("truth", "std_alt"))),
            "(b) vs std": _noise_floor_violations(hist, curve, tiny_rel, test=test, ref="std",
                                                  floor=(("std", "std_alt"), ("std", "truth")))}


def _assert_within_noise(hist, curve, tiny_rel, report):
    for check, bad in _violations(hist, curve, tiny_rel).items():
        assert not bad, f"{curve} {check}: (step, deviation, envelope) {bad[:5]}\n{report}"


def _params_within_noise(hist, test, tiny):
    """The final parameter distance to truth of ``test`` is at most 3x the stock paths' (+ tiny)."""
    floor = max(max(hist["std"]["param_rel_diff"]), max(hist["std_alt"]["param_rel_diff"]))
    return hist[test]["param_rel_diff"][-1] <= NOISE_FACTOR * floor + tiny


def _report(hist, title):
    lines = [title]
    for c in CURVES:
        err = {r: max(deviation(hist["truth"], hist[r], c)) for r in ("std", "std_alt", "dualkv")}
        lines.append(f"  {c:<16} max|x - truth|: std {err['std']:.3e} std_alt {err['std_alt']:.3e} dualkv "
                     f"{err['dualkv']:.3e}; max|std-dualkv| {max(deviation(hist['std'], hist['dualkv'], c)):.3e} "
                     f"max|std-std_alt| {max(deviation(hist['std'], hist['std_alt'], c)):.3e} "
                     f"max|std| {max(abs(x) for x in hist['std'][c]):.4g}")
    lines.append("  final params vs truth: " + "  ".join(f"{r} {hist[r]['param_rel_diff'][-1]:.3e}"
                                                        for r in hist if r != "truth"))
    return "\n".join(lines)


@pytest.fixture(scope="module")
def cpu_history():
    torch.manual_seed(0)
    setup = Setup(size="tiny", device="cpu", dtype=torch.float32, steps=30, seed=0)
    runs = standard_runs(setup, dualkv_max_tokens=128)  # dualkv: 2 micro-batches of whole groups
    perturbed = Run(Setup(size="tiny", device="cpu", dtype=torch.float32, steps=30, seed=0, lr=setup.lr * 1.001),
                    "lr+0.1%", "standard")
    t0 = time.perf_counter()
    hist = train(setup, runs + [perturbed])
    seconds = time.perf_counter() - t0
    print(_report(hist, f"\nconvergence, tiny, cpu fp32 (truth fp64), 30 steps: {seconds:.1f} s"))
    return hist


def test_cpu_training_moves(cpu_history):
    """The comparison is about a run that learns: the expected reward rises well above chance, the
    loss and log-prob curves move, PPO clipping engages in the second epoch."""
    h = cpu_history["std"]
    assert len(h["loss"]) == 30
    assert h["expected_reward"][-1] > 5 * h["expected_reward"][0], h["expected_reward"]
    assert max(h["loss"]) - min(h["loss"]) > 0.05, h["loss"]
    assert max(h["clip_frac"]) > 0, h["clip_frac"]
    assert all(torch.isfinite(torch.tensor(h[c])).all() for c in CURVES)


@pytest.mark.parametrize("curve", CURVES)
def test_cpu_dualkv_within_noise_floor(cpu_history, curve):
    _assert_within_noise(cpu_history, curve, TINY_FP32, _report(cpu_history, ""))


@pytest.mark.parametrize("curve", CURVES)
def test_cpu_fp32_curves_agree_tightly(cpu_history, curve):
    dev = max(deviation(cpu_history["std"], cpu_history["dualkv"], curve))
    scale = max(abs(x) for x in cpu_history["std"][curve])
    assert dev <= FP32_REL_BOUND[curve] * scale, (curve, dev, scale)


def test_cpu_fp32_parameters_agree(cpu_history):
    assert cpu_history["dualkv"]["param_rel_diff"][-1] <= FP32_PARAM_BOUND
    assert _params_within_noise(cpu_history, "dualkv", 1e-7), _report(cpu_history, "")


def test_cpu_check_catches_a_small_change(cpu_history):
    """A 0.1% larger learning rate is flagged by the same criteria (the checks are not vacuous)."""
    hist = cpu_history
    flagged = [c for c in CURVES if any(_violations(hist, c, TINY_FP32, test="lr+0.1%").values())]
    assert len(flagged) >= 2, flagged
    assert hist["lr+0.1%"]["param_rel_diff"][-1] > 10 * FP32_PARAM_BOUND
    assert not _params_within_noise(hist, "lr+0.1%", 1e-7)


# ----------------------------------------------------------------------------------------------
# bf16: the same checks (a) and (b) with an fp32 truth. Measured on CPU, tiny, bf16, 30 steps, seeds
# 0 / 1 (before std_alt joined the floor of (a)): worst ratio to the envelope (a) 3.4 / 6.2 at steps
# where the envelope is small (the tiny term needed was at most 1.4e-4 relative), (b) 2.8 / 2.6;
# final parameter distance to fp32: dualkv 3.3e-2 / 3.2e-2, std 3.5e-2 / 3.3e-2. Without the fp32
# run, (b)'s floor alone (|std - std_alt|) needs tiny >= 2.4e-2 for the loss at one step.
# ----------------------------------------------------------------------------------------------

#: bf16: "tiny" term relative to max |curve| (covers the first steps, where the floors are near 0;
#: measured need at most 1.4e-4)
TINY_BF16 = 1e-2


def _bf16_checks(hist, report):
    assert all(torch.isfinite(torch.tensor(hist[r][c])).all() for r in hist for c in CURVES), report
    for curve in CURVES:
        _assert_within_noise(hist, curve, TINY_BF16, report)
    assert _params_within_noise(hist, "dualkv", 1e-3), report


def test_cpu_bf16_convergence_short():
    """The bf16 criteria on the CPU (tiny, 10 steps: bf16 is slow there; the first 10 steps of the
    30-step measurement above)."""
    setup = Setup(size="tiny", device="cpu", dtype=torch.bfloat16, steps=10, seed=0)
    t0 = time.perf_counter()
    hist = train(setup, standard_runs(setup, dualkv_max_tokens=128))
    report = _report(hist, f"\nconvergence, tiny, cpu bf16, 10 steps: {time.perf_counter() - t0:.1f} s")
    print(report)
    assert hist["truth"]["expected_reward"][-1] > 2 * hist["truth"]["expected_reward"][0], report
    _bf16_checks(hist, report)


# GPU: bf16, a larger config (hidden 512, 4 layers, head dim 64, V 8192, 8 groups x 8, P<=256, R<=128),
# 30 steps, the same bf16 criteria. Passed on the H200 (session 3, library of f0046e3).

@pytest.mark.cuda_head_dims(64)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bf16 dualkv kernels)")
def test_gpu_bf16_convergence():
    # lr 1e-4 with a 5-step warm-up: a CPU fp32 check of this model shape (smaller batch) diverged at
    # 3e-4 (loss 4.5 after Adam's first step, reward collapse) and learned stably at 1e-4.
    setup = Setup(size="gpu", device="cuda", dtype=torch.bfloat16, steps=30, seed=0, lr=1e-4, warmup_steps=5)
    t0 = time.perf_counter()
    hist = train(setup, standard_runs(setup, dualkv_max_tokens=4096))
    torch.cuda.synchronize()
    report = _report(hist, f"\nconvergence, gpu size, bf16, 30 steps: {time.perf_counter() - t0:.1f} s")
    print(report)
    assert hist["truth"]["expected_reward"][-1] > 2 * hist["truth"]["expected_reward"][0], report
    _bf16_checks(hist, report)
