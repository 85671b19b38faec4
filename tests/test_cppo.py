"""CPPO (`loss=cppo`): the plugin against the independent float64 reference on random batches, its reduction
to binary-TV DPPO, hand-computed cases of the position weight and the prefix budget, the one-pass graph,
and its config."""

from __future__ import annotations

import math

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import trace_loss

from trainer.config.checks import ConfigError
from trainer.losses import CPPOLoss, DPPOLoss, GRPOLoss, build_loss
from trainer.losses.diagnostics import DIAGNOSTIC_KEYS
from trainer.losses.per_datum import make_per_datum_fn
from trainer.losses.reference import ref_loss

F64 = torch.float64
CPPO_KEYS = ("loss/cppo_masked_frac", "loss/cppo_token_masked_frac", "loss/cppo_budget_masked_frac")


def batch(seed: int, B: int = 7, T: int = 30, drift: float = 0.35):
    """(logp, sampler, adv, mask, anchor): float64 rows of a prompt (mask 0, garbage logprobs), a response
    of 1..T - 6 tokens, one with a masked gap inside, right padding; one row has A = 0."""
    g = torch.Generator().manual_seed(seed)
    sampler = torch.log(0.02 + 0.97 * torch.rand(B, T, generator=g, dtype=F64))
    anchor = torch.clamp(sampler + 0.2 * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    logp = torch.clamp(anchor + drift * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    adv[2] = 0.0
    prompt = torch.randint(0, 5, (B,), generator=g)
    length = torch.randint(1, T - 5, (B,), generator=g)
    length[0] = 1  # a one-token response: T = 1
    pos = torch.arange(T)[None, :]
    mask = ((pos >= prompt[:, None]) & (pos < (prompt + length)[:, None])).to(F64)
    mask[3, prompt[3] + 1] = 0.0  # a gap inside a response
    sampler = torch.where(mask > 0, sampler, torch.zeros_like(sampler))  # as datums carry it outside
    return logp, sampler, adv, mask, anchor


def value_grad(loss, logp, *args, **kwargs):
    leaf = logp.detach().clone().requires_grad_(True)
    value, metrics = loss(leaf, *args, **kwargs)
    value.backward()
    return value.detach(), leaf.grad, metrics


SETTINGS = [{}, {"w_min": 0.5, "delta_b": 0.05}, {"delta": 0.1, "w_min": 0.0, "delta_b": 0.01},
            {"w_min": 1.0}]


@pytest.mark.parametrize("settings", SETTINGS, ids=["defaults", "w0.5_b0.05", "d0.1_w0_b0.01", "w1"])
@pytest.mark.parametrize("aggregation", ["sum", "seq_mean_token_mean"])
@pytest.mark.parametrize("anchored", [False, True], ids=["sampler", "recomputed"])
@pytest.mark.parametrize("seed", [0, 1])
def test_cppo_matches_the_float64_reference_in_value_gradient_and_diagnostics(settings, aggregation, anchored,
                                                                                seed):
    logp, sampler, adv, mask, anchor = batch(seed)
    loss = CPPOLoss(aggregation=aggregation, anchor="recomputed" if anchored else "sampler", **settings)
    extra = {"anchor_logp": anchor} if anchored else {}
    value, grad, metrics = value_grad(loss, logp, sampler, adv, mask, **extra)
    ref = ref_loss("cppo", logp.tolist(), sampler.tolist(), adv.tolist(), mask.tolist(),
                   aggregation=aggregation, anchor_logp=anchor.tolist() if anchored else None, **settings)
    assert float(value) == pytest.approx(ref.value, rel=1e-12, abs=1e-12)
    assert float((grad - torch.tensor(ref.grad, dtype=F64)).abs().max()) <= 1e-12
    assert list(metrics) == list(DIAGNOSTIC_KEYS)
    for key, expected in ref.metrics.items():
        assert metrics[key] == pytest.approx(expected, rel=1e-9, abs=1e-12), key
    # the batch exercises both causes, and they partition the mask
    assert metrics["loss/cppo_token_masked_frac"] > 0 and metrics["loss/cppo_budget_masked_frac"] > 0
    assert metrics["loss/cppo_masked_frac"] == pytest.approx(
        metrics["loss/cppo_token_masked_frac"] + metrics["loss/cppo_budget_masked_frac"])


@pytest.mark.parametrize("delta_b", [1.0, 50.0])
@pytest.mark.parametrize("aggregation", ["sum", "token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("anchored", [False, True], ids=["sampler", "recomputed"])
def test_at_w_min_1_and_an_unbounded_budget_cppo_is_binary_tv_dppo_exactly(delta_b, aggregation, anchored):
    """w_t = 1 and delta_b >= 1 (S_{t-1} <= W_{t-1} because D <= 1, so c_t = delta): the same loss and
    gradient as DPPO's binary-TV rule at the same delta, bit for bit."""
    for seed in range(3):
        logp, sampler, adv, mask, anchor = batch(seed, drift=0.5)
        extra = {"anchor_logp": anchor} if anchored else {}
        kw = {"aggregation": aggregation, "anchor": "recomputed" if anchored else "sampler"}
        v_c, g_c, m_c = value_grad(CPPOLoss(w_min=1.0, delta_b=delta_b, delta=0.15, **kw),
                                   logp, sampler, adv, mask, **extra)
        v_d, g_d, m_d = value_grad(DPPOLoss(mode="binary_tv", delta=0.15, **kw), logp, sampler, adv, mask,
                                   **extra)
        assert torch.equal(v_c, v_d) and torch.equal(g_c, g_d)
        assert m_c["loss/cppo_budget_masked_frac"] == 0.0
        # DPPO also drops A = 0 tokens (no gradient either way): CPPO's mask is DPPO's on A != 0
        assert m_c["loss/cppo_masked_frac"] == pytest.approx(
            m_d["loss/dppo_masked_frac_nonzero_adv"] * sum(1 for a in adv[mask > 0].tolist() if a != 0)
            / float(mask.sum()))
        assert m_c["loss/cppo_masked_frac"] > 0
    # not vacuous: at the defaults the two differ on the same batch
    v_c, g_c, _ = value_grad(CPPOLoss(**kw), logp, sampler, adv, mask, **extra)
    assert not torch.equal(g_c, g_d)


def hand(p_sampler, p, adv, mask=None):
    """One sequence (a [1, T] batch) from probabilities."""
    logp = torch.log(torch.tensor([p], dtype=F64))
    slp = torch.log(torch.tensor([p_sampler], dtype=F64))
    a = torch.tensor([adv], dtype=F64)
    m = torch.ones_like(a) if mask is None else torch.tensor([mask], dtype=F64)
    return logp, slp, a, m


def test_the_prefix_budget_counts_every_earlier_token_hand_computed():
    """w_min = 1, delta 0.15, delta_b 0.02, all four tokens move p away from the sampler with A > 0:
    D = .1, .1, .1, .05; P90(D) = .1 -> delta_b^seq = clamp(.1, .02, .04) = .04;
    c_1 = .15 (keep), c_2 = .15 + .04 - .1 = .09 < .1 (drop), c_3 = .15 + .08 - .2 = .03 (drop),
    c_4 = .15 + .12 - .3 = -.03 (drop): S sums the dropped tokens too (kept-only sums would keep 3 and 4)."""
    logp, slp, adv, mask = hand([0.5] * 4, [0.6, 0.6, 0.6, 0.55], [1.0] * 4)
    loss = CPPOLoss(w_min=1.0, delta=0.15, delta_b=0.02)
    value, grad, m = value_grad(loss, logp, slp, adv, mask)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, 0.0, 0.0, 0.0]], dtype=F64))
    assert float(value) == pytest.approx(-1.2 * math.log(0.6))
    assert m["loss/cppo_masked_frac"] == pytest.approx(3 / 4)
    assert m["loss/cppo_budget_masked_frac"] == pytest.approx(3 / 4)
    assert m["loss/cppo_token_masked_frac"] == 0.0
    assert m["loss/dppo_masked_frac"] == 0.0  # no D above 0.15: DPPO keeps them all
    # the same sequence after a masked prompt and before padding: positions with mask 0 count in neither t,
    # T, S, W nor P90, whatever they hold (a garbage logprob of 800 has exp = inf: no NaN may reach S)
    logp2, slp2, adv2, mask2 = hand([0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0],
                                    [0.01, 0.9, 0.6, 0.6, 0.6, 0.55, 0.3],
                                    [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [0, 0, 1, 1, 1, 1, 0])
    slp2 = torch.where(mask2 > 0, slp2, torch.zeros_like(slp2))
    logp2[0, 0] = 800.0
    _, grad2, m2 = value_grad(loss, logp2, slp2, adv2, mask2)
    torch.testing.assert_close(grad2[:, 2:6], grad)
    assert m2["loss/cppo_masked_frac"] == pytest.approx(3 / 4)


def test_the_position_weight_relaxes_late_tokens_and_the_token_threshold_binds_hand_computed():
    """w_min = 0.8, T = 3: w = 1, .9, .8. D = .05, .2, .18 (A > 0, p above the sampler), delta 0.15,
    delta_b 0.1: P90(D) = .18 + .8 (.2 - .18) = .196, inside [.1, .2]. c_1 = .15 (Z .05 keep);
    c_2 = min(.15, .15 + .196 - .05) = .15 < Z_2 = .18 (drop, the per-token threshold); c_3 = min(.15,
    .15 + .196 * 1.9 - .23) = .15 >= Z_3 = .144 (keep, though D_3 = .18 > .15 and DPPO drops it)."""
    logp, slp, adv, mask = hand([0.5] * 3, [0.55, 0.7, 0.68], [1.0] * 3)
    _, grad, m = value_grad(CPPOLoss(w_min=0.8, delta=0.15, delta_b=0.1), logp, slp, adv, mask)
    torch.testing.assert_close(grad, torch.tensor([[-1.1, 0.0, -1.36]], dtype=F64))
    assert m["loss/cppo_token_masked_frac"] == pytest.approx(1 / 3)
    assert m["loss/cppo_budget_masked_frac"] == 0.0
    assert m["loss/dppo_masked_frac"] == pytest.approx(2 / 3)


def test_tokens_moving_back_toward_the_sampler_are_always_kept_hand_computed():
    """A (r - 1) <= 0 keeps a token whatever its divergence (p fell with A > 0, p rose with A < 0), and its
    Z_t still spends the budget: the next token, pushing away with D = .1 <= delta, is dropped by it."""
    logp, slp, adv, mask = hand([0.5] * 3, [0.2, 0.9, 0.6], [1.0, -1.0, 1.0])
    _, grad, m = value_grad(CPPOLoss(w_min=1.0), logp, slp, adv, mask)
    torch.testing.assert_close(grad, torch.tensor([[-0.4, 1.8, 0.0]], dtype=F64))
    assert m["loss/cppo_budget_masked_frac"] == pytest.approx(1 / 3)


def test_a_one_token_response_has_weight_1():
    """T = 1: w_1 = 1 (UniRL's code: 1 - (1 - w_min)(t - 1)/max(T - 1, 1)), so Z = D = .16 > .15 is dropped
    (w_min's .128 would have been kept), and c_1 = delta."""
    logp, slp, adv, mask = hand([0.5], [0.66], [1.0])
    _, grad, m = value_grad(CPPOLoss(w_min=0.8), logp, slp, adv, mask)
    assert torch.equal(grad, torch.zeros_like(grad)) and m["loss/cppo_token_masked_frac"] == 1.0
    _, grad, _ = value_grad(CPPOLoss(w_min=0.8), *hand([0.5], [0.64], [1.0]))
    torch.testing.assert_close(grad, torch.tensor([[-1.28]], dtype=F64))


def test_only_the_cppo_arm_registers_a_graph_that_sorts():
    """CPPO's rule needs a sort (its P90), which a service's table of allowed graph functions may lack: the
    other arms' one-pass graphs leave CPPO's counterfactual rules to the client and call no sort."""
    def targets(loss) -> set[str]:
        pd = make_per_datum_fn(loss)
        handle = trace_loss(pd.fn, pd.input_ranks, "test")
        return {getattr(n.target, "__name__", str(n.target)) for n in handle.graph.graph.nodes}

    assert "sort" in targets(CPPOLoss())
    assert "sort" not in targets(GRPOLoss()) and "sort" not in targets(DPPOLoss(anchor="recomputed"))


def test_the_server_rebuilds_cppos_graph_and_runs_it_as_the_sdk_traced_it():
    """`python -m trainer.serve` takes CPPO's one-pass graph (its table allows torch.sort), bounds its cost,
    and the graph it rebuilds from the wire gives the SDK-traced graph's loss, gradient and sums."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph

    from trainer.serve import wire
    from trainer.serve.graph_cost import check_at_upload, check_request
    from trainer.serve.limits import Limits

    pd = make_per_datum_fn(CPPOLoss(w_min=0.5))
    traced = trace_loss(pd.fn, pd.input_ranks, "test").graph
    rebuilt = wire.rebuild_graph(encode_graph(trace_loss(pd.fn, pd.input_ranks, "test")))
    n_inputs = len(pd.input_ranks)
    check_at_upload(rebuilt, [1] * n_inputs, Limits())
    assert 0 < check_request(rebuilt, [[((40,), torch.float32)] * n_inputs] * 4, Limits())
    logp, sampler, adv, mask, anchor = batch(2)
    row = [t[4].float() for t in (logp, sampler, adv, mask, anchor)]
    outs = []
    for graph in (traced, rebuilt):
        leaf = row[0].clone().requires_grad_(True)
        value, metrics = graph(leaf, *row[1:])
        value.backward()
        outs.append((value.detach(), leaf.grad, {k: float(v) for k, v in metrics.items()}))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert outs[0][2] == outs[1][2] and float((outs[0][1] != 0).sum()) > 0


def test_cppo_config_defaults_bounds_and_registry():
    from trainer.config.losses import CPPOLossConfig

    c = CPPOLossConfig()
    assert (c.delta, c.w_min, c.delta_b, c.is_cap) == (0.15, 0.8, 0.02, 1e4)
    assert type(build_loss(c)) is CPPOLoss and CPPOLoss().name == "cppo"
    for fields, message in (
        ({"delta": 0.0}, "delta must be in (0, 1]"),
        ({"delta": 1.5}, "delta must be in (0, 1]"),
        ({"delta": math.inf}, "delta must be in (0, 1]"),
        ({"w_min": -0.1}, "w_min must be in [0, 1]"),
        ({"w_min": 1.01}, "w_min must be in [0, 1]"),
        ({"delta_b": 0.0}, "delta_b must be a finite number > 0"),
        ({"delta_b": math.inf}, "delta_b must be a finite number > 0"),
        ({"delta_b": math.nan}, "delta_b must be a number"),
        ({"w_min": math.nan}, "w_min must be a number"),
        ({"is_cap": 0.5}, "is_cap must be >= 1"),
        ({"name": "dppo"}, "name must be 'cppo'"),
    ):
        with pytest.raises(ConfigError, match=f"^CPPOLoss: {re_escape(message)}"):
            CPPOLoss(**fields)
    assert CPPOLoss(w_min=0.0, delta=1.0, delta_b=1.0).w_min == 0.0  # the closed ends are allowed


def re_escape(s: str) -> str:
    import re

    return re.escape(s)


def test_loss_cppo_composes_and_a_bad_key_fails_naming_it():
    from trainer.config.compose import compose_config as compose
    from trainer.config.schema import validate

    cfg = validate(compose(["loss=cppo", "loss.w_min=0.9", "loss.delta_b=0.03", "loss.delta=0.2"]))
    loss = build_loss(cfg.loss)
    assert (type(loss), loss.delta, loss.w_min, loss.delta_b) == (CPPOLoss, 0.2, 0.9, 0.03)
    for override, message in (("loss.delta_b=nan", "loss.delta_b must be a number"),
                              ("loss.w_min=2", "loss.w_min must be in [0, 1], got 2.0")):
        with pytest.raises(ConfigError, match=re_escape(message)):
            validate(compose(["loss=cppo", override]))
