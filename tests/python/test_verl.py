"""The veRL plug-in (dualkv.integrations.verl) against veRL's own remove_padding path, on CPU.

veRL's FSDP engine cannot be initialised without an accelerator (its platform layer has no CPU
platform and ``initialize`` queries CUDA memory), so the engine object is built around a plain
tiny Qwen3 (fp32) with the attributes its methods read, and veRL's device lookups are pointed at the
CPU. Everything else is veRL's own code: ``DataProto.to_tensordict``, ``left_right_2_no_padding``,
``forward_backward_batch`` with its micro-batching, ``prepare_model_inputs/outputs``, ``ppo_loss``
(clipping active, entropy bonus, KL loss) and the output re-ordering. The stock engine runs the
unpacked rows on sdpa (packed sequences recognised from the position restarts, which is veRL's
remove_padding path on CPU); the dualkv engine runs the same rows packed per uid.
"""
import datetime
import json
import pathlib
import traceback
from functools import partial

import numpy as np
import pytest
import torch

pytest.importorskip("verl")
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.utils import seqlen_balancing  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, FSDPEngineConfig  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl as impl  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding  # noqa: E402

import dualkv  # noqa: E402
from dualkv.demo import MOE_SIZES, build_model, qwen3_config  # noqa: E402
from dualkv.integrations import verl as dkv  # noqa: E402
from spawned_ranks import spawn_ranks  # noqa: E402  (tests/python)

VOCAB = 64
N = 4  # rollout.n


@pytest.fixture(scope="module", autouse=True)
def cpu_process_group(tmp_path_factory):
    """A one-rank gloo group (veRL all-reduces token counts over the data-parallel group)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def cpu_device(monkeypatch):
    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(seqlen_balancing, "get_device_name", lambda: "cpu")


def make_model(attn, size="tiny"):
    torch.manual_seed(0)
    cls = transformers.Qwen3MoeForCausalLM if size in MOE_SIZES else transformers.Qwen3ForCausalLM
    model = cls(qwen3_config(size, vocab_size=VOCAB))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.set_attn_implementation(attn)
    return model.train()


def make_engine(attn, size="tiny", **config):
    """FSDPEngineWithLMHead around a plain module: the attributes forward_backward_batch reads."""
    engine = impl.FSDPEngineWithLMHead.__new__(impl.FSDPEngineWithLMHead)
    engine.module = make_model(attn, size)
    engine.engine_config = FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, **config)
    engine.ulysses_sequence_parallel_size = 1
    engine.use_ulysses_sp = False
    engine.ulysses_device_mesh = None
    engine.pad_to_length = False
    engine._autocast_dtype = torch.float32
    engine.scaler = None
    engine.compute_entropy_from_logits = impl.verl_F.entropy_from_logits
    return engine


def rollout_batch(groups=3, seed=0, uids=None):
    """A veRL rollout batch: `groups` prompts x N responses, left-padded prompts, right-padded responses,
    rows of a group interleaved with other groups (as after veRL's balancing)."""
    g = torch.Generator().manual_seed(seed)
    plens = [int(torch.randint(2, 9, (1,), generator=g)) for _ in range(groups)]
    prompts = [torch.randint(2, VOCAB, (p,), generator=g) for p in plens]
    rows = [(k, int(torch.randint(1, 7, (1,), generator=g))) for k in range(groups) for _ in range(N)]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g).tolist()]
    Lp, Lr = max(plens), max(r for _, r in rows)
    B = len(rows)
    prompt_ids = torch.zeros(B, Lp, dtype=torch.long)
    response_ids = torch.zeros(B, Lr, dtype=torch.long)
    mask = torch.zeros(B, Lp + Lr, dtype=torch.long)
    for b, (k, r) in enumerate(rows):
        prompt_ids[b, Lp - plens[k]:] = prompts[k]
        response_ids[b, :r] = torch.randint(2, VOCAB, (r,), generator=g)
        mask[b, Lp - plens[k]:Lp + r] = 1
    response_mask = mask[:, Lp:].clone()
    batch = {
        "prompts": prompt_ids, "responses": response_ids, "input_ids": torch.cat([prompt_ids, response_ids], 1),
        "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0), "response_mask": response_mask,
        "old_log_probs": -3.0 - torch.rand(B, Lr, generator=g) * response_mask,
        "ref_log_prob": -3.0 - torch.rand(B, Lr, generator=g) * response_mask,
        "advantages": torch.randn(B, 1, generator=g).expand(B, Lr) * response_mask,
    }
    uid = np.array(uids if uids is not None else [f"prompt-{k}" for k, _ in rows], dtype=object)
    return DataProto.from_dict(batch, non_tensors={"uid": uid}, meta_info={"temperature": 0.7})


def engine_batch(proto, max_tokens, mode, use_dynamic_bsz=True):
    """What veRL's trainer and worker hand to the engine (ray_trainer._update_actor / train_batch)."""
    td = left_right_2_no_padding(proto.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, global_batch_size=len(proto), compute_loss=mode == "train",
                         use_remove_padding=True, use_dynamic_bsz=use_dynamic_bsz, max_token_len_per_gpu=max_tokens,
                         micro_batch_size_per_gpu=2, use_fused_kernels=False)
    return td


def actor_config():
    config = FSDPActorConfig(strategy="fsdp2", rollout_n=N, ppo_mini_batch_size=3, use_dynamic_bsz=True,
                             ppo_max_token_len_per_gpu=64, clip_ratio_low=0.2, clip_ratio_high=0.28,
                             entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.05)
    return config


def run(engine, proto, max_tokens, mode, use_dynamic_bsz=True):
    td = engine_batch(proto, max_tokens, mode, use_dynamic_bsz)
    engine.module.zero_grad()
    if mode == "train":
        out = engine.forward_backward_batch(td, loss_function=partial(ppo_loss, config=actor_config()))
        grads = {n: p.grad.clone() for n, p in engine.module.named_parameters()}
        return out, grads, td
    with torch.no_grad():
        out = engine.forward_backward_batch(td, loss_function=None, forward_only=True)
    return out, None, td


def test_log_probs_match_remove_padding():
    proto = rollout_batch()
    stock, _, td = run(make_engine("sdpa"), proto, max_tokens=48, mode="infer")
    packed, _, _ = run(make_engine(dualkv.integrations.transformers.ATTN_IMPLEMENTATION), proto, max_tokens=48,
                       mode="infer")
    for key in ("log_probs", "entropy"):
        a = no_padding_2_padding(stock["model_output"][key], td)
        b = no_padding_2_padding(packed["model_output"][key], td)
        mask = proto.batch["response_mask"].bool()
        assert a.shape == b.shape == mask.shape
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)


def test_update_matches_remove_padding():
    proto = rollout_batch(groups=4, seed=1)
    stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=40, mode="train")
    packed, g_packed, _ = run(make_engine("dualkv"), proto, max_tokens=40, mode="train")
    # micro-batches differ (rows vs whole groups); ppo_loss normalises by the global token count, so the summed
    # loss and the accumulated gradient do not depend on the split
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    for name, g in g_stock.items():
        assert float((g_packed[name] - g).norm()) <= 1e-5 * float(g.norm()), name
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss"):  # summed over micro-batches, like the loss
        assert sum(packed["metrics"][key].values) == pytest.approx(sum(stock["metrics"][key].values), rel=1e-5), key
    assert max(stock["metrics"]["actor/pg_clipfrac"].values) > 0  # the clipped branch is covered


def group_sizes(proto):
    """{uid: (prompt length, [response lengths])} of a rollout batch."""
    mask, width = proto.batch["attention_mask"], proto.batch["prompts"].shape[1]
    sizes = {}
    for b, u in enumerate(proto.non_tensor_batch["uid"]):
        sizes.setdefault(u, (int(mask[b, :width].sum()), []))[1].append(int(mask[b, width:].sum()))
    return sizes


def count_forwards(engine):
    """Spies on the engine: the tokens through the embedding (every forward: phase A, micro-batches,
    placeholders) and the uids of every micro-batch veRL's forward_step runs."""
    seen = {"tokens": 0, "micro_batches": []}

    def embedded(module, args):
        seen["tokens"] += args[0].numel()

    engine.module.model.embed_tokens.register_forward_pre_hook(embedded)
    forward_step = engine.forward_step

    def spy(micro_batch, **kwargs):
        seen["micro_batches"].append(set(dkv._uids(micro_batch)))
        return forward_step(micro_batch, **kwargs)

    engine.forward_step = spy
    return seen


def count_prompt_phases(monkeypatch):
    """The prompts (as token lists) of every phase A the plug-in runs."""
    phases = []
    run_prompt_phase = dkv.schedule.run_prompt_phase

    def spy(model, prompts, *args, **kwargs):
        phases.append([p.tolist() for p in prompts])
        return run_prompt_phase(model, prompts, *args, **kwargs)

    monkeypatch.setattr(dkv.schedule, "run_prompt_phase", spy)
    return phases


def prompts_of(proto):
    """{uid: prompt tokens}."""
    ids, mask, width = proto.batch["prompts"], proto.batch["attention_mask"], proto.batch["prompts"].shape[1]
    return {u: ids[b][mask[b, :width].bool()].tolist() for b, u in enumerate(proto.non_tensor_batch["uid"])}


def expected_tokens(proto, micro_batches):
    """Tokens through the model when each micro-batch holding part of a group carries its whole prompt
    (copies) or only its last token (prompt once: the rest ran once, in a prompt phase)."""
    sizes = group_sizes(proto)
    base = sum(p + sum(rs) for p, rs in sizes.values())
    pieces = {u: sum(u in mb for mb in micro_batches) for u in sizes}
    once = base + sum(k - 1 for k in pieces.values())
    copies = base + sum((k - 1) * sizes[u][0] for u, k in pieces.items())
    return once, copies


#: a budget every group of rollout_batch(groups=4, seed=3) exceeds (16-22 packed tokens, prompts of 5-7)
SPLIT_BUDGET = 14


@pytest.mark.parametrize("options", ["", "recompute_prompt=1,prompt_grad_dtype=float32", "0"])
def test_split_groups_update_matches_remove_padding(options, monkeypatch):
    """Every group over the budget: the update on dualkv equals the stock one, and each prompt ran once
    (its last token once more per extra micro-batch); with prompt once off (0), once per piece."""
    monkeypatch.setenv(dkv.PROMPT_ONCE_ENV, options)
    proto = rollout_batch(groups=4, seed=3)
    stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=SPLIT_BUDGET, mode="train")
    engine = make_engine("dualkv")
    seen, phases = count_forwards(engine), count_prompt_phases(monkeypatch)
    packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="train")
    assert all(p + sum(rs) > SPLIT_BUDGET for p, rs in group_sizes(proto).values())
    once, copies = expected_tokens(proto, seen["micro_batches"])
    if options == "0":  # each piece with its prompt (>= 5 tokens): 2+ pieces per group
        assert not phases and seen["tokens"] == copies >= once + 4 * 4
    else:  # each prompt but its last token once, in a phase A (with copies the count would be `copies`);
        # recompute_prompt runs phase A's forward again in phase C
        assert sorted(p[:-1] for phase in phases for p in phase) == sorted(p[:-1] for p in prompts_of(proto).values())
        rerun = sum(p - 1 for p, _ in group_sizes(proto).values()) if "recompute_prompt=1" in options else 0
        assert seen["tokens"] == once + rerun
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    for name, g in g_stock.items():
        assert float((g_packed[name] - g).norm()) <= 1e-5 * float(g.norm()), name
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss"):
        assert sum(packed["metrics"][key].values) == pytest.approx(sum(stock["metrics"][key].values), rel=1e-5), key


def test_split_groups_log_probs_match_remove_padding(monkeypatch):
    """Log-probs and entropies (forward only) with every group split, in veRL's row order; each prompt
    ran once."""
    proto = rollout_batch(groups=4, seed=3)
    stock, _, td = run(make_engine("sdpa"), proto, max_tokens=SPLIT_BUDGET, mode="infer")
    engine = make_engine("dualkv")
    seen, phases = count_forwards(engine), count_prompt_phases(monkeypatch)
    packed, _, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="infer")
    once, _ = expected_tokens(proto, seen["micro_batches"])
    assert sum(len(phase) for phase in phases) == 4 and seen["tokens"] == once
    mask = proto.batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        a = no_padding_2_padding(stock["model_output"][key], td)
        b = no_padding_2_padding(packed["model_output"][key], td)
        torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)


def test_some_groups_split_with_whole_groups_after_the_phases(monkeypatch):
    """A budget two groups exceed and two fit: prompt phases, then micro-batches of whole groups (the
    last backward of the schedule is a whole-group micro-batch's); still the stock update."""
    proto = rollout_batch(groups=4, seed=1)  # 15, 18, 20, 24 packed tokens
    stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=19, mode="train")
    engine = make_engine("dualkv")
    seen, phases = count_forwards(engine), count_prompt_phases(monkeypatch)
    packed, g_packed, _ = run(engine, proto, max_tokens=19, mode="train")
    once, _ = expected_tokens(proto, seen["micro_batches"])
    assert sum(len(phase) for phase in phases) == 2 and seen["tokens"] == once
    assert seen["micro_batches"][-1] <= {"prompt-0", "prompt-3"}  # whole groups run last
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    for name, g in g_stock.items():
        assert float((g_packed[name] - g).norm()) <= 1e-5 * float(g.norm()), name


@pytest.mark.parametrize("mode", ["train", "infer"])
@pytest.mark.parametrize("options", ["", "stream_prompt_state=1,prompt_grad_dtype=float32", "0"])
def test_fixed_size_micro_batches_run_the_prompt_once(mode, options, monkeypatch):
    """use_dynamic_bsz=False: veRL's own loop over its 2-row chunks, which cut every group (rows interleaved).
    A group in several chunks runs its prompt once, closed inside veRL's loop: phase A (without gradients)
    at the first chunk, each chunk but the group's last reads the recorded prompt, the last packs it whole
    (training) and hands it the earlier chunks' gradients; log-probs read it everywhere. The update and
    log-probs equal the stock engine's on the same chunks; with prompt once off (0) each chunk packs a copy."""
    monkeypatch.setenv(dkv.PROMPT_ONCE_ENV, options)
    proto = rollout_batch(groups=4, seed=3)
    stock, g_stock, td = run(make_engine("sdpa"), proto, max_tokens=SPLIT_BUDGET, mode=mode, use_dynamic_bsz=False)
    engine = make_engine("dualkv")
    seen, phases = count_forwards(engine), count_prompt_phases(monkeypatch)
    packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode=mode, use_dynamic_bsz=False)
    assert all(len(mb) <= 2 for mb in seen["micro_batches"]) and len(seen["micro_batches"]) == len(proto) // 2
    once, copies = expected_tokens(proto, seen["micro_batches"])
    if options == "0":
        assert not phases and seen["tokens"] == copies
    else:  # phase A runs each prompt but its last token; a training step's closing chunk runs it again, whole
        split = [u for u in group_sizes(proto) if sum(u in mb for mb in seen["micro_batches"]) > 1]
        assert len(phases) == 1 and len(phases[0]) == len(split) == 4
        closing = sum(group_sizes(proto)[u][0] - 1 for u in split) if mode == "train" else 0
        assert seen["tokens"] == once + closing < copies
    mask = proto.batch["response_mask"].bool()
    if mode == "infer":
        for key in ("log_probs", "entropy"):
            a = no_padding_2_padding(stock["model_output"][key], td)
            b = no_padding_2_padding(packed["model_output"][key], td)
            torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)
    else:
        assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
        for name, g in g_stock.items():
            assert float((g_packed[name] - g).norm()) <= 1e-5 * float(g.norm()), name


def test_fsdp1_runs_the_prompt_once_in_verls_loop(monkeypatch):
    """veRL's FSDP1 strategy (its root forward wraps the model, so the plug-in's own prompt-once loop cannot
    run phase A inside it): with dynamic batch size its micro-batches cut each group over the budget, and the
    cut groups run their prompt once, closed inside veRL's loop (phase A through FSDP1's root forward). The
    update equals the stock engine's."""
    proto = rollout_batch(groups=4, seed=3)
    stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=SPLIT_BUDGET, mode="train")
    engine = _veRL_fsdp1_engine(torch.float32)
    phases = count_prompt_phases(monkeypatch)
    packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="train")
    g_packed = full_grads(engine, g_packed)
    assert len(phases) == 1 and len(phases[0]) == 4
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    assert set(g_packed) == set(g_stock)
    for name, g in g_stock.items():
        assert float((g_packed[name] - g).norm()) <= 1e-5 * float(g.norm()), name


def full_grads(engine, grads):
    """Every parameter's whole gradient by its Hugging Face name, from ``grads`` (test_verl.run's
    ``named_parameters`` gradients of ``engine``). FSDP2: the DTensor gradients gathered. FSDP1 with
    ``use_orig_params=False`` (veRL's default): a unit's one FlatParameter holds its parameters
    flattened and concatenated (``_fqns``, ``_shapes``, ``_numels_with_padding``; names relative to
    the unit) and padded to a multiple of the world, and its gradient is this rank's equal share of
    that; the shares are all-gathered over the FSDP mesh (all ranks) and cut back into the
    parameters (torch's ``summon_full_params(with_grads=True)`` refuses ``use_orig_params=False``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    if not isinstance(engine.module, FSDP):
        return {n: (g.full_tensor() if hasattr(g, "full_tensor") else g) for n, g in grads.items()}
    flat_params = dict(engine.module.named_parameters())
    out = {}
    for name, shard in grads.items():
        flat = flat_params[name]
        whole = shard.new_empty(shard.numel() * dist.get_world_size())
        dist.all_gather_into_tensor(whole, shard.contiguous())
        unit = name.removesuffix("_flat_param").replace("_fsdp_wrapped_module.", "")
        pieces = whole[:sum(flat._numels_with_padding)].split(flat._numels_with_padding)
        params = [p for p, padding in zip(pieces, flat._is_padding_mask) if not padding]
        for fqn, shape, p in zip(flat._fqns, flat._shapes, params, strict=True):
            out[unit + fqn] = p.view(shape)
    return out


def assert_log_probs_match_stock(engine, proto):
    """The forward-only log-probs of ``engine`` (split budget) equal the stock engine's on ``proto``."""
    stock, _, td = run(make_engine("sdpa"), proto, max_tokens=64, mode="infer")
    packed, _, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="infer")
    mask = proto.batch["response_mask"].bool()
    a = no_padding_2_padding(stock["model_output"]["log_probs"], td)
    b = no_padding_2_padding(packed["model_output"]["log_probs"], td)
    torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)


def _veRL_fsdp2_engine(param_dtype, size="tiny", world=1):
    """The dualkv engine around the tiny model (untied embeddings) sharded by veRL's own apply_fsdp2
    over ``world`` ranks (veRL's engine mesh: all of them): the decoder layers, embed_tokens and lm_head
    each a unit of their own, then the root."""
    from verl.utils.fsdp_utils import MixedPrecisionPolicy, apply_fsdp2
    from torch.distributed.device_mesh import init_device_mesh
    engine = make_engine("dualkv", size)
    assert not engine.module.config.tie_word_embeddings
    engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    apply_fsdp2(engine.module, {"mesh": init_device_mesh("cpu", (world,)), "mp_policy": mp, "offload_policy": None,
                                "reshard_after_forward": True}, engine.engine_config)
    assert type(engine.module.lm_head).__name__.startswith("FSDP")  # a unit of its own
    return engine


def _veRL_fsdp1_engine(param_dtype, size="tiny", world=1):
    """The dualkv engine around the tiny model wrapped by veRL's own FSDP1 strategy over ``world``
    ranks: ``FSDPEngine._build_fsdp_module`` with ``strategy="fsdp"`` (torch's FullyShardedDataParallel
    with veRL's wrap policy, each decoder layer a unit (the model's _no_split_modules) and the rest in
    the root's; FULL_SHARD over veRL's 1-D "fsdp" mesh of all ranks (``fsdp_size=-1``);
    ``MixedPrecision(param_dtype, fp32 reduction, fp32 buffers)``; ``use_orig_params=False``: one
    FlatParameter per unit; ``sync_module_states=True``), after gradient checkpointing as veRL's model
    build enables it; ``_autocast_dtype`` is the one the build sets (``param_dtype``).

    One guard of torch's is lifted for the build: with ``sync_module_states=True`` FSDP1 refuses CPU
    parameters before it broadcasts rank 0's (torch 2.15, ``torch/distributed/fsdp/_init_utils.py``,
    ``_check_module_states_for_sync_module_states``: "The module has CPU parameters or buffers when
    `sync_module_states=True`, which requires them to be on GPU"); gloo broadcasts CPU tensors, so
    with the check lifted the broadcast itself runs. Nothing else of FSDP1 refuses the CPU."""
    from types import SimpleNamespace
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import _init_utils as fsdp_init
    names = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    engine = make_engine("dualkv", size)
    engine.engine_config = FSDPEngineConfig(strategy="fsdp", use_torch_compile=False, mixed_precision=dict(
        param_dtype=names[param_dtype], reduce_dtype="fp32", buffer_dtype="fp32"))
    engine.model_config = SimpleNamespace(lora_rank=0, enable_activation_offload=False)  # what the build reads
    engine.device_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=["fsdp"])  # veRL's create_device_mesh
    engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as veRL
    cpu_guard = fsdp_init._check_module_states_for_sync_module_states
    fsdp_init._check_module_states_for_sync_module_states = lambda module_states: None
    try:
        engine.module = engine._build_fsdp_module(engine.module)
    finally:
        fsdp_init._check_module_states_for_sync_module_states = cpu_guard
    units = [m for m in engine.module.modules() if isinstance(m, FSDP)]
    assert units[0] is engine.module and len(units) == 1 + len(engine.module.model.layers), units
    assert engine._autocast_dtype == param_dtype
    return engine


def test_untied_head_in_its_own_fsdp2_unit_bf16():
    """The H200 failure (session 31, torch 2.11): with bf16 parameters and fp32 gradient reduction,
    FSDP's final backward callback reads every unit's gathered parameter, and the head's unit had never
    gathered ('FSDPParam' object has no attribute '_unsharded_param'; torch 2.15 skips that unit, so
    the hook count is what fails there). A split-group update runs, through the head's own forward."""
    engine = _veRL_fsdp2_engine(torch.bfloat16)
    engine._autocast_dtype = torch.bfloat16
    calls = []
    engine.module.lm_head.register_forward_pre_hook(lambda *a: calls.append(1))
    packed, grads, _ = run(engine, rollout_batch(groups=4, seed=3), max_tokens=SPLIT_BUDGET, mode="train")
    assert calls and all(torch.isfinite(torch.as_tensor(x)) for x in packed["loss"])
    g = grads["lm_head.weight"]
    assert float((g.full_tensor() if hasattr(g, "full_tensor") else g).norm()) > 0


def test_untied_head_in_its_own_fsdp2_unit():
    """veRL's apply_fsdp2 wraps lm_head as a unit of its own when the embeddings are untied (Qwen3-8B):
    the plug-in's log-probs run inside the head's own forward call, so that unit's hooks gather its
    weight and reduce its gradient (reading the weight outside it gave the sharded DTensor, and torch
    2.11's final backward callback then failed on the unit that never ran). Update and log-probs equal
    the stock engine's, split groups included."""
    engine = _veRL_fsdp2_engine(torch.float32)
    calls = []
    engine.module.lm_head.register_forward_pre_hook(lambda *a: calls.append(1))
    proto = rollout_batch(groups=4, seed=3)
    stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=64, mode="train")
    packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="train")
    assert calls, "the LM head's own forward (its FSDP2 gather) never ran"
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    for name, g in g_stock.items():
        got = g_packed[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert float((got - g).norm()) <= 1e-5 * float(g.norm()), name
    assert_log_probs_match_stock(engine, proto)


def test_moe_split_groups_match_remove_padding(monkeypatch):
    """The Qwen3-MoE shape class (tiny-moe: Qwen3MoeForCausalLM, 8 experts, 2 per token; issue 24 item 2's
    30b-a3b has the same modules) sharded by veRL's apply_fsdp2: each Qwen3MoeDecoderLayer a unit (the
    model's _no_split_modules), its experts inside it. Every group over the budget: prompt once's update
    (loss, every gradient, the experts' and the router's included) and its log-probs equal the stock
    engine's, each prompt but its last token once in a phase A."""
    from torch.distributed.fsdp import FSDPModule
    engine = _veRL_fsdp2_engine(torch.float32, "tiny-moe")
    assert engine.module.config.model_type == "qwen3_moe"
    units = [type(m).__name__ for m in engine.module.modules() if isinstance(m, FSDPModule)]
    assert units.count("FSDPQwen3MoeDecoderLayer") == 2 and "FSDPQwen3MoeSparseMoeBlock" not in units
    proto = rollout_batch(groups=4, seed=3)
    seen, phases = count_forwards(engine), count_prompt_phases(monkeypatch)
    stock, g_stock, _ = run(make_engine("sdpa", "tiny-moe"), proto, max_tokens=64, mode="train")
    packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="train")
    once, _ = expected_tokens(proto, seen["micro_batches"])
    assert sum(len(phase) for phase in phases) == 4 and seen["tokens"] == once
    assert any("experts" in n for n in g_stock) and any("mlp.gate" in n for n in g_stock)
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    for name, g in g_stock.items():
        got = g_packed[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert float((got - g).norm()) <= 1e-5 * float(g.norm()), name
    stock, _, td = run(make_engine("sdpa", "tiny-moe"), proto, max_tokens=64, mode="infer")
    packed, _, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="infer")
    mask = proto.batch["response_mask"].bool()
    a = no_padding_2_padding(stock["model_output"]["log_probs"], td)
    b = no_padding_2_padding(packed["model_output"]["log_probs"], td)
    torch.testing.assert_close(b[mask], a[mask], rtol=0, atol=1e-5)


def test_prompt_once_options():
    options = dkv.PromptOnceOptions.from_env
    assert options("") == options("1") == dkv.PromptOnceOptions()
    assert not options("off").enabled
    got = options("recompute_prompt=1, offload_prompt_grads=1,stream_prompt_state=auto,prompt_grad_dtype=float32,"
                  "prompt_state_budget=0.5,max_prompt_tokens=4096")
    assert (got.recompute_prompt, got.offload_prompt_grads, got.stream_prompt_state, got.prompt_grad_dtype,
            got.prompt_state_budget, got.max_prompt_tokens) == (True, True, None, torch.float32, 0.5, 4096)
    assert options("prompt_state_budget=1").prompt_state_budget is True
    for bad, match in [("recompute=1", "is not one of"), ("recompute_prompt=yes", "expected 0 or 1"),
                       ("prompt_grad_dtype=bf16", "model or float32"), ("max_prompt_tokens=0", "token count"),
                       ("prompt_state_budget=-1", "factor >= 0"), ("offload_prompt_grads=1", "needs recompute_prompt"),
                       ("recompute_prompt=1,recompute_prompt=0", "twice")]:
        with pytest.raises(dualkv.ArgumentError, match=match):
            options(bad)


def test_bad_prompt_once_options_fail_before_any_forward(monkeypatch):
    monkeypatch.setenv(dkv.PROMPT_ONCE_ENV, "stream_prompt_state=maybe")
    engine = make_engine("dualkv")
    seen = count_forwards(engine)
    with pytest.raises(dualkv.ArgumentError, match="DUALKV_VERL_PROMPT_ONCE"):
        run(engine, rollout_batch(groups=4, seed=3), max_tokens=SPLIT_BUDGET, mode="train")
    assert seen["tokens"] == 0


# ---- two ranks, FSDP2 (gloo, spawned processes) ----

#: a collective that waits longer fails (gloo), and the two ranks are killed after the deadline, so a
#: schedule whose ranks fall out of step fails the test instead of hanging CI
PG_TIMEOUT_S = 60
WORLD_DEADLINE_S = 300
#: rank 1's rollouts per round, under SPLIT_BUDGET (rank 0: rollout_batch(groups=4, seed=3), two prompt
#: phases of 2 and 3 micro-batches, nothing after them). seed 5: one phase of one micro-batch, then a
#: whole group: rank 1 pads its first phase, runs a placeholder phase of 3 placeholder micro-batches,
#: and rank 0 a placeholder after its phases (the last backward). seed 2: one phase of 3 micro-batches
#: (rank 0 pads its first phase of 2): the last backward is the second phase's phase C on both ranks.
RANK1_SEEDS = (5, 2)


def _fsdp2(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as veRL
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _two_rank_case(rank, world):
    """Per round: the stock engine (sdpa, plain module, its gradients averaged over the ranks by hand)
    against the dualkv engine under FSDP2 with veRL's deferred gradient sync, prompt once on each
    rank's own rows; then the log-probs (forward only)."""
    impl.get_device_id = impl.get_device_name = lambda: "cpu"
    seqlen_balancing.get_device_name = lambda: "cpu"
    placeholders = []
    placeholder_step = dkv._placeholder_step

    def spy(*args):
        placeholders.append(1)
        return placeholder_step(*args)

    dkv._placeholder_step = spy
    engine = make_engine("dualkv")
    engine.module = _fsdp2(engine.module, world)
    report = {}
    for seed in RANK1_SEEDS:
        proto = rollout_batch(groups=4, seed=3) if rank == 0 else rollout_batch(groups=2, seed=seed)
        # (the stock engine's own budget: veRL's row micro-batches need as many rows on rank 1 as rank 0 has
        # micro-batches; it does not change the update)
        stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=64, mode="train")
        for g in g_stock.values():
            dist.all_reduce(g)
            g /= world  # FSDP averages the ranks' gradients
        del placeholders[:]
        packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="train")
        report[f"placeholders_{seed}"] = len(placeholders)
        assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
        for name, g in g_stock.items():
            got = g_packed[name].full_tensor()
            assert float((got - g).norm()) <= 1e-5 * float(g.norm()), f"rank 1 seed {seed}: {name}"
        assert_log_probs_match_stock(engine, proto)
    # veRL's own loop over fixed-size chunks (2 rows: every group cut): prompt once closed inside the loop,
    # phase A on both ranks, FSDP2's sync deferred to the last chunk
    proto = rollout_batch(groups=4, seed=3 if rank == 0 else 4)
    stock, g_stock, _ = run(make_engine("sdpa"), proto, max_tokens=64, mode="train", use_dynamic_bsz=False)
    for g in g_stock.values():
        dist.all_reduce(g)
        g /= world
    packed, g_packed, _ = run(engine, proto, max_tokens=SPLIT_BUDGET, mode="train", use_dynamic_bsz=False)
    assert sum(packed["loss"]) == pytest.approx(sum(stock["loss"]), rel=1e-5)
    for name, g in g_stock.items():
        got = g_packed[name].full_tensor()
        assert float((got - g).norm()) <= 1e-5 * float(g.norm()), f"fixed-size chunks: {name}"
    # a bad batch on rank 1 only (its uid "b" spans two prompts): both ranks raise, neither waits in a
    # collective for the other (the deadline would kill them); in the plug-in's loop and in veRL's
    bad = rollout_batch(groups=4, seed=3) if rank == 0 else rollout_batch(uids=["a"] * N + ["b"] * (2 * N))
    for dynamic in (True, False):
        with pytest.raises((ValueError, dualkv.ArgumentError)) as err:
            run(engine, bad, max_tokens=SPLIT_BUDGET, mode="train", use_dynamic_bsz=dynamic)
        report[f"bad_batch_{'dynamic' if dynamic else 'fixed'}"] = f"{type(err.value).__name__}: {err.value}"
    return report


def _two_rank_worker(rank, world, init_file, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    try:
        outcome = {"ok": True, "report": _two_rank_case(rank, world)}
    except BaseException:  # noqa: BLE001 - recorded, read by the test
        outcome = {"ok": False, "error": traceback.format_exc()}
    (pathlib.Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def test_two_ranks_fsdp2_prompt_once(tmp_path):
    """Two data-parallel ranks with different plans (phases, micro-batches per phase, whole groups
    after them), FSDP2 with veRL's deferred gradient sync: each rank runs the same steps (placeholders
    where it has nothing) and the update and the log-probs equal the stock engine's; the same for veRL's
    own loop over fixed-size chunks (prompt once closed inside it); a bad batch on one rank raises on both."""
    if not dist.is_gloo_available():
        pytest.skip("torch.distributed without gloo")
    world = 2
    found, note, _ = spawn_ranks(_two_rank_worker, world, tmp_path, (world, str(tmp_path / "init"), str(tmp_path)),
                              WORLD_DEADLINE_S)
    outcomes = [o if o is not None else {"ok": False, "error": note or "no result"} for o in found]
    assert all(o["ok"] for o in outcomes), "\n".join(f"rank {r}: {o['error']}" for r, o in enumerate(outcomes))
    # seed 5: rank 0 one placeholder (after its phases); rank 1 one in its first phase, three in the second
    assert [o["report"]["placeholders_5"] for o in outcomes] == [1, 4]
    # seed 2: rank 0 one in its first phase (two micro-batches, rank 1's has three); rank 1 a placeholder
    # phase of three
    assert [o["report"]["placeholders_2"] for o in outcomes] == [1, 3]
    for kind in ("dynamic", "fixed"):
        assert "rank(s) [1]" in outcomes[0]["report"][f"bad_batch_{kind}"], outcomes[0]["report"]
        assert "same uid have different prompt tokens" in outcomes[1]["report"][f"bad_batch_{kind}"]


def test_micro_batches_keep_groups_whole():
    proto = rollout_batch(groups=5, seed=2)
    td = engine_batch(proto, max_tokens=30, mode="train")
    tu.assign_non_tensor(td, dualkv=True)  # what forward_backward_batch marks on a dualkv engine's batch
    micro, indices = impl.prepare_micro_batches(data=td, dp_group=dist.group.WORLD)
    uid = list(proto.non_tensor_batch["uid"])
    seen = sorted(r for rows in indices for r in rows)
    assert seen == list(range(len(proto)))
    packed_tokens = []
    for mb, rows in zip(micro, indices):
        groups = {uid[r] for r in rows}
        assert all(sum(uid[r] == u for r in rows) == N for u in groups)  # whole groups
        ids = dkv._pack(mb)
        packed_tokens.append(ids.num_tokens)
    assert max(packed_tokens) <= 30 and len(micro) >= 2


def test_micro_batch_count_is_raised_to_the_other_ranks():
    # another data-parallel rank planned more micro-batches: split the largest ones (a cut group packs twice)
    assert dkv._split_to([[0, 1, 2, 3], [4, 5]], 4) == [[0], [1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="give every rank at least 3 rows"):
        dkv._split_to([[0], [1]], 3)


def test_bad_input_is_refused():
    engine = make_engine("dualkv")
    uids = ["a"] * N + ["b"] * (2 * N)  # group "b" spans two different prompts
    with pytest.raises(ValueError, match="same uid have different prompt tokens"):
        run(engine, rollout_batch(uids=uids), max_tokens=64, mode="infer")
    td = engine_batch(rollout_batch(), 64, "infer")
    tu.assign_non_tensor(td, use_remove_padding=False)
    with pytest.raises(dualkv.UnsupportedError, match="use_remove_padding=True"):
        engine.prepare_model_inputs(td)


def test_example_config_is_valid_verl():
    """examples/verl_grpo.yaml sets only keys veRL 0.9.1 has, and its actor/rollout sections load."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.import_utils import import_external_libs

    examples = pathlib.Path(__file__).resolve().parents[2] / "examples"
    verl_config = pathlib.Path(impl.__file__).resolve().parents[3] / "trainer" / "config"
    with initialize_config_dir(config_dir=str(verl_config), version_base=None):
        stock = compose(config_name="ppo_trainer")
    with initialize_config_dir(config_dir=str(examples), version_base=None):
        cfg = compose(config_name="verl_grpo")
    raw = OmegaConf.to_container(OmegaConf.load(examples / "verl_grpo.yaml"))
    absent = object()

    def leaves(node, path):
        for key, value in node.items():
            if isinstance(value, dict) and key != "override_config":  # override_config is a free-form dict
                yield from leaves(value, path + [key])
            else:
                yield ".".join(path + [key])

    def known(key):  # present in veRL's config (a required "???" value counts)
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(stock, parent, default=absent) if parent else stock
        return node is not absent and name in node.keys()

    unknown = [k for k in leaves({k: v for k, v in raw.items() if k not in ("hydra", "defaults")}, []) if not known(k)]
    assert not unknown
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert actor.use_dynamic_bsz and not actor.shuffle and actor.ulysses_sequence_parallel_size == 1
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz and cfg.actor_rollout_ref.rollout.log_prob_use_dynamic_bsz
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "dualkv"
    import_external_libs(cfg.actor_rollout_ref.model.external_lib)  # what HFModelConfig does in every worker
    assert impl.prepare_micro_batches is dkv._prepare_micro_batches


def test_engine_model_build_names_the_trl_conflict():
    """veRL's engine builds its model through ``apply_monkey_patch``, which imports TRL's
    AutoModelForCausalLMWithValueHead whenever TRL is installed; TRL removed the class (the TRL
    plug-in's pin, 1.16, has none), and the plug-in turns veRL's bare ImportError into one that says
    what to do. With a TRL that still has the class (veRL's own pin) the patch runs as before."""
    assert impl.apply_monkey_patch is dkv._apply_monkey_patch  # what the engine's _build_module calls
    model = build_model(qwen3_config("tiny"), torch.device("cpu"), torch.float32)
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
        has_value_head = True
    except ImportError:
        try:
            from trl import AutoModelForCausalLMWithValueHead  # noqa: F401,F811
            has_value_head = True
        except ImportError:
            has_value_head = False
    if has_value_head:
        impl.apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)
    else:
        with pytest.raises(ImportError, match=r"run veRL in an environment without TRL or with veRL's own pin"):
            impl.apply_monkey_patch(model=model, use_remove_padding=True, ulysses_sp_size=1)
