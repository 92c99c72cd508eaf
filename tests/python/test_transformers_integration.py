"""attn_implementation="dualkv" in transformers: the packed model equals the unpacked one.

For tiny random Llama, Qwen2, Qwen3, Qwen3-MoE and Mistral models in fp32: the logits of every
token of every unpacked row, the per-token response log-probs, the GRPO loss and EVERY parameter
gradient of the packed dualkv model equal those of the stock model (eager or sdpa) run on the
unpacked N x (P + R) batch. Plus the position-ids guards, gradient checkpointing and torch.compile.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import dualkv  # noqa: E402
from dualkv.grpo import group_advantages, policy_loss  # noqa: E402
from dualkv.integrations import transformers as dkt  # noqa: E402
from dualkv.logprobs import response_logprobs  # noqa: E402
from dualkv.packing import pack  # noqa: E402
from dualkv.reference import unpacked_groups, visibility_mask  # noqa: E402

VOCAB = 96
COMMON = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=128, attention_dropout=0.0, use_cache=False)


def make_config(kind: str):
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, head_dim=8)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON)  # q/k/v biases
    if kind == "qwen3":
        return transformers.Qwen3Config(**COMMON, head_dim=8)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**COMMON, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=16, decoder_sparse_step=1)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, head_dim=8, sliding_window=None)
    raise ValueError(kind)


def make_model(kind: str, attn: str = "sdpa", seed: int = 0):
    return build_model(make_config(kind), attn, seed)


def build_model(config, attn: str = "sdpa", seed: int = 0):
    """A random fp32 model of ``config`` in training mode, norms and biases perturbed."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)
    model = model.float().train()
    with torch.no_grad():  # random norms and biases, so that every parameter matters
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


PROMPTS = [7, 4, 9]
RESPONSES = [[3, 1, 5], [4, 2], [1, 6, 2, 3]]  # includes 1-token responses


def rollouts(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (p,), generator=g) for p in PROMPTS]
    responses = [[torch.randint(0, VOCAB, (r,), generator=g) for r in rs] for rs in RESPONSES]
    return prompts, responses


def padded(prompts, responses):
    rows = [(p, r) for p, rs in zip(prompts, responses) for r in rs]
    L = max(p.numel() + r.numel() for p, r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    for b, (p, r) in enumerate(rows):
        ids[b, :p.numel() + r.numel()] = torch.cat([p, r])
    return ids, rows


def std_logprobs_from_logits(logits, rows, r_max):
    """Plain per-token log-probs of each row's response from full [B, L, V] logits."""
    out = torch.zeros(len(rows), r_max, dtype=torch.float32)
    cols = []
    for b, (p, r) in enumerate(rows):
        P, R = p.numel(), r.numel()
        lp = torch.log_softmax(logits[b, P - 1:P + R - 1].float(), dim=-1)
        cols.append(lp.gather(1, r.unsqueeze(1)).squeeze(1))
        out = out.index_put((torch.full((R,), b), torch.arange(R)), cols[-1])
    return out


def rel_err(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_grads_match(std, dk, tol=1e-5):
    """Every parameter gradient of ``dk`` equals ``std``'s (relative error <= ``tol``)."""
    grads_dk = dict(dk.named_parameters())
    checked = 0
    for name, p in std.named_parameters():
        q = grads_dk[name]
        if p.grad is None:
            assert q.grad is None or float(q.grad.abs().max()) == 0.0, name
            continue
        assert q.grad is not None, name
        assert rel_err(q.grad, p.grad) <= tol, (name, rel_err(q.grad, p.grad))
        checked += 1
    assert checked >= len(list(std.parameters())) - 1  # every parameter that has a gradient


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral"])
def test_packed_equals_unpacked(kind, attn):
    std = make_model(kind, attn)
    dk = dkt.enable(copy.deepcopy(std))
    assert dkt.is_enabled(dk) and not dkt.is_enabled(std)
    assert_packed_equals_unpacked(std, dk, *rollouts())


def assert_packed_equals_unpacked(std, dk, prompts, responses, grad_tol=1e-5):
    """The packed dualkv model ``dk`` against the stock model ``std`` on the unpacked batch (fp32):
    logits of every row, response log-probs, GRPO loss (1e-5) and every parameter gradient (``grad_tol``)."""
    packed = pack(prompts, responses)
    ids, rows = padded(prompts, responses)
    B, R_max = len(rows), packed.max_response_len
    mask = packed.response_mask()

    # 1. logits of every real token of every unpacked row (prompt and response positions)
    out_std = std(input_ids=ids, use_cache=False)
    out_dk = dk(**dkt.model_inputs(packed), output_hidden_states=True)
    for b, idx in enumerate(unpacked_groups(packed.layout)):
        n = idx.numel()
        torch.testing.assert_close(out_dk.logits[0, idx], out_std.logits[b, :n], rtol=1e-5, atol=1e-5)

    # 2. per-token log-probs: plain log-softmax on the unpacked logits vs the fused packed routine
    lp_std = std_logprobs_from_logits(out_std.logits, rows, R_max)
    hidden = out_dk.hidden_states[-1]
    lp_dk = response_logprobs(hidden, dk.lm_head.weight, packed)
    torch.testing.assert_close(lp_dk, lp_std, rtol=1e-5, atol=1e-5)
    assert bool((lp_dk[~mask] == 0).all())

    # 3. GRPO loss and every parameter gradient
    g = torch.Generator().manual_seed(3)
    old = (lp_std.detach() + 0.3 * torch.randn(lp_std.shape, generator=g)) * mask  # some clipping
    adv = group_advantages(torch.randn(B, generator=g), packed.row_group)
    loss_std, m_std = policy_loss(lp_std, old, adv, mask, clip_high=0.28)
    loss_dk, m_dk = policy_loss(lp_dk, old, adv, mask, clip_high=0.28)
    assert 0 < m_std["clip_frac"] < 1 and m_std["clip_frac"] == m_dk["clip_frac"]
    assert abs(loss_std.item() - loss_dk.item()) <= 1e-5 * max(1.0, abs(loss_std.item()))
    loss_std.backward()
    loss_dk.backward()
    assert_grads_match(std, dk, grad_tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_tolerance_rule(dtype):
    """bf16/fp16: the packed dualkv model's error against the fp32 truth is at most 2x the error of the
    stock model on the unpacked batch in the same dtype, plus a small absolute term."""
    err_dk, err_std = low_precision_logprob_errors(make_model("qwen3", "sdpa"), dtype)
    print(f"{dtype}: max |log-prob error| vs fp32: stock unpacked {err_std:.3e}, dualkv packed {err_dk:.3e}")
    assert err_dk <= 2 * err_std + 1e-3, (err_dk, err_std)


def low_precision_logprob_errors(truth_model, dtype):
    """(dualkv packed, stock unpacked) max |log-prob error| in ``dtype`` against the fp32 truth: the
    fp32 model's weights are rounded to ``dtype`` first, so that fp32 is the exact truth."""
    with torch.no_grad():
        for p in truth_model.parameters():
            p.copy_(p.to(dtype).float())
    low = copy.deepcopy(truth_model).to(dtype)
    dk = dkt.enable(copy.deepcopy(low))
    prompts, responses = rollouts()
    packed = pack(prompts, responses)
    ids, rows = padded(prompts, responses)
    with torch.no_grad():
        truth = std_logprobs_from_logits(truth_model(input_ids=ids).logits, rows, packed.max_response_len)
        hidden = low.model(input_ids=ids).last_hidden_state  # logits in fp32, as response_logprobs does
        lp_std = std_logprobs_from_logits(hidden.float() @ low.lm_head.weight.float().T, rows,
                                          packed.max_response_len)
        out = dk.model(**dkt.model_inputs(packed))
        lp_dk = response_logprobs(out.last_hidden_state, dk.lm_head.weight, packed)
    m = packed.response_mask()
    err_std = float((lp_std - truth).abs()[m].max())
    assert err_std > 0
    return float((lp_dk - truth).abs()[m].max()), err_std


def test_position_ids_filled_from_layout_and_kernel_kwargs():
    dk = dkt.enable(make_model("qwen3"))
    prompts, responses = rollouts()
    packed = pack(prompts, responses)
    full = dk(**dkt.model_inputs(packed)).logits
    auto = dk(input_ids=packed.input_ids, dualkv_layout=packed.layout).logits  # hook fills position_ids
    torch.testing.assert_close(auto, full, rtol=0, atol=0)
    positional = dk(packed.input_ids, dualkv_layout=packed.layout).logits
    torch.testing.assert_close(positional, full, rtol=0, atol=0)
    det = dk(**dkt.model_inputs(packed), dualkv_deterministic=True).logits
    torch.testing.assert_close(det, full, rtol=1e-6, atol=1e-6)
    # model_inputs from a token tensor and a layout
    kw = dkt.model_inputs(packed.input_ids[0], packed.layout)
    assert kw["input_ids"].shape == (1, packed.num_tokens) and kw["position_ids"].shape == (1, packed.num_tokens)
    torch.testing.assert_close(dk(**kw).logits, full, rtol=0, atol=0)


def test_dense_reference_implementation():
    """attn_implementation="dualkv_reference" (dense-mask SDPA over the layout) equals dualkv."""
    dk = dkt.enable(make_model("qwen3_moe"))
    ref = dkt.enable(copy.deepcopy(dk), reference=True)
    assert dkt.is_enabled(ref) and ref.config._attn_implementation == dkt.REFERENCE_IMPLEMENTATION
    packed = pack(*rollouts())
    a = dk(**dkt.model_inputs(packed)).logits
    b = ref(**dkt.model_inputs(packed)).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(dk.named_parameters(), ref.parameters()):
        assert rel_err(q.grad, p.grad) <= 1e-5, name
    mask = dkt.dense_visibility_mask(packed.layout, "cpu")
    assert torch.equal(mask, visibility_mask(packed.layout))
    with pytest.raises(dkt.MissingLayoutError):
        ref(input_ids=packed.input_ids)


def test_micro_batched_update_equals_full_unpacked_update():
    """The docs' recipe: micro-batches planned under a token budget (one group split into response
    subsets, each with its own prompt copy), packed, token-mean loss weighted over the whole batch:
    the accumulated gradient equals the one-batch unpacked gradient."""
    from torch.nn.utils.rnn import pad_sequence

    from dualkv.microbatch import plan_micro_batches
    std = make_model("qwen2", "sdpa")
    dk = dkt.enable(copy.deepcopy(std))
    prompts, responses = rollouts(seed=7)
    g = torch.Generator().manual_seed(8)
    old_lp = [[-4 + 0.3 * torch.randn(r.numel(), generator=g) for r in rs] for rs in responses]
    rewards = torch.randn(sum(len(rs) for rs in responses), generator=g)
    adv = group_advantages(rewards, [k for k, rs in enumerate(responses) for _ in rs])
    row = {}
    for k, rs in enumerate(responses):
        for i in range(len(rs)):
            row[(k, i)] = len(row)
    # one batch, unpacked
    ids, rows = padded(prompts, responses)
    r_max = max(r.numel() for _, r in rows)
    lp_std = std_logprobs_from_logits(std(input_ids=ids).logits, rows, r_max)
    old = pad_sequence([o for os in old_lp for o in os], batch_first=True)
    mask = torch.arange(r_max)[None, :] < torch.tensor([r.numel() for _, r in rows])[:, None]
    loss, _ = policy_loss(lp_std, old, adv, mask, clip_high=0.28)
    loss.backward()
    # micro-batches, packed
    plan = plan_micro_batches([(p.numel(), [r.numel() for r in rs]) for p, rs in zip(prompts, responses)],
                              max_tokens=16)
    assert plan.split_groups  # the test covers a split group
    total = int(mask.sum())
    for mb in plan.ranks[0]:
        if not mb.entries:
            continue
        packed = pack([prompts[k] for k, idx in mb.entries], [[responses[k][i] for i in idx] for k, idx in mb.entries])
        logp = dkt.packed_logprobs(dk, packed)
        o = pad_sequence([old_lp[k][i] for k, idx in mb.entries for i in idx], batch_first=True)
        o = torch.nn.functional.pad(o, (0, logp.shape[1] - o.shape[1]))
        a = adv[[row[(k, i)] for k, idx in mb.entries for i in idx]]
        m = packed.response_mask()
        mb_loss, _ = policy_loss(logp, o, a, m, clip_high=0.28)
        (mb_loss * m.sum() / total).backward()
    grads = dict(dk.named_parameters())
    for name, p in std.named_parameters():
        assert rel_err(grads[name].grad, p.grad) <= 1e-5, name


def test_packed_logprobs_one_call():
    dk = dkt.enable(make_model("mistral"))
    packed = pack(*rollouts())
    hidden = dk.model(**dkt.model_inputs(packed)).last_hidden_state
    expect, ent_expect = response_logprobs(hidden, dk.lm_head.weight, packed, temperature=0.7, entropy=True)
    got, ent = dkt.packed_logprobs(dk, packed, temperature=0.7, entropy=True)
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    torch.testing.assert_close(ent, ent_expect, rtol=0, atol=0)
    with pytest.raises(dkt.WrongAttentionError):
        dkt.packed_logprobs(make_model("mistral"), packed)


def test_guard_missing_layout():
    dk = dkt.enable(make_model("llama"))
    ids = torch.randint(0, VOCAB, (1, 10))
    with pytest.raises(dkt.MissingLayoutError, match="dualkv_layout"):
        dk(input_ids=ids)
    # a model built directly with attn_implementation="dualkv" (no hook) raises in the attention function
    raw = make_model("qwen3", attn="dualkv")
    with pytest.raises(dkt.MissingLayoutError, match="dualkv_layout"):
        raw(input_ids=ids)


def test_guard_layout_on_stock_attention():
    prompts, responses = rollouts()
    packed = pack(prompts, responses)
    std = dkt.guard(make_model("qwen3", "sdpa"))
    with pytest.raises(dkt.WrongAttentionError, match="enable"):
        std(**dkt.model_inputs(packed))
    with pytest.raises(dkt.WrongAttentionError):
        std.model(**dkt.model_inputs(packed))  # the base model is guarded too
    # the shared-prompt position ids alone (no layout) on a stock path: the silent trap
    with pytest.raises(dkt.WrongAttentionError, match="drop back"):
        std(input_ids=packed.input_ids, position_ids=packed.position_ids)
    # generate()-style positions of left-padded rows are fine
    std(input_ids=torch.randint(0, VOCAB, (2, 6)), position_ids=torch.tensor([[1, 1, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5]]))
    # ordinary packing (restarts at 0) and plain batches stay allowed
    std(input_ids=packed.input_ids[:, :8], position_ids=torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]]))
    std(input_ids=torch.randint(0, VOCAB, (2, 6)))
    # a dualkv model switched back to stock attention keeps its guard
    dk = dkt.enable(make_model("qwen3"))
    dk(**dkt.model_inputs(packed))
    dkt.disable(dk)
    with pytest.raises(dkt.WrongAttentionError):
        dk(**dkt.model_inputs(packed))
    with pytest.raises(dkt.WrongAttentionError):
        dkt.check_model(dk, {"dualkv_layout": packed.layout})


def test_register_layout_attention():
    """register_layout_attention: a model set to the registered name counts as enabled, so the guard lets the
    layout through (it refuses it for stock attention) and packed_logprobs packs for it; every layer's call
    gets the packed layout; dualkv's and transformers' own names and a non-callable are refused."""
    seen = []

    def dense_counting(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs[dkt.LAYOUT_KWARG])
        return dkt.dense_reference_attention_forward(module, query, key, value, attention_mask, **kwargs)

    dkt.register_layout_attention("test_layout_attention", dense_counting)
    dk = dkt.enable(make_model("qwen3"))
    other = dkt.guard(make_model("qwen3", "sdpa"))
    packed = pack(*rollouts())
    with pytest.raises(dkt.WrongAttentionError):
        other(**dkt.model_inputs(packed))
    other.set_attn_implementation("test_layout_attention")
    assert dkt.is_enabled(other) and not dkt.is_enabled(make_model("qwen3", "sdpa"))
    torch.testing.assert_close(other(**dkt.model_inputs(packed)).logits, dk(**dkt.model_inputs(packed)).logits,
                               rtol=1e-5, atol=1e-5)
    del seen[:]
    torch.testing.assert_close(dkt.packed_logprobs(other, packed), dkt.packed_logprobs(dk, packed),
                               rtol=1e-5, atol=1e-5)
    assert len(seen) == other.config.num_hidden_layers and all(x is packed.layout for x in seen)
    dkt.register_layout_attention("test_layout_attention", dkt.dense_reference_attention_forward)  # replaced
    for bad in (dkt.ATTN_IMPLEMENTATION, dkt.REFERENCE_IMPLEMENTATION, "eager", "sdpa", "flash_attention_2", ""):
        with pytest.raises(dualkv.ArgumentError, match="register_layout_attention"):
            dkt.register_layout_attention(bad, dense_counting)
    with pytest.raises(dualkv.ArgumentError, match="callable"):
        dkt.register_layout_attention("test_layout_attention_2", None)


def test_guard_bad_batches():
    dk = dkt.enable(make_model("qwen3"))
    prompts, responses = rollouts()
    packed = pack(prompts, responses)
    kw = dkt.model_inputs(packed)
    with pytest.raises(dualkv.ArgumentError, match="layout has"):
        dk(**dict(kw, input_ids=kw["input_ids"][:, :-1], position_ids=kw["position_ids"][:, :-1]))
    with pytest.raises(dualkv.ArgumentError, match="batch size 1"):
        dk(**dict(kw, input_ids=kw["input_ids"].expand(2, -1), position_ids=kw["position_ids"].expand(2, -1)))
    with pytest.raises(TypeError, match="dualkv.Layout"):
        dk(**dict(kw, dualkv_layout="not a layout"))


def test_unsupported_configs():
    """Attention dropout and non-causal attention are refused. (Sliding windows, softcapping and sinks
    are supported since issue 16: test_transformers_mask_models.py.)"""
    cfg = make_config("qwen3")
    cfg.attention_dropout = 0.1
    with pytest.raises(dualkv.UnsupportedError, match="attention dropout"):
        dkt.check_config(cfg)
    cfg = make_config("qwen3")
    cfg.is_causal = False
    with pytest.raises(dualkv.UnsupportedError, match="non-causal"):
        dkt.check_config(cfg)
    dkt.check_config(transformers.MistralConfig(**COMMON, sliding_window=16))
    dkt.check_config(transformers.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=16, max_window_layers=1))
    # a model built directly with attn_implementation="dualkv" and a window runs it
    torch.manual_seed(0)
    raw = transformers.AutoModelForCausalLM.from_config(
        transformers.MistralConfig(**COMMON, head_dim=8, sliding_window=16), attn_implementation="dualkv")
    raw(**dkt.model_inputs(pack(*rollouts())))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing(reentrant):
    base = dkt.enable(make_model("qwen3"))
    ckpt = copy.deepcopy(base)
    dkt.enable_checkpointing(ckpt, use_reentrant=reentrant)
    dkt.guard(ckpt)
    prompts, responses = rollouts()
    packed = pack(prompts, responses)
    for m in (base, ckpt):
        out = m.model(**dkt.model_inputs(packed))
        lp = response_logprobs(out.last_hidden_state, m.lm_head.weight, packed)
        (lp * packed.response_mask()).sum().backward()
    for (name, p), q in zip(base.named_parameters(), ckpt.parameters()):
        assert q.grad is not None, name
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7)


def test_torch_compile_fullgraph():
    """The whole HF model compiles with fullgraph=True (aot_eager backend: dynamo + AOTAutograd, no C++
    codegen, to keep the test fast on CPU; inductor was checked by hand); outputs and gradients equal
    eager mode. Default (automatic) dynamic shapes: after one recompile, new packed lengths and
    segment counts reuse the graph."""
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    eager = dkt.enable(make_model("qwen3"))
    comp_model = copy.deepcopy(eager)
    compiled = torch.compile(comp_model, backend="aot_eager", fullgraph=True)
    packed = pack(*rollouts())
    ref = eager(**dkt.model_inputs(packed)).logits
    out = compiled(**dkt.model_inputs(packed)).logits
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    ref.square().mean().backward()
    out.square().mean().backward()
    for (name, p), q in zip(eager.named_parameters(), comp_model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    g = torch.Generator().manual_seed(5)
    graphs = []
    for prompts, responses in (([6, 3], [[2, 2, 4], [1, 3]]), ([9], [[5, 1, 2, 7]])):  # new T and segment counts
        other = pack([torch.randint(0, VOCAB, (p,), generator=g) for p in prompts],
                     [[torch.randint(0, VOCAB, (r,), generator=g) for r in rs] for rs in responses])
        torch.testing.assert_close(compiled(**dkt.model_inputs(other)).logits,
                                   eager(**dkt.model_inputs(other)).logits, rtol=1e-6, atol=1e-6)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0], "a third layout recompiled: dynamic shapes did not take"
