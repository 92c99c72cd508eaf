"""dualkv.distributed over real process groups: gloo on the CPU, 2 and 4 ranks, fp64.

Ulysses SP=2 and SP=4 against SP=1 and against the unpacked stock model (attention outputs bit-equal,
log-probs, loss and every parameter gradient within 1e-10 relative); FSDP2 (DP, SP, DP x SP) against
one process; torch.compile'd decoder layers; odd token counts (pad), shard boundaries inside a
prompt and at segment edges, SP > KV heads, an empty micro-batch on one rank; bad inputs raise a
typed error on every rank.

Each world size is one launch (spawned processes; importing torch dominates the cost): every rank
runs all the cases of its world in order and records each one's outcome, and the tests read them.
A collective that hangs times out after PG_TIMEOUT_S (gloo), and the whole world is killed after
WORLD_DEADLINE_S, so a deadlock fails the tests instead of hanging CI.
"""
from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
if torch.cuda.is_available():  # device time is scarce: the GPU machine runs the NCCL example instead
    pytest.skip("the gloo multi-process suite runs in CI on the CPU (docs/distributed.md section 6 lists the GPU runs)",
                allow_module_level=True)

import dualkv  # noqa: E402
from dualkv import distributed  # noqa: E402
from dualkv.grpo import group_advantages, policy_loss  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.microbatch import plan_micro_batches  # noqa: E402
from dualkv.packing import pack  # noqa: E402
from spawned_ranks import CaseWorlds, run_cases  # noqa: E402  (tests/python)

PG_TIMEOUT_S = 60
WORLD_DEADLINE_S = 420
VOCAB = 64
#: (prompt lengths, response lengths): 47 tokens (odd: padded; SP=2 cuts at a segment edge, SP=4
#: inside a response and at edges), and 32 tokens (SP=2 cuts right after the first prompt, so rank
#: 0's last token predicts every first response token; SP=4 cuts inside both prompts)
ROLLOUTS = {"odd": ([7, 4, 9], [[3, 1, 5], [4, 2], [1, 6, 2, 3]]), "cut_prompt": ([16, 3], [[2, 5], [4, 2]])}


# ----------------------------------------------------------------------------------------------
# helpers (run inside the ranks)
# ----------------------------------------------------------------------------------------------

def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _rms_norm_in_input_dtype(self, x):
    """RMSNorm in the input's dtype. transformers' computes in fp32, a downcast for fp64 inputs whose
    rounding turns two exact fp64 paths that differ by summation order (1e-16) into 1e-9 apart."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def qwen3(heads=4, kv_heads=2, seed=0, attn="dualkv"):
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=heads,
                                   num_key_value_heads=kv_heads, head_dim=8, vocab_size=VOCAB,
                                   max_position_embeddings=128, attention_dropout=0.0, use_cache=False,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).double().train()
    with torch.no_grad():  # random norms, so that every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm_in_input_dtype, m)
    return dkt.guard(model) if attn == "dualkv" else model


def rollouts(prompt_lens, response_lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in prompt_lens]
    responses = [[torch.randint(0, VOCAB, (r,), generator=g) for r in rs] for rs in response_lens]
    return prompts, responses


def loss_inputs(packed, seed=2):
    """Old log-probs (near the model's, so that clipping is active on some tokens) and advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = packed.response_mask()
    old = (-4.1 + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)) * mask
    adv = group_advantages(torch.randn(packed.num_rows, generator=g, dtype=torch.float64), packed.row_group)
    return old, adv, mask


def grpo_loss(logp, ent, old, adv, mask):
    loss, _ = policy_loss(logp, old, adv, mask, clip_high=0.28)
    return loss - 0.01 * (ent * mask).sum() / mask.sum()  # an entropy bonus: its gradient path is checked too


def packed_update(model, batch, old, adv, mask, scale=1.0):
    """log-probs, entropy, loss and the gradients of one packed (or sharded) micro-batch."""
    model.zero_grad(set_to_none=True)
    logp, ent = dkt.packed_logprobs(model, batch, entropy=True)
    loss = grpo_loss(logp, ent, old, adv, mask)
    (loss * scale).backward()
    return logp.detach(), ent.detach(), loss.detach(), grads(model)


def grads(model):
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor
            g = g.full_tensor()
        out[name] = g.detach().clone()
    return out


def unpacked_update(model, prompts, responses, packed, old, adv, mask):
    """The same update on the unpacked N x (P + R) rows with the stock SDPA attention."""
    std = copy.deepcopy(model)
    std.set_attn_implementation("sdpa")  # eager computes its softmax in fp32
    std.zero_grad(set_to_none=True)
    rows = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    L = max(p.numel() + r.numel() for p, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        ids[b, :p.numel() + r.numel()] = torch.cat([p, r])
    logits = std(input_ids=ids, use_cache=False).logits
    logp = torch.zeros(mask.shape, dtype=torch.float64)
    ent = torch.zeros(mask.shape, dtype=torch.float64)
    for b, (p, r) in enumerate(rows):
        P, R = p.numel(), r.numel()
        lsm = torch.log_softmax(logits[b, P - 1:P + R - 1], dim=-1)
        logp = logp.index_put((torch.full((R,), b), torch.arange(R)), lsm.gather(1, r.unsqueeze(1)).squeeze(1))
        ent = ent.index_put((torch.full((R,), b), torch.arange(R)), -(lsm.exp() * lsm).sum(1))
    loss = grpo_loss(logp, ent, old, adv, mask)
    loss.backward()
    return logp.detach(), ent.detach(), loss.detach(), grads(std)


def sum_over(group, gs):
    for g in gs.values():
        dist.all_reduce(g, group=group)
    return gs


def assert_update_close(got, want, tol, what):
    (lp, ent, loss, gs), (lp_w, ent_w, loss_w, gs_w) = got, want
    assert rel(lp, lp_w) <= tol, f"{what}: log-probs {rel(lp, lp_w):.2e}"
    assert rel(ent, ent_w) <= tol, f"{what}: entropy {rel(ent, ent_w):.2e}"
    assert abs(float(loss - loss_w)) <= tol * max(1.0, abs(float(loss_w))), f"{what}: loss {loss} vs {loss_w}"
    for name, g in gs_w.items():
        assert rel(gs[name], g) <= tol, f"{what}: gradient of {name} {rel(gs[name], g):.2e}"


def fsdp_model(model, mesh):
    from torch.distributed.fsdp import fully_shard
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------

def case_attention_sp(rank, world):
    """dualkv.distributed.attention (SP = world) vs dualkv.attention on all tokens: outputs bit-equal,
    dq bit-equal, dk / dv <= 1e-12 (the KV replicas' gradients are summed in another order)."""
    group = dist.group.WORLD
    forests = {name: dualkv.Layout.from_groups(*lens) for name, lens in ROLLOUTS.items()}
    forests["many"] = dualkv.Layout.from_groups([1 + i % 5 for i in range(40)], [[1 + (i * 7 + j) % 4 for j in range(1 + i % 3)]
                                                                                for i in range(40)])
    forests["depth3"] = dualkv.Layout.from_tree([5, 3, 2, 1, 4, 2, 6], [-1, 0, 1, 1, 0, -1, 5])
    heads = [(4, 2), (4, 1), (8, 2), (2 * world, 2 * world)]
    g = torch.Generator().manual_seed(0)
    for name, lay in forests.items():
        sh = distributed.shard(lay, group)
        T, Tp = lay.num_tokens, sh.num_tokens
        for H, Hk in heads:
            q = torch.randn(T, H, 16, generator=g, dtype=torch.float64)
            k, v = (torch.randn(T, Hk, 16, generator=g, dtype=torch.float64) for _ in range(2))
            dout = torch.randn(T, H, 16, generator=g, dtype=torch.float64)
            ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
            ref = dualkv.attention(*ref_in, lay)
            (ref * dout).sum().backward()

            def local(x):
                return torch.cat([x, x.new_zeros(Tp - T, *x.shape[1:])])[sh.start:sh.stop]
            mine = [local(x).requires_grad_() for x in (q, k, v)]
            out = distributed.attention(*mine, sh)
            (out * local(dout)).sum().backward()
            what = f"{name}, H={H}, Hk={Hk}"
            assert torch.equal(out, local(ref)), what
            assert torch.equal(mine[0].grad, local(ref_in[0].grad)), what
            for a, b in zip(mine[1:], ref_in[1:]):
                assert (a.grad - local(b.grad)).abs().max() <= 1e-12 * b.grad.abs().max(), what
            if Hk > 1 and world // Hk > 1:
                # the check has teeth: KV heads tiled over the ranks (rank r reads KV head r % Hk,
                # Tensor.repeat) instead of replicated would not pass it
                tiled = torch.arange(world) % Hk
                kt, vt = (x[:, tiled].repeat_interleave(H // world, dim=1) for x in (k, v))
                wrong = dualkv.attention(q, kt, vt, lay)
                assert not torch.allclose(local(wrong), out), what


def case_rows_sp(rank, world):
    """The standard path's pieces under Ulysses SP = world, on right-padded unpacked rows split by
    columns: ulysses_attention around causal SDPA equals SDPA on every whole row (outputs and q, k, v
    gradients <= 1e-12; the junk in the right padding reaches no real token), and
    rows_response_logprobs equals response_logprobs on the rows' real tokens (log-probs, entropy, the
    hidden gradient of this rank's columns, the LM-head gradient summed over the ranks)."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    lens = [13, 6, 9, 1]
    L = -(-max(lens) // world) * world
    n = L // world
    real = torch.arange(L).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # [B, L]
    for H, Hk in [(4, 2), (4, 1), (8, 2), (2 * world, 2 * world)]:
        q = torch.randn(len(lens), L, H, 16, generator=g, dtype=torch.float64)
        k, v = (torch.randn(len(lens), L, Hk, 16, generator=g, dtype=torch.float64) for _ in range(2))
        dout = torch.randn(q.shape, generator=g, dtype=torch.float64) * real[..., None, None]
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        per_row = []
        for b, m in enumerate(lens):  # every row alone, at its own length
            qb, kb, vb = (x[b:b + 1, :m].transpose(1, 2) for x in ref_in)
            o = sdpa(qb, kb, vb, is_causal=True, enable_gqa=True).transpose(1, 2)[0]
            per_row.append(torch.cat([o, o.new_zeros(L - m, H, 16)]))
        ref = torch.stack(per_row)
        (ref * dout).sum().backward()
        mine = [x[:, rank * n:(rank + 1) * n].clone().requires_grad_() for x in (q, k, v)]

        def causal(qr, kr, vr):
            return sdpa(qr.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=True,
                        enable_gqa=True).transpose(1, 2)
        out = distributed.ulysses_attention(*mine, group, causal)
        (out * dout[:, rank * n:(rank + 1) * n]).sum().backward()
        what = f"H={H}, Hk={Hk}"
        mask = real[:, rank * n:(rank + 1) * n, None, None]
        assert (out - ref[:, rank * n:(rank + 1) * n]).mul(mask).abs().max() <= 1e-12, what
        for a, b in zip(mine, ref_in):
            assert (a.grad - b.grad[:, rank * n:(rank + 1) * n]).abs().max() <= 1e-12 * b.grad.abs().max(), what
    for name, (prompt_lens, response_lens) in ROLLOUTS.items():
        prompts, responses = rollouts(prompt_lens, response_lens)
        pairs = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
        rows = pack([p for p, _ in pairs], [[r] for _, r in pairs])
        sh = distributed.shard_rows(rows, group)
        assert sh.length % world == 0 and sh.input_ids.shape == (len(pairs), sh.length // world)
        lens = [p.numel() + r.numel() for p, r in pairs]
        valid = torch.arange(sh.length).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
        hidden = torch.randn(len(pairs), sh.length, 8, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(VOCAB, 8, generator=g, dtype=torch.float64, requires_grad=True)
        weights = torch.randn(len(pairs), rows.max_response_len, generator=g, dtype=torch.float64)
        want, want_ent = response_logprobs(hidden[valid], w, rows, entropy=True)
        ((want * weights).sum() + want_ent.sum()).backward()
        local = hidden.detach()[:, sh.start:sh.stop].clone().requires_grad_()
        w_local = w.detach().clone().requires_grad_()
        got, got_ent = distributed.rows_response_logprobs(local, w_local, sh, entropy=True, chunk_size=5)
        ((got * weights).sum() + got_ent.sum()).backward()
        assert rel(got, want) <= 1e-12 and rel(got_ent, want_ent) <= 1e-12, name
        assert rel(local.grad, hidden.grad[:, sh.start:sh.stop]) <= 1e-12, name
        assert rel(sum_over(group, {"w": w_local.grad})["w"], w.grad) <= 1e-12, name


def case_model_sp(rank, world, checkpointing=False):
    """A tiny Qwen3 (GQA 4/2) through the transformers backend: SP = world vs SP = 1 vs the unpacked
    stock model, fp64: log-probs, entropy, GRPO loss and every parameter gradient (summed over the SP
    ranks) within 1e-10 relative."""
    for name, lens in ROLLOUTS.items():
        model = qwen3()
        prompts, responses = rollouts(*lens)
        packed = pack(prompts, responses)
        old, adv, mask = loss_inputs(packed)
        want = packed_update(model, packed, old, adv, mask)
        std = unpacked_update(model, prompts, responses, packed, old, adv, mask)
        assert_update_close(want, std, 1e-10, f"{name}: SP=1 vs unpacked")
        if checkpointing:
            dkt.enable_checkpointing(model)
        sh = distributed.shard(packed, dist.group.WORLD)
        got = packed_update(model, sh, old, adv, mask)
        got = got[:3] + (sum_over(dist.group.WORLD, got[3]),)
        assert_update_close(got, want, 1e-10, f"{name}: SP={world} vs SP=1")
        assert_update_close(got, std, 1e-10, f"{name}: SP={world} vs unpacked")
        # grad_scale = s for a harness that averages over the SP ranks (veRL's convention)
        model.zero_grad(set_to_none=True)
        logp, ent = dkt.packed_logprobs(model, sh, entropy=True, grad_scale=float(world))
        grpo_loss(logp, ent, old, adv, mask).backward()
        for n, g in sum_over(dist.group.WORLD, grads(model)).items():
            assert rel(g / world, want[3][n]) <= 1e-10, f"{name}: grad_scale={world}, gradient of {n}"


def case_model_sp_checkpointing(rank, world):
    case_model_sp(rank, world, checkpointing=True)


def case_model_sp_compile(rank, world):
    """Decoder layers compiled with fullgraph=True (aot_eager: dynamo + AOTAutograd), the all-to-alls
    inside, equal eager SP."""
    model = qwen3()
    prompts, responses = rollouts(*ROLLOUTS["odd"])
    packed = pack(prompts, responses)
    old, adv, mask = loss_inputs(packed)
    sh = distributed.shard(packed, dist.group.WORLD)
    want = packed_update(model, sh, old, adv, mask)
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)  # fullgraph: the all-to-alls trace, no graph break
    got = packed_update(model, sh, old, adv, mask)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert_update_close(got, want, 1e-12, "compiled vs eager")


def _plan_and_losses(groups_lens, max_tokens, num_ranks):
    prompts, responses = rollouts(*groups_lens)
    plan = plan_micro_batches([(p.numel(), [r.numel() for r in rs]) for p, rs in zip(prompts, responses)],
                              max_tokens, num_ranks=num_ranks)
    g = torch.Generator().manual_seed(4)
    old = [[-4.1 + 0.3 * torch.randn(r.numel(), generator=g, dtype=torch.float64) for r in rs] for rs in responses]
    rewards = [torch.randn(len(rs), generator=g, dtype=torch.float64) for rs in responses]
    adv = [group_advantages(r, torch.zeros(len(r), dtype=torch.long)) for r in rewards]
    return prompts, responses, plan, old, adv


def _mb_loss_inputs(entries, old, adv, packed):
    mask = packed.response_mask()
    o = torch.zeros(mask.shape, dtype=torch.float64)
    rows = [(g, i) for g, idx in entries for i in idx]
    for b, (g, i) in enumerate(rows):
        o[b, :old[g][i].numel()] = old[g][i]
    a = torch.stack([adv[g][i] for g, i in rows])
    return o, a, mask


def _dp_update(model, rank_mbs, prompts, responses, plan, old, adv, sp_group, loss_scale):
    """One rank's part of a DP (x SP) update: its micro-batches (a placeholder for an empty one),
    token-mean over the whole batch."""
    model.zero_grad(set_to_none=True)
    for mb in rank_mbs:
        if mb.entries:
            packed = pack([prompts[g] for g, _ in mb.entries], [[responses[g][i] for i in idx] for g, idx in mb.entries])
            o, a, mask = _mb_loss_inputs(mb.entries, old, adv, packed)
        else:
            packed = distributed.placeholder_batch("cpu")
        batch = distributed.shard(packed, sp_group) if sp_group is not None else packed
        logp, ent = dkt.packed_logprobs(model, batch, entropy=True)
        if mb.entries:
            loss = grpo_loss(logp, ent, o, a, mask) * (mb.response_tokens / plan.response_tokens)
        else:
            loss = logp.sum() * 0.0  # same forward and backward, no contribution
        (loss * loss_scale).backward()
    return grads(model)


def _single_process_update(model, prompts, responses, old, adv):
    """The whole batch in one packed micro-batch, one process, token-mean."""
    model.zero_grad(set_to_none=True)
    packed = pack(prompts, responses)
    entries = [(g, tuple(range(len(rs)))) for g, rs in enumerate(responses)]
    o, a, mask = _mb_loss_inputs(entries, old, adv, packed)
    logp, ent = dkt.packed_logprobs(model, packed, entropy=True)
    # token-mean over the batch of the per-micro-batch GRPO loss = sum over groups weighted by tokens
    loss = 0.0
    for g, rs in enumerate(responses):
        sub = pack([prompts[g]], [rs])
        rows = list(range(sum(len(r) for r in responses[:g]), sum(len(r) for r in responses[:g + 1])))
        sub_mask = mask[rows][:, :sub.max_response_len]
        tokens = int(sub_mask.sum())
        loss = loss + grpo_loss(logp[rows][:, :sub.max_response_len], ent[rows][:, :sub.max_response_len],
                                o[rows][:, :sub.max_response_len], a[rows], sub_mask) * tokens
    total = int(mask.sum())
    (loss / total).backward()
    return grads(model)


#: four groups; at a budget of 40 tokens over two ranks group 0 (50 tokens) is split into two
#: micro-batches on one rank and the other rank has one micro-batch and one empty one
DP_GROUPS = ([20, 5, 6, 4], [[10, 10, 10], [3, 4], [2, 2, 3], [1, 5]])


def case_fsdp_dp(rank, world):
    """FSDP2 over 2 ranks, DP=2: plan_micro_batches over the ranks (one rank runs a placeholder for
    its empty micro-batch; with a `continue` instead the other rank would hang in FSDP's
    collectives), global token-mean loss; every gradient equals the one-process update."""
    from torch.distributed.device_mesh import init_device_mesh
    prompts, responses, plan, old, adv = _plan_and_losses(DP_GROUPS, 40, world)
    assert plan.num_empty == 1 and plan.micro_batches_per_rank == 2, plan.summary()
    want = _single_process_update(qwen3(), prompts, responses, old, adv)
    model = fsdp_model(qwen3(), init_device_mesh("cpu", (world,)))
    got = _dp_update(model, plan.ranks[rank], prompts, responses, plan, old, adv, None, loss_scale=world)
    for name, g in want.items():  # FSDP averages over the ranks: the loss was scaled by the world size
        assert rel(got[name], g) <= 1e-10, f"gradient of {name}: {rel(got[name], g):.2e}"


def case_fsdp_sp(rank, world):
    """FSDP2 over 2 ranks, SP=2 (DP=1), gradient checkpointing: equals one process."""
    from torch.distributed.device_mesh import init_device_mesh
    prompts, responses = rollouts(*ROLLOUTS["odd"])
    packed = pack(prompts, responses)
    old, adv, mask = loss_inputs(packed)
    want = packed_update(qwen3(), packed, old, adv, mask)
    model = qwen3()
    dkt.enable_checkpointing(model)
    model = fsdp_model(model, init_device_mesh("cpu", (world,)))
    got = packed_update(model, distributed.shard(packed, dist.group.WORLD), old, adv, mask, scale=world)
    assert_update_close(got, want, 1e-10, "FSDP2 SP=2 vs one process")


def case_fsdp_dp_sp(rank, world):
    """4 ranks: FSDP2 over all of them, DP=2 x SP=2 (the SP groups from a 2-D device mesh), several
    groups per DP rank, one empty micro-batch: equals one process."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    dp_rank, sp_group = mesh.get_local_rank("dp"), mesh["sp"].get_group()
    prompts, responses, plan, old, adv = _plan_and_losses(DP_GROUPS, 40, 2)
    want = _single_process_update(qwen3(), prompts, responses, old, adv)
    model = fsdp_model(qwen3(), init_device_mesh("cpu", (world,)))
    got = _dp_update(model, plan.ranks[dp_rank], prompts, responses, plan, old, adv, sp_group, loss_scale=world)
    for name, g in want.items():
        assert rel(got[name], g) <= 1e-10, f"gradient of {name}: {rel(got[name], g):.2e}"


def case_schedule_sp(rank, world):
    """dualkv.schedule under Ulysses SP = world, gradient checkpointing: a group over the budget runs
    its prompt once (phase A sharded, each rank keeping its heads' keys and values), fitted groups
    share its micro-batches; the gradients summed over the SP ranks equal the one-process update."""
    from dualkv import schedule
    group = dist.group.WORLD
    prompts, responses, _, old, adv = _plan_and_losses(DP_GROUPS, 40, 1)
    plan = plan_micro_batches([(p.numel(), [r.numel() for r in rs]) for p, rs in zip(prompts, responses)], 24,
                              prompt_once=True)
    assert plan.split_groups == (0,) and len(plan.prompt_phases[0]) == 1, plan.summary()
    want = _single_process_update(qwen3(), prompts, responses, old, adv)
    model = qwen3()
    dkt.enable_checkpointing(model)
    model.zero_grad(set_to_none=True)
    for mb, packed in schedule.micro_batches(model, plan, 0, prompts, responses, sp_group=group):
        o, a, mask = _mb_loss_inputs(mb.entries, old, adv, packed)
        logp, ent = dkt.packed_logprobs(model, distributed.shard(packed, group), entropy=True)
        (grpo_loss(logp, ent, o, a, mask) * (mb.response_tokens / plan.response_tokens)).backward()
    got = sum_over(group, grads(model))
    for name, g in want.items():
        assert rel(got[name], g) <= 1e-10, f"gradient of {name}: {rel(got[name], g):.2e}"


def case_fsdp_dp_schedule(rank, world):
    """FSDP2 over 2 ranks, DP=2, gradient checkpointing, dualkv.grpo.policy_update with prompt_once:
    group 0 (50 tokens) is over the 40-token budget and runs its prompt once on one rank (phase A
    under no_grad, phase C's forward again with gradients: recompute_prompt), the other rank runs a
    placeholder prompt phase in step; every gradient (x world: FSDP averages) equals the one-process
    update, for the default, offload_prompt_grads and recompute_prompt=False. (Phase C's backward
    must enter each layer through its output, where FSDP2 gathers the parameters before the
    checkpoint recompute: without the prompt forward's output as a root it failed with "mixed
    torch.Tensor and DTensor".)"""
    from torch.distributed.device_mesh import init_device_mesh

    from dualkv.grpo import policy_update
    prompts, responses, _, old, adv = _plan_and_losses(DP_GROUPS, 40, world)
    adv = [[float(a) for a in xs] for xs in adv]
    want_model = qwen3()
    want_model.zero_grad(set_to_none=True)
    policy_update(want_model, prompts, responses, old, adv, 1000, clip_high=0.28)
    want = grads(want_model)
    model = qwen3()
    dkt.enable_checkpointing(model)
    model = fsdp_model(model, init_device_mesh("cpu", (world,)))
    for recompute, offload in ((True, False), (True, True), (False, False)):
        model.zero_grad(set_to_none=True)
        out = policy_update(model, prompts, responses, old, adv, 40, num_ranks=world, rank=rank, clip_high=0.28,
                            recompute_prompt=recompute, offload_prompt_grads=offload)
        assert out["plan"].split_groups == (0,) and len(out["plan"].prompt_phases[rank]) == 1
        got = grads(model)
        for name, g in want.items():
            assert rel(got[name] * world, g) <= 1e-10, f"recompute={recompute} offload={offload}: gradient of " \
                                                       f"{name}: {rel(got[name] * world, g):.2e}"


def case_prompt_once_closing(rank, world):
    """Prompt once with phase C inside the synced backward (PromptKV.closing: the TRL plug-in's schedule),
    under DDP and FSDP2, gradient checkpointing: each rank's group (its own prompt and five responses) runs in
    three micro-batches: phase A without gradients through the wrapper's forward, two micro-batches reading the
    recorded keys and values with the gradient sync off (DDP's no_sync; FSDP2's requires_gradient_sync), the
    third packing the prompt live and closing it, synced. The gradients equal the mean over the ranks of each
    group run whole in one process (what DDP and FSDP average)."""
    from contextlib import contextmanager, nullcontext

    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from dualkv import schedule
    from dualkv.integrations._packed_forward import DECODER_ONLY_KWARG, forward_kwargs, install
    from dualkv.packing import pack_groups

    g = torch.Generator().manual_seed(7)
    lens = (3, 5, 2, 4, 1)
    groups = [(torch.randint(0, VOCAB, (9 + 2 * r,), generator=g),
               [torch.randint(0, VOCAB, (n,), generator=g) for n in lens],
               [torch.randn(n, generator=g, dtype=torch.float64) for n in lens]) for r in range(world)]
    pieces = [(0, 1), (2,), (3, 4)]  # the responses of each micro-batch

    def loss_of(logp, weights, rows):
        return sum((logp[k, :weights[i].numel()] * weights[i]).sum() for k, i in enumerate(rows))

    want = None
    for prompt, responses, weights in groups:
        plain = install(qwen3())
        out = plain(**forward_kwargs(pack_groups([prompt], [responses])))
        loss_of(out.log_probs, weights, range(len(lens))).backward()
        gs = grads(plain)
        want = gs if want is None else {n: want[n] + gs[n] for n in gs}
    want = {n: v / world for n, v in want.items()}

    prompt, responses, weights = groups[rank]
    for wrapper in ("ddp", "fsdp2"):
        inner = install(qwen3())
        dkt.enable_checkpointing(inner)
        if wrapper == "ddp":
            model = DistributedDataParallel(inner)
            sync_off = model.no_sync
        else:
            model = fsdp_model(inner, init_device_mesh("cpu", (world,)))

            @contextmanager
            def sync_off():
                model.set_requires_gradient_sync(False)
                try:
                    yield
                finally:
                    model.set_requires_gradient_sync(True)
        with torch.no_grad():
            kv = schedule.run_prompt_phase(inner, [prompt], stream_prompt_state=False,
                                           call=lambda **kw: model(**kw, **{DECODER_ONLY_KWARG: True}))
        for j, rows in enumerate(pieces):
            last = j == len(pieces) - 1
            with nullcontext() if last else sync_off():
                resp = [[responses[i] for i in rows]]
                if last:
                    packed = pack_groups([prompt], resp, prompt_kv=kv)
                    with kv.closing([0], [0]) as probes:
                        out = model(**forward_kwargs(packed))
                    loss = loss_of(out.log_probs, weights, rows) + torch.stack(probes).sum()
                else:
                    packed = pack_groups([prompt[-1:]], resp, prompt_prefix=[0], prefix_lens=list(kv.prefix_lens),
                                         prompt_kv=kv)
                    loss = loss_of(model(**forward_kwargs(packed)).log_probs, weights, rows)
                loss.backward()
        assert kv.memory["kv"] == 0 and kv.memory["grad"] == 0  # closed: the state is freed
        got = grads(inner)
        for name, w in want.items():
            assert rel(got[name], w) <= 1e-10, f"{wrapper}: gradient of {name} {rel(got[name], w):.2e}"


def case_bad_layouts_differ(rank, world):
    lens = ROLLOUTS["odd"]
    responses = [list(rs) for rs in lens[1]]
    responses[1][0] += rank == world - 1  # the last rank packed a different batch
    packed = pack(*rollouts(lens[0], responses))
    with pytest.raises(dualkv.LayoutError, match="differ between ranks"):
        distributed.shard(packed, dist.group.WORLD)


def case_bad_token_count(rank, world):
    """One rank feeds the model the whole packed batch instead of its shard: every rank raises (the
    guard's collective check), none waits in an all-to-all."""
    model = qwen3()
    packed = pack(*rollouts(*ROLLOUTS["odd"]))
    sh = distributed.shard(packed, dist.group.WORLD)
    ids = packed.input_ids if rank == 0 else sh.input_ids
    pos = packed.position_ids if rank == 0 else sh.position_ids
    with pytest.raises(dualkv.ArgumentError, match="rank 0 got 47 tokens but its shard holds|rank\\(s\\) \\[0\\]"):
        model(input_ids=ids, position_ids=pos, dualkv_layout=sh)


def case_bad_heads(rank, world):
    """Query heads not divisible by the SP size, and KV heads neither dividing nor a multiple of it:
    ArgumentError on every rank (the model's shapes are the same on every rank)."""
    packed = pack(*rollouts(*ROLLOUTS["odd"]))
    sh = distributed.shard(packed, dist.group.WORLD)
    bad = [(3, 1, "3 query heads are not divisible")] if world == 2 else \
          [(6, 2, "6 query heads are not divisible"), (12, 3, "3 KV heads")]
    for H, Hk, msg in bad:
        model = qwen3(heads=H, kv_heads=Hk)
        with pytest.raises(dualkv.ArgumentError, match=msg):
            dkt.packed_logprobs(model, sh)


CASES = {
    2: ["attention_sp", "rows_sp", "model_sp", "model_sp_checkpointing", "model_sp_compile", "fsdp_dp", "fsdp_sp",
        "schedule_sp", "fsdp_dp_schedule", "prompt_once_closing", "bad_layouts_differ", "bad_token_count", "bad_heads"],
    4: ["attention_sp", "rows_sp", "model_sp", "fsdp_dp_sp", "schedule_sp", "bad_layouts_differ", "bad_token_count",
        "bad_heads"],
}


# ----------------------------------------------------------------------------------------------
# the launch
# ----------------------------------------------------------------------------------------------

def _worker(rank, world, init_file, out_dir, cases):
    torch.set_num_threads(1)
    run_cases(rank, world, init_file, out_dir, cases, lambda name: globals()[f"case_{name}"](rank, world), PG_TIMEOUT_S)


WORLDS = CaseWorlds(_worker, CASES, WORLD_DEADLINE_S, "world")


@pytest.mark.parametrize("world,case", WORLDS.params())
def test_distributed(world, case, tmp_path_factory):
    WORLDS.check(world, case, tmp_path_factory)
