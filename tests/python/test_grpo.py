"""dualkv.grpo: policy loss and group advantages against hand-computed values."""
import math

import pytest
import torch

from dualkv.grpo import aggregate, group_advantages, kl_penalty, policy_loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 3.0, 5.0, 7.0])
    gid = ["a", "a", "a", "a", "b", "b", "c"]
    adv = group_advantages(r, gid, eps=0.0)
    # group a: mean 0.75, unbiased std sqrt(0.25) = 0.5 -> (r - 0.75) / 0.5
    # group b: mean 4, std sqrt(2) ; group c: single response -> 0
    expect = [0.5, -1.5, 0.5, 0.5, -1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]
    torch.testing.assert_close(adv, torch.tensor(expect), rtol=0, atol=1e-6)
    centred = group_advantages(r, torch.tensor([0, 0, 0, 0, 5, 5, 9]), normalize_std=False)
    torch.testing.assert_close(centred, torch.tensor([0.25, -0.75, 0.25, 0.25, -1.0, 1.0, 0.0]))


def test_group_advantages_equal_rewards_and_eps():
    adv = group_advantages(torch.tensor([2.0, 2.0, 2.0]), [0, 0, 0])
    assert torch.equal(adv, torch.zeros(3))
    adv = group_advantages(torch.tensor([0.0, 2.0]), [1, 1], eps=1.0)  # std sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0]) / (math.sqrt(2) + 1.0))


def _case():
    # two rows, R_max = 3; row 1 has 2 tokens
    old = torch.zeros(2, 3)
    logp = torch.log(torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 7.0]]))  # ratios
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0])
    return logp, old, adv, mask


def test_policy_loss_ppo_clip_by_hand():
    logp, old, adv, mask = _case()
    logp.requires_grad_(True)
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    # row 0 (A=1): ratio 1.5 -> max(-1.5, -1.2) = -1.2 (clipped); 0.9 -> -0.9; 1.0 -> -1.0
    # row 1 (A=-2): ratio 0.5 -> max(1.0, 1.6) = 1.6 (clipped); 1.1 -> max(2.2, 2.2) = 2.2
    tok = [-1.2, -0.9, -1.0, 1.6, 2.2]
    assert loss.item() == pytest.approx(sum(tok) / 5, abs=1e-6)
    assert m["clip_frac"] == pytest.approx(2 / 5)
    assert m["clip_frac_low"] == pytest.approx(1 / 5)  # ratio 0.5
    assert m["clip_frac_high"] == pytest.approx(1 / 5)  # ratio 1.5
    assert m["num_tokens"] == 5
    assert m["approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.9) + math.log(0.5) + math.log(1.1)) / 5,
                                           abs=1e-6)
    loss.backward()
    # d/dlogp of -A*ratio = -A*ratio where unclipped, 0 where clipped; / 5 tokens
    g = torch.tensor([[0.0, -0.9, -1.0], [0.0, 2.2, 0.0]]) / 5
    torch.testing.assert_close(logp.grad, g, rtol=0, atol=1e-6)


def test_policy_loss_clip_higher_and_dual_clip():
    logp, old, adv, mask = _case()
    loss, m = policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # ratio 1.5 now clipped at 1.28
    assert loss.item() == pytest.approx((-1.28 - 0.9 - 1.0 + 1.6 + 2.2) / 5, abs=1e-6)
    logp2 = torch.log(torch.tensor([[1.0], [5.0]]))
    loss, _ = policy_loss(logp2, torch.zeros(2, 1), torch.tensor([1.0, -1.0]), torch.ones(2, 1, dtype=torch.bool),
                          dual_clip=3.0)
    # row 1: max(5, 1.2) = 5, dual clip caps at 3
    assert loss.item() == pytest.approx((-1.0 + 3.0) / 2, abs=1e-6)


def test_aggregation_modes_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert aggregate(v, mask, "token-mean").item() == pytest.approx(15 / 5)
    assert aggregate(v, mask, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.5) / 2)
    assert aggregate(v, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 9) / 2)
    assert aggregate(v, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="unknown agg"):
        aggregate(v, mask, "sum")


def test_policy_loss_agg_matches_aggregate():
    logp, old, adv, mask = _case()
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        loss, m = policy_loss(logp, old, adv, mask, agg=agg)
        tok = torch.tensor([[-1.2, -0.9, -1.0], [1.6, 2.2, 0.0]])
        assert loss.item() == pytest.approx(aggregate(tok, mask, agg).item(), abs=1e-6)
        assert m["pg_loss"] == pytest.approx(loss.item(), abs=1e-6)


def test_kl_estimators_by_hand():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    d = torch.tensor([[0.5, -1.0]])
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), d)
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), d.abs())
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), 0.5 * d * d)
    k3 = torch.tensor([[math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]])
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3)
    with pytest.raises(ValueError, match="unknown kl_type"):
        kl_penalty(logp, ref, "k9")


def test_policy_loss_with_kl():
    logp, old, adv, mask = _case()
    ref = torch.full((2, 3), -0.1)
    base, _ = policy_loss(logp, old, adv, mask)
    loss, m = policy_loss(logp, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_type="k1")
    kl = ((logp - ref) * mask).sum() / 5
    assert loss.item() == pytest.approx(base.item() + 0.1 * kl.item(), abs=1e-6)
    assert m["kl"] == pytest.approx(kl.item(), abs=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, kl_coef=0.1)


def test_policy_loss_shape_errors():
    logp, old, adv, mask = _case()
    with pytest.raises(ValueError, match="mask shape"):
        policy_loss(logp, old, adv, mask[:, :2])
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, torch.ones(3), mask)
    loss, _ = policy_loss(logp, old, adv[:, None].expand(2, 3), mask)  # per-token advantages
    ref, _ = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(ref.item())
