"""pack / unpack: identity on random batches, list and padded inputs agree, bad input is rejected."""
import random

import pytest
import torch

import dualkv.packing as packing
from dualkv.layout import Layout
from dualkv.packing import PackedBatch, pack

VOCAB = 1000
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_groups(rng: random.Random, G=5, max_p=12, max_n=5, max_r=9):
    """Random groups with distinct prompts (first token = group index + 1 makes them distinct)."""
    prompts, responses = [], []
    for g in range(G):
        P = 1 if rng.random() < 0.2 else rng.randint(1, max_p)
        p = torch.tensor([g + 1] + [rng.randrange(VOCAB) for _ in range(P - 1)], dtype=torch.int64)
        N = 1 if rng.random() < 0.25 else rng.randint(1, max_n)
        rs = [torch.tensor([rng.randrange(VOCAB) for _ in range(1 if rng.random() < 0.2 else rng.randint(1, max_r))],
                           dtype=torch.int64) for _ in range(N)]
        prompts.append(p)
        responses.append(rs)
    return prompts, responses


def padded_batch(prompts, responses, rng: random.Random, shuffle=True, extra_p=3, extra_r=2, pad_id=0):
    """veRL-style batch: rows = responses (optionally shuffled), left-padded prompts, right-padded responses.

    Returns (input_ids, attention_mask, response_mask, uid (list of str), rows) where rows[b] = (g, i).
    """
    rows = [(g, i) for g in range(len(prompts)) for i in range(len(responses[g]))]
    if shuffle:
        rng.shuffle(rows)
    Lp = max(p.numel() for p in prompts) + extra_p
    Lr = max(r.numel() for rs in responses for r in rs) + extra_r
    B = len(rows)
    ids = torch.full((B, Lp + Lr), pad_id, dtype=torch.int64)
    am = torch.zeros(B, Lp + Lr, dtype=torch.int64)
    for b, (g, i) in enumerate(rows):
        p, r = prompts[g], responses[g][i]
        ids[b, Lp - p.numel():Lp] = p
        ids[b, Lp:Lp + r.numel()] = r
        am[b, Lp - p.numel():Lp + r.numel()] = 1
    return ids, am, am[:, Lp:].clone(), [f"uid-{g}" for g, _ in rows], rows


def check_packed(pb: PackedBatch, prompts, responses, rows):
    """Every invariant of a PackedBatch against the groups it was built from (rows[b] = (g, i))."""
    B = len(rows)
    T = pb.num_tokens
    ids = pb.input_ids[0]
    assert pb.input_ids.shape == (1, T) and pb.position_ids.shape == (1, T)
    assert pb.num_rows == B
    assert pb.layout.num_tokens == T
    unpacked_tokens = 0
    for b, (g, i) in enumerate(rows):
        P, r = prompts[g].numel(), responses[g][i]
        R = r.numel()
        off = int(pb.response_offsets[b])
        assert int(pb.response_lens[b]) == R
        assert torch.equal(ids[off:off + R], r)
        last = int(pb.prompt_last_index[b])
        assert torch.equal(ids[last - P + 1:last + 1], prompts[g])
        assert torch.equal(pb.position_ids[0, off:off + R], torch.arange(P, P + R))
        assert torch.equal(pb.position_ids[0, last - P + 1:last + 1], torch.arange(P))
        seg = int(pb.row_segment[b])
        assert int(pb.layout.seg_offsets[seg]) == off and int(pb.layout.seg_offsets[seg + 1]) == off + R
        assert int(pb.layout.seg_offsets[int(pb.layout.seg_parent[seg]) + 1]) == last + 1
        unpacked_tokens += P + R
    # rows of one group share its group index and prompt; different groups differ
    key = {}
    for b, (g, _) in enumerate(rows):
        key.setdefault(g, int(pb.row_group[b]))
        assert key[g] == int(pb.row_group[b])
    assert len(set(key.values())) == len(key) == pb.num_groups
    assert T == sum(p.numel() for p in prompts) + sum(r.numel() for rs in responses for r in rs)
    assert pb.rho == pytest.approx(unpacked_tokens / T)
    # unpack of the packed tokens is the padded response matrix
    out, mask = pb.unpack(pb.input_ids)
    assert out.shape == (B, pb.max_response_len) and mask.shape == (B, pb.max_response_len)
    for b, (g, i) in enumerate(rows):
        r = responses[g][i]
        assert torch.equal(out[b, :r.numel()], r)
        assert bool(mask[b, :r.numel()].all()) and not bool(mask[b, r.numel():].any())
        assert not bool(out[b, r.numel():].any())


@pytest.mark.parametrize("seed", range(6))
def test_pack_groups_roundtrip(seed):
    rng = random.Random(seed)
    prompts, responses = random_groups(rng, G=rng.randint(1, 6))
    pb = pack(prompts, responses)
    rows = [(g, i) for g in range(len(prompts)) for i in range(len(responses[g]))]
    check_packed(pb, prompts, responses, rows)
    assert pb.max_response_len == max(r.numel() for rs in responses for r in rs)
    assert isinstance(pb.layout, Layout)
    assert pb.layout.num_segments == len(prompts) + len(rows)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("uid_kind", ["str", "int_list", "tensor", "none"])
def test_pack_padded_roundtrip_interleaved(seed, uid_kind):
    rng = random.Random(100 + seed)
    prompts, responses = random_groups(rng, G=rng.randint(1, 6))
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng, shuffle=True, extra_p=rng.randint(0, 3),
                                          extra_r=rng.randint(0, 3), pad_id=rng.choice([0, 7]))
    if uid_kind == "int_list":
        uid = [1000 - g for g, _ in rows]
    elif uid_kind == "tensor":
        uid = torch.tensor([3 * g + 5 for g, _ in rows], dtype=torch.int32)
    elif uid_kind == "none":
        uid = None
    pb = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
    check_packed(pb, prompts, responses, rows)
    assert pb.max_response_len == rm.shape[1]
    # groups are numbered by first appearance; rows of a group in row order
    first_seen = []
    for g, _ in rows:
        if g not in first_seen:
            first_seen.append(g)
    for b, (g, _) in enumerate(rows):
        assert int(pb.row_group[b]) == first_seen.index(g)
    for k, g in enumerate(first_seen):
        assert list(pb.group_rows[k]) == [b for b, (gg, _) in enumerate(rows) if gg == g]
        assert pb.group_prompt_lens[k] == prompts[g].numel()


@pytest.mark.parametrize("seed", range(4))
def test_padded_and_list_inputs_agree(seed):
    rng = random.Random(200 + seed)
    prompts, responses = random_groups(rng, G=rng.randint(1, 5))
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng, shuffle=False, extra_r=0)
    a = pack(prompts, responses)
    for kw in (dict(response_mask=rm, uid=uid), dict(response_mask=rm), dict(response_length=rm.shape[1], uid=uid),
               dict(response_lens=rm.sum(1), response_length=rm.shape[1]),
               dict(response_mask=rm, response_lens=rm.sum(1).tolist())):
        b = pack(input_ids=ids, attention_mask=am, **kw)
        for name in ("input_ids", "position_ids", "row_group", "row_segment", "response_offsets", "response_lens",
                     "prompt_last_index"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert torch.equal(a.layout.seg_offsets, b.layout.seg_offsets)
        assert torch.equal(a.layout.seg_parent, b.layout.seg_parent)
        assert a.rho == b.rho and a.max_response_len == b.max_response_len
        assert a.group_rows == b.group_rows and a.group_prompt_lens == b.group_prompt_lens
        assert a.row_response_lens == b.row_response_lens


def test_bool_masks_and_numpy_uid():
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    prompts, responses = random_groups(rng, G=4)
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng)
    pb = pack(input_ids=ids, attention_mask=am.bool(), response_mask=rm.bool(), uid=np.array(uid, dtype=object))
    check_packed(pb, prompts, responses, rows)


def test_identical_prompts_without_uid_merge_and_with_uid_stay_apart():
    p = torch.tensor([5, 6, 7])
    rs = [[torch.tensor([1, 2])], [torch.tensor([3])]]
    prompts = [p, p.clone()]
    ids, am, rm, uid, rows = padded_batch(prompts, rs, random.Random(0), shuffle=False)
    merged = pack(input_ids=ids, attention_mask=am, response_mask=rm)
    assert merged.num_groups == 1 and merged.group_rows == ((0, 1),)
    assert merged.rho == pytest.approx((3 + 2 + 3 + 1) / (3 + 2 + 1))
    apart = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=[0, 1])
    assert apart.num_groups == 2


def test_hash_collision_falls_back_to_exact_grouping(monkeypatch):
    rng = random.Random(3)
    prompts, responses = random_groups(rng, G=5)
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng)
    monkeypatch.setattr(packing, "_prompt_hash", lambda ids, pm, plen: torch.zeros(ids.shape[0], dtype=torch.int64))
    pb = pack(input_ids=ids, attention_mask=am, response_mask=rm)
    check_packed(pb, prompts, responses, rows)


def test_single_token_segments_and_single_row():
    prompts = [torch.tensor([9])]
    responses = [[torch.tensor([4])]]
    pb = pack(prompts, responses)
    assert pb.num_tokens == 2 and pb.rho == 1.0
    check_packed(pb, prompts, responses, [(0, 0)])


def test_unpack_feature_dims_gradient_and_batch_dim():
    rng = random.Random(11)
    prompts, responses = random_groups(rng, G=3)
    pb = pack(prompts, responses)
    T = pb.num_tokens
    x = torch.randn(T, 3, 2, requires_grad=True)
    out, mask = pb.unpack(x)
    assert out.shape == (pb.num_rows, pb.max_response_len, 3, 2)
    out2, _ = pb.unpack(x.unsqueeze(0))
    assert torch.equal(out, out2)
    idx = pb.response_offsets[:, None] + torch.arange(pb.max_response_len)
    for b in range(pb.num_rows):
        R = int(pb.response_lens[b])
        assert torch.equal(out[b, :R], x[idx[b, :R]])
        assert not bool(out[b, R:].any())
    out.sum().backward()
    expect = torch.zeros(T)
    for b in range(pb.num_rows):
        o, R = int(pb.response_offsets[b]), int(pb.response_lens[b])
        expect[o:o + R] = 1
    assert torch.equal(x.grad[:, 0, 0], expect)
    filled, _ = pb.unpack(torch.ones(T), fill=-1.0)
    assert torch.equal(filled[~mask], torch.full((int((~mask).sum()),), -1.0))
    with pytest.raises(ValueError, match="per-token tensor"):
        pb.unpack(torch.ones(T + 1))


def test_groups_view_feeds_planner():
    from dualkv.microbatch import plan_micro_batches
    rng = random.Random(5)
    prompts, responses = random_groups(rng, G=4)
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng)
    pb = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
    groups = pb.groups()
    assert sum(p + sum(rs) for p, rs in groups) == pb.num_tokens
    plan = plan_micro_batches(groups, max_tokens=pb.num_tokens)
    assert plan.total_tokens == pb.num_tokens
    # micro-batches of at most ~half the tokens, rows selected from the padded batch and re-packed
    budget = max(p + max(rs) for p, rs in groups) + pb.num_tokens // 2
    plan = plan_micro_batches(groups, max_tokens=budget, num_ranks=2)
    seen = []
    for mbs in plan.ranks:
        for mb in mbs:
            if not mb.entries:
                continue
            rows = mb.rows(pb.group_rows)
            seen.extend(rows)
            sub = pack(input_ids=ids[rows], attention_mask=am[rows], response_mask=rm[rows],
                       uid=[uid[r] for r in rows])
            assert sub.num_tokens == mb.num_tokens <= budget
    assert sorted(seen) == list(range(pb.num_rows))


def test_large_batch_is_fast_enough():
    # 64 rows, P up to 512, R up to 256: a smoke test that nothing is quadratic in Python
    rng = random.Random(9)
    prompts, responses = random_groups(rng, G=8, max_p=512, max_n=8, max_r=256)
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng)
    pb = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
    check_packed(pb, prompts, responses, rows)


# ---- bad input -----------------------------------------------------------------------------------


def _simple():
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    responses = [[torch.tensor([6, 7]), torch.tensor([8])], [torch.tensor([9, 10, 11])]]
    ids, am, rm, uid, rows = padded_batch(prompts, responses, random.Random(0), shuffle=False, extra_p=1, extra_r=1)
    return ids, am, rm, uid


def test_rows_of_one_group_with_different_prompts():
    ids, am, rm, uid = _simple()
    ids = ids.clone()
    ids[1, 3] = 99  # row 1 shares uid with row 0 but its last prompt token differs
    with pytest.raises(ValueError, match=r"same uid have different prompt tokens: rows 1 vs 0"):
        pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
    # different prompt length inside one uid
    ids2, am2 = ids.clone(), am.clone()
    am2[1, 1] = 0
    ids2[1, 3] = ids[0, 3]
    with pytest.raises(ValueError, match="different prompt tokens: rows 1 vs 0"):
        pack(input_ids=ids2, attention_mask=am2, response_mask=rm, uid=uid)
    # without uid the same rows are simply two groups
    assert pack(input_ids=ids, attention_mask=am, response_mask=rm).num_groups == 3


def test_empty_responses_and_prompts():
    ids, am, rm, uid = _simple()
    am2, rm2 = am.clone(), rm.clone()
    Lp = ids.shape[1] - rm.shape[1]
    am2[1, Lp:] = 0
    rm2[1] = 0
    with pytest.raises(ValueError, match=r"response of length 0: rows \[1\]"):
        pack(input_ids=ids, attention_mask=am2, response_mask=rm2, uid=uid)
    am3 = am.clone()
    am3[2, :Lp] = 0
    with pytest.raises(ValueError, match=r"prompt of length 0.*rows \[2\]"):
        pack(input_ids=ids, attention_mask=am3, response_mask=rm)
    with pytest.raises(ValueError, match=r"responses\[0\]\[1\] is empty \(response of length 0\)"):
        pack([torch.tensor([1])], [[torch.tensor([2]), torch.tensor([], dtype=torch.int64)]])
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        pack([torch.tensor([], dtype=torch.int64)], [[torch.tensor([2])]])
    with pytest.raises(ValueError, match="group 0 has no responses"):
        pack([torch.tensor([1])], [[]])


def test_masks_with_holes():
    ids, am, rm, uid = _simple()
    Lp = ids.shape[1] - rm.shape[1]
    am2 = am.clone()
    am2[0, Lp - 2] = 0  # hole inside the prompt of row 0
    with pytest.raises(ValueError, match=r"not left-padded.*rows \[0\]"):
        pack(input_ids=ids, attention_mask=am2, response_mask=rm, uid=uid)
    am3, rm3 = am.clone(), rm.clone()
    am3[2, Lp + 1] = 0  # hole inside the response of row 2
    rm3[2, 1] = 0
    with pytest.raises(ValueError, match=r"not right-padded.*rows \[2\]"):
        pack(input_ids=ids, attention_mask=am3, response_mask=rm3, uid=uid)
    with pytest.raises(ValueError, match=r"not right-padded.*rows \[2\]"):
        pack(input_ids=ids, attention_mask=am3, response_length=rm.shape[1], uid=uid)
    am4 = am.clone()
    am4[0, -1] = 1  # attention covers a token the response mask excludes
    with pytest.raises(ValueError, match=r"disagrees with attention_mask.*rows \[0\]"):
        pack(input_ids=ids, attention_mask=am4, response_mask=rm, uid=uid)
    am5 = am.clone()
    am5[1, 0] = 2
    with pytest.raises(ValueError, match=r"values other than 0 and 1.*rows \[1\]"):
        pack(input_ids=ids, attention_mask=am5, response_mask=rm, uid=uid)
    with pytest.raises(ValueError, match=r"response_lens outside"):
        pack(input_ids=ids, attention_mask=am, response_lens=[2, 1, 9], response_length=rm.shape[1])
    with pytest.raises(ValueError, match=r"response_lens disagrees"):
        pack(input_ids=ids, attention_mask=am, response_mask=rm, response_lens=[2, 2, 3])


def test_shapes_types_and_uid_mismatch():
    ids, am, rm, uid = _simple()
    with pytest.raises(ValueError, match="attention_mask shape"):
        pack(input_ids=ids, attention_mask=am[:, 1:], response_mask=rm)
    with pytest.raises(ValueError, match="response_mask must be"):
        pack(input_ids=ids, attention_mask=am, response_mask=rm[:2])
    with pytest.raises(ValueError, match="input_ids must be"):
        pack(input_ids=ids[0], attention_mask=am, response_mask=rm)
    with pytest.raises(ValueError, match="cannot split"):
        pack(input_ids=ids, attention_mask=am, response_length=ids.shape[1])
    with pytest.raises(TypeError, match=r"pass response_mask \[B, Lr\] or response_length"):
        pack(input_ids=ids, attention_mask=am)
    with pytest.raises(TypeError, match="attention_mask"):
        pack(input_ids=ids, attention_mask=None, response_mask=rm)
    with pytest.raises(TypeError, match="integer token ids"):
        pack(input_ids=ids.float(), attention_mask=am, response_mask=rm)
    with pytest.raises(ValueError, match=r"uid has 2 entries for 3 rows \(uid length mismatch\)"):
        pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid[:2])
    with pytest.raises(ValueError, match="uid length mismatch"):
        pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="uid"):
        pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=torch.tensor([0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match=r"response_lens has 2 entries"):
        pack(input_ids=ids, attention_mask=am, response_lens=[1, 2], response_length=rm.shape[1])
    with pytest.raises(TypeError, match="not both"):
        pack([torch.tensor([1])], [[torch.tensor([2])]], input_ids=ids)
    with pytest.raises(TypeError, match="only applies to a padded batch"):
        pack([torch.tensor([1])], [[torch.tensor([2])]], uid=[0])
    with pytest.raises(ValueError, match="2 prompts but 1 response lists"):
        pack([torch.tensor([1]), torch.tensor([2])], [[torch.tensor([2])]])
    with pytest.raises(ValueError, match=r"responses\[0\]\[0\] must be 1-D"):
        pack([torch.tensor([1])], [[torch.tensor([[2]])]])
    with pytest.raises(TypeError, match="integer token ids"):
        pack([torch.tensor([1.0])], [[torch.tensor([2])]])
    with pytest.raises(TypeError, match="expected a tensor"):
        pack([[1, 2]], [[torch.tensor([2])]])


@cuda
def test_cuda_matches_cpu():
    rng = random.Random(21)
    prompts, responses = random_groups(rng, G=6, max_p=300, max_r=100)
    ids, am, rm, uid, rows = padded_batch(prompts, responses, rng)
    cpu = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
    for u in (uid, None, torch.tensor([int(x.split("-")[1]) for x in uid]).cuda()):
        gpu = pack(input_ids=ids.cuda(), attention_mask=am.cuda(), response_mask=rm.cuda(), uid=u)
        assert gpu.input_ids.is_cuda and gpu.layout.device.type == "cuda"
        for name in ("input_ids", "position_ids", "row_group", "row_segment", "response_offsets", "response_lens",
                     "prompt_last_index"):
            assert torch.equal(getattr(cpu, name), getattr(gpu, name).cpu()), name
        out, mask = gpu.unpack(gpu.input_ids)
        ref, rmask = cpu.unpack(cpu.input_ids)
        assert torch.equal(out.cpu(), ref) and torch.equal(mask.cpu(), rmask)
    gl = pack([p.cuda() for p in prompts], [[r.cuda() for r in rs] for rs in responses])
    cl = pack(prompts, responses)
    assert torch.equal(gl.input_ids.cpu(), cl.input_ids)


def _count_syncs(fn) -> int:
    """Synchronizing CUDA calls made by fn (torch's sync debug mode), after a warm-up call."""
    import warnings
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


@cuda
def test_cuda_host_syncs_do_not_grow_with_rows():
    from dualkv.logprobs import response_logprobs
    counts = []
    for G, n in ((2, 2), (12, 8)):
        rng = random.Random(G)
        prompts, responses = random_groups(rng, G=G, max_n=n)
        ids, am, rm, uid, rows = padded_batch(prompts, responses, rng)
        ids, am, rm = ids.cuda(), am.cuda(), rm.cuda()
        pb = pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)
        h = torch.randn(pb.num_tokens, 16, device="cuda", requires_grad=True)
        w = torch.randn(VOCAB, 16, device="cuda", requires_grad=True)

        def logprobs():
            response_logprobs(h, w, pb, chunk_size=8).sum().backward()

        counts.append((_count_syncs(lambda: pack(input_ids=ids, attention_mask=am, response_mask=rm, uid=uid)),
                       _count_syncs(lambda: pack(input_ids=ids, attention_mask=am, response_mask=rm)),
                       _count_syncs(logprobs)))
    # pack reads the lengths back once; torch's caching host allocator may add one synchronizing
    # pinned allocation when the staging block of the previous call is still in flight (seen on
    # an H200 with torch 2.11: 2 syncs for the first, small batch, 1 for the larger one). What
    # must hold: a small constant, independent of the batch size, and none in the log-probs.
    for pack_uid, pack_hash, lp in counts:
        assert pack_uid <= 2 and pack_hash <= 2 and lp == 0, f"host syncs (pack uid, pack hash, logprobs): {counts}"


def test_multi_turn_loss_mask_with_holes():
    """veRL multi-turn: attention covers the whole response, the loss mask has holes at tool tokens.
    Packing with response_length works and the [B, Lr] columns line up with the loss mask; passing
    the loss mask as response_mask is refused with a message that says what to do."""
    ids, am, rm, uid = _simple()
    Lr = rm.shape[1]
    Lp = ids.shape[1] - Lr
    loss_mask = rm.clone()
    loss_mask[2, 1] = 0  # a "tool" token in the middle of row 2's response
    with pytest.raises(ValueError, match=r"pass response_length=Lr instead"):
        pack(input_ids=ids, attention_mask=am, response_mask=loss_mask, uid=uid)
    packed = pack(input_ids=ids, attention_mask=am, response_length=Lr, uid=uid)
    assert packed.response_lens.tolist() == rm.sum(1).tolist()
    tokens, mask = packed.unpack(packed.input_ids[0].float())
    assert tokens.shape == (ids.shape[0], Lr) and torch.equal(mask, rm.bool())
    assert torch.equal(tokens[mask].long(), ids[:, Lp:][rm.bool()])  # the response's own columns
    assert torch.equal((mask & loss_mask.bool()), loss_mask.bool())  # the loss mask applies as is


def test_mixed_token_dtypes_promote_instead_of_narrowing():
    """Issue 22: every token tensor was cast to the first prompt's dtype (uint8 + int64: 300 -> 44)."""
    pb = pack([torch.tensor([1, 2], dtype=torch.uint8)], [[torch.tensor([300], dtype=torch.int64)]])
    assert pb.input_ids.dtype == torch.int64
    assert pb.input_ids.tolist() == [[1, 2, 300]]
    pb = pack([torch.tensor([5], dtype=torch.int32)], [[torch.tensor([7], dtype=torch.int16)]])
    assert pb.input_ids.dtype == torch.int32 and pb.input_ids.tolist() == [[5, 7]]
