"""Identities between the losses and importance sampling, and detachment of every mask.

What holds (and is tested):
- GRPO with eps = inf is importance sampling `-sum(r*A)` in value and gradient.
- DPPO with delta = inf (and r below the cap, or cap = inf) has the gradient of `-sum(r*A)`;
  its value is the documented REINFORCE surrogate `-sum(A * sg(min(r, c)) * logp)`, which
  is not the IS value.
- At logp == sampler_logp both losses give the same gradient, -A per loss token scaled by
  the aggregation weight, for every aggregation and DPPO mode.
- No gradient flows through the masks, the DPPO IS weight, sampler_logp or advantages.
"""

from __future__ import annotations

import pytest
import torch

from trainer.losses import AGGREGATIONS, DPPOLoss, GRPOLoss, aggregate
from trainer.losses.aggregate import NEEDS_NORM_LENGTH
from trainer.losses.trust_region import dppo_drop_mask, ppo_clip_active

F64 = torch.float64
INF = float("inf")


NORM_LENGTH = 40.0  # the constant H of seq_mean_token_sum_norm (Dr. GRPO)


def agg(aggregation: str) -> dict:
    """Loss kwargs selecting `aggregation` (with its constant normaliser where it needs one)."""
    return {"aggregation": aggregation, "norm_length": norm(aggregation)}


def norm(aggregation: str) -> float | None:
    return NORM_LENGTH if aggregation in NEEDS_NORM_LENGTH else None


def drifted_batch(seed: int, B: int = 5, T: int = 16, drift: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    sampler = torch.log(0.02 + 0.97 * torch.rand(B, T, generator=g, dtype=F64))
    logp = torch.clamp(sampler + drift * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    adv[0] = 0.0  # an all-zero-advantage sequence
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    return logp, sampler, adv, mask


def value_and_grad(loss, logp, sampler, adv, mask):
    leaf = logp.detach().clone().requires_grad_(True)
    value, _ = loss(leaf, sampler, adv, mask)
    value.backward()
    return value.detach(), leaf.grad


def importance_sampling(logp, sampler, adv, mask, aggregation="sum"):
    leaf = logp.detach().clone().requires_grad_(True)
    value = aggregate(-torch.exp(leaf - sampler) * adv, mask, aggregation, norm(aggregation))
    value.backward()
    return value.detach(), leaf.grad


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_grpo_with_infinite_eps_is_importance_sampling(aggregation):
    batch = drifted_batch(seed=1)
    v, g = value_and_grad(GRPOLoss(clip_eps=INF, **agg(aggregation)), *batch)
    v_is, g_is = importance_sampling(*batch, aggregation=aggregation)
    torch.testing.assert_close(v, v_is)
    torch.testing.assert_close(g, g_is)
    # and finite eps differs on this drifted batch (the identity is not vacuous)
    _, g_clip = value_and_grad(GRPOLoss(**agg(aggregation)), *batch)
    assert not torch.allclose(g_clip, g_is)


@pytest.mark.parametrize("mode", ["binary_tv", "binary_kl"])
@pytest.mark.parametrize("is_cap", [INF, 1e4])
def test_dppo_with_infinite_delta_has_the_importance_sampling_gradient(mode, is_cap):
    logp, sampler, adv, mask = drifted_batch(seed=2)
    assert float(torch.exp(logp - sampler).max()) < 1e4  # below the default cap too
    v, g = value_and_grad(DPPOLoss(mode=mode, delta=INF, is_cap=is_cap), logp, sampler, adv, mask)
    v_is, g_is = importance_sampling(logp, sampler, adv, mask)
    torch.testing.assert_close(g, g_is)
    # value: the REINFORCE surrogate -sum(A * sg(r) * logp), not -sum(r*A)
    surrogate = -(adv * torch.exp(logp - sampler) * logp * mask).sum()
    torch.testing.assert_close(v, surrogate)
    assert not torch.isclose(v, v_is)
    # with the default delta the trust region drops tokens here, so the gradient changes
    _, g_tr = value_and_grad(DPPOLoss(mode=mode), logp, sampler, adv, mask)
    assert not torch.allclose(g_tr, g_is)


def test_dppo_cap_truncates_the_importance_weight():
    logp, sampler, adv, mask = drifted_batch(seed=4, drift=1.5)
    r = torch.exp(logp - sampler)
    cap = 2.0
    assert bool((r[mask.bool()] > cap).any())
    _, g = value_and_grad(DPPOLoss(delta=INF, is_cap=cap), logp, sampler, adv, mask)
    torch.testing.assert_close(g, -adv * torch.clamp(r, max=cap) * mask)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_on_policy_both_losses_give_the_same_gradient(aggregation):
    _, sampler, adv, mask = drifted_batch(seed=3)
    logp = sampler.clone()
    _, g_grpo = value_and_grad(GRPOLoss(**agg(aggregation)), logp, sampler, adv, mask)
    for loss in (
        DPPOLoss(mode="binary_tv", **agg(aggregation)),
        DPPOLoss(mode="binary_kl", delta=0.01, **agg(aggregation)),
    ):
        _, g = value_and_grad(loss, logp, sampler, adv, mask)
        torch.testing.assert_close(g, g_grpo)
    # closed form: -A times the aggregation weight of each loss token
    w = torch.autograd.functional.jacobian(lambda x: aggregate(x, mask, aggregation, norm(aggregation)), torch.zeros_like(adv))
    expected = -adv * w
    torch.testing.assert_close(g_grpo, expected)


def test_masks_and_weights_are_detached():
    logp, sampler, adv, mask = drifted_batch(seed=6, drift=0.8)
    logp = logp.clone().requires_grad_(True)
    sampler = sampler.clone().requires_grad_(True)
    adv = adv.clone().requires_grad_(True)
    for m in (
        dppo_drop_mask(logp, sampler, adv, "binary_tv", 0.15, 0.15),
        dppo_drop_mask(logp, sampler, adv, "binary_kl", 0.05, 0.05),
        ppo_clip_active(logp, sampler, adv, 0.2, 0.2),
        DPPOLoss().keep_mask(logp, sampler, adv),
    ):
        assert not m.requires_grad
    for loss in (GRPOLoss(), DPPOLoss(), DPPOLoss(mode="binary_kl")):
        value, _ = loss(logp, sampler, adv, mask.clone().requires_grad_(True))
        grads = torch.autograd.grad(value, (logp, sampler, adv), allow_unused=True)
        assert grads[1] is None and grads[2] is None  # only logp carries the gradient
    # DPPO: closed form -A * min(r, c) * keep; a non-detached weight would add -A*r*logp
    logp_d, sampler_d, adv_d = logp.detach(), sampler.detach(), adv.detach()
    dppo = DPPOLoss()
    keep = dppo.keep_mask(logp_d, sampler_d, adv_d)
    assert 0 < float((keep * mask).sum()) < float(mask.sum())
    _, g = value_and_grad(dppo, logp_d, sampler_d, adv_d, mask)
    r = torch.exp(logp_d - sampler_d)
    torch.testing.assert_close(g, -adv_d * torch.clamp(r, max=1e4) * keep * mask)
    # GRPO: -A*r where the clip does not bind, 0 where it does
    clip = ppo_clip_active(logp_d, sampler_d, adv_d, 0.2, 0.2)
    assert bool((clip & mask.bool()).any())
    _, g = value_and_grad(GRPOLoss(), logp_d, sampler_d, adv_d, mask)
    torch.testing.assert_close(g, torch.where(clip, 0.0, -adv_d * r) * mask)


def test_grpo_and_dppo_normalise_identically_on_an_all_unmasked_batch():
    """With no token dropped or clipped, every aggregation scales both arms the same way."""
    _, sampler, adv, _ = drifted_batch(seed=8)
    logp = sampler + 0.01  # tiny drift: nothing clipped (r ~ 1.01) or dropped
    mask = torch.ones_like(adv)
    for aggregation in AGGREGATIONS:
        _, g_grpo = value_and_grad(GRPOLoss(**agg(aggregation)), logp, sampler, adv, mask)
        _, g_dppo = value_and_grad(DPPOLoss(**agg(aggregation)), logp, sampler, adv, mask)
        torch.testing.assert_close(g_grpo, g_dppo)
