"""The loss family beside GRPO and DPPO (importance sampling, CISPO, GSPO, the Dr. GRPO aggregation),
recomputed anchors and the KL penalty: value and gradient against the independent float64 reference
(`trainer.losses.reference`) on drifted batches where each rule is active, the per-datum and
custom-loss paths, the shared diagnostics, hand-computed cases and the configs."""

from __future__ import annotations

import math

import hydra.utils
import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import run_loss_handle, trace_loss

from trainer.losses import (
    CISPOLoss,
    CPPOLoss,
    DPPOLoss,
    GRPOLoss,
    GSPOLoss,
    ImportanceSamplingLoss,
    build_loss,
)
from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.diagnostics import DIAGNOSTIC_KEYS
from trainer.losses.per_datum import finalize_per_datum_metrics, make_per_datum_fn, with_per_datum_inputs
from trainer.losses.reference import ref_loss

F64 = torch.float64
TOL = 1e-5


def drifted(seed: int = 0, B: int = 8, T: int = 24, drift: float = 0.4, anchor_drift: float = 0.15):
    """(logp, sampler, adv, mask, anchor, ref): a drifted float64 batch with padding and an A = 0 row.

    The anchor sits between the sampler and the current policy (as trainer logprobs before the
    first update would); ref (the initial weights) is another perturbation of the sampler."""
    g = torch.Generator().manual_seed(seed)
    sampler = torch.log(0.02 + 0.97 * torch.rand(B, T, generator=g, dtype=F64))
    anchor = torch.clamp(sampler + anchor_drift * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    logp = torch.clamp(anchor + drift * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    ref = torch.clamp(sampler + 0.3 * torch.randn(B, T, generator=g, dtype=F64), max=-1e-6)
    adv = torch.randn(B, 1, generator=g, dtype=F64).expand(B, T).clone()
    adv[1] = 0.0
    lengths = torch.randint(4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(F64)
    return logp, sampler, adv, mask, anchor, ref


def rows(t: torch.Tensor) -> list:
    return t.tolist()


# (id, plugin, reference loss name, reference params, the plugin's own rule key or None)
CASES = [
    ("is_sum", lambda: ImportanceSamplingLoss(), "importance_sampling", {}, None),
    ("is_token_mean", lambda: ImportanceSamplingLoss(aggregation="token_mean"), "importance_sampling",
     {"aggregation": "token_mean"}, None),
    ("cispo_default", lambda: CISPOLoss(), "cispo", {"drift": 1.0}, "loss/cispo_clip_frac"),
    ("cispo_tight", lambda: CISPOLoss(clip_low_threshold=0.8, clip_high_threshold=1.2), "cispo",
     {"low": 0.8, "high": 1.2, "rules": {"cispo_low": 0.8, "cispo_high": 1.2}}, "loss/cispo_clip_frac"),
    ("gspo_default", lambda: GSPOLoss(), "gspo", {}, "loss/gspo_clip_frac"),
    ("gspo_wide_seq_mean", lambda: GSPOLoss(seq_clip_eps_low=0.05, seq_clip_eps_high=0.08, aggregation="seq_mean_token_mean"),
     "gspo", {"eps_low": 0.05, "eps_high": 0.08, "aggregation": "seq_mean_token_mean"}, "loss/gspo_clip_frac"),
    ("grpo_dr_grpo_norm", lambda: GRPOLoss(aggregation="seq_mean_token_sum_norm", norm_length=64),
     "grpo", {"aggregation": "seq_mean_token_sum_norm", "norm_length": 64.0}, "loss/grpo_clip_frac"),
    ("dppo_dr_grpo_norm", lambda: DPPOLoss(aggregation="seq_mean_token_sum_norm", norm_length=64),
     "dppo", {"aggregation": "seq_mean_token_sum_norm", "norm_length": 64.0}, "loss/dppo_masked_frac"),
]


def plugin_value_grad(loss, logp, *args, **kwargs):
    leaf = logp.detach().clone().requires_grad_(True)
    value, metrics = loss(leaf, *args, **kwargs)
    value.backward()
    return float(value.detach()), leaf.grad, metrics


def check_against_reference(value, grad, metrics, ref):
    assert abs(value - ref.value) <= TOL, (value, ref.value)
    assert float((grad - torch.tensor(ref.grad, dtype=F64)).abs().max()) <= TOL
    for key, expected in ref.metrics.items():
        assert metrics[key] == pytest.approx(expected, rel=1e-9, abs=1e-12), key


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_plugin_matches_the_reference_in_value_gradient_and_diagnostics(case, seed):
    _, make, ref_name, params, rule = case
    params = dict(params)
    logp, sampler, adv, mask, _, _ = drifted(seed, drift=params.pop("drift", 0.4))
    loss = make()
    value, grad, metrics = plugin_value_grad(loss, logp, sampler, adv, mask)
    ref = ref_loss(ref_name, rows(logp), rows(sampler), rows(adv), rows(mask), **params)
    check_against_reference(value, grad, metrics, ref)
    assert list(metrics) == list(DIAGNOSTIC_KEYS)
    if rule is not None:  # the batch is drifted enough that the rule acts on part of it
        assert 0 < metrics[rule] < 1


ANCHORED = [
    ("grpo", lambda: GRPOLoss(anchor="recomputed"), {}, "loss/grpo_clip_frac"),
    ("dppo_tv", lambda: DPPOLoss(anchor="recomputed"), {}, "loss/dppo_masked_frac"),
    ("dppo_kl", lambda: DPPOLoss(mode="binary_kl", anchor="recomputed"),
     {"mode": "binary_kl", "delta_low": 0.05, "delta_high": 0.05}, "loss/dppo_masked_frac"),
    ("gspo", lambda: GSPOLoss(seq_clip_eps_low=0.02, seq_clip_eps_high=0.02, anchor="recomputed"),
     {"eps_low": 0.02, "eps_high": 0.02}, "loss/gspo_clip_frac"),
]


@pytest.mark.parametrize("case", ANCHORED, ids=[c[0] for c in ANCHORED])
def test_recomputed_anchor_matches_the_reference_and_moves_the_rule(case):
    name, make, params, rule = case
    ref_name = name.split("_")[0]
    logp, sampler, adv, mask, anchor, _ = drifted(3, drift=0.3, anchor_drift=0.4)
    loss = make()
    value, grad, metrics = plugin_value_grad(loss, logp, sampler, adv, mask, anchor_logp=anchor)
    ref = ref_loss(ref_name, rows(logp), rows(sampler), rows(adv), rows(mask), anchor_logp=rows(anchor), **params)
    check_against_reference(value, grad, metrics, ref)
    assert 0 < metrics[rule] < 1
    # the anchor changes which tokens the rule acts on (so the comparison above is not vacuous)
    _, grad_sampler, m_sampler = plugin_value_grad(loss, logp, sampler, adv, mask)
    assert m_sampler[rule] != metrics[rule]
    assert not torch.allclose(grad, grad_sampler)
    # an anchor equal to the sampler is exactly the one-pass (sampler-anchored) loss
    v_same, g_same, _ = plugin_value_grad(loss, logp, sampler, adv, mask, anchor_logp=sampler.clone())
    v_none, g_none, _ = plugin_value_grad(loss, logp, sampler, adv, mask)
    assert v_same == v_none and torch.equal(g_same, g_none)


@pytest.mark.parametrize("make", [lambda: CISPOLoss(kl_coef=0.05), lambda: GRPOLoss(kl_coef=0.1, aggregation="token_mean")])
def test_kl_penalty_to_the_initial_weights_matches_the_reference(make):
    logp, sampler, adv, mask, _, ref_lp = drifted(4)
    loss = make()
    name = "cispo" if isinstance(loss, CISPOLoss) else "grpo"
    value, grad, metrics = plugin_value_grad(loss, logp, sampler, adv, mask, ref_logp=ref_lp)
    ref = ref_loss(name, rows(logp), rows(sampler), rows(adv), rows(mask), aggregation=loss.aggregation,
                   ref_logp=rows(ref_lp), kl_coef=loss.kl_coef)
    check_against_reference(value, grad, metrics, ref)
    assert metrics["loss/kl_ref"] > 0
    with pytest.raises(ValueError, match="needs ref_logp"):
        loss(logp, sampler, adv, mask)


def test_every_arm_reports_the_same_keys_and_identical_counterfactuals_at_the_defaults():
    """At their defaults the five arms evaluate the same four rules: identical diagnostics, so any
    two arms' curves compare point by point."""
    logp, sampler, adv, mask, _, _ = drifted(5, drift=0.6)
    arms = [GRPOLoss(), DPPOLoss(), ImportanceSamplingLoss(), CISPOLoss(), GSPOLoss(), CPPOLoss()]
    results = [arm(logp, sampler, adv, mask)[1] for arm in arms]
    for m in results:
        assert list(m) == list(DIAGNOSTIC_KEYS)
        assert m == results[0]
    m = results[0]
    for rule in ("dppo_masked", "grpo_clip", "cispo_clip", "gspo_clip", "cppo_masked", "cppo_token_masked",
                 "cppo_budget_masked"):
        assert 0 < m[f"loss/{rule}_frac"] < 1, rule
    # a counterfactual follows the arm's own setting of its rule
    _, m_tight = CISPOLoss(clip_high_threshold=1.1)(logp, sampler, adv, mask)
    assert m_tight["loss/cispo_clip_frac"] > m["loss/cispo_clip_frac"]


def test_rule_shares_by_advantage_sign_hand_computed():
    p_s = [0.5, 0.5, 0.5, 0.5, 0.5, 0.9]
    p = [0.9, 0.55, 0.25, 0.45, 0.5, 0.1]  # last one is padding
    logp = torch.log(torch.tensor(p, dtype=F64))
    slp = torch.log(torch.tensor(p_s, dtype=F64))
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 1.0], dtype=F64)
    mask = torch.tensor([1, 1, 1, 1, 1, 0], dtype=F64)
    _, m = GRPOLoss()(logp, slp, adv, mask)
    # DPPO TV 0.15: token 0 (A>0, +0.4) and token 2 (A<0, -0.25) are dropped
    assert m["loss/dppo_masked_frac"] == pytest.approx(2 / 5)
    assert m["loss/dppo_masked_frac_adv_pos"] == pytest.approx(1 / 2)
    assert m["loss/dppo_masked_frac_adv_neg"] == pytest.approx(1 / 2)
    # GRPO 0.2: r = 1.8 (A>0) and r = 0.5 (A<0) clip; r = 1.1 and 0.9 do not
    assert m["loss/grpo_clip_frac_adv_pos"] == pytest.approx(1 / 2)
    assert m["loss/grpo_clip_frac_adv_neg"] == pytest.approx(1 / 2)
    # CISPO 0 / 4: no r above 4
    assert m["loss/cispo_clip_frac"] == 0.0
    # GSPO: one sequence, mean log-ratio = (log 1.8 + log 1.1 + log .5 + log .9 + 0) / 5 < 0 -> s < 1 - 3e-4:
    # the clip binds on the A < 0 tokens only
    s = math.exp((math.log(1.8) + math.log(1.1) + math.log(0.5) + math.log(0.9)) / 5)
    assert s < 1 - 3e-4
    assert m["loss/gspo_clip_frac_adv_neg"] == 1.0 and m["loss/gspo_clip_frac_adv_pos"] == 0.0
    assert m["loss/gspo_clip_frac"] == pytest.approx(2 / 5)
    assert m["entropy/sampled_token_estimate"] == pytest.approx(-math.log(0.5))


def test_cispo_truncates_the_weight_but_never_drops_a_token():
    logp = torch.log(torch.tensor([0.9, 0.05, 0.5], dtype=F64)).requires_grad_(True)
    slp = torch.log(torch.tensor([0.1, 0.5, 0.5], dtype=F64))  # r = 9, 0.1, 1
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=F64)
    value, m = CISPOLoss()(logp, slp, adv, torch.ones(3, dtype=F64))
    value.backward()
    # weights clip(r, 0, 4) = 4, 0.1, 1; gradient -A*w on every token
    torch.testing.assert_close(logp.grad, torch.tensor([-4.0, 0.1, -2.0], dtype=F64))
    expected = -(4 * 1 * math.log(0.9) + 0.1 * -1 * math.log(0.05) + 1 * 2 * math.log(0.5))
    assert float(value.detach()) == pytest.approx(expected)
    assert m["loss/cispo_clip_frac"] == pytest.approx(1 / 3)


def test_gspo_clips_whole_sequences():
    """Two sequences with opposite drift: the one whose sequence ratio leaves the band in the direction
    of its advantage gets zero gradient on every token, the other gets -A*s on every token."""
    slp = torch.log(torch.full((2, 3), 0.5, dtype=F64))
    logp = torch.log(torch.tensor([[0.6, 0.6, 0.6], [0.45, 0.5, 0.55]], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([[1.0] * 3, [1.0] * 3], dtype=F64)
    value, _ = GSPOLoss(seq_clip_eps_low=0.1, seq_clip_eps_high=0.1)(logp, slp, adv, torch.ones(2, 3, dtype=F64))
    value.backward()
    assert torch.equal(logp.grad[0], torch.zeros(3, dtype=F64))  # s = 1.2 > 1.1 with A > 0
    s1 = math.exp((math.log(0.9) + 0 + math.log(1.1)) / 3)
    torch.testing.assert_close(logp.grad[1], torch.full((3,), -s1, dtype=F64))


@pytest.mark.parametrize("make", [
    lambda: ImportanceSamplingLoss(), lambda: CISPOLoss(), lambda: GSPOLoss(seq_clip_eps_low=0.05, seq_clip_eps_high=0.05),
    lambda: GRPOLoss(kl_coef=0.1), lambda: DPPOLoss(anchor="recomputed"), lambda: CPPOLoss(),
    lambda: CPPOLoss(anchor="recomputed", w_min=0.5),
])
def test_custom_fn_and_traced_per_datum_fn_equal_the_batch_loss(make):
    """The two tinker paths (two-pass callable, one-pass registered per-datum function) give the batch
    loss's value, gradient and count diagnostics, anchors and reference logprobs included."""
    from tinker import types

    loss = make()
    logp, sampler, adv, mask, anchor, ref = drifted(6, B=5, T=12)
    data, current = [], []
    for i in range(logp.shape[0]):
        n = int(mask[i].sum())
        inputs = {
            "target_tokens": types.TensorData.from_torch(torch.zeros(n, dtype=torch.int64)),
            "logprobs": types.TensorData.from_torch(sampler[i, :n].float()),
            "advantages": types.TensorData.from_torch(adv[i, :n].float()),
            "mask": types.TensorData.from_torch(torch.ones(n)),
            "anchor_logprobs": types.TensorData.from_torch(anchor[i, :n].float()),
            "ref_logprobs": types.TensorData.from_torch(ref[i, :n].float()),
        }
        data.append(types.Datum(model_input=types.ModelInput.from_ints([0] * n), loss_fn_inputs=inputs))
        current.append(logp[i, :n].float())
    f32 = [t.float().double() for t in (logp, sampler, adv, anchor, ref)]
    leaf = f32[0].clone().requires_grad_(True)
    v_batch, m_batch = loss(leaf, f32[1], f32[2], mask, anchor_logp=f32[3], ref_logp=f32[4])
    v_batch.backward()
    g_batch = torch.cat([leaf.grad[i, : int(mask[i].sum())] for i in range(len(data))])

    def run(fn, ds):
        leaves = [c.clone().requires_grad_(True) for c in current]
        value, metrics = fn(ds, leaves)
        value.backward()
        return float(value), torch.cat([x.grad.double() for x in leaves]), metrics

    v_fn, g_fn, m_fn = run(make_custom_loss_fn(loss), data)
    assert v_fn == pytest.approx(float(v_batch), rel=1e-5, abs=1e-5)
    assert float((g_fn - g_batch).abs().max()) <= 1e-5
    if loss.aggregation == "sum":
        pd = make_per_datum_fn(loss)
        handle = trace_loss(pd.fn, pd.input_ranks, "test")
        pd_data = [with_per_datum_inputs(d) for d in data]
        v_pd, g_pd, m_pd = run(lambda d, lp: run_loss_handle(handle, d, lp), pd_data)
        assert v_pd == pytest.approx(float(v_batch), rel=1e-5, abs=1e-5)
        assert float((g_pd - g_batch).abs().max()) <= 1e-5
        for key, val in finalize_per_datum_metrics(m_pd).items():
            assert val == pytest.approx(m_batch[key], rel=1e-4, abs=1e-6), key


def test_constructors_check_their_settings():
    with pytest.raises(ValueError, match="clip_low_threshold must be in"):
        CISPOLoss(clip_low_threshold=-0.1)
    with pytest.raises(ValueError, match="clip_high_threshold must be >= 1"):
        CISPOLoss(clip_high_threshold=0.5)
    with pytest.raises(ValueError, match="seq_clip_eps_low"):
        GSPOLoss(seq_clip_eps_low=0.0)
    with pytest.raises(ValueError, match="norm_length must be > 0 for aggregation seq_mean_token_sum_norm"):
        GRPOLoss(aggregation="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="anchor must be one of"):
        DPPOLoss(anchor="trainer")
    with pytest.raises(ValueError, match="kl_coef must be"):
        ImportanceSamplingLoss(kl_coef=-1.0)
    assert CISPOLoss().clip_low == 0.0 and CISPOLoss().clip_high == 4.0
    assert (GSPOLoss().eps_low, GSPOLoss().eps_high) == (3e-4, 4e-4)
    for name, cls in (("importance_sampling", ImportanceSamplingLoss), ("cispo", CISPOLoss), ("gspo", GSPOLoss)):
        assert type(build_loss(cls.config_class())) is cls and cls().name == name


@pytest.mark.parametrize("name", ["importance_sampling", "cispo", "gspo"])
def test_loss_configs_compose_validate_and_instantiate(name):
    from trainer.config.compose import compose_config as compose
    from trainer.config.schema import validate

    cfg = compose([f"loss={name}"])
    validate(cfg)
    loss = hydra.utils.instantiate(cfg.loss)
    assert loss.name == name and loss.aggregation == "sum" and loss.anchor == "sampler" and loss.kl_coef == 0.0
    cfg = compose([f"loss={name}", "loss.aggregation=seq_mean_token_sum_norm"])
    assert hydra.utils.instantiate(cfg.loss).norm_length == float(cfg.sampling.max_tokens)


def test_loss_config_errors_name_the_key():
    from trainer.config.compose import compose_config as compose
    from trainer.config.schema import ConfigError, validate

    for overrides, key in (
        (["loss=cispo", "loss.clip_high_threshold=0.5"], "loss.clip_high_threshold"),
        (["loss=gspo", "loss.anchor=trainer"], "loss.anchor"),
        (["loss=grpo", "loss.kl_coef=-0.1"], "loss.kl_coef"),
        (["loss=dppo", "loss.aggregation=seq_mean_token_sum_norm", "loss.norm_length=0"], "loss.norm_length"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validate(compose(overrides))


def check_anchor_kl_rows(rows: list[dict], path: str) -> None:
    """The anchor pass and the reference logprobs are timed, the anchor is the trainer's pre-update
    logprobs (no anchored rule fires at the first update), the KL to the initial weights is 0 before any
    update and grows after, the exact entropy is logged, and the mismatch keys are the first update's drift."""
    assert [(r["step"], r["update"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in rows:
        assert r["loss/path"] == path
        assert 0 < r["time/anchor_forward"] and 0 < r["time/ref_logprobs"]
        assert r["time/train"] >= r["time/anchor_forward"] + r["time/ref_logprobs"]
        assert r["entropy/exact"] > 0 and r["entropy/sampled_token_estimate"] > 0
        first = next(x for x in rows if x["step"] == r["step"] and x["update"] == 0)
        assert r["mismatch/abs_p_max"] == first["drift/abs_p_max"]
        assert r["mismatch/kl_k3"] == first["drift/kl_sampler_current"]
        if r["update"] == 0:
            assert r["loss/dppo_masked_frac"] == 0.0 and r["loss/grpo_clip_frac"] == 0.0
    assert rows[0]["loss/kl_ref"] < 1e-6  # LoRA starts at B = 0: the first update sees the initial weights
    assert rows[-1]["loss/kl_ref"] > 1e-4
    assert rows[-1]["drift/abs_p_max"] > 0


@pytest.mark.slow
def test_three_loss_sweep_gives_every_arm_the_same_metric_keys(tmp_path):
    """`--multirun loss=grpo,dppo,cispo` on the tiny model (Dr. GRPO aggregation: the two-pass path;
    recomputed anchor and KL penalty): three arms, one run folder each, identical metric keys and eval
    items, so compare can pair any treatment with the baseline point by point."""
    import json

    from runs import TINY, read_metrics, run_train

    sweep = tmp_path / "sweep"
    p = run_train(["--multirun", "loss=grpo,dppo,cispo", "seed=0", *TINY, "loss.aggregation=seq_mean_token_sum_norm",
                   "loss.anchor=recomputed", "loss.kl_coef=0.05", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    arms = json.loads((sweep / "arms.json").read_text())
    assert sorted(a["arm"] for a in arms.values()) == ["cispo_seed0", "dppo_seed0", "grpo_seed0"]
    keys, items = [], []
    for job in sorted(arms):
        run = sweep / job
        rows = read_metrics(run)
        check_anchor_kl_rows(rows, "two_pass")
        keys.append({k for r in rows for k in r})
        ev = [json.loads(x) for x in (run / "eval" / "gsm8k_test.jsonl").read_text().splitlines()]
        items.append([(e["index"], e["question_sha256"]) for e in ev])
        config = (run / "config.yaml").read_text()
        assert "aggregation: seq_mean_token_sum_norm" in config and "norm_length: 12" in config
    assert keys[0] == keys[1] == keys[2]
    assert items[0] == items[1] == items[2] and len(items[0]) == 4


def test_local_forward_returns_the_exact_entropy(tmp_path_factory):
    """The no-grad forward's `entropy` output equals -sum_v p log p from the full next-token distribution
    (all V logprobs per position through rank-2 target_tokens), and training calls do not pay for it."""
    from local_client import local_service_client
    from tinker import types

    gen = local_service_client(tmp_path_factory, "entropy")
    sc = next(gen)
    try:
        tc = sc.create_lora_training_client("pairedrl/tiny-random", rank=4, seed=0).result()
        V = tc.compute.base.vocab_size
        ids = [[5, 9, 2, 7, 11, 3], [4, 4, 8]]
        data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                            loss_fn_inputs={"target_tokens": s[1:]}) for s in ids]
        out = tc.forward(data, "cross_entropy").result()
        full = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData.from_torch(torch.arange(V).repeat(len(s) - 1, 1))}) for s in ids]
        lp_full = tc.forward(full, "cross_entropy").result().loss_fn_outputs
        for o, f in zip(out.loss_fn_outputs, lp_full):
            lp = f["logprobs"].to_torch().double()
            expected = -(lp.exp() * lp).sum(-1)
            torch.testing.assert_close(o["entropy"].to_torch().double(), expected, atol=1e-4, rtol=1e-4)
            assert float(expected.min()) > 0.1  # a near-uniform random model: far from the trivial 0
            assert "entropy" not in f  # rank-2 targets: logprobs only
        fb = tc.forward_backward(data, "cross_entropy").result()
        assert all("entropy" not in o for o in fb.loss_fn_outputs)
    finally:
        gen.close()


def test_any_two_loss_configs_agree_on_the_keys_they_share():
    """eval.compare requires the settings both arms' loss groups have to be equal (only the loss may
    differ), so a sweep over any losses at their defaults must pass that check."""
    from itertools import combinations

    from omegaconf import OmegaConf

    from trainer.config.compose import compose_config

    names = ["grpo", "dppo", "importance_sampling", "cispo", "gspo", "cppo"]
    cfgs = {n: OmegaConf.to_container(compose_config([f"loss={n}"]).loss, resolve=True) for n in names}
    for a, b in combinations(names, 2):
        shared = (set(cfgs[a]) & set(cfgs[b])) - {"name", "_target_"}
        assert shared >= {"aggregation", "norm_length", "anchor", "kl_coef"}
        for key in shared:
            assert cfgs[a][key] == cfgs[b][key], (a, b, key)
