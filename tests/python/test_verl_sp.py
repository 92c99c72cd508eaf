"""The veRL plug-in under Ulysses sequence parallelism (``ulysses_sequence_parallel_size = 2``), on CPU.

Spawned gloo ranks (tests/python/spawned_ranks.py), a world of 2 (dp 1 x sp 2) and of 4 (dp 2 x sp
2). On every rank the dualkv engine is built as test_verl.py builds it, FSDP2-sharded over all ranks by
veRL's own ``apply_fsdp2`` (gradient checkpointing, veRL's deferred gradient sync), with the
attributes veRL's ``_init_device_mesh`` sets for Ulysses (the ``(dp, sp)`` mesh, the SP group), veRL's
``apply_monkey_patch(ulysses_sp_size=2)`` applied to the model and veRL's global SP group set, as
its train and eval mode contexts do. The ranks of an SP group hold the same rows (veRL's dispatch);
the dp ranks hold different ones (different plans: placeholders). Against the same engine at sp 1 on
one rank (a one-rank data-parallel group, no FSDP) on each dp rank's rows, combined as veRL's global
token mean combines them: the summed loss, every parameter gradient (whole: test_verl.full_grads), the
log-probs and the entropy within ``dualkv.demo.TOLERANCES[float32]``, for whole groups (each SP rank
embedding its half of every micro-batch, every attention layer through ``distributed.attention``), for
split groups with prompt once (phase A sharded over the SP group), with prompt copies and with veRL's
fixed-size micro-batches, for tiny-moe with prompt once, and for the forward-only log-prob pass. The
same for veRL's FSDP1 strategy (``strategy="fsdp"``: torch's FullyShardedDataParallel as veRL's
``_build_fsdp_module`` wraps the model), split groups with a prompt copy per piece (the plug-in runs
no prompt phase under FSDP1), in both worlds. The refusals reach every rank: heads the SP size does
not fit, and ``prompt_state_budget`` under SP.

Each world is one launch (importing torch, transformers and veRL dominates: ~10 s a process); a
collective that hangs times out after PG_TIMEOUT_S and the world is killed after WORLD_DEADLINE_S.
"""
import contextlib
import os

import pytest
import torch

pytest.importorskip("verl")
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from verl.utils import seqlen_balancing  # noqa: E402
from verl.utils.ulysses import set_ulysses_sequence_parallel_group  # noqa: E402
from verl.workers.config import FSDPEngineConfig  # noqa: E402
from verl.workers.engine.fsdp import transformer_impl as impl  # noqa: E402
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

import dualkv  # noqa: E402
from dualkv.demo import TOLERANCES, qwen3_config  # noqa: E402
from dualkv.integrations import verl as dkv  # noqa: E402
from spawned_ranks import CaseWorlds, run_cases  # noqa: E402  (tests/python)
from test_verl import (SPLIT_BUDGET, VOCAB, _veRL_fsdp1_engine, _veRL_fsdp2_engine, full_grads, make_engine,  # noqa: E402
                       rollout_batch, run)

SP = 2
PG_TIMEOUT_S = 60
WORLD_DEADLINE_S = 240
LOGP_TOL, LOSS_TOL, GRAD_TOL = TOLERANCES[torch.float32]
#: per dp rank its rollouts: (groups, seed). dp rank 0: four groups of 16-22 packed tokens, every one
#: over the split budget; dp rank 1: two groups, one phase and a whole group (test_verl's RANK1_SEEDS)
ROLLOUTS = ((4, 3), (2, 5))
#: packed tokens per GPU: whole groups (x sp = 64 per micro-batch), and the split budget
WHOLE_PER_GPU, SPLIT_PER_GPU = 32, SPLIT_BUDGET // SP


# ----------------------------------------------------------------------------------------------
# helpers (run inside the ranks)
# ----------------------------------------------------------------------------------------------

def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sp_engine(size, world, model=None, strategy="fsdp2"):
    """The dualkv engine as veRL builds it for Ulysses on ``world`` ranks: sharded over all of them by
    veRL's ``strategy`` ("fsdp2": ``apply_fsdp2``; "fsdp": its FSDP1 wrap, test_verl._veRL_fsdp1_engine),
    the ``(dp, sp)`` mesh and SP group of ``_init_device_mesh``, veRL's Ulysses monkey patch applied
    (to the Hugging Face model: it patches the model's classes and module, the same before or after
    wrapping). With ``model``: that model, unsharded and unpatched (one the plug-in refuses before
    any forward; veRL's monkey patch asserts on the same heads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from verl.models.transformers import monkey_patch
    if model is None:
        build = {"fsdp2": _veRL_fsdp2_engine, "fsdp": _veRL_fsdp1_engine}[strategy]
        engine = build(torch.float32, size, world)
        # veRL 0.9.1's patch imports TRL's value-head model when TRL is installed (to patch its
        # state_dict), which TRL 1.16 no longer has: that step concerns value heads only, so it is skipped
        monkey_patch.is_trl_available = lambda: False
        monkey_patch.apply_monkey_patch(model=dkv._hf_model(engine.module), ulysses_sp_size=SP,
                                        use_remove_padding=True)
    else:
        engine = make_engine("dualkv", size)
        engine.module = model
    mesh = init_device_mesh("cpu", (world // SP, SP), mesh_dim_names=["dp", "sp"])
    engine.engine_config = FSDPEngineConfig(strategy=strategy, use_torch_compile=False,
                                            ulysses_sequence_parallel_size=SP)
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = SP, True
    engine.ulysses_device_mesh, engine.ulysses_parallel_group = mesh, mesh["sp"].get_group()
    set_ulysses_sequence_parallel_group(engine.ulysses_parallel_group)  # as veRL's train / eval mode contexts
    return engine


def one_rank_engine(size, solo_group):
    """The same engine at sp 1 on one rank: a data-parallel group of this rank alone, no FSDP."""
    engine = make_engine("dualkv", size)
    engine.get_data_parallel_group = lambda: solo_group
    engine.get_data_parallel_size = lambda: 1
    return engine


@contextlib.contextmanager
def spy_prompt_phases():
    """The SP group (None at sp 1) of every phase A the plug-in runs but the placeholder phases (one
    prompt of two 0 tokens: the rollouts draw tokens from 2 up), which a dp rank runs in step with a
    phase of another."""
    phases = []
    run_prompt_phase = dkv.schedule.run_prompt_phase

    def spy(model, prompts, *args, **kwargs):
        if not (len(prompts) == 1 and prompts[0].tolist() == [0, 0]):
            phases.append(kwargs.get("sp_group"))
        return run_prompt_phase(model, prompts, *args, **kwargs)

    dkv.schedule.run_prompt_phase = spy
    try:
        yield phases
    finally:
        dkv.schedule.run_prompt_phase = run_prompt_phase


class Ranks:
    """This rank's place on the (dp, sp) grid, its dp rank's rows and the one-rank reference engine."""

    def __init__(self, rank, world, size="tiny", strategy="fsdp2"):
        self.rank, self.world, self.size = rank, world, size
        self.dp_rank, self.dp = rank // SP, world // SP
        solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
        groups, seed = ROLLOUTS[self.dp_rank]
        self.proto = rollout_batch(groups=groups, seed=seed)
        self.tokens = float(self.proto.batch["response_mask"].sum())  # this dp rank's share of veRL's token mean
        self.reference = one_rank_engine(size, solo)
        self.engine = sp_engine(size, world, strategy=strategy)
        self.dp_group = self.engine.get_data_parallel_group()

    def dp_sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=self.dp_group)
        return x

    def check_update(self, per_gpu: int, what: str, use_dynamic_bsz: bool = True) -> None:
        """One training step on the SP engine against the one-rank engine on each dp rank's rows: the
        global token mean of veRL's loss is sum_d (loss_d x tokens_d) / sum_d tokens_d, and so is its
        gradient (what FSDP's average of the SP engine's gradients must be)."""
        want, g_want, _ = run(self.reference, self.proto, max_tokens=per_gpu * SP, mode="train")
        got, g_got, _ = run(self.engine, self.proto, max_tokens=per_gpu, mode="train", use_dynamic_bsz=use_dynamic_bsz)
        total = self.dp_sum(torch.tensor(self.tokens, dtype=torch.float64))
        want_loss = self.dp_sum(torch.tensor(sum(want["loss"]) * self.tokens, dtype=torch.float64)) / total
        got_loss = self.dp_sum(torch.tensor(sum(got["loss"]), dtype=torch.float64)) / self.dp  # each x dp_size
        assert abs(float(got_loss - want_loss)) <= LOSS_TOL * max(1.0, abs(float(want_loss))), \
            f"{what}: loss {float(got_loss)} vs {float(want_loss)}"
        g_got = full_grads(self.engine, g_got)
        assert set(g_got) == set(g_want), (what, sorted(set(g_got) ^ set(g_want)))
        for name, g in g_want.items():
            g = self.dp_sum(g * self.tokens) / total
            assert rel(g_got[name], g) <= GRAD_TOL, f"{what}: gradient of {name}: {rel(g_got[name], g):.2e}"

    def check_log_probs(self, per_gpu: int, what: str) -> None:
        """The forward-only pass: log-probs and entropy of this dp rank's rows on every SP rank."""
        want, _, td = run(self.reference, self.proto, max_tokens=per_gpu * SP, mode="infer")
        got, _, _ = run(self.engine, self.proto, max_tokens=per_gpu, mode="infer")
        mask = self.proto.batch["response_mask"].bool()
        for key in ("log_probs", "entropy"):
            a = no_padding_2_padding(want["model_output"][key], td)[mask]
            b = no_padding_2_padding(got["model_output"][key], td)[mask]
            err = float((a - b).abs().max())
            assert err <= LOGP_TOL, f"{what}: {key} max |diff| {err:.2e}"


# ----------------------------------------------------------------------------------------------
# the cases: each returns a small report (JSON)
# ----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def embedded_tokens(engine):
    """Spies on the engine's embedding: the tokens of every forward through it."""
    seen = []
    hook = engine.module.model.embed_tokens.register_forward_pre_hook(lambda module, args: seen.append(args[0].numel()))
    try:
        yield seen
    finally:
        hook.remove()


def case_whole_groups(ranks: Ranks):
    """Micro-batches of whole groups (the same plan on both engines): each SP rank embeds its half of
    every micro-batch (padded to a multiple of sp), every attention layer runs dualkv's all-to-all
    path, and veRL's monkey patch left the "dualkv" attention function alone (it replaced
    transformers' _flash_attention_forward, and the equality below holds with veRL's SP group set)."""
    from transformers.integrations import flash_attention
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from verl.models.transformers.monkey_patch import _ulysses_flash_attention_forward
    assert flash_attention._flash_attention_forward is _ulysses_flash_attention_forward  # veRL's patch is on
    assert ALL_ATTENTION_FUNCTIONS["dualkv"] is dualkv.integrations.transformers.dualkv_attention_forward
    sharded_calls = []
    attention = dualkv.distributed.attention
    dualkv.distributed.attention = lambda *a, **k: sharded_calls.append(1) or attention(*a, **k)
    try:
        with embedded_tokens(ranks.engine) as sp_tokens, embedded_tokens(ranks.reference) as one_tokens:
            ranks.check_update(WHOLE_PER_GPU, "whole groups")
    finally:
        dualkv.distributed.attention = attention
    # forwards with gradient checkpointing embed once; each SP forward holds ceil(T / sp) tokens
    assert len(sp_tokens) == len(one_tokens) and sharded_calls, (sp_tokens, one_tokens, len(sharded_calls))
    assert all(s == -(-t // SP) for s, t in zip(sp_tokens, one_tokens)), (sp_tokens, one_tokens)
    ranks.check_log_probs(WHOLE_PER_GPU, "whole groups")
    return {"sp_tokens": sp_tokens, "one_rank_tokens": one_tokens, "sharded_attention_calls": len(sharded_calls)}


def case_prompt_once(ranks: Ranks):
    """Every group of dp rank 0 over the budget (SPLIT_BUDGET per micro-batch, SPLIT_BUDGET / sp per
    GPU): prompt once, phase A sharded over the engine's SP group; update and log-probs."""
    with spy_prompt_phases() as phases:
        ranks.check_update(SPLIT_PER_GPU, "prompt once")
        ranks.check_log_probs(SPLIT_PER_GPU, "prompt once, log-probs")
    sharded = [g for g in phases if g is ranks.engine.ulysses_parallel_group]
    # the SP engine's phases all sharded over its group, and as many as the one-rank engine's at the
    # same micro-batch budget (SPLIT_PER_GPU x sp: veRL's max_token_len_per_gpu * sp)
    assert sharded and len(sharded) + phases.count(None) == len(phases), phases
    assert len(sharded) == phases.count(None), (len(sharded), phases.count(None))
    return {"sharded_phases": len(sharded)}


def case_prompt_copies(ranks: Ranks):
    """DUALKV_VERL_PROMPT_ONCE=0: veRL's loop over group_micro_batches, split groups with a prompt copy;
    then (prompt once on again) use_dynamic_bsz=False: veRL's row chunks (2 rows: groups cut), each cut
    group's prompt run once, closed inside veRL's loop, sharded over the SP group."""
    os.environ[dkv.PROMPT_ONCE_ENV] = "0"
    try:
        ranks.check_update(SPLIT_PER_GPU, "prompt copies")
        ranks.check_log_probs(SPLIT_PER_GPU, "prompt copies, log-probs")
    finally:
        del os.environ[dkv.PROMPT_ONCE_ENV]
    with spy_prompt_phases() as phases:
        ranks.check_update(SPLIT_PER_GPU, "fixed-size micro-batches", use_dynamic_bsz=False)
    sharded = [g for g in phases if g is not None]  # the one-rank reference's phases have no SP group
    assert sharded, phases
    return {"fixed_size_sharded_phases": len(sharded)}


def case_refusals(ranks: Ranks):
    """Raised on every rank before any forward: 3 query heads over sp 2 (prompt once: agreed over the dp
    group; copies: each rank's own check of the same config), and prompt_state_budget under SP."""
    report = {}
    model = transformers.Qwen3ForCausalLM(qwen3_config("tiny", vocab_size=VOCAB, num_attention_heads=3,
                                                       num_key_value_heads=1))
    model.set_attn_implementation("dualkv")
    for option in ("", "0"):
        os.environ[dkv.PROMPT_ONCE_ENV] = option
        engine = sp_engine("tiny", ranks.world, model=model.train())
        with pytest.raises(dualkv.ArgumentError, match="ulysses_sequence_parallel_size=2: 3 query heads are not divisible"):
            run(engine, ranks.proto, max_tokens=SPLIT_PER_GPU, mode="train")
    os.environ[dkv.PROMPT_ONCE_ENV] = "prompt_state_budget=1"
    try:
        with pytest.raises(dualkv.UnsupportedError) as err:
            run(ranks.engine, ranks.proto, max_tokens=SPLIT_PER_GPU, mode="train")
        assert "prompt_state_budget" in str(err.value) and "ulysses_sequence_parallel_size=2" in str(err.value)
        report["budget"] = str(err.value)
    finally:
        del os.environ[dkv.PROMPT_ONCE_ENV]
    return report


def case_moe_prompt_once(ranks: Ranks):
    """tiny-moe (Qwen3-MoE: each SP rank routes its own tokens to the experts): prompt once's update."""
    moe = Ranks(ranks.rank, ranks.world, "tiny-moe")
    with spy_prompt_phases() as phases:
        moe.check_update(SPLIT_PER_GPU, "tiny-moe, prompt once")
    assert moe.engine.ulysses_parallel_group in phases
    return {}


def case_fsdp1(ranks: Ranks):
    """veRL's FSDP1 strategy (``strategy="fsdp"``: torch's FullyShardedDataParallel as veRL's
    ``_build_fsdp_module`` wraps the model, test_verl._veRL_fsdp1_engine) under SP: the plug-in's own
    prompt-once loop cannot run there (its phase A would enter FSDP1's root forward from inside,
    ``_runs_prompt_once``), so veRL's own loop runs the micro-batches (FSDP1's ``no_sync`` on all but
    the last), every group over the budget split into pieces, each micro-batch sharded over the SP
    group, and a split group runs its prompt once closed inside the loop (phase A without gradients
    through FSDP1's root forward, sharded over the SP group; the group's last piece closes it:
    verl._LoopPromptOnce). Update (every gradient: the FlatParameters' shards cut back into the
    parameters) and log-probs against the one-rank engine, which runs the same rows with the plug-in's
    own prompt-once loop; at dp 1 the update again with veRL's fixed-size micro-batches
    (use_dynamic_bsz=False: its row chunks)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from verl.utils.fsdp_utils import fsdp_version
    fsdp1 = Ranks(ranks.rank, ranks.world, strategy="fsdp")
    assert isinstance(fsdp1.engine.module, FSDP) and fsdp_version(fsdp1.engine.module) == 1
    sharded_calls = []
    attention = dualkv.distributed.attention
    dualkv.distributed.attention = lambda *a, **k: sharded_calls.append(1) or attention(*a, **k)
    try:
        with spy_prompt_phases() as phases:
            fsdp1.check_update(SPLIT_PER_GPU, "FSDP1, prompt copies")
            fsdp1.check_log_probs(SPLIT_PER_GPU, "FSDP1, prompt copies, log-probs")
            if fsdp1.dp == 1:
                # veRL's row chunks assume every dp rank holds as many rows (its DataProto.chunk), and
                # ROLLOUTS gives the two dp ranks of world 4 unequal ones (for the dynamic batch sizes'
                # balancing): their FSDP collectives would then differ in number, stock veRL's as well
                fsdp1.check_update(SPLIT_PER_GPU, "FSDP1, fixed-size micro-batches", use_dynamic_bsz=False)
    finally:
        dualkv.distributed.attention = attention
    # the one-rank engine's phases (no SP group) and the FSDP1 engine's, sharded over its SP group; its
    # attention layers ran dualkv's all-to-all path
    sharded_phases = [g for g in phases if g is not None]
    assert phases.count(None) and sharded_phases and all(g is sharded_phases[0] for g in sharded_phases), phases
    assert sharded_calls
    return {"one_rank_phases": phases.count(None), "sharded_phases": len(sharded_phases),
            "sharded_attention_calls": len(sharded_calls)}


CASES = {2: ["whole_groups", "prompt_once", "prompt_copies", "refusals", "moe_prompt_once", "fsdp1"],
         4: ["prompt_once", "fsdp1"]}


# ----------------------------------------------------------------------------------------------
# in this process: what is refused before any forward (the model's config, the same on every rank)
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides,sp,error,message", [
    (dict(num_attention_heads=3, num_key_value_heads=1), 2, dualkv.ArgumentError, "=2: 3 query heads are not divisible by the sequence-parallel size 2"),
    (dict(num_attention_heads=8, num_key_value_heads=3), 2, dualkv.ArgumentError, "=2: 3 KV heads: the sequence-parallel size 2 must divide them"),
    (dict(num_attention_heads=4, num_key_value_heads=2), 8, dualkv.ArgumentError, "=8: 4 query heads are not divisible"),
    (dict(use_sliding_window=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"]), 2,
     dualkv.UnsupportedError, r"mask modifiers \(window\)"),
])
def test_sequence_parallel_refusals(overrides, sp, error, message):
    engine = make_engine("dualkv")
    engine.module = transformers.Qwen3ForCausalLM(qwen3_config("tiny", vocab_size=VOCAB, **overrides))
    engine.module.set_attn_implementation("dualkv")
    engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = sp, True
    with pytest.raises(error, match=message):
        dkv._prepare_engine(engine, torch.device("cpu"))


def test_sequence_parallel_fits():
    """4 query / 2 KV heads at sp 2 and 4 (KV heads divisible by sp, or dividing it): accepted."""
    for sp in (2, 4):
        engine = make_engine("dualkv")
        engine.ulysses_sequence_parallel_size, engine.use_ulysses_sp = sp, True
        dkv._prepare_engine(engine, torch.device("cpu"))
        assert dkv._sp_grad_scale(engine) == float(sp)


# ----------------------------------------------------------------------------------------------
# the launch
# ----------------------------------------------------------------------------------------------

def _worker(rank, world, init_file, out_dir, cases):
    torch.set_num_threads(1)
    impl.get_device_id = impl.get_device_name = lambda: "cpu"
    seqlen_balancing.get_device_name = lambda: "cpu"
    built = {}

    def run_case(name):
        if "ranks" not in built:  # after the process group (its first case fails if this does)
            built["ranks"] = Ranks(rank, world)
        return globals()[f"case_{name}"](built["ranks"])

    run_cases(rank, world, init_file, out_dir, cases, run_case, PG_TIMEOUT_S)


WORLDS = CaseWorlds(_worker, CASES, WORLD_DEADLINE_S, "verl_sp_world")


@pytest.mark.parametrize("world,case", WORLDS.params())
def test_verl_ulysses(world, case, tmp_path_factory):
    WORLDS.check(world, case, tmp_path_factory)
