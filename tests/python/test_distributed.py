"""dualkv.distributed in one process: the token-order log-prob index and its parts, the single-rank
path (no group), autocast in the fused log-prob path, the forward redirection that FSDP2 needs, the
placeholder micro-batch; the standard path's rows (shard_rows, rows_response_logprobs) and the
Ulysses wrapper without a group. The multi-rank tests (gloo, 2 and 4 processes) are in
test_distributed_ranks.py."""
import random

import pytest
import torch

import dualkv
from dualkv import distributed
from dualkv.logprobs import _index, response_logprobs
from dualkv.packing import pack

transformers = pytest.importorskip("transformers")

from dualkv.integrations import transformers as dkt  # noqa: E402


def random_packed(rng: random.Random, groups: int, vocab: int = 50, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (rng.randint(1, 9),), generator=g) for _ in range(groups)]
    responses = [[torch.randint(0, vocab, (rng.randint(1, 6),), generator=g) for _ in range(rng.randint(1, 4))]
                 for _ in range(groups)]
    return pack(prompts, responses)


@pytest.mark.parametrize("seed", range(6))
def test_index_parts_tile_the_whole_index(seed):
    """Selected rows are in token order, so any token range is one contiguous range of selected rows
    and of outputs, and the parts of a partition of [0, T) put together are the whole index."""
    rng = random.Random(seed)
    packed = random_packed(rng, rng.randint(1, 6), seed=seed)
    idx = _index(packed)
    T = packed.num_tokens
    assert bool((idx.sel_idx[1:] > idx.sel_idx[:-1]).all()), "selected rows in token order"
    assert bool((idx.out_row[1:] >= idx.out_row[:-1]).all()), "outputs sorted by selected row"
    cuts = sorted({0, T} | {rng.randint(0, T) for _ in range(rng.randint(0, 5))})
    chunk = rng.randint(1, 7)
    sel, labels, out_row, out_end = [], [], [], 0
    for lo, hi in zip(cuts, cuts[1:]):
        part = idx.part(lo, hi, chunk)
        assert part.out_range[0] == out_end
        out_end = part.out_range[1]
        s_lo = len(sel)
        sel += (part.sel_idx + lo).tolist()
        labels += part.labels.tolist()
        out_row += (part.out_row + s_lo).tolist()
        assert all(lo <= t < hi for t in (part.sel_idx + lo).tolist())
        for s0, s1, o0, o1 in part.chunks:  # a chunk's outputs are exactly those of its rows
            assert ((part.out_row[o0:o1] >= s0) & (part.out_row[o0:o1] < s1)).all()
        assert [c[0] for c in part.chunks] == list(range(0, part.sel_idx.numel(), chunk))
    assert out_end == idx.num_out
    assert sel == idx.sel_idx.tolist() and labels == idx.labels.tolist() and out_row == idx.out_row.tolist()


def test_shard_without_group_is_the_single_rank_path():
    packed = random_packed(random.Random(3), 4)
    sh = distributed.shard(packed)
    assert sh.size == 1 and sh.rank == 0 and sh.layout is packed.layout
    assert sh.input_ids is packed.input_ids or torch.equal(sh.input_ids, packed.input_ids)
    assert torch.equal(sh.position_ids, packed.position_ids)
    assert (sh.start, sh.stop, sh.num_tokens) == (0, packed.num_tokens, packed.num_tokens)
    g = torch.Generator().manual_seed(0)
    T, H, Hk, D, V = packed.num_tokens, 4, 2, 8, 50
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(T, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    assert torch.equal(distributed.attention(q, k, v, sh), dualkv.attention(q, k, v, packed.layout))
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    a, ea = distributed.response_logprobs(h, w, sh, entropy=True)
    b, eb = response_logprobs(h, w, packed, entropy=True)
    assert torch.equal(a, b) and torch.equal(ea, eb)
    with pytest.raises(dualkv.ArgumentError, match="rank 0 got 5 tokens but its shard holds"):
        sh.check_tokens(5)
    with pytest.raises(dualkv.ArgumentError, match="q has 3 tokens"):
        distributed.attention(q[:3], k[:3], v[:3], sh)
    with pytest.raises(TypeError, match="expected a dualkv.PackedBatch or Layout"):
        distributed.shard(packed.input_ids)
    bare = distributed.shard(packed.layout)
    assert bare.input_ids is None and torch.equal(bare.position_ids, packed.position_ids)
    assert torch.equal(distributed.attention(q, k, v, bare), dualkv.attention(q, k, v, packed.layout))
    with pytest.raises(TypeError, match="no token ids"):
        bare.model_inputs()
    with pytest.raises(TypeError, match="of a PackedBatch"):
        distributed.response_logprobs(q[:, 0], q[:1, 0], bare)


def unpacked_rows(rng: random.Random, groups: int, vocab: int = 50, seed: int = 0):
    """(rows, prompt + response length of every row): each response of random_packed's groups with its
    own prompt copy, the standard path's rows."""
    packed = random_packed(rng, groups, vocab, seed)
    ids = packed.input_ids[0]
    prompts, responses = [], []
    for b in range(packed.num_rows):
        last, g = int(packed.prompt_last_index[b]), int(packed.row_group[b])
        prompts.append(ids[last - packed.group_prompt_lens[g] + 1:last + 1])
        first = int(packed.response_offsets[b])
        responses.append([ids[first:first + packed.row_response_lens[b]]])
    rows = pack(prompts, responses)
    return rows, [p.numel() + r[0].numel() for p, r in zip(prompts, responses)]


@pytest.mark.parametrize("seed", range(3))
def test_rows_without_group_are_the_single_rank_standard_path(seed):
    """shard_rows / rows_response_logprobs / ulysses_attention without a group: the rows right-padded
    to the longest one, log-probs (and entropy, values and gradients) equal response_logprobs on the
    real tokens, and the attention wrapper is the attention it wraps."""
    rows, lens = unpacked_rows(random.Random(seed), 4, seed=seed)
    sh = distributed.shard_rows(rows)
    L = max(lens)
    assert (sh.size, sh.rank, sh.length, sh.start, sh.stop) == (1, 0, L, 0, L)
    valid = torch.arange(L).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
    assert torch.equal(sh.input_ids[valid], rows.input_ids[0]) and not sh.input_ids[~valid].any()
    assert torch.equal(sh.position_ids, torch.arange(L).expand(rows.num_rows, -1))
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows.num_rows, L, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=True)
    a, ea = distributed.rows_response_logprobs(h, w, sh, entropy=True, chunk_size=3)
    b, eb = response_logprobs(h[valid], w, rows, entropy=True)
    assert (a - b).abs().max() <= 1e-12 and (ea - eb).abs().max() <= 1e-12
    weights = torch.randn(a.shape, generator=g, dtype=torch.float64)
    ga = torch.autograd.grad((a * weights).sum() + ea.sum(), [h, w])
    gb = torch.autograd.grad((b * weights).sum() + eb.sum(), [h, w])
    assert all((x - y).abs().max() <= 1e-12 for x, y in zip(ga, gb))
    q = torch.randn(2, 5, 4, 8, generator=g, dtype=torch.float64)
    assert distributed.ulysses_attention(q, q, q, None, lambda *x: x[0] + 1).equal(q + 1)


def test_rows_bad_input():
    packed = random_packed(random.Random(1), 3)
    with pytest.raises(dualkv.ArgumentError, match="exactly one response"):
        distributed.shard_rows(pack([torch.tensor([1, 2])], [[torch.tensor([3]), torch.tensor([4])]]))
    with pytest.raises(TypeError, match="PackedBatch of unpacked rows"):
        distributed.shard_rows(packed.layout)
    rows, lens = unpacked_rows(random.Random(1), 3)
    sh = distributed.shard_rows(rows)
    w = torch.randn(50, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="hidden must be"):
        distributed.rows_response_logprobs(torch.randn(rows.num_rows, sh.length + 1, 8, dtype=torch.float64), w, sh)
    with pytest.raises(dualkv.ArgumentError, match="token ids must lie in"):
        distributed.rows_response_logprobs(torch.randn(rows.num_rows, sh.length, 8, dtype=torch.float64), w[:3], sh)
    with pytest.raises(TypeError, match="must be a RowShard"):
        distributed.rows_response_logprobs(torch.randn(1, 2, 8), w, distributed.shard(packed))


@pytest.mark.parametrize("entropy", [False, True])
def test_fused_logprobs_respect_autocast(entropy):
    """Under autocast(bf16) the fused LM head takes bf16 operands (as the model's lm_head would),
    with an fp32 result; backward called inside the autocast region still runs its fp32 path (it
    used to be downcast there). The weight gradient reaches the fp32 weight."""
    packed = random_packed(random.Random(1), 3)
    g = torch.Generator().manual_seed(1)
    T, D, V = packed.num_tokens, 16, 50
    h32 = torch.randn(T, D, generator=g).requires_grad_()
    w32 = torch.randn(V, D, generator=g).requires_grad_()
    h16 = h32.detach().bfloat16().requires_grad_()
    w16 = w32.detach().bfloat16().requires_grad_()
    cot = torch.randn(packed.num_rows, packed.max_response_len, generator=g)

    def loss(out):
        return sum((o * cot).sum() for o in (out if entropy else (out,)))

    want = response_logprobs(h16, w16, packed, entropy=entropy)
    loss(want).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = response_logprobs(h32, w32, packed, entropy=entropy)
        loss(got).backward()
    for a, b in zip(got if entropy else (got,), want if entropy else (want,)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert w32.grad.dtype == torch.float32 and h32.grad.dtype == torch.float32
    torch.testing.assert_close(h32.grad, h16.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w32.grad, w16.grad.float(), rtol=0, atol=0)
    # without autocast the same fp32 inputs take the fp32 path: a different (more exact) result
    assert not torch.equal(response_logprobs(h32, w32, packed), want if not entropy else want[0])


def tiny_model(seed=0):
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, vocab_size=50, max_position_embeddings=128,
                                   attention_dropout=0.0, use_cache=False)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="dualkv").double()


def test_packed_logprobs_runs_inside_the_model_forward():
    """packed_logprobs calls model(...) with its own forward in place, so the root module's hooks
    (FSDP2's unshard of the LM head, autocast wrappers) run around it; the forward is restored."""
    model = dkt.guard(tiny_model())
    packed = random_packed(random.Random(2), 3)
    calls = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(sorted(kwargs)), with_kwargs=True)
    got = dkt.packed_logprobs(model, packed)
    assert calls and "dualkv_layout" in calls[0]
    assert "forward" not in model.__dict__
    hidden = model.model(**dkt.model_inputs(packed)).last_hidden_state
    assert torch.equal(got, response_logprobs(hidden, model.lm_head.weight, packed))
    def broken(**kwargs):
        raise RuntimeError("inside")
    model.model.forward = broken
    with pytest.raises(RuntimeError, match="inside"):  # an error inside still restores the forward
        dkt.packed_logprobs(model, packed)
    assert "forward" not in model.__dict__
    del model.model.forward
    sh = distributed.shard(packed)
    assert torch.equal(dkt.packed_logprobs(model, sh), got)


def test_reference_attention_on_a_one_rank_shard():
    """"dualkv_reference" (the dense-mask check path) takes the single-rank path's shard, the whole
    layout, as the plain layout (a one-process --check of a trainer runs it that way)."""
    model = dkt.enable(tiny_model(), reference=True)
    packed = random_packed(random.Random(4), 3)
    expected = dkt.packed_logprobs(model, packed)
    assert torch.equal(dkt.packed_logprobs(model, distributed.shard(packed)), expected)
    dkt.disable(model, "dualkv")
    assert torch.allclose(dkt.packed_logprobs(model, packed), expected, rtol=0, atol=1e-10)


def test_placeholder_batch():
    pb = distributed.placeholder_batch("cpu")
    assert pb.num_tokens == 2 and pb.num_rows == 1 and pb.num_groups == 1
    model = dkt.guard(tiny_model())
    logp = dkt.packed_logprobs(model, pb)
    (logp.sum() * 0).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters() if p.requires_grad
               and p is not model.model.embed_tokens.weight)


def test_agree_without_group():
    distributed.agree(None, "cpu", None, "x", {"a": 1})
    with pytest.raises(dualkv.LayoutError, match="what: bad"):
        distributed.agree(None, "cpu", "bad", "what", error=dualkv.LayoutError)
