"""Loss plugins: registry, constructor checks, hand-computed branches, aggregation,
bad input, diagnostics, the forward_backward_custom adapter and the one-pass per-datum form."""

from __future__ import annotations

import math

import hydra.utils
import pytest
import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import (
    check_loss_inputs,
    encode_graph,
    run_loss_handle,
    trace_loss,
)
from tinker.lib.public_interfaces.training_client import TrainingClient

from trainer.config.losses import DPPOLossConfig, GRPOLossConfig
from trainer.losses import CISPOLoss, DPPOLoss, GRPOLoss, GSPOLoss, aggregate, build_loss
from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.diagnostics import DIAGNOSTIC_KEYS
from trainer.losses.per_datum import finalize_per_datum_metrics, make_per_datum_fn, with_per_datum_inputs

F64 = torch.float64
INF = float("inf")


def tokens(p_sampler: list[float], p: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp leaf requiring grad, sampler_logp) from probabilities."""
    logp = torch.log(torch.tensor(p, dtype=F64)).requires_grad_(True)
    return logp, torch.log(torch.tensor(p_sampler, dtype=F64))


def random_batch(seed: int = 0, B: int = 4, T: int = 12, drift: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    sampler = torch.log(0.02 + 0.97 * torch.rand(B, T, generator=g, dtype=F64))
    logp = torch.clamp(sampler + drift * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    lengths = torch.randint(3, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    return logp, sampler, adv, mask


# ----------------------------------------------------------------------------- selector / config
def test_build_loss_selects_by_target_and_builds_from_the_typed_config():
    grpo = build_loss(GRPOLossConfig(clip_eps_high=0.28))
    assert type(grpo) is GRPOLoss and (grpo.eps_low, grpo.eps_high) == (0.2, 0.28)
    dppo = build_loss(DPPOLossConfig(mode="binary_kl"))
    assert type(dppo) is DPPOLoss and dppo.delta == 0.05 and dppo.config.mode == "binary_kl"
    # the target names the class, the config's own type must be the one that class takes
    with pytest.raises(ValueError, match="takes a DPPOLossConfig, not a GRPOLossConfig"):
        build_loss(GRPOLossConfig(_target_="trainer.losses.dppo.DPPOLoss"))
    with pytest.raises(ValueError, match=r"loss\._target_ 'trainer\.losses\.base\.kl_k3' is not"):
        build_loss(GRPOLossConfig(_target_="trainer.losses.base.kl_k3"))
    with pytest.raises(ValueError, match=r"loss\._target_ 'trainer\.losses\.nope\.Loss' is not an importable"):
        build_loss(GRPOLossConfig(_target_="trainer.losses.nope.Loss"))
    # a config passed whole and the same fields as keywords build the same loss
    assert repr(GRPOLoss(GRPOLossConfig(clip_eps=0.3))) == repr(GRPOLoss(clip_eps=0.3))
    assert GRPOLoss(GRPOLossConfig(clip_eps=0.3), clip_eps_low=0.1).eps_low == 0.1
    with pytest.raises(TypeError, match="expected a GRPOLossConfig"):
        GRPOLoss(DPPOLossConfig())


def test_hydra_instantiate_returns_configured_callable():
    loss = hydra.utils.instantiate(
        {
            "_target_": "trainer.losses.dppo.DPPOLoss",
            "mode": "binary_kl",
            "delta_high": 0.1,
            "aggregation": "token_mean",
        }
    )
    assert isinstance(loss, DPPOLoss)
    assert (loss.mode, loss.delta_low, loss.delta_high, loss.aggregation) == (
        "binary_kl",
        0.05,
        0.1,
        "token_mean",
    )
    grpo = hydra.utils.instantiate({"_target_": "trainer.losses.grpo.GRPOLoss", "clip_eps_high": 0.28})
    assert (grpo.eps_low, grpo.eps_high, grpo.is_cap) == (0.2, 0.28, 1e4)
    assert DPPOLoss().delta == 0.15 and DPPOLoss(mode="binary_kl").delta == 0.05


@pytest.mark.parametrize(
    "cls, kwargs, arg",
    [
        (GRPOLoss, {"clip_eps": 0.0}, "clip_eps"),
        (GRPOLoss, {"clip_eps": -0.1}, "clip_eps"),
        (GRPOLoss, {"clip_eps": float("nan")}, "clip_eps"),
        (GRPOLoss, {"clip_eps_low": 0.0}, "clip_eps_low"),
        (GRPOLoss, {"clip_eps_high": -1.0}, "clip_eps_high"),
        (GRPOLoss, {"aggregation": "mean"}, "aggregation"),
        (GRPOLoss, {"cf_dppo_delta": 1.5}, "cf_dppo_delta"),
        (GRPOLoss, {"name": ""}, "name"),
        (DPPOLoss, {"mode": "topk_tv"}, "mode"),
        (DPPOLoss, {"delta": 0.0}, "delta"),
        (DPPOLoss, {"delta": 1.5}, "delta"),
        (DPPOLoss, {"delta_low": -0.1}, "delta_low"),
        (DPPOLoss, {"delta_high": 2.0}, "delta_high"),
        (DPPOLoss, {"mode": "binary_kl", "delta": -1.0}, "delta"),
        (DPPOLoss, {"is_cap": 0.5}, "is_cap"),
        (DPPOLoss, {"is_cap": "big"}, "is_cap"),
        (DPPOLoss, {"aggregation": "token-mean"}, "aggregation"),
        (DPPOLoss, {"cf_grpo_eps": 0.0}, "cf_grpo_eps"),
    ],
)
def test_constructor_rejects_out_of_range_kwargs_naming_the_argument(cls, kwargs, arg):
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        cls(**kwargs)


def test_constructor_accepts_inf_and_mode_specific_ranges():
    assert GRPOLoss(clip_eps=INF).eps_low == INF
    assert DPPOLoss(delta=INF, is_cap=INF).delta_high == INF
    assert DPPOLoss(mode="binary_kl", delta=1.5).delta == 1.5  # KL has no upper bound
    assert DPPOLoss(delta=1.0).delta == 1.0  # (0, 1] includes 1 for TV


# ----------------------------------------------------------------------------- hand-computed branches
def test_grpo_hand_computed_branches_value_and_gradient():
    # p_sampler 0.5 everywhere except the spike (1e-6); r = p / p_sampler.
    p_s = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1e-6, 0.5]
    p = [0.55, 0.75, 0.25, 0.25, 0.75, 0.45, 0.75, 0.02, 0.9]
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0, 0.0, -1.0, 5.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=F64)  # last = padding
    logp, slp = tokens(p_s, p)
    # r:        1.1,  1.5,  0.5,  0.5,  1.5,  0.9,  1.5,  2e4
    # A>0 in:   -1.1 (grad -1.1)
    # A>0 r>1.2 clipped: -1.2 (grad 0)
    # A>0 r<0.8 unclipped: -0.5 (grad -0.5)
    # A<0 r<0.8 clipped: -min(-0.5, -0.8) = 0.8 (grad 0)
    # A<0 r>1.2 unclipped: -min(-1.5, -1.2) = 1.5 (grad +1.5)
    # A<0 in: 0.9 (grad 0.9);  A=0: 0;  spike A<0, r=2e4 > c: 2e4 (grad 2e4, no truncation in GRPO)
    expected_loss = -1.1 - 1.2 - 0.5 + 0.8 + 1.5 + 0.9 + 0.0 + 2e4
    expected_grad = [-1.1, 0.0, -0.5, 0.0, 1.5, 0.9, 0.0, 2e4, 0.0]
    value, metrics = GRPOLoss()(logp, slp, adv, mask)
    value.backward()
    assert value.item() == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-10, atol=1e-12)
    assert metrics["loss/grpo_clip_frac"] == pytest.approx(2 / 8)
    assert metrics["ratio/cap_hits"] == 1.0 and metrics["loss/n_tokens"] == 8.0
    assert metrics["ratio/max"] == pytest.approx(2e4)


def test_dppo_binary_tv_hand_computed_branches():
    p_s = [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 1e-6, 0.5]
    p = [0.6, 0.7, 0.2, 0.3, 0.9, 0.3, 0.02, 0.99]
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 2.0, 1.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0], dtype=F64)
    logp, slp = tokens(p_s, p)
    # dp = p - p_s:  +0.1 keep (A>0, <= 0.15); +0.2 drop (A>0); -0.3 keep (A>0 only drops rises);
    # -0.2 drop (A<0); +0.4 keep (A<0 only drops falls); A=0 dp -0.2: dropped by the A<=0 rule;
    # spike: dp ~ +0.02 keep, r = 2e4 truncated to c = 1e4.
    w = [1.2, 1.4, 0.4, 0.6, 1.8, 0.6, 1e4]
    keep = [1, 0, 1, 0, 1, 0, 1]
    a = [1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 2.0]
    expected_grad = [-a[i] * w[i] * keep[i] for i in range(7)] + [0.0]
    expected_loss = sum(-a[i] * w[i] * keep[i] * math.log(p[i]) for i in range(7))
    value, metrics = DPPOLoss()(logp, slp, adv, mask)
    value.backward()
    assert value.item() == pytest.approx(expected_loss, rel=1e-12)
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-10, atol=1e-12)
    assert metrics["loss/dppo_masked_frac"] == pytest.approx(3 / 7)
    assert metrics["loss/dppo_masked_frac_nonzero_adv"] == pytest.approx(2 / 6)
    assert metrics["ratio/cap_hits"] == 1.0


def test_dppo_binary_kl_hand_computed_branches():
    # KL_bin(p_s || p) = p_s ln(p_s/p) + (1-p_s) ln((1-p_s)/(1-p)), the sampler first. The
    # probabilities are asymmetric so that the swapped direction KL_bin(p || p_s) lands on the
    # other side of delta = 0.05 for tokens 0-3:
    #   tok  p_s   p     A    KL(p_s||p)  KL(p||p_s)  decision
    #   0    0.9   0.97  +1   0.0530      0.0365      drop (KL > delta, p rose)
    #   1    0.1   0.21  +1   0.0431      0.0528      keep (KL < delta)
    #   2    0.1   0.03  -1   0.0530      0.0365      drop (KL > delta, p fell)
    #   3    0.9   0.79  -1   0.0431      0.0528      keep (KL < delta)
    #   4    0.9   0.75  +1   0.0725      0.0923      keep (A > 0 but p fell)
    #   5    0.2   0.35  -1   0.0542      0.0609      keep (A < 0 but p rose)
    p_s = [0.9, 0.1, 0.1, 0.9, 0.9, 0.2]
    p = [0.97, 0.21, 0.03, 0.79, 0.75, 0.35]
    a = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    kl = [ps * math.log(ps / q) + (1 - ps) * math.log((1 - ps) / (1 - q)) for ps, q in zip(p_s, p)]
    kl_swapped = [q * math.log(q / ps) + (1 - q) * math.log((1 - q) / (1 - ps)) for ps, q in zip(p_s, p)]
    assert [k > 0.05 for k in kl[:4]] == [True, False, True, False]
    assert [k > 0.05 for k in kl_swapped[:4]] == [False, True, False, True]
    keep = [0, 1, 0, 1, 1, 1]
    adv = torch.tensor(a, dtype=F64)
    logp, slp = tokens(p_s, p)
    # d/dlogp of -A * (p / p_s) * logp with the ratio detached: -A * p / p_s on kept tokens
    expected_grad = [-a[i] * p[i] / p_s[i] * keep[i] for i in range(6)]
    value, metrics = DPPOLoss(mode="binary_kl")(logp, slp, adv, torch.ones(6, dtype=F64))
    value.backward()
    torch.testing.assert_close(logp.grad, torch.tensor(expected_grad, dtype=F64), rtol=1e-10, atol=1e-12)
    expected_loss = sum(-a[i] * p[i] / p_s[i] * keep[i] * math.log(p[i]) for i in range(6))
    assert value.item() == pytest.approx(expected_loss, rel=1e-12)
    assert metrics["loss/dppo_masked_frac"] == pytest.approx(2 / 6)
    # delta 0.06 keeps tokens 0 and 2 (0.0530 < 0.06); delta 0.1 keeps everything
    for delta in (0.06, 0.1):
        logp2, _ = tokens(p_s, p)
        DPPOLoss(mode="binary_kl", delta=delta)(logp2, slp, adv, torch.ones(6, dtype=F64))[0].backward()
        torch.testing.assert_close(
            logp2.grad, torch.tensor([-a[i] * p[i] / p_s[i] for i in range(6)], dtype=F64), rtol=1e-10, atol=1e-12
        )


@pytest.mark.parametrize("anchored", [False, True])
def test_grpo_asymmetric_clip_bounds_hand_computed(anchored):
    """clip-higher (eps_low 0.1, eps_high 0.3) and its mirror (0.3, 0.1) give different, hand-computed
    losses and gradients: a swap of the two bounds anywhere in the rule cannot pass both. `anchored`: the
    recomputed-anchor form with the anchor at the sampler (r_a = r, w = 1), whose clip is written apart."""
    # p_sampler 0.5, r = 2p:   1.25  1.4   0.85   0.95   1.25  0.8   1.2
    p_s = [0.5] * 7
    p = [0.625, 0.7, 0.425, 0.475, 0.625, 0.4, 0.6]
    a = [1.0, 1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    cases = {
        # [0.9, 1.3]: A>0 r=1.25 unclipped; A>0 r=1.4 clipped at 1.3; A<0 r=0.85 clipped at 0.9 (grad 0);
        # A<0 r=0.95 and r=1.25 unclipped; A>0 r=0.8 unclipped (the low bound never binds for A>0); A>0 r=1.2
        # unclipped
        (0.1, 0.3): ([-1.25, -1.3, 0.9, 0.95, 1.25, -0.8, -1.2], [-1.25, 0.0, 0.0, 0.95, 1.25, -0.8, -1.2], 2 / 7),
        # [0.7, 1.1]: A>0 r=1.25 and r=1.2 now clipped at 1.1; A<0 r=0.85 now unclipped
        (0.3, 0.1): ([-1.1, -1.1, 0.85, 0.95, 1.25, -0.8, -1.1], [0.0, 0.0, 0.85, 0.95, 1.25, -0.8, 0.0], 3 / 7),
    }
    for (lo, hi), (loss_tok, grad, clip_frac) in cases.items():
        logp, slp = tokens(p_s, p)
        loss = GRPOLoss(clip_eps_low=lo, clip_eps_high=hi)
        assert (loss.eps_low, loss.eps_high) == (lo, hi)
        value, metrics = loss(logp, slp, torch.tensor(a, dtype=F64), torch.ones(7, dtype=F64),
                              anchor_logp=slp.clone() if anchored else None)
        value.backward()
        assert value.item() == pytest.approx(sum(loss_tok), rel=1e-12)
        torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=F64), rtol=1e-10, atol=1e-12)
        assert metrics["loss/grpo_clip_frac"] == pytest.approx(clip_frac)


def test_dppo_asymmetric_deltas_hand_computed():
    """delta_low (A <= 0) and delta_high (A > 0) set apart, in both modes, with their mirror: each token
    sits between the two thresholds, so a swap of the roles flips which ones are dropped."""
    # binary_tv, p_s 0.5: dp = +0.2 (A>0), +0.3 (A>0), -0.1 (A<0), -0.03 (A<0)
    tv = ([0.5] * 4, [0.7, 0.8, 0.4, 0.47], [1.0, 1.0, -1.0, -1.0])
    # binary_kl (the sampler first): tokens 0 and 1 of test_dppo_binary_kl_hand_computed_branches,
    # KL 0.0530 each, one rising with A > 0, one falling with A < 0
    kl = ([0.9, 0.1], [0.97, 0.03], [1.0, -1.0])
    cases = [
        ("binary_tv", tv, 0.05, 0.25, [1, 0, 0, 1]),  # +0.2 <= 0.25 kept; -0.1 < -0.05 dropped
        ("binary_tv", tv, 0.25, 0.05, [0, 0, 1, 1]),  # +0.2 > 0.05 dropped; -0.1 >= -0.25 kept
        ("binary_kl", kl, 0.04, 0.06, [1, 0]),  # 0.053 <= 0.06 kept (A>0); 0.053 > 0.04 dropped (A<0)
        ("binary_kl", kl, 0.06, 0.04, [0, 1]),
    ]
    for mode, (p_s, p, a), lo, hi, keep in cases:
        logp, slp = tokens(p_s, p)
        n = len(p)
        loss = DPPOLoss(mode=mode, delta_low=lo, delta_high=hi)
        assert (loss.delta_low, loss.delta_high) == (lo, hi)
        value, metrics = loss(logp, slp, torch.tensor(a, dtype=F64), torch.ones(n, dtype=F64))
        value.backward()
        # kept tokens: gradient -A * r (r = p / p_s, below the IS cap); dropped: 0
        grad = [-a[i] * p[i] / p_s[i] * keep[i] for i in range(n)]
        torch.testing.assert_close(logp.grad, torch.tensor(grad, dtype=F64), rtol=1e-10, atol=1e-12)
        assert value.item() == pytest.approx(sum(g * math.log(q) for g, q in zip(grad, p)), rel=1e-12)
        assert metrics["loss/dppo_masked_frac"] == pytest.approx(keep.count(0) / n)


def test_dppo_log_ratio_clamped_at_20_before_exp():
    logp, slp = torch.tensor([-0.5], dtype=F64, requires_grad=True), torch.tensor([-30.0], dtype=F64)
    # delta = inf: the TV rule would drop this token (dp = 0.61 > 0.15).
    DPPOLoss(delta=INF, is_cap=INF)(logp, slp, torch.tensor([1.0], dtype=F64), torch.ones(1, dtype=F64))[
        0
    ].backward()
    assert logp.grad.item() == pytest.approx(-math.exp(20.0), rel=1e-12)


def test_grpo_log_ratio_overflow_gives_finite_gradients_in_float32():
    """fp32 exp overflows past log r ~ 88: without the [-20, 20] clamp, inf * 0 put NaN into the gradient
    of a masked token (garbage sampler logprob) and of an A > 0 token whose clip binds."""
    F32 = torch.float32
    logp = torch.tensor([-0.1, -0.5, -0.2, -0.3], dtype=F32, requires_grad=True)
    slp = torch.tensor([-100.0, -0.4, -100.0, -100.0], dtype=F32)
    adv = torch.tensor([1.0, 1.0, 3.0, -1.0], dtype=F32)
    mask = torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F32)  # token 2 is masked
    value, _ = GRPOLoss()(logp, slp, adv, mask)
    value.backward()
    r1 = math.exp(-0.1)
    # token 0: A > 0, r > 1.2 -> clipped at 1.2 (grad 0); token 1: unclipped (grad -r1); token 2 masked;
    # token 3: A < 0 past the clamp -> value A * -e^20 (finite), grad 0
    assert value.item() == pytest.approx(-1.2 - r1 + math.exp(20.0), rel=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -r1, 0.0, 0.0]), rtol=1e-6, atol=0)


def test_grpo_matches_tinker_builtin_ppo_definition():
    logp, sampler, adv, mask = random_batch(seed=3, drift=0.5)
    logp.requires_grad_(True)
    value, _ = GRPOLoss()(logp, sampler, adv, mask)
    value.backward()
    # Tinker docs (/tinker/losses/ppo): loss = -sum(min(r*A, clip(r, 0.8, 1.2)*A)), token sum.
    lp = logp.detach().clone().requires_grad_(True)
    r = torch.exp(lp - sampler)
    tinker_ppo = -(torch.minimum(r * adv, torch.clamp(r, 0.8, 1.2) * adv) * mask).sum()
    tinker_ppo.backward()
    torch.testing.assert_close(value, tinker_ppo)
    torch.testing.assert_close(logp.grad, lp.grad)
    assert (lp.grad[mask.bool()] == 0).any() and (lp.grad[mask.bool()] != 0).any()  # both branches hit


# ----------------------------------------------------------------------------- aggregation
def test_aggregate_modes_hand_computed():
    loss_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0], [7.0, 7.0, 7.0]], dtype=F64)
    mask_BT = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=F64)  # empty row 3
    assert aggregate(loss_BT, mask_BT, "sum").item() == 10.0
    assert aggregate(loss_BT, mask_BT, "token_mean").item() == 2.5
    assert aggregate(loss_BT, mask_BT, "seq_mean_token_sum").item() == 5.0  # (6 + 4) / 2 non-empty
    assert aggregate(loss_BT, mask_BT, "seq_mean_token_mean").item() == 3.0  # (2 + 4) / 2
    # Dr. GRPO: the mean over sequences of each sequence's token sum, over a fixed length: (6 + 4) / 2 / 4
    assert aggregate(loss_BT, mask_BT, "seq_mean_token_sum_norm", norm_length=4).item() == 1.25
    flat = torch.tensor([1.0, 2.0, 6.0], dtype=F64)
    assert aggregate(flat, torch.tensor([1.0, 1.0, 0.0]), "seq_mean_token_mean").item() == 1.5
    with pytest.raises(ValueError, match="aggregation must be one of"):
        aggregate(flat, torch.ones(3), "mean")
    with pytest.raises(ValueError, match="no loss tokens"):
        aggregate(flat, torch.zeros(3), "sum")


def test_cispo_weight_is_a_stopped_gradient_hand_computed():
    """CISPO: loss -sg(clip(r, low, high)) * A * logp, so d loss / d logp = -clip(r) * A for every token,
    clipped or not (r = 8 clips to 4, r = 2 stays, r = 0.5 clips up to low = 0.6)."""
    logp, sampler = tokens([0.1, 0.2, 0.5], [0.8, 0.4, 0.25])  # r = 8, 2, 0.5
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=F64)
    token = CISPOLoss(clip_low_threshold=0.6, clip_high_threshold=4.0).token_loss(logp, sampler, adv,
                                                                                   torch.ones(3))
    w = [4.0, 2.0, 0.6]
    want = [-w[0] * math.log(0.8), -w[1] * math.log(0.4), w[2] * math.log(0.25)]
    assert token.tolist() == pytest.approx(want, rel=1e-12)
    token.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-4.0, -2.0, 0.6], rel=1e-12)


def test_gspo_sequence_ratio_is_the_length_normalised_mean_hand_computed():
    """GSPO on two sequences of unequal length (2 and 4 loss tokens): s = exp(mean log(p / mu)) over each
    sequence's own loss tokens, every token's loss -s * A and gradient -s * A (own logprob, the rest
    stopped); with eps_high = 0.1 the first sequence's s = e^0.2 > 1.1 clips to 1.1 and its gradient is 0."""
    lr_BT = torch.tensor([[0.1, 0.3, 9.0, 9.0], [0.2, -0.1, 0.05, 0.25]], dtype=F64)  # 9.0: padding
    mask_BT = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=F64)
    sampler = torch.log(torch.full((2, 4), 0.3, dtype=F64))
    adv_BT = torch.tensor([[1.0] * 4, [-2.0] * 4], dtype=F64)
    s = [math.exp(0.2), math.exp(0.1)]  # means 0.4 / 2 and 0.4 / 4
    for eps_high, s0 in ((INF, s[0]), (0.1, 1.1)):
        logp = (sampler + lr_BT).requires_grad_(True)
        token = GSPOLoss(seq_clip_eps_low=INF, seq_clip_eps_high=eps_high).token_loss(logp, sampler, adv_BT,
                                                                                         mask_BT)
        want = torch.tensor([[-s0, -s0, 0, 0], [2 * s[1]] * 4], dtype=F64)
        torch.testing.assert_close(token * mask_BT, want, rtol=1e-12, atol=0)
        (token * mask_BT).sum().backward()
        g0 = -s[0] if eps_high == INF else 0.0
        want = torch.tensor([[g0, g0, 0, 0], [2 * s[1]] * 4], dtype=F64)
        torch.testing.assert_close(logp.grad, want, rtol=1e-12, atol=1e-15)


def test_aggregate_ignores_nonfinite_padding_values():
    loss = torch.tensor([1.0, float("inf"), float("nan")], dtype=F64, requires_grad=True)
    value = aggregate(loss, torch.tensor([1.0, 0.0, 0.0]), "token_mean")
    value.backward()
    assert value.item() == 1.0 and loss.grad.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("cls", [GRPOLoss, DPPOLoss])
def test_plugins_use_the_shared_aggregation(cls):
    logp, sampler, adv, mask = random_batch(seed=5)
    token_loss = cls().token_loss(logp, sampler, adv, mask)
    for mode in ("sum", "token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        value, _ = cls(aggregation=mode)(logp, sampler, adv, mask)
        torch.testing.assert_close(value, aggregate(token_loss, mask, mode))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("loss", [GRPOLoss(), DPPOLoss(mode="binary_kl")])
def test_bad_inputs_raise_value_error_naming_the_tensor(loss):
    logp, sampler, adv, mask = random_batch()
    with pytest.raises(ValueError, match="'advantages' has shape"):
        loss(logp, sampler, adv[:, :-1], mask)
    with pytest.raises(ValueError, match="'mask' has shape"):
        loss(logp, sampler, adv, mask[0])
    bad = logp.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"'logp' has 1 non-finite value.*\(1, 2\)"):
        loss(bad, sampler, adv, mask)
    bad = sampler.clone()
    bad[0, -1] = -float("inf")  # padding position: still rejected
    with pytest.raises(ValueError, match="'sampler_logp' has 1 non-finite"):
        loss(logp, bad, adv, mask)
    with pytest.raises(ValueError, match="'mask' is empty"):
        loss(logp, sampler, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="'mask' must contain only 0 and 1"):
        loss(logp, sampler, adv, mask * 0.5)
    with pytest.raises(ValueError, match=r"'logp' must be \[T\] or \[B, T\]"):
        loss(logp[None], sampler[None], adv[None], mask[None])
    with pytest.raises(TypeError, match="'advantages' must be a torch.Tensor"):
        loss(logp, sampler, adv.tolist(), mask)


# ----------------------------------------------------------------------------- diagnostics
def test_diagnostics_identical_keys_and_counterfactuals_match_the_other_arm():
    logp, sampler, adv, mask = random_batch(seed=7, drift=0.6)
    grpo = GRPOLoss(clip_eps=0.2, cf_dppo_delta=0.15)
    dppo = DPPOLoss(mode="binary_tv", delta=0.15, cf_grpo_eps=0.2)
    _, m_grpo = grpo(logp, sampler, adv, mask)
    _, m_dppo = dppo(logp, sampler, adv, mask)
    assert list(m_grpo) == list(m_dppo) == list(DIAGNOSTIC_KEYS)
    assert all(type(v) is float for v in m_grpo.values())
    for key in DIAGNOSTIC_KEYS:  # same rules on both sides -> same numbers
        assert m_grpo[key] == pytest.approx(m_dppo[key], rel=1e-12), key
    assert 0 < m_grpo["loss/dppo_masked_frac"] < 1 and 0 < m_grpo["loss/grpo_clip_frac"] < 1
    # the counterfactual follows its own parameter
    _, m_wide = GRPOLoss(cf_dppo_delta=1.0)(logp, sampler, adv, mask)
    assert m_wide["loss/dppo_masked_frac"] == 0.0


def test_diagnostic_values_hand_computed():
    p_s = [0.5, 0.5, 0.5, 0.5, 0.9]
    p = [0.5, 0.6, 0.25, 0.9, 0.1]  # last one is padding
    logp, slp = tokens(p_s, p)
    adv = torch.tensor([1.0, 1.0, -1.0, 0.0, 1.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=F64)
    _, m = GRPOLoss()(logp, slp, adv, mask)
    abs_dp = [0.0, 0.1, 0.25, 0.4]  # sorted |p - p_s| over loss tokens
    assert m["drift/abs_p_q50"] == pytest.approx(0.175)  # midway between 0.1 and 0.25
    assert m["drift/abs_p_q90"] == pytest.approx(0.25 + 0.7 * 0.15)  # pos 2.7
    assert m["drift/abs_p_max"] == pytest.approx(max(abs_dp))
    ratios = [1.0, 1.2, 0.5, 1.8]
    assert m["ratio/mean"] == pytest.approx(sum(ratios) / 4) and m["ratio/max"] == pytest.approx(1.8)
    k3 = sum(r - 1 - math.log(r) for r in ratios) / 4
    assert m["drift/kl_sampler_current"] == pytest.approx(k3)
    assert m["loss/grpo_clip_frac"] == pytest.approx(1 / 4)  # A<0 with r=0.5
    assert m["loss/dppo_masked_frac"] == pytest.approx(1 / 4)  # A<0, dp=-0.25 < -0.15
    assert m["loss/dppo_masked_frac_nonzero_adv"] == pytest.approx(1 / 3)
    assert m["loss/n_tokens"] == 4.0


# ----------------------------------------------------------------------------- tinker adapters
def make_datums(seed: int = 0, with_mask: bool = True):
    """Cookbook-style datums: prompt tokens carry A = 0 and logprobs = 0."""
    logp, sampler, adv, mask = random_batch(seed=seed, B=3, T=10)
    prompt = [2, 1, 3]
    data, current = [], []
    for i in range(3):
        n = int(mask[i].sum())
        s = torch.cat([torch.zeros(prompt[i]), sampler[i, :n].float()])
        a = torch.cat([torch.zeros(prompt[i]), adv[i, :n].float()])
        inputs = {"target_tokens": torch.arange(prompt[i] + n), "logprobs": s, "advantages": a}
        if with_mask:
            inputs["mask"] = torch.cat([torch.zeros(prompt[i]), torch.ones(n)])
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(list(range(prompt[i] + n))), loss_fn_inputs=inputs
            )
        )
        current.append(torch.cat([torch.full((prompt[i],), -3.0), logp[i, :n].float()]))
    return data, current


def padded(data, current):
    T = max(len(c) for c in current)
    out = [torch.zeros(len(data), T) for _ in range(4)]
    for i, (d, c) in enumerate(zip(data, current)):
        n = len(c)
        out[0][i, :n] = c
        out[1][i, :n] = d.loss_fn_inputs["logprobs"].to_torch()
        out[2][i, :n] = d.loss_fn_inputs["advantages"].to_torch()
        out[3][i, :n] = d.loss_fn_inputs["mask"].to_torch()
    return out


@pytest.mark.parametrize(
    "loss", [GRPOLoss(aggregation="seq_mean_token_mean"), DPPOLoss(), DPPOLoss(mode="binary_kl")]
)
def test_custom_loss_fn_pads_and_matches_the_batch_loss(loss):
    data, current = make_datums()
    leaves = [c.clone().requires_grad_(True) for c in current]
    value, metrics = make_custom_loss_fn(loss)(data, leaves)
    value.backward()
    logp_BT, s_BT, a_BT, m_BT = padded(data, current)
    logp_BT.requires_grad_(True)
    ref_value, ref_metrics = loss(logp_BT, s_BT, a_BT, m_BT)
    ref_value.backward()
    torch.testing.assert_close(value, ref_value)
    for i, leaf in enumerate(leaves):
        torch.testing.assert_close(leaf.grad, logp_BT.grad[i, : len(leaf)])
    assert metrics == ref_metrics and metrics["loss/n_tokens"] == float(m_BT.sum())


def test_custom_loss_fn_without_mask_uses_nonzero_rule():
    data, current = make_datums(with_mask=False)
    with_mask, _ = make_datums(with_mask=True)
    _, m_missing = make_custom_loss_fn(GRPOLoss())(data, [c.clone().requires_grad_(True) for c in current])
    _, m_given = make_custom_loss_fn(GRPOLoss())(with_mask, [c.clone().requires_grad_(True) for c in current])
    assert m_missing == m_given  # prompt tokens (A = 0, logprobs = 0) excluded by the rule


def test_custom_loss_fn_errors_name_the_datum_and_key():
    data, current = make_datums()
    fn = make_custom_loss_fn(DPPOLoss())
    with pytest.raises(ValueError, match=r"datum\[1\] loss_fn_inputs\['advantages'\] has"):
        bad = types.Datum(
            model_input=data[1].model_input,
            loss_fn_inputs={**data[1].loss_fn_inputs, "advantages": torch.zeros(2)},
        )
        fn([data[0], bad, data[2]], current)
    with pytest.raises(ValueError, match=r"datum\[0\] has no loss_fn_inputs\['logprobs'\]"):
        fn(
            [types.Datum(model_input=data[0].model_input, loss_fn_inputs={"advantages": torch.zeros(3)})],
            [torch.zeros(3)],
        )
    with pytest.raises(ValueError, match="no datums"):
        fn([], [])


def test_a_failing_loss_is_reported_as_a_loss_error_not_a_backend_failure():
    """A RuntimeError inside the loss code would look like a poisoned client to the trainer (which then
    recovers from checkpoints and fails again); it surfaces as LossFunctionError (a ValueError) instead."""
    from trainer.backends.errors import is_retryable
    from trainer.losses.adapter import LossFunctionError

    class Broken(GRPOLoss):
        def __call__(self, *a, **k):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    data, current = make_datums()
    with pytest.raises(LossFunctionError, match="raised RuntimeError: mat1 and mat2") as e:
        make_custom_loss_fn(Broken())(data, current)
    assert isinstance(e.value, ValueError) and not is_retryable(e.value)


def test_custom_loss_fn_through_tinkers_compute_custom_loss():
    """tinker's own client-side step: the CE weights it sends are -dloss/dlogprobs."""
    data, current = make_datums()
    fwd = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(c)} for c in current],
    )
    loss = DPPOLoss()
    result = TrainingClient._compute_custom_loss(data, make_custom_loss_fn(loss), fwd)
    logp_BT, s_BT, a_BT, m_BT = padded(data, current)
    logp_BT.requires_grad_(True)
    value, metrics = loss(logp_BT, s_BT, a_BT, m_BT)
    value.backward()
    assert result.loss_sum == pytest.approx(value.item(), rel=1e-6)
    assert result.metrics == metrics
    for i, d in enumerate(result.data):
        weights = d.loss_fn_inputs["weights"].to_torch()
        torch.testing.assert_close(weights, -logp_BT.grad[i, : len(current[i])])


@pytest.mark.parametrize("loss", [GRPOLoss(), DPPOLoss(), DPPOLoss(mode="binary_kl", is_cap=INF, delta=INF)])
def test_per_datum_fn_traces_and_sums_to_the_batch_loss(loss):
    pd = make_per_datum_fn(loss)
    handle = trace_loss(pd.fn, pd.input_ranks, session_id="test")
    assert len(encode_graph(handle).nodes) > 10  # encodable for upload
    data, current = make_datums()
    pd_data = [with_per_datum_inputs(d) for d in data]
    check_loss_inputs(handle, pd_data)
    leaves = [c.clone().requires_grad_(True) for c in current]
    value, metrics = run_loss_handle(handle, pd_data, leaves)
    value.backward()

    logp_BT, s_BT, a_BT, m_BT = padded(data, current)
    logp_BT.requires_grad_(True)
    ref_value, ref_metrics = loss(logp_BT, s_BT, a_BT, m_BT)
    ref_value.backward()
    torch.testing.assert_close(value, ref_value)
    for i, leaf in enumerate(leaves):
        torch.testing.assert_close(leaf.grad, logp_BT.grad[i, : len(leaf)])
    final = finalize_per_datum_metrics(metrics)
    for key, v in final.items():
        assert v == pytest.approx(ref_metrics[key], rel=1e-5), key


def test_per_datum_fn_requires_sum_aggregation():
    with pytest.raises(ValueError, match="aggregation='sum'.*token_mean"):
        make_per_datum_fn(GRPOLoss(aggregation="token_mean"))
    with pytest.raises(ValueError, match="aggregation='sum'"):
        make_per_datum_fn(DPPOLoss(aggregation="seq_mean_token_sum"))


def test_with_per_datum_inputs_adds_sampler_key_and_default_mask():
    data, _ = make_datums(with_mask=False)
    out = with_per_datum_inputs(data[0])
    torch.testing.assert_close(
        out.loss_fn_inputs["sampler_logprobs"].to_torch(), data[0].loss_fn_inputs["logprobs"].to_torch()
    )
    mask = out.loss_fn_inputs["mask"].to_torch()
    assert mask[:2].tolist() == [0.0, 0.0] and bool((mask[2:] == 1).all())
    assert "sampler_logprobs" not in data[0].loss_fn_inputs  # original untouched


def test_make_loss_handle_registers_a_handle_that_tinker_runs_client_side():
    """Through tinker's own ServiceClient.create_custom_loss tracing step (no server needed)."""
    from tinker.lib.public_interfaces.custom_loss import LossHandle

    from trainer.losses.per_datum import make_loss_handle

    class TracingOnlyServiceClient:
        """Does what tinker's create_custom_loss does when the server runs losses client-side."""

        def create_custom_loss(self, fn, input_ranks):
            from concurrent.futures import Future

            fut: Future = Future()
            fut.set_result(trace_loss(fn, input_ranks, session_id="local"))
            return fut

    loss = DPPOLoss()
    handle = make_loss_handle(loss, TracingOnlyServiceClient())
    assert isinstance(handle, LossHandle) and handle.input_names == (
        "sampler_logprobs", "advantages", "mask", "anchor_logprobs"
    )
    assert make_loss_handle(loss, object()) is None
    with pytest.raises(ValueError, match="aggregation='sum'"):
        make_loss_handle(DPPOLoss(aggregation="token_mean"), TracingOnlyServiceClient())
    data, current = make_datums()
    with pytest.raises(ValueError, match="sampler_logprobs"):  # datums must be prepared first
        check_loss_inputs(handle, data)
    fwd = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[{"logprobs": types.TensorData.from_torch(c)} for c in current],
    )
    pd_data = [with_per_datum_inputs(d) for d in data]
    via_handle = TrainingClient._compute_custom_loss(pd_data, handle, fwd)
    via_fn = TrainingClient._compute_custom_loss(data, make_custom_loss_fn(loss), fwd)
    assert via_handle.loss_sum == pytest.approx(via_fn.loss_sum, rel=1e-6)
    for a, b in zip(via_handle.data, via_fn.data):
        torch.testing.assert_close(
            a.loss_fn_inputs["weights"].to_torch(), b.loss_fn_inputs["weights"].to_torch()
        )
