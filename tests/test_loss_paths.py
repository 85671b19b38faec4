"""The two loss paths (`trainer.losses.paths`): what each sends to `forward_backward_custom`, the metrics
each reads back, the factory that picks one, and the RL loop on both paths giving the same updates."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from local_client import local_service_client
from runs import TINY, read_metrics, train_entry
from test_loss_family import check_anchor_kl_rows
from test_losses import make_datums
from tinker import types

from trainer.datums import Rollout, rollout_to_datum
from trainer.losses import CISPOLoss, CPPOLoss, DPPOLoss, GRPOLoss, GSPOLoss, ImportanceSamplingLoss
from trainer.losses.inputs import ANCHOR_KEY, REF_KEY, LossNeeds, default_mask
from trainer.losses.paths import InputClients, OnePassLossPath, TwoPassLossPath

TINY_MODEL = "pairedrl/tiny-random"
# the metric families both paths report; engine/ counters and the loss's own extras differ by construction
SHARED = ("loss/", "ratio/", "drift/", "entropy/", "mismatch/")


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    yield from local_service_client(tmp_path_factory, "loss_paths")


# ----------------------------------------------------------------------------- prepare
def test_two_pass_prepare_sends_the_minibatch_as_it_is_with_the_client_side_callable():
    data, _ = make_datums()
    path = TwoPassLossPath(GRPOLoss())
    call = path.prepare(data)
    assert path.name == "two_pass"
    assert call.data == data and all(a is b for a, b in zip(call.data, data))
    assert callable(call.loss_fn) and call.loss_fn.__name__ == "grpo_custom_loss"


def test_one_pass_prepare_adds_the_per_datum_keys_and_leaves_the_minibatch_alone():
    data, _ = make_datums(with_mask=False)
    anchor = torch.full((len(data[1].loss_fn_inputs["logprobs"].to_torch()),), -1.5)
    data[1] = types.Datum(model_input=data[1].model_input,
                          loss_fn_inputs={**data[1].loss_fn_inputs, "anchor_logprobs": anchor})
    handle = object()
    path = OnePassLossPath(DPPOLoss(), handle)
    call = path.prepare(data)
    assert path.name == "one_pass" and call.loss_fn is handle and len(call.data) == len(data)
    for i, (before, after) in enumerate(zip(data, call.data)):
        slp = before.loss_fn_inputs["logprobs"].to_torch()
        adv = before.loss_fn_inputs["advantages"].to_torch()
        got = after.loss_fn_inputs
        # tinker passes the current logprobs as `logprobs`: the sampler's travel under their own key
        torch.testing.assert_close(got["sampler_logprobs"].to_torch(), slp)
        torch.testing.assert_close(got["logprobs"].to_torch(), slp)
        torch.testing.assert_close(got["mask"].to_torch(), default_mask(slp, adv))
        want_anchor = anchor if i == 1 else slp  # a recomputed anchor is kept; else the sampler's
        torch.testing.assert_close(got["anchor_logprobs"].to_torch(), want_anchor)
        assert set(before.loss_fn_inputs) == {"target_tokens", "logprobs", "advantages"} | (
            {"anchor_logprobs"} if i == 1 else set())


# ----------------------------------------------------------------------------- the loss's optional inputs
@pytest.mark.parametrize("cls", [GRPOLoss, DPPOLoss, ImportanceSamplingLoss, CISPOLoss, GSPOLoss, CPPOLoss])
def test_every_loss_declares_the_inputs_its_settings_use(cls):
    assert cls().needs == LossNeeds()
    assert cls(anchor="recomputed").needs == LossNeeds(anchor=True)
    assert cls(kl_coef=0.05).needs == LossNeeds(reference=True)
    assert cls(anchor="recomputed", kl_coef=0.05).needs == LossNeeds(anchor=True, reference=True)


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


class _FakeClients:
    """A training client whose forward returns logprobs -0.5 - i for datum i (and entropies 0.1 * position
    when `entropy`), and a reference sampler whose logprob of token t is -0.01 * t (None for the first);
    `calls` lists the backend calls by the names the trainer's wrapper received, `made` the samplers made."""

    def __init__(self, entropy: bool = False):
        self.entropy, self.calls, self.made, self.forwarded, self.scored = entropy, [], 0, [], []

    def forward(self, data, loss_fn):
        self.forwarded.append((data, loss_fn))
        outs = []
        for i, d in enumerate(data):
            n = len(d.loss_fn_inputs["target_tokens"].tolist())
            out = {"logprobs": types.TensorData.from_torch(torch.full((n,), -0.5 - i))}
            if self.entropy:
                out["entropy"] = types.TensorData.from_torch(0.1 * torch.arange(n, dtype=torch.float32))
            outs.append(out)
        return _Done(SimpleNamespace(loss_fn_outputs=outs))

    def compute_logprobs(self, model_input):
        tokens = model_input.to_ints()
        self.scored.append(tokens)
        return _Done([None] + [-0.01 * t for t in tokens[1:]])

    def sampler(self):
        self.made += 1
        return self

    def clients(self) -> InputClients:
        def call(what, fn):
            self.calls.append(what)
            return fn()

        return InputClients(training=self, reference_sampler=self.sampler, call=call)


def _rollouts() -> list[Rollout]:
    return [Rollout(group=0, prompt_tokens=[1, 2, 3][:2 + i], tokens=[7 + i, 8, 9][:2 + i],
                    logprobs=[-0.5, -1.0, -0.2][:2 + i], reward=float(i), metrics={}, stop_reason="stop",
                    advantage=0.5 - i) for i in range(2)]


@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
def test_a_kl_loss_gets_the_reference_logprobs_and_a_loss_without_it_asks_for_nothing(one_pass):
    """The loss declares the reference input (kl_coef > 0) and the path fetches it, through the reference
    sampler and the trainer's call wrapper, into every datum it then prepares; the same loss with kl_coef = 0
    makes no backend call at all and gets its datums back as they were."""
    rollouts = _rollouts()
    datums = [rollout_to_datum(r) for r in rollouts]
    for kl_coef in (0.05, 0.0):
        loss = GRPOLoss(kl_coef=kl_coef)
        path = OnePassLossPath(loss, handle=object()) if one_pass else TwoPassLossPath(loss)
        fake = _FakeClients()
        got, metrics = path.fetch_inputs(datums, fake.clients())
        unchanged = {"target_tokens", "logprobs", "advantages", "mask"}
        assert all(set(d.loss_fn_inputs) == unchanged for d in datums)
        assert fake.forwarded == []  # no anchor pass: the loss's anchor is the sampler
        if kl_coef == 0:
            assert got is datums and metrics == {} and fake.calls == [] and fake.made == 0
            continue
        assert set(metrics) == {"time/ref_logprobs"} and metrics["time/ref_logprobs"] >= 0
        assert fake.made == 1 and fake.calls == ["compute_logprobs"]
        assert fake.scored == [r.prompt_tokens + r.tokens for r in rollouts]  # the whole sequences
        call = path.prepare(got)
        for r, d in zip(rollouts, call.data):
            assert ANCHOR_KEY not in d.loss_fn_inputs or one_pass  # one pass fills it with the sampler's
            # position i of a datum predicts token i + 1 of the sequence
            want = torch.tensor([-0.01 * t for t in (r.prompt_tokens + r.tokens)[1:]])
            torch.testing.assert_close(d.loss_fn_inputs[REF_KEY].to_torch(), want)
        if not one_pass:  # and the loss runs on them: it refuses kl_coef > 0 without the reference
            logp = [torch.full((len(r.prompt_tokens) + len(r.tokens) - 1,), -0.7) for r in rollouts]
            _, loss_metrics = call.loss_fn(call.data, logp)
            assert loss_metrics["loss/kl_ref"] > 0


@pytest.mark.parametrize("entropy", [False, True])
def test_a_recomputed_anchor_comes_from_one_forward_pass_over_the_batch(entropy):
    """`anchor: recomputed`: one `forward` of the training client over the datums' targets, weighted by their
    masks, gives each datum's `anchor_logprobs`; `entropy/exact` is the mean entropy over the loss tokens
    when the pass returns entropies, absent when it does not; no reference sampler is made."""
    rollouts = _rollouts()
    datums = [rollout_to_datum(r) for r in rollouts]
    fake = _FakeClients(entropy=entropy)
    got, metrics = TwoPassLossPath(DPPOLoss(anchor="recomputed")).fetch_inputs(datums, fake.clients())
    assert fake.calls == ["forward"] and fake.made == 0 and len(fake.forwarded) == 1
    sent, loss_fn = fake.forwarded[0]
    assert loss_fn == "cross_entropy" and len(sent) == len(datums)
    for d, s, g, i in zip(datums, sent, got, range(len(datums))):
        assert s.model_input == d.model_input and set(s.loss_fn_inputs) == {"target_tokens", "weights"}
        torch.testing.assert_close(s.loss_fn_inputs["weights"].to_torch(),
                                   d.loss_fn_inputs["mask"].to_torch())
        torch.testing.assert_close(g.loss_fn_inputs[ANCHOR_KEY].to_torch(),
                                   torch.full((len(g.loss_fn_inputs["mask"].tolist()),), -0.5 - i))
        assert REF_KEY not in g.loss_fn_inputs
    assert metrics["time/anchor_forward"] >= 0
    if entropy:
        masked = [0.1 * t for d in datums for t, m in enumerate(d.loss_fn_inputs["mask"].tolist()) if m]
        assert set(metrics) == {"time/anchor_forward", "entropy/exact"}
        assert metrics["entropy/exact"] == pytest.approx(sum(masked) / len(masked))
    else:
        assert set(metrics) == {"time/anchor_forward"}


# ----------------------------------------------------------------------------- metrics
def test_two_pass_metrics_are_the_result_metrics_without_their_reduction_suffix():
    result = SimpleNamespace(metrics={"loss:sum": 2.5, "loss/n_tokens:sum": 7.0, "ratio/max:max": 1.25,
                                      "drift/kl_sampler_current:mean": 0.125, "ratio/min:min": 0.5,
                                      "engine/x:p50": 3.0, "plain": 4})
    out = TwoPassLossPath(GRPOLoss()).metrics(result, [])
    assert out == {"loss/value": 2.5, "loss/n_tokens": 7.0, "ratio/max": 1.25, "drift/kl_sampler_current": 0.125,
                   "ratio/min": 0.5, "engine/x:p50": 3.0, "plain": 4.0}
    assert all(type(v) is float for v in out.values())


def test_one_pass_metrics_survive_a_server_that_drops_sums_or_logprobs(caplog):
    """The one-pass diagnostics come from the server's custom/...:sum keys and the returned logprobs; a
    server that omits either must not crash the step after its optim_step was applied."""
    import tinker

    from trainer.losses.per_datum import _COUNT_KEYS

    r = Rollout(group=0, prompt_tokens=[1, 2], tokens=[3, 4, 5], logprobs=[-0.5, -1.0, -0.2], reward=1.0,
                metrics={}, stop_reason="stop", advantage=0.5)
    path = OnePassLossPath(GRPOLoss(), handle=object())
    data = path.prepare([rollout_to_datum(r)]).data
    current = tinker.TensorData.from_torch(torch.tensor([0.0, -0.4, -1.1, -0.25]))

    no_sums = SimpleNamespace(metrics={"loss:sum": 1.5}, loss_fn_outputs=[{"logprobs": current}])
    out = path.metrics(no_sums, data)
    assert out["loss/value"] == 1.5 and out["loss/n_tokens"] == 3.0 and "drift/abs_p_q90" in out
    sums = {k: 1.0 for k in _COUNT_KEYS.values()} | {"custom/loss/n_tokens:sum": 3.0}
    no_logprobs = SimpleNamespace(metrics={"loss:sum": 1.5, **sums}, loss_fn_outputs=[{}])
    out = path.metrics(no_logprobs, data)
    assert out["loss/n_tokens"] == 3.0 and out["loss/grpo_clip_frac"] == pytest.approx(1 / 3)
    assert "drift/abs_p_q90" not in out
    assert "came back with logprobs" in caplog.text and "missing metric keys" in caplog.text


def _drifted_minibatch(sc) -> list:
    """Datums whose sampler logprobs are the tiny model's own moved by +-0.5 nats, and on every third token
    a likely token (p = 0.74) where the random model has p ~ 0.002, so ratios leave GRPO's trust region and
    probabilities DPPO's on some tokens but not all."""
    tc = sc.create_lora_training_client(TINY_MODEL, rank=4, seed=0).result()
    g = torch.Generator().manual_seed(1)
    rollouts = []
    for i in range(4):
        prompt = [1, 5 + i, 9, 13]
        tokens = [20 + 3 * i + k for k in range(5 + i)]
        rollouts.append(Rollout(group=i // 2, prompt_tokens=prompt, tokens=tokens, logprobs=[0.0] * len(tokens),
                                reward=0.0, metrics={}, stop_reason="stop", advantage=(-1.0) ** i * (0.5 + i)))
    data = [rollout_to_datum(r) for r in rollouts]
    cur = tc.forward(_forward_data(data), "cross_entropy").result().loss_fn_outputs
    for r, o in zip(rollouts, cur):
        lp = o["logprobs"].to_torch()[len(r.prompt_tokens) - 1:]
        slp = (lp + 0.5 * torch.randn(len(lp), generator=g)).clamp(max=-1e-3)
        slp[::3] = -0.3
        r.logprobs = slp.tolist()
    return [rollout_to_datum(r) for r in rollouts]


def _forward_data(data: list) -> list:
    return [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": d.loss_fn_inputs["mask"]}) for d in data]


@pytest.mark.parametrize("loss", [GRPOLoss(), DPPOLoss(), CPPOLoss()], ids=["grpo", "dppo", "cppo"])
def test_both_paths_give_the_same_metrics_and_update_on_one_minibatch(sc, loss):
    """One minibatch, the same initial weights: the one-pass path's metrics (rebuilt from per-datum sums
    and the returned logprobs) equal the two-pass path's (the loss's own), and the weights after the
    optimizer step give the same logprobs."""
    mb = _drifted_minibatch(sc)
    metrics, after = {}, {}
    for path in (TwoPassLossPath(loss), OnePassLossPath.register(loss, sc)):
        tc = sc.create_lora_training_client(TINY_MODEL, rank=4, seed=0).result()
        call = path.prepare(mb)
        fb = tc.forward_backward_custom(call.data, call.loss_fn).result()
        metrics[path.name] = path.metrics(fb, call.data)
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        out = tc.forward(_forward_data(mb), "cross_entropy").result().loss_fn_outputs
        after[path.name] = torch.cat([o["logprobs"].to_torch() for o in out])
    one, two = metrics["one_pass"], metrics["two_pass"]
    assert set(one) <= set(two), set(one) - set(two)
    assert len(one) > 20
    for k, v in one.items():
        assert two[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    # the minibatch exercises the numbers: drift, clipping and masking on some tokens but not all
    assert 0 < one["drift/kl_sampler_current"] and one["ratio/mean"] != pytest.approx(1.0, abs=1e-3)
    assert 0 < one[f"loss/{loss.name}_{'clip' if loss.name == 'grpo' else 'masked'}_frac"] < 1
    torch.testing.assert_close(after["one_pass"], after["two_pass"], rtol=1e-5, atol=1e-5)
    before = torch.cat([o["logprobs"].to_torch() for o in sc.create_lora_training_client(
        TINY_MODEL, rank=4, seed=0).result().forward(_forward_data(mb), "cross_entropy").result().loss_fn_outputs])
    assert (after["one_pass"] - before).abs().max() > 1e-3  # the update moved the weights


# ----------------------------------------------------------------------------- the factory
def test_make_loss_picks_the_path_from_the_config_and_the_backend(sc, capsys):
    from trainer.config.compose import run_config
    from trainer.setup import make_loss

    def path(*overrides, client=sc):
        return make_loss(run_config([*TINY, *overrides]), client)

    auto = path()
    assert isinstance(auto, OnePassLossPath) and auto.loss.name == "grpo" and auto.handle is not None
    assert isinstance(path("backend.loss_path=two_pass"), TwoPassLossPath)
    assert isinstance(path("loss=dppo", "backend.loss_path=one_pass"), OnePassLossPath)
    # one pass needs sum aggregation and create_custom_loss; auto falls back to two passes
    dr = path("loss.aggregation=seq_mean_token_sum_norm")
    assert isinstance(dr, TwoPassLossPath) and dr.loss.aggregation == "seq_mean_token_sum_norm"
    assert isinstance(path(client=object()), TwoPassLossPath)
    with pytest.raises(SystemExit):
        path("loss.aggregation=token_mean", "backend.loss_path=one_pass")
    assert "backend.loss_path=one_pass needs loss.aggregation=sum" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the loop on both paths
# DPPO with every optional loss input (the recomputed anchor and the KL penalty)
DPPO_ALL_INPUTS = ["loss=dppo", "loss.anchor=recomputed", "loss.kl_coef=0.05"]


@pytest.fixture(scope="module")
def dppo_runs(tmp_path_factory) -> dict[str, Path]:
    """`train.py` on the tiny model with DPPO_ALL_INPUTS, run in this process: once on the path the factory
    picks for it (`default`: the one-pass path) and once on the two-pass path. Read-only for the tests:
    one run serves the whole-run check of the one-pass path and the comparison of the paths."""
    d = tmp_path_factory.mktemp("dppo_runs")
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        for name, extra in (("default", []), ("two_pass", ["backend.loss_path=two_pass"])):
            runs[name] = d / name
            code = train_entry([*TINY, "eval=none", "report.enabled=false", *DPPO_ALL_INPUTS, *extra,
                                f"hydra.run.dir={runs[name]}"], d, mp)
            assert code == 0, (runs[name] / "train.log").read_text()[-3000:]
    return runs


def test_training_with_recomputed_anchor_and_kl_penalty_one_pass(dppo_runs):
    """train.py on the tiny model, DPPO on the one-pass (registered per-datum loss) path."""
    check_anchor_kl_rows(read_metrics(dppo_runs["default"]), "one_pass")


def test_the_loop_on_the_two_pass_path_matches_the_one_pass_path(dppo_runs):
    """The RL loop run twice from the same seed, once per path, with every optional loss input (DPPO with
    the recomputed anchor and the KL penalty): every update logs the same loss, ratio, drift and entropy
    numbers (the second update of a step and the second step depend on the weights the earlier updates
    produced, so equal rows mean equal updates), and the same rollouts."""
    for run in dppo_runs.values():
        assert json.loads((run / "result.json").read_text())["optim_steps"] == 4
    one, two = read_metrics(dppo_runs["default"]), read_metrics(dppo_runs["two_pass"])
    assert [(r["step"], r["update"]) for r in one] == [(r["step"], r["update"]) for r in two] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["loss/path"] for r in one} == {"one_pass"} and {r["loss/path"] for r in two} == {"two_pass"}
    for ro, rt in zip(one, two):
        shared = {k for k in ro if k.startswith(SHARED) and k != "loss/path"}
        assert len(shared) > 20 and shared <= set(rt), shared - set(rt)
        for k in shared:
            assert rt[k] == pytest.approx(ro[k], rel=1e-4, abs=1e-6), (ro["step"], ro["update"], k)
        for k in ("env/reward_mean", "tokens/sampled", "tokens/trained"):
            assert rt[k] == ro[k], k
    # the weights moved: the second update sees drift from the first
    assert all(r["drift/abs_p_max"] > 1e-4 for r in one if r["update"] == 1)
    assert all("loss/kl_ref" in r and "entropy/exact" in r for r in one + two)
    assert one[-1]["loss/kl_ref"] > 1e-4
