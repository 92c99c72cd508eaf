"""Prompt once with the prompt state streamed (issue 17): ``stream_prompt_state=True`` keeps a
prompt phase's keys and values and their gradient sums in host memory and brings them to the
device a layer at a time (dualkv.schedule._StreamedPromptState).

On the CPU the host is the CPU, so the same bookkeeping runs with plain copies: the update
(loss, every log-prob, every parameter gradient) is bitwise the device-resident one in bf16, with
and without gradient checkpointing, with both phase-C modes and both gradient-sum dtypes, for
fitted and split groups mixed and for one response per micro-batch; the copies made are exactly
the ones the prefetch schedule plans (none missed under checkpointing), and the reported memory
splits the state into what is on the device and what is in host memory. On CUDA (``gpu``): bitwise
the device-resident update, and the allocator peaks of phases B and C drop by the kept state.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dualkv  # noqa: E402
from dualkv import schedule  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from test_schedule import (PROMPT_LENS, RESPONSE_LENS, _cuda_reads_external_prefixes,  # noqa: E402
                           checkpointed_qwen3, cuda_qwen3_case, dualkv_update, make_model, rollouts)
from test_transformers_integration import COMMON, VOCAB  # noqa: E402


def assert_bitwise(a, b):
    """Two updates (loss, log-probs, gradients) are bitwise equal."""
    loss_a, lp_a, g_a = a[:3]
    loss_b, lp_b, g_b = b[:3]
    assert loss_a == loss_b, (loss_a, loss_b)
    for xs, ys in zip(lp_a, lp_b):
        for x, y in zip(xs, ys):
            assert torch.equal(x, y)
    assert g_a.keys() == g_b.keys() and len(g_b) >= 10
    for name in g_b:
        assert torch.equal(g_a[name], g_b[name]), name


def on_host(run):
    """An update's (loss, log-probs, gradients, plan) with its tensors in host memory."""
    loss, lps, grads, plan = run
    return loss, [[x.cpu() for x in xs] for xs in lps], {k: g.cpu() for k, g in grads.items()}, plan


class PhaseRecorder:
    """Wraps PromptKV.backward (phase C) for the duration: per prompt phase, PromptKV.memory at the
    end of phase B and the streamed copies (PromptKV.traffic) once phase C is done."""

    def __init__(self, monkeypatch):
        self.memory, self.traffic = [], []
        original = schedule.PromptKV.backward

        def backward(kv):
            self.memory.append(dict(kv.memory))
            original(kv)
            self.traffic.append(dict(kv.traffic) if kv.traffic is not None else None)
        monkeypatch.setattr(schedule.PromptKV, "backward", backward)


def deep_model(kind, layers):
    """test_schedule's bf16 model of ``kind`` with ``layers`` decoder layers (its tiny configs have 2,
    too few to tell a forward's direction from a recompute's)."""
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[kind]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**dict(COMMON, num_hidden_layers=layers), head_dim=8),
                                                          attn_implementation="sdpa")
    model = model.to(torch.bfloat16).train()
    with torch.no_grad():  # random norms, so that every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def kv_sizes(model, rows, dtype, grad_dtype=None):
    """Bytes of one layer's keys + values over ``rows`` prompt rows, and of one layer's gradient sums."""
    cfg = model.config
    elements = 2 * rows * cfg.num_key_value_heads * cfg.head_dim
    size = torch.empty((), dtype=dtype).element_size()
    grad_size = torch.empty((), dtype=grad_dtype).element_size() if grad_dtype is not None else size
    return elements * size, elements * grad_size


@pytest.mark.parametrize("grad_dtype", [None, torch.float32])
@pytest.mark.parametrize("phase_c", ["default", "recompute"])
@pytest.mark.parametrize("checkpointing", [True, False])
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_streamed_equals_device_resident_bitwise(kind, checkpointing, phase_c, grad_dtype, monkeypatch):
    """bf16, fitted groups (1, 3) and split ones (0, 2) in shared micro-batches under a budget of 12:
    the streamed update is bitwise the device-resident one. The streamed state really ran: every
    layer's keys and values went to the host in phase A and its sums at every micro-batch that read
    it, and the copies back are the planned ones (L = 4 layers, n micro-batches reading a phase).
    Under checkpointing a micro-batch reads each layer twice (forward 0..L-1, then the recompute
    L-1..0), every read prefetched: the first micro-batch copies layers 1..L-1 up and L-2..0 down
    (2L - 2), a later one finds layers 0 and 1 still there from the previous backward (2L - 3); the
    sums come back once per layer and later micro-batch and once in phase C, one layer ahead, none
    missed. Without checkpointing a micro-batch reads each layer once, upwards: the first read of a
    later micro-batch (layer 0 after layer L-1) and its backward's first sums (layer L-1's) are the
    misses, one each per micro-batch after the first."""
    model = dkt.enable(deep_model(kind, 4))
    if checkpointing:
        dkt.enable_checkpointing(model)
    prompts, responses, old, adv = rollouts(PROMPT_LENS, RESPONSE_LENS, torch.bfloat16)
    kw = dict(recompute_prompt=phase_c == "recompute", prompt_grad_dtype=grad_dtype)
    resident = dualkv_update(model, prompts, responses, old, adv, 12, stream_prompt_state=False, **kw)
    rec = PhaseRecorder(monkeypatch)
    streamed = dualkv_update(model, prompts, responses, old, adv, 12, stream_prompt_state=True, **kw)
    assert_bitwise(streamed, resident)

    plan = streamed[3]
    assert plan.split_groups == (0, 2)
    assert any(not all(mb.external) and any(mb.external) for mb in plan.ranks[0])  # fitted and split mixed
    phases = plan.prompt_phases[0]
    assert len(rec.traffic) == len(phases) >= 1
    L = model.config.num_hidden_layers
    for phase, traffic, memory in zip(phases, rec.traffic, rec.memory):
        rows = sum(PROMPT_LENS[g] - 1 for g in phase.groups)
        layer_kv, layer_grad = kv_sizes(model, rows, torch.bfloat16, grad_dtype)
        n = sum(1 for i in phase.micro_batches if any(plan.ranks[0][i].external))  # micro-batches reading it
        assert n >= 1
        if checkpointing:
            want = dict(kv_copies=(2 * L - 2) + (n - 1) * (2 * L - 3), kv_missed=0, grad_copies=n * L, grad_missed=0)
        else:
            want = dict(kv_copies=(L - 1) + (n - 1) * L, kv_missed=n - 1, grad_copies=n * L, grad_missed=n - 1)
        assert traffic == dict(want, to_host_bytes=L * layer_kv + n * L * layer_grad,
                               to_device_bytes=want["kv_copies"] * layer_kv + n * L * layer_grad), (traffic, n, L)
        # the end of phase B: all of it in host memory, one layer of keys and values on the device
        assert memory["kv_host"] == L * layer_kv and memory["grad_host"] == L * layer_grad, memory
        assert memory["kv"] <= 2 * layer_kv and memory["grad"] <= layer_grad, memory


def closing_run(model, prompts, responses, stream, device="cpu"):
    """Phase A without gradients, then three micro-batches (the TRL plug-in's schedule): the first reads both
    prompts, the second closes prompt 0 (live) and reads prompt 1, the third closes prompt 1. Returns the
    log-probs, every gradient and the phase's final memory report."""
    from dualkv.integrations._packed_forward import forward_kwargs, install
    install(model)
    model.zero_grad(set_to_none=True)
    det = {dkt.DETERMINISTIC_KWARG: True}  # bitwise comparable on CUDA too (no atomics in the backward)
    with torch.no_grad():
        kv = schedule.run_prompt_phase(model, prompts, deterministic=True, stream_prompt_state=stream)
    lens = list(kv.prefix_lens)
    steps = [  # per micro-batch: (prompt 0's role, prompt 1's role) as (tokens, prefix or -1), responses
        ([(prompts[0][-1:], 0), (prompts[1][-1:], 1)], [responses[0][:2], responses[1][:1]], []),
        ([(prompts[0], -1), (prompts[1][-1:], 1)], [responses[0][2:], responses[1][1:2]], [0]),
        ([(prompts[1], -1)], [responses[1][2:]], [1]),
    ]
    logps = []
    for entries, resp, closes in steps:
        reads = any(e >= 0 for _, e in entries)
        packed = dualkv.pack_groups([t for t, _ in entries], resp,
                                    prompt_prefix=[e for _, e in entries] if reads else None,
                                    prefix_lens=lens if reads else None, prompt_kv=kv)
        if closes:
            with kv.closing(closes, [0]) as probes:  # the closed prompt leads the stream
                out = model(**forward_kwargs(packed), **det)
            root = torch.stack(probes).sum()
        else:
            out, root = model(**forward_kwargs(packed), **det), 0.0
        w = torch.linspace(-1, 1, out.log_probs.numel(), device=device).view_as(out.log_probs)
        ((out.log_probs * w).sum() + root).backward()
        logps.append(out.log_probs.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logps, grads, dict(kv.memory)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_closing_streamed_equals_device_resident_bitwise(checkpointing):
    """PromptKV.closing with the prompt state in host memory: the probes fetch each layer's sums when the
    backward reaches them and take the closed prompt's rows; the gradients and log-probs are bitwise the
    device-resident run's (bf16), and once both prompts are closed nothing of the state is left."""
    prompts, responses, _, _ = rollouts([9, 6], [[3, 4, 2], [2, 5, 1, 3]], torch.bfloat16)
    runs = []
    for stream in (False, True):
        model = dkt.enable(make_model("qwen3", torch.bfloat16))
        if checkpointing:
            dkt.enable_checkpointing(model)
        runs.append(closing_run(model, prompts, responses, stream))
    (lp_a, g_a, mem_a), (lp_b, g_b, mem_b) = runs
    for x, y in zip(lp_a, lp_b):
        assert torch.equal(x, y)
    assert g_a.keys() == g_b.keys() and len(g_b) >= 10
    for name in g_a:
        assert torch.equal(g_a[name], g_b[name]), name
    assert mem_a["kv"] == mem_a["grad"] == 0
    assert mem_b["kv"] == mem_b["grad"] == mem_b["kv_host"] == mem_b["grad_host"] == 0


@pytest.mark.gpu
@pytest.mark.cuda_head_dims(128)
def test_cuda_closing_streamed_equals_device_resident_bitwise():
    """On CUDA (bf16 Qwen3 shape, hidden 1024, 4 layers, 2 KV heads of 128, checkpointing, deterministic
    attention): PromptKV.closing with the state streamed through pinned host memory on the copy streams is
    bitwise the device-resident run (the TRL plug-in's dualkv_stream_prompt_state)."""
    if not _cuda_reads_external_prefixes():
        pytest.skip("this build's CUDA backend does not run external prefix segments")
    prompts, responses, _, _ = rollouts([700, 390], [[64, 128, 32], [96, 16, 200, 48]], torch.bfloat16)
    prompts, responses = [p.cuda() for p in prompts], [[r.cuda() for r in rs] for rs in responses]
    runs = []
    for stream in (False, True):
        model = checkpointed_qwen3("cuda", hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=128, vocab_size=4096,
                                   max_position_embeddings=2048)
        runs.append(closing_run(model, prompts, responses, stream, device="cuda"))
    (lp_a, g_a, _), (lp_b, g_b, mem_b) = runs
    for x, y in zip(lp_a, lp_b):
        assert torch.equal(x, y)
    for name in g_a:
        assert torch.equal(g_a[name], g_b[name]), name
    assert mem_b["kv_host"] == mem_b["grad_host"] == 0


def test_one_response_per_micro_batch_streamed(monkeypatch):
    """Every response alone with the last prompt token (4 micro-batches, uneven lengths), with and
    without checkpointing: bitwise the device-resident update; deterministic mode bitwise run to run."""
    for checkpointing in (True, False):
        model = dkt.enable(make_model("qwen3", torch.bfloat16, seed=3))
        if checkpointing:
            dkt.enable_checkpointing(model)
        prompts, responses, old, adv = rollouts([10], [[5, 4, 5, 3]], torch.bfloat16)
        kw = dict(max_prompt_tokens=9, deterministic=True)
        resident = dualkv_update(model, prompts, responses, old, adv, 6, stream_prompt_state=False, **kw)
        runs = [dualkv_update(model, prompts, responses, old, adv, 6, stream_prompt_state=True, **kw)
                for _ in range(2)]
        assert [mb.num_responses for mb in runs[0][3].ranks[0]] == [1, 1, 1, 1]
        assert_bitwise(runs[0], resident)
        assert_bitwise(runs[1], runs[0])


def test_streamed_phase_without_micro_batches_and_under_no_grad():
    """A phase no micro-batch read: phase C hands zeros to every layer (no sums were made), as the
    device-resident path does; log-probs under no_grad read the streamed keys and values and leave
    no sums."""
    model = dkt.enable(make_model("llama", torch.bfloat16))
    dkt.enable_checkpointing(model)
    prompts, responses, _, _ = rollouts([12, 4], [[5, 6, 3], [2, 2]], torch.bfloat16)
    got = {}
    for stream in (False, True):
        model.zero_grad(set_to_none=True)
        kv = schedule.run_prompt_phase(model, prompts, stream_prompt_state=stream)
        assert kv.stream == stream
        kv.backward()
        got[stream] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert got[True].keys() == got[False].keys() and got[True]
    for name, g in got[False].items():
        assert torch.equal(got[True][name], g), name
    assert kv.traffic["to_device_bytes"] == 0 and kv.traffic["grad_copies"] == 0  # nothing came back

    plan = dualkv.plan_micro_batches([(p.numel(), [r.numel() for r in rs]) for p, rs in zip(prompts, responses)],
                                     12, prompt_once=True)
    rows = {}
    for stream in (False, True):
        with torch.no_grad():
            batches = schedule.micro_batches(model, plan, 0, prompts, responses, stream_prompt_state=stream)
            for i, (mb, packed) in enumerate(batches):
                logp = dkt.packed_logprobs(model, packed)
                assert not logp.requires_grad
                rows[stream, i] = logp
    assert len(rows) == 2 * len(plan.ranks[0]) == 4
    for i in range(len(plan.ranks[0])):
        assert torch.equal(rows[True, i], rows[False, i])


def test_streamed_memory_report_and_default():
    """PromptKV.memory with stream_prompt_state: kv / grad are the bytes on the device (after phase
    A: the first layer only), kv_host / grad_host the state in host memory; after phase C nothing.
    The default streams on CUDA only, when schedule.STREAM_PROMPT_STATE says so: on the CPU never."""
    model = dkt.enable(make_model("qwen3", torch.float32))
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (7, 5)]
    kv = schedule.run_prompt_phase(model, prompts, stream_prompt_state=True)
    layer_kv, _ = kv_sizes(model, 6 + 4, torch.float32)
    L = model.config.num_hidden_layers
    assert kv.memory == {"kv": layer_kv, "grad": 0, "kv_host": L * layer_kv, "grad_host": 0, "device": None,
                         "host": 0}
    assert kv.traffic["to_host_bytes"] == L * layer_kv
    kv.backward()
    assert kv.memory == {"kv": 0, "grad": 0, "kv_host": 0, "grad_host": 0, "device": None, "host": 0}
    for default in (False, True):
        old = schedule.STREAM_PROMPT_STATE
        schedule.STREAM_PROMPT_STATE = default
        try:
            assert schedule._streams(None, torch.device("cpu")) is False
            assert schedule._streams(None, torch.device("cuda")) is default
            assert schedule.run_prompt_phase(model, prompts).stream is False
        finally:
            schedule.STREAM_PROMPT_STATE = old
    assert schedule._streams(True, torch.device("cpu")) is True


def test_prompt_state_factor_streamed():
    """The planner's factor with the streamed state: the keys, values and sums of at most
    _STREAMED_LAYERS layers plus the last hidden state, per prompt token (Qwen3-1.7B in bf16: 28
    layers, 8 KV heads of 128: 3 x 8 KB of keys and values and as much of sums + 4 KB, against
    233.5 KB kept on the device)."""
    from dualkv.demo import qwen3_config
    cfg = qwen3_config("1.7b")
    resident = schedule.prompt_state_factor(cfg, dtype=torch.bfloat16)
    streamed = schedule.prompt_state_factor(cfg, dtype=torch.bfloat16, stream_prompt_state=True)
    token = schedule._token_bytes(cfg, 2)
    assert schedule._STREAMED_LAYERS == 3
    assert streamed * token == pytest.approx(2 * 3 * 8 * 128 * (2 + 2) + 2048 * 2)
    assert resident * token == pytest.approx(2 * 28 * 8 * 128 * (2 + 2) + 2048 * 2)
    assert streamed < resident / 5
    # a model of fewer layers than the cache keeps them all: the same factor as on the device
    tiny = transformers.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16)
    assert schedule.prompt_state_factor(tiny, stream_prompt_state=True) == schedule.prompt_state_factor(tiny)


@pytest.mark.gpu
@pytest.mark.cuda_head_dims(128)
def test_cuda_streamed_prompt_state_bitwise_and_off_the_device():
    """On the H200: bf16 Qwen3 shape (hidden 1024, 16 layers, 2 KV heads of 128), checkpointing on,
    one group of P = 8192 and 8 responses of 256 in 4 response micro-batches (max_tokens 513,
    max_prompt_tokens 8192), deterministic mode. The streamed update is bitwise the device-resident
    one (the streams only move data; the sums are the same in-place adds in the same order).

    Peaks (torch.cuda.max_memory_allocated, absolute): phase B from the end of phase A to the start
    of phase C, phase C from its start to its end. The bound: the device-resident path holds the keys
    and values of all L = 16 layers (kv bytes) through phase B and their gradient buffers (grad bytes)
    from the second micro-batch on, which (the parameter gradients all allocated) holds phase B's
    peak; everything else allocated is the same in both runs at every point. The streamed path has on
    the device at most 2 layers of keys and values (the one read or recomputed and the one
    prefetched) and 2 layers of sums (the one being added into, the one prefetched; a sum whose copy
    to the host is in flight is freed in the allocator's count); so its phase-B peak is lower by at
    least (1 - 2/L)(kv + grad) = 7/8 of it: asserted >= 3/4. Phase C: the device-resident path starts
    it (where its peak is measured from) with the keys and values and the gradient buffers of every
    layer, and holds the buffers of each layer at least until its backward (the keys and values and
    buffers even longer: the last micro-batch's graph, which the caller's loop still references,
    keeps the leaves and their .grad alive), the streamed one holds the sums of at most 3 layers (the
    one handed to the backward, the one prefetched, one fetched early if the engine runs a probe
    before its turn): lower by at least (1 - 3/L) grad, asserted >= 3/4 of grad."""
    if not _cuda_reads_external_prefixes():
        pytest.skip("this build's CUDA backend does not run external prefix segments")
    L, P = 16, 8192
    model, prompts, responses, old, adv = cuda_qwen3_case(L, P, 16384)
    peaks, kept, traffic = {}, {}, {}
    run_phase, backward = schedule.run_prompt_phase, schedule.PromptKV.backward

    def measured(name):
        def phase_a(*args, **kwargs):
            kv = run_phase(*args, **kwargs)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return kv

        def phase_c(self):
            torch.cuda.synchronize()
            peaks[name, "B"] = torch.cuda.max_memory_allocated()
            kept[name] = dict(self.memory)
            torch.cuda.reset_peak_memory_stats()
            backward(self)
            torch.cuda.synchronize()
            peaks[name, "C"] = torch.cuda.max_memory_allocated()
            traffic[name] = self.traffic
        return phase_a, phase_c

    runs = {}
    for name, stream in (("resident", False), ("streamed", True)):
        schedule.run_prompt_phase, schedule.PromptKV.backward = measured(name)
        try:
            # kept on the host: the first run's gradient copies (a model's worth) on the device would
            # count in the second run's peaks (they did: streamed 1.40 GB vs resident 1.24 GB on the H200
            # at 22866ee; 0.93 vs 1.15 GiB without them at eb4b2db)
            runs[name] = on_host(dualkv_update(model, prompts, responses, old, adv, 2 * 256 + 1, max_prompt_tokens=P,
                                               deterministic=True, stream_prompt_state=stream))
        finally:
            schedule.run_prompt_phase, schedule.PromptKV.backward = run_phase, backward
    assert [mb.num_responses for mb in runs["streamed"][3].ranks[0]] == [2, 2, 2, 2]
    assert_bitwise(runs["streamed"], runs["resident"])

    kv_bytes = 2 * L * (P - 1) * 2 * 128 * 2  # (k, v) x layers x rows x kv heads x dim x bf16
    assert kept["resident"]["kv"] == kept["resident"]["grad"] == kv_bytes, kept
    assert kept["streamed"]["kv_host"] == kept["streamed"]["grad_host"] == kv_bytes, kept
    assert traffic["streamed"]["kv_missed"] == traffic["streamed"]["grad_missed"] == 0, traffic
    assert peaks["streamed", "B"] <= peaks["resident", "B"] - 0.75 * 2 * kv_bytes, (peaks, kv_bytes)
    assert peaks["streamed", "C"] <= peaks["resident", "C"] - 0.75 * kv_bytes, (peaks, kv_bytes)


def test_prompt_once_bench_streamed_methods_on_cpu(tmp_path):
    """bench/prompt_once_e2e.py's once_stream and once_resident (tiny fp32 model, one timed update):
    both run, give the same update (bitwise on the CPU), and once_stream's record has the state in
    host memory and the copies of its prompt phase."""
    import json

    from test_demo import _load_bench
    bench = _load_bench("prompt_once_e2e")
    out = tmp_path / "prompt_once_e2e_tiny.json"
    assert bench.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--iters", "1", "--no-controls",
                       "--methods", "split,once,once_stream,once_resident", "--out", str(out)]) == 0
    by = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("once", "once_stream", "once_resident"):
        assert by[name]["status"] == "ok" and by[name]["prompt_phases"] == 1, by[name]
    assert by["once_stream"]["loss"] == by["once_resident"]["loss"]
    assert by["once_stream"]["max_abs_dlogp_vs_split"] == by["once_resident"]["max_abs_dlogp_vs_split"]
    streamed, resident = by["once_stream"]["prompt_kv_memory"], by["once_resident"]["prompt_kv_memory"]
    assert streamed["kv_host"] == resident["kv"] >= streamed["kv"]  # 2 layers: both stay (layers 0 and 1)
    assert streamed["traffic"]["to_host_bytes"] >= streamed["kv_host"] and streamed["traffic"]["kv_copies"] > 0
    assert "kv_host" not in resident and "traffic" not in resident
    assert "once_stream s" in out.with_suffix(".txt").read_text()


def test_streamed_state_leaves_the_device_cpu_emulation(monkeypatch):
    """The GPU test's peak bounds on the CPU: with the streamed state's host buffers made where
    bench/live_bytes.py does not count them (its CUDA configuration emulated: they stand for pinned
    host memory), the tracked bytes of phase B (from the end of phase A to the start of phase C) and
    of phase C drop by at least 3/4 of the kept keys and values plus their gradient sums (phase B) and
    of the sums (phase C): L = 16 layers, of which the streamed state has at most 2 of keys and values
    and 2 of sums alive at once (the bound's derivation is the gpu test's), so 7/8 is the floor. Also
    shows that nothing else keeps a read's buffers alive (autograd, the checkpoint's recompute)."""
    import pathlib
    import sys

    from torch.utils._python_dispatch import _disable_current_modes
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from live_bytes import LiveTensorBytes

    host_pair = schedule._StreamedPromptState._host_pair

    def untracked(self, like):
        with _disable_current_modes():
            return host_pair(self, like)
    monkeypatch.setattr(schedule._StreamedPromptState, "_host_pair", untracked)
    L, P = 16, 256
    model = checkpointed_qwen3(hidden_size=64, intermediate_size=128, num_hidden_layers=L, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=32, vocab_size=VOCAB, max_position_embeddings=1024)
    prompts, responses, old, adv = rollouts([P], [[16] * 8], torch.bfloat16)
    run_phase, backward = schedule.run_prompt_phase, schedule.PromptKV.backward
    peaks = {}
    for stream in (False, True):
        model.zero_grad(set_to_none=True)
        with LiveTensorBytes() as m:
            def phase_a(*args, **kwargs):
                kv = run_phase(*args, **kwargs)
                m.reset_peak()
                return kv

            def phase_c(self):
                peaks[stream, "B"] = m.peak
                m.reset_peak()
                backward(self)
                peaks[stream, "C"] = m.peak
            monkeypatch.setattr(schedule, "run_prompt_phase", phase_a)
            monkeypatch.setattr(schedule.PromptKV, "backward", phase_c)
            out = policy_update_with(model, prompts, responses, old, adv, 2 * 16 + 1, max_prompt_tokens=P,
                                     stream_prompt_state=stream)
        monkeypatch.setattr(schedule, "run_prompt_phase", run_phase)
        monkeypatch.setattr(schedule.PromptKV, "backward", backward)
        assert [mb.num_responses for mb in out["plan"].ranks[0]] == [2, 2, 2, 2]
    kv_bytes = 2 * L * (P - 1) * 2 * 32 * 2  # (k, v) x layers x rows x kv heads x dim x bf16; the sums as many
    assert peaks[True, "B"] <= peaks[False, "B"] - 0.75 * 2 * kv_bytes, (peaks, kv_bytes)
    assert peaks[True, "C"] <= peaks[False, "C"] - 0.75 * kv_bytes, (peaks, kv_bytes)


def policy_update_with(model, prompts, responses, old, adv, max_tokens, **kw):
    from dualkv.grpo import policy_update
    return policy_update(model, prompts, responses, old, adv, max_tokens, clip_high=0.28, **kw)


# ---- under torch.distributed (gloo, 2 spawned ranks, test_distributed_ranks.py's models and data) ----

def case_schedule_sp_streamed(rank, world):
    """Ulysses SP over the 2 ranks: the split group runs its prompt once with each rank's heads'
    keys and values streamed; every rank's gradients are bitwise those of the device-resident run."""
    import torch.distributed as dist
    from test_distributed_ranks import (DP_GROUPS, _mb_loss_inputs, _plan_and_losses, distributed, grads, grpo_loss,
                                        qwen3)
    group = dist.group.WORLD
    prompts, responses, _, old, adv = _plan_and_losses(DP_GROUPS, 40, 1)
    plan = dualkv.plan_micro_batches([(p.numel(), [r.numel() for r in rs]) for p, rs in zip(prompts, responses)], 24,
                                     prompt_once=True)
    assert plan.split_groups == (0,) and len(plan.prompt_phases[0]) == 1
    model = qwen3()
    dkt.enable_checkpointing(model)
    got = {}
    for stream in (False, True):
        model.zero_grad(set_to_none=True)
        for mb, packed in schedule.micro_batches(model, plan, 0, prompts, responses, sp_group=group,
                                                 stream_prompt_state=stream):
            o, a, mask = _mb_loss_inputs(mb.entries, old, adv, packed)
            logp, ent = dkt.packed_logprobs(model, distributed.shard(packed, group), entropy=True)
            (grpo_loss(logp, ent, o, a, mask) * (mb.response_tokens / plan.response_tokens)).backward()
        got[stream] = grads(model)
    for name, g in got[False].items():
        assert torch.equal(got[True][name], g), name


def case_fsdp_dp_schedule_streamed(rank, world):
    """FSDP2 over the 2 ranks (DP 2), checkpointing, policy_update with the split group's prompt once
    on one rank and a placeholder phase on the other, both phase-C modes: the streamed state gives
    bitwise the device-resident gradients."""
    from torch.distributed.device_mesh import init_device_mesh

    from dualkv.grpo import policy_update
    from test_distributed_ranks import DP_GROUPS, _plan_and_losses, fsdp_model, grads, qwen3
    prompts, responses, _, old, adv = _plan_and_losses(DP_GROUPS, 40, world)  # the data (its plan: unused)
    adv = [[float(a) for a in xs] for xs in adv]
    model = qwen3()
    dkt.enable_checkpointing(model)
    model = fsdp_model(model, init_device_mesh("cpu", (world,)))
    for recompute in (True, False):
        got = {}
        for stream in (False, True):
            model.zero_grad(set_to_none=True)
            out = policy_update(model, prompts, responses, old, adv, 24, num_ranks=world, rank=rank, clip_high=0.28,
                                recompute_prompt=recompute, stream_prompt_state=stream)
            phases = out["plan"].prompt_phases[rank]
            assert out["plan"].split_groups == (0,) and len(phases) == 1
            assert len(phases[0].micro_batches) >= 2  # its sums come back once at least
            got[stream] = grads(model)
        for name, g in got[False].items():
            assert torch.equal(got[True][name], g), (recompute, name)


def _distributed_worker(rank, world, init_file, out_dir, cases):
    import datetime
    import faulthandler
    import json
    import os
    import pathlib
    import traceback

    import torch.distributed as dist
    out = pathlib.Path(out_dir)
    fault_log = open(out / f"rank{rank}.fault", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.enable(file=fault_log, all_threads=True)  # a fatal signal leaves every thread's stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for name in cases:
        try:
            globals()[f"case_{name}"](rank, world)
            results[name] = None
        except BaseException:  # noqa: BLE001 - read by the test
            results[name] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    # Both ranks past their last collective before either tears gloo down (a rank that finished
    # first could abort in teardown while the other was still in FSDP's last reduce), then the
    # results say "synced": a rank dying after that is torch's teardown, not a case.
    dist.all_reduce(torch.tensor([sum(v is not None for v in results.values())]))
    (out / f"rank{rank}.json").write_text(json.dumps(dict(results, synced=True)))
    dist.destroy_process_group()
    # Skip the interpreter's finalisation: CI saw a rank end with "terminate called without an
    # active exception" (SIGABRT) after its cases in 2 of ~6 fresh-clone runs (2026-12-02), never in
    # 50 local runs; the cases' verdicts are in the file, and the fault log would show a stack.
    fault_log.flush()
    os._exit(0)


def test_streamed_under_sequence_parallelism_and_fsdp(tmp_path):
    """The two cases above on 2 gloo ranks (spawned): every rank reports each case passed. The
    verdict is the ranks' result files; a rank that died before it wrote its synced results fails
    the test with its fault log (the Python stacks of a fatal signal)."""
    import torch.distributed as dist
    from spawned_ranks import spawn_ranks  # tests/python
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    cases = ["schedule_sp_streamed", "fsdp_dp_schedule_streamed"]
    found, died, timed_out = spawn_ranks(_distributed_worker, 2, tmp_path,
                                         (2, str(tmp_path / "init"), str(tmp_path), cases), 300)
    assert not timed_out, "the ranks did not finish within 300 s"
    problems = []
    for r in range(2):
        fault = tmp_path / f"rank{r}.fault"
        results = found[r] or {}
        if not results.get("synced"):
            problems.append(f"rank {r} ended before its synced results; fault log:\n"
                            f"{fault.read_text() if fault.exists() else '(none)'}")
        problems += [f"rank {r}, {name}:\n{results[name]}" for name in cases if results.get(name) is not None]
    assert not problems, f"{died or 'no rank exited with an error'}\n" + "\n".join(problems)
