"""response_logprobs equals the UNPACKED computation: values and gradients, entropy, temperature.

The equivalence being tested: in the unpacked batch, row b is ``prompt_g + response_b`` and (by
causality) its prompt hidden states equal the packed prompt's. So unpacked hidden states are built
by *indexing* the packed ones; autograd through that index sums the N rows' gradients into the
shared prompt positions, exactly what the packed computation must reproduce.
"""
import random

import pytest
import torch

import dualkv
from dualkv.logprobs import response_logprobs, response_logprobs_from_logits
from dualkv.packing import pack

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_packed(seed, G=4, max_p=7, max_n=4, max_r=6, vocab=37, device="cpu"):
    rng = random.Random(seed)
    prompts, responses = [], []
    for g in range(G):
        P = rng.randint(1, max_p)
        prompts.append(torch.tensor([rng.randrange(vocab) for _ in range(P)], device=device))
        N = 1 if g == 0 else rng.randint(1, max_n)
        rs = []
        for i in range(N):
            R = 1 if rng.random() < 0.25 else rng.randint(1, max_r)
            rs.append(torch.tensor([rng.randrange(vocab) for _ in range(R)], device=device))
        if N > 1:  # two responses starting with the same token: one logits row, equal labels
            rs[1][0] = rs[0][0]
        responses.append(rs)
    return pack(prompts, responses)


def unpacked_reference(hidden, weight, pb, temperature=1.0):
    """Log-probs and entropy [B, R_max] from the unpacked rows (prompt + response), plain autograd."""
    B, R_max = pb.num_rows, pb.max_response_len
    ids = pb.input_ids[0]
    lp = hidden.new_zeros(B, R_max)
    ent = hidden.new_zeros(B, R_max)
    lp_rows, ent_rows = [], []
    for b in range(B):
        last = int(pb.prompt_last_index[b])
        P = pb.group_prompt_lens[int(pb.row_group[b])]
        off, R = int(pb.response_offsets[b]), int(pb.response_lens[b])
        idx = torch.cat([torch.arange(last - P + 1, last + 1), torch.arange(off, off + R)]).to(hidden.device)
        h = hidden[idx]  # the unpacked row's hidden states (prompt shared with the packed stream)
        tokens = ids[idx]
        logits = (h @ weight.t()) / temperature
        logsm = torch.log_softmax(logits, dim=-1)
        # token t of the response (unpacked position P + t) is predicted by position P + t - 1
        pred = logsm[P - 1:P - 1 + R]
        lp_rows.append((b, R, pred.gather(1, tokens[P:P + R, None])[:, 0]))
        ent_rows.append((b, R, -(pred.exp() * pred).sum(-1)))
    lp = torch.stack([torch.cat([v, v.new_zeros(R_max - R)]) for _, R, v in lp_rows])
    ent = torch.stack([torch.cat([v, v.new_zeros(R_max - R)]) for _, R, v in ent_rows])
    return lp, ent


def _grads(out, inputs, seeds):
    loss = sum((o * s).sum() for o, s in zip(out, seeds))
    return torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("chunk_size", [2, 5, None])
def test_fused_matches_unpacked_fp64(seed, temperature, entropy, chunk_size):
    pb = random_packed(seed)
    T, D, V = pb.num_tokens, 8, 37
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    ref_lp, ref_ent = unpacked_reference(hidden, weight, pb, temperature)
    out = response_logprobs(hidden, weight, pb, temperature=temperature, entropy=entropy, chunk_size=chunk_size)
    if entropy:
        lp, ent = out
        torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-12)
    else:
        lp = out
    assert lp.dtype == torch.float64 and lp.shape == (pb.num_rows, pb.max_response_len)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-12, atol=1e-12)
    assert not bool(lp[~pb.response_mask()].any())
    seeds = [torch.randn(lp.shape, generator=g, dtype=torch.float64) for _ in range(2)]
    mine = _grads([lp, ent] if entropy else [lp], [hidden, weight], seeds)
    ref = _grads([ref_lp, ref_ent] if entropy else [ref_lp], [hidden, weight], seeds)
    for a, b in zip(mine, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("entropy", [False, True])
def test_fused_fp32_against_fp64_reference(seed, entropy):
    pb = random_packed(10 + seed, G=3, max_r=9)
    T, D, V = pb.num_tokens, 16, 37
    g = torch.Generator().manual_seed(seed)
    h64 = torch.randn(T, D, generator=g, dtype=torch.float64)
    w64 = torch.randn(V, D, generator=g, dtype=torch.float64) * 0.5
    h32 = h64.float().requires_grad_()
    w32 = w64.float().requires_grad_()
    h64.requires_grad_()
    w64.requires_grad_()
    ref_lp, ref_ent = unpacked_reference(h64, w64, pb, 1.3)
    out = response_logprobs(h32.unsqueeze(0), w32, pb, temperature=1.3, entropy=entropy, chunk_size=5)
    lp = out[0] if entropy else out
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    if entropy:
        torch.testing.assert_close(out[1].double(), ref_ent, rtol=1e-5, atol=1e-5)
    seeds = [torch.randn(lp.shape, generator=g, dtype=torch.float64) for _ in range(2)]
    mine = _grads(list(out) if entropy else [out], [h32, w32], [s.float() for s in seeds])
    ref = _grads([ref_lp, ref_ent] if entropy else [ref_lp], [h64, w64], seeds)
    for a, b in zip(mine, ref):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def test_shared_prompt_position_gets_summed_gradient():
    # one group, 3 responses: the last prompt position predicts 3 first tokens
    pb = pack([torch.tensor([1, 2, 3])], [[torch.tensor([4]), torch.tensor([5, 6]), torch.tensor([4, 7])]])
    hidden = torch.randn(pb.num_tokens, 4, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    lp = response_logprobs(hidden, weight, pb)
    lp[:, 0].sum().backward()
    z = hidden[2] @ weight.t()
    p = torch.softmax(z, 0).detach()
    onehot = torch.zeros(9, dtype=torch.float64)
    for tok in (4, 5, 4):
        onehot[tok] += 1
    torch.testing.assert_close(hidden.grad[2], (onehot - 3 * p) @ weight.detach())
    assert not bool(hidden.grad[torch.tensor([0, 1, 3, 4, 5, 6, 7])].any())


@pytest.mark.parametrize("entropy", [False, True])
def test_from_logits_matches_fused(entropy):
    pb = random_packed(3)
    T, D, V = pb.num_tokens, 8, 37
    hidden = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, dtype=torch.float64)
    a = response_logprobs(hidden, weight, pb, temperature=0.9, entropy=entropy)
    b = response_logprobs_from_logits((hidden @ weight.t()).unsqueeze(0), pb, temperature=0.9, entropy=entropy)
    a, b = (a, b) if entropy else ((a,), (b,))
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    ga = torch.autograd.grad(sum(x.sum() for x in a), hidden)[0]
    gb = torch.autograd.grad(sum(x.sum() for x in b), hidden)[0]
    torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-12)
    # bf16 logits are upcast: the result is fp32
    lp16 = response_logprobs_from_logits((hidden @ weight.t()).detach().bfloat16(), pb)
    assert lp16.dtype == torch.float32


def test_bf16_inputs_give_fp32_logprobs_and_grads():
    pb = random_packed(5, G=3)
    T, D, V = pb.num_tokens, 32, 37
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.2).bfloat16().requires_grad_()
    lp, ent = response_logprobs(h, w, pb, entropy=True, chunk_size=4)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref_lp, ref_ent = unpacked_reference(h64, w64, pb)
    # inputs are exact bf16 values and the math runs in fp32: far tighter than bf16 rounding (~1e-2)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=1e-5, atol=1e-5)
    (lp.sum() + ent.sum()).backward()
    (ref_lp.sum() + ref_ent.sum()).backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-2, atol=2e-2)


def test_frozen_weight_and_no_grad():
    pb = random_packed(6)
    hidden = torch.randn(pb.num_tokens, 8, requires_grad=True)
    weight = torch.randn(37, 8)
    lp = response_logprobs(hidden, weight, pb, chunk_size=2)
    lp.sum().backward()
    assert hidden.grad is not None and weight.grad is None
    with torch.no_grad():
        lp2 = response_logprobs(hidden, weight, pb)
    assert not lp2.requires_grad
    torch.testing.assert_close(lp2, lp.detach())


def test_bad_inputs():
    pb = random_packed(1)
    T = pb.num_tokens
    h, w = torch.randn(T, 8), torch.randn(37, 8)
    with pytest.raises(ValueError, match=r"hidden must be \[T, D\] or \[1, T, D\]"):
        response_logprobs(h[1:], w, pb)
    with pytest.raises(ValueError, match=r"lm_head_weight must be \[V, D=8\]"):
        response_logprobs(h, w[:, :4], pb)
    with pytest.raises(ValueError, match="temperature must be a positive"):
        response_logprobs(h, w, pb, temperature=0.0)
    with pytest.raises(TypeError, match="temperature"):
        response_logprobs(h, w, pb, temperature="hot")
    with pytest.raises(ValueError, match="chunk_size"):
        response_logprobs(h, w, pb, chunk_size=0)
    with pytest.raises(TypeError, match="PackedBatch"):
        response_logprobs(h, w, {"input_ids": None})
    with pytest.raises(TypeError, match="floating point"):
        response_logprobs(h.long(), w, pb)
    with pytest.raises(ValueError, match=r"logits must be \[T, D\]"):
        response_logprobs_from_logits(torch.randn(T + 2, 37), pb)


@cuda
@pytest.mark.parametrize("entropy", [False, True])
def test_cuda_bf16_matches_fp64_reference(entropy):
    pb = random_packed(7, G=4, max_p=40, max_r=30, vocab=500, device="cuda")
    T, D, V = pb.num_tokens, 64, 500
    g = torch.Generator().manual_seed(1)
    h = torch.randn(T, D, generator=g).bfloat16().cuda().requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.1).bfloat16().cuda().requires_grad_()
    out = response_logprobs(h, w, pb, temperature=0.8, entropy=entropy, chunk_size=16)
    lp = out[0] if entropy else out
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    ref_lp, ref_ent = unpacked_reference(h64, w64, pb, 0.8)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=1e-5, atol=1e-5)
    loss = lp.sum() + (out[1].sum() if entropy else 0)
    loss.backward()
    (ref_lp.sum() + (ref_ent.sum() if entropy else 0)).backward()
    torch.testing.assert_close(h.grad.double(), h64.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=2e-2, atol=2e-2)


def test_plan_built_under_inference_mode_is_reusable_for_training():
    with torch.inference_mode():
        pb = random_packed(8)
        h = torch.randn(pb.num_tokens, 8)
        w = torch.randn(37, 8)
        old = response_logprobs(h, w, pb)
        pb.unpack(h)
    h2 = h.clone().requires_grad_()
    w2 = w.clone().requires_grad_()
    lp = response_logprobs(h2, w2, pb)
    out, _ = pb.unpack(h2)
    (lp.sum() + out.sum()).backward()
    torch.testing.assert_close(lp.detach(), old)
    assert h2.grad is not None and w2.grad is not None


@pytest.mark.parametrize("bad_id", [-1, 10, 2**40])
def test_token_ids_outside_the_vocabulary_are_rejected(bad_id):
    """Issue 22: id -1 silently read vocab row V-1 (and sent its gradient there); ids >= V raised a
    bare IndexError (a device-side assert on CUDA)."""
    pk = dualkv.pack([torch.tensor([1, 2, 3])], [[torch.tensor([4, bad_id, 5])]])
    hidden, weight = torch.randn(pk.num_tokens, 8), torch.randn(10, 8)
    with pytest.raises(dualkv.ArgumentError, match=r"token ids must lie in \[0, 10\)"):
        dualkv.response_logprobs(hidden, weight, pk)
    with pytest.raises(dualkv.ArgumentError, match=r"\[0, 10\)"):
        dualkv.response_logprobs_from_logits(torch.randn(pk.num_tokens, 10), pk)


def test_token_ids_are_checked_against_each_vocabulary():
    pk = dualkv.pack([torch.tensor([1, 2])], [[torch.tensor([3, 7])]])
    assert dualkv.response_logprobs(torch.randn(pk.num_tokens, 4), torch.randn(8, 4), pk).shape == (1, 2)
    with pytest.raises(dualkv.ArgumentError, match=r"\[0, 5\)"):
        dualkv.response_logprobs(torch.randn(pk.num_tokens, 4), torch.randn(5, 4), pk)


@pytest.mark.gpu
def test_cuda_token_ids_outside_the_vocabulary_raise_without_a_device_assert():
    pk = dualkv.pack([torch.tensor([1, 2, 3], device="cuda")], [[torch.tensor([4, -1, 5], device="cuda")]])
    hidden = torch.randn(pk.num_tokens, 8, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(10, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(dualkv.ArgumentError, match="token ids"):
        dualkv.response_logprobs(hidden, weight, pk)
    torch.cuda.synchronize()  # the context is healthy: no device-side assert fired
    ok = dualkv.pack([torch.tensor([1, 2, 3], device="cuda")], [[torch.tensor([4, 6, 5], device="cuda")]])
    assert torch.isfinite(dualkv.response_logprobs(hidden, weight, ok)).all()
