"""The sampler's mismatch knobs (`backend.sampler_quant`, `backend.sampler_logit_noise`) and its coupled draw
(`sampling.coupling=gumbel`): the fake-quantisation formats against hand values, the exact path left as it
was, the mismatch each knob puts between the sampler's and the trainer's logprobs, and the Gumbel-max draw's
determinism, row independence, distribution and coupling."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from tinker import types

from trainer.backends.local import LocalServiceClient
from trainer.backends.local.keyed import GUMBEL_SALT, gumbel_argmax, row_keys, uniform
from trainer.backends.local.quant import fake_quant

TINY = "pairedrl/tiny-random"
PROMPT = "<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n"
D = torch.float64


# ----------------------------------------------------------------------------- fake quantisation
def test_fake_quant_int_formats_per_output_channel_against_hand_values():
    """Symmetric per-row scales (max|w_row| / 127 or / 7), round half to even, int4 codes in [-7, 7]."""
    w8 = torch.tensor([[254.0, 1.0, -0.9, 3.0],  # scale 2: codes 127, 0.5 -> 0, -0.45 -> 0, 1.5 -> 2
                       [127 / 64, -63.5 / 64, 0.5 / 64, 1.5 / 64]], dtype=D)  # scale 1/64: -63.5 -> -64
    assert torch.equal(fake_quant(w8, "int8"), torch.tensor([[254.0, 0.0, 0.0, 4.0],
                                                             [127 / 64, -1.0, 0.0, 2 / 64]], dtype=D))
    w4 = torch.tensor([[7.0, -3.5, 1.2, 0.5],  # scale 1: 7, -4, 1, 0
                       [-14.0, 5.0, 3.0, 0.0],  # scale 2: -7, 2.5 -> 2, 1.5 -> 2, 0
                       [0.0, 0.0, 0.0, 0.0]], dtype=D)  # a zero row stays zero
    assert torch.equal(fake_quant(w4, "int4"), torch.tensor([[7.0, -4.0, 1.0, 0.0], [-14.0, 4.0, 4.0, 0.0],
                                                             [0.0, 0.0, 0.0, 0.0]], dtype=D))
    # on random rows every code is an integer in [-7, 7], the row's max reaching +-7 (-8 is never used)
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0), dtype=D)
    codes = fake_quant(w, "int4") / (w.abs().amax(-1, keepdim=True) / 7)
    assert torch.allclose(codes, codes.round(), atol=1e-9) and codes.round().min() >= -7
    assert torch.equal(codes.round().abs().amax(-1), torch.full((64,), 7.0, dtype=D))


def test_fake_quant_float_formats_against_hand_values():
    """fp16 is a saturating cast; fp8 E4M3 scales each row so its max |w| maps to 448 (E4M3's largest
    finite value), rounds to nearest even with 3 mantissa bits, and saturates rather than overflowing."""
    w16 = torch.tensor([[1 + 2 ** -11, 1 + 2 ** -10, 70000.0, 2.0 ** -25, 3 * 2.0 ** -25]], dtype=D)
    assert torch.equal(fake_quant(w16, "fp16"), torch.tensor([[1.0, 1 + 2 ** -10, 65504.0, 0.0, 2.0 ** -23]],
                                                             dtype=D))
    # scale 2: w / 2 = 448, 0.5, 13, 13.5 (-> 14: even), 17 (-> 16: spacing 2), -300 (-> -288: spacing 32)
    w8 = torch.tensor([[896.0, 1.0, 26.0, 27.0, 34.0, -600.0],
                       [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], dtype=D)
    assert torch.equal(fake_quant(w8, "fp8_e4m3"), torch.tensor([[896.0, 1.0, 26.0, 28.0, 32.0, -576.0],
                                                                 [0.0] * 6], dtype=D))
    # each row's largest entry is reproduced (448 is a code): a scale past E4M3's range would saturate it
    spread = torch.logspace(-3, 2, 32, dtype=D)[:, None]  # rows of very different sizes
    w = torch.randn(32, 50, generator=torch.Generator().manual_seed(1), dtype=D) * spread
    q = fake_quant(w, "fp8_e4m3")
    i = w.abs().argmax(-1, keepdim=True)
    assert torch.allclose(q.gather(1, i), w.gather(1, i), rtol=1e-14, atol=0)
    assert ((q - w).abs() <= w.abs() * 2 ** -4 + w.abs().amax(-1, keepdim=True) / 448 * 2 ** -9).all()


def test_fake_quant_none_is_the_tensor_itself_and_an_unknown_format_is_refused():
    w = torch.randn(3, 4)
    assert fake_quant(w, "none") is w
    with pytest.raises(ValueError, match="sampler_quant must be one of"):
        fake_quant(w, "int3")


# ----------------------------------------------------------------------------- the sampler's weights
def _weights(pack: bool):
    from trainer.backends.local.model import dims, rotary_tables
    from trainer.backends.local.ops import sampler_ops
    from trainer.backends.local.plan import sampler_plan_for
    from trainer.backends.local.sampler_weights import build_weights
    from trainer.model_registry import resolve_base_model

    factory, _ = resolve_base_model(TINY)
    model = factory(torch.float32)
    cos, sin = rotary_tables(model, 64)
    plan = sampler_plan_for(dims(model.config), torch.float32)
    return build_weights(model.config, dict(model.state_dict()), cos, sin, torch.float32, pack=pack,
                         ops=sampler_ops(plan))


def _lora(W, g):
    """A rank-2 adapter on layer 0's o and gate projections (`HF module name -> (A, B)`)."""
    from trainer.backends.local.model import layer_names

    n = layer_names(0)
    inter = W.intermediate
    hidden = W.layers[0].o.w.shape[0]
    return {n.o: (torch.randn(2, W.n_heads * W.head_dim, generator=g), torch.randn(hidden, 2, generator=g)),
            n.gate_up[0]: (torch.randn(2, hidden, generator=g), torch.randn(inter, 2, generator=g))}


def test_quantised_sampler_weights_round_the_merged_weight_and_keep_the_rest_exact():
    """Every layer projection is `fake_quant(W + s B A)` (the merge first, then the rounding: the weight the
    sampler computes with); the embedding, the norms and the unembedding stay the exact ones."""
    from trainer.backends.local.sampler_weights import with_lora

    W = _weights(pack=False)
    lora = _lora(W, torch.Generator().manual_seed(0))
    Q = with_lora(W, lora, 0.5, "int4")
    assert Q.quant == "int4" and Q.embed is W.embed and Q.lm_head is W.lm_head
    assert Q.final_norm is W.final_norm
    L, QL = W.layers[0], Q.layers[0]
    (A, B), (Ag, Bg) = lora.values()
    assert torch.equal(QL.o.w, fake_quant(torch.addmm(L.o.w, 0.5 * B, A), "int4"))
    inter = W.intermediate
    gate_up = torch.cat([L.gate_up.w[:inter] + 0.5 * Bg @ Ag, L.gate_up.w[inter:]])
    assert torch.allclose(QL.gate_up.w, fake_quant(gate_up, "int4"), atol=1e-6, rtol=0)
    for lin, qlin in ((L.qkv, QL.qkv), (L.down, QL.down), (W.layers[1].o, Q.layers[1].o)):  # no LoRA on them
        assert torch.equal(qlin.w, fake_quant(lin.w, "int4"))
        assert qlin.lora_a is None
    assert QL.in_norm is L.in_norm


def test_quantised_packed_weights_compute_the_fake_quantised_product():
    from trainer.backends.local.sampler_weights import with_lora

    W = _weights(pack=True)
    if W.layers[0].o.packed is None and W.layers[0].o.amx is None:
        pytest.skip("no oneDNN packing here: the plain path is the previous test's")
    lora = _lora(W, torch.Generator().manual_seed(0))
    Q = with_lora(W, lora, 0.5, "fp8_e4m3")
    (A, B) = next(iter(lora.values()))
    x = torch.randn(5, W.layers[0].o.w.shape[1], generator=torch.Generator().manual_seed(3))
    want = x @ fake_quant(torch.addmm(W.layers[0].o.w, 0.5 * B, A), "fp8_e4m3").T
    assert Q.layers[0].o.w is None and torch.allclose(Q.layers[0].o(x), want, atol=1e-4, rtol=1e-4)


def test_none_leaves_the_sampler_weights_as_they_were():
    """`none` is today's path: no LoRA gives the base weight set itself, a LoRA the same factors (unmerged
    here) as before, and the engine's cache serves the very same object with or without the argument."""
    from trainer.backends.local.engine import BASE_SNAPSHOT, shared_base
    from trainer.backends.local.sampler_weights import with_lora

    W = _weights(pack=False)
    assert with_lora(W, {}, 0.5, "none") is W
    lora = _lora(W, torch.Generator().manual_seed(0))
    a, b = with_lora(W, lora, 0.5), with_lora(W, lora, 0.5, "none")
    for pa, pb, pw in ((a.layers[0].o, b.layers[0].o, W.layers[0].o),
                       (a.layers[0].qkv, b.layers[0].qkv, W.layers[0].qkv)):
        assert pa.w is pw.w and pb.w is pw.w  # the base weight itself: nothing rounded, nothing copied
        assert (pa.lora_a is None) == (pb.lora_a is None)
        if pa.lora_a is not None:
            assert torch.equal(pa.lora_a, pb.lora_a) and torch.equal(pa.lora_b, pb.lora_b)
    base = shared_base(TINY)
    got = base.sampler_weights(BASE_SNAPSHOT, torch.float32)
    assert base.sampler_weights(BASE_SNAPSHOT, torch.float32, "none") is got and got.quant == "none"
    assert torch.equal(got.layers[0].o.w, base.base_state["model.layers.0.self_attn.o_proj.weight"])
    q = base.sampler_weights(BASE_SNAPSHOT, torch.float32, "int8")  # packed as the engine packs (w None)
    x = torch.randn(3, got.layers[0].o.out_features)
    assert q is not got and q.quant == "int8" and not torch.equal(q.layers[0].o(x), got.layers[0].o(x))


# ----------------------------------------------------------------------------- the mismatch in the engine
@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    """One fp32 service client per setting (all sharing the process's tiny model)."""
    made = {}
    for name, kw in {"exact": {}, "int4": {"sampler_quant": "int4"}, "noise": {"sampler_logit_noise": 0.5},
                     "noise0": {"sampler_logit_noise": 0.0}, "gumbel": {"sampling_coupling": "gumbel"},
                     "gumbel_int4": {"sampling_coupling": "gumbel", "sampler_quant": "int4"}}.items():
        made[name] = LocalServiceClient(state_dir=tmp_path_factory.mktemp(name), sampler_dtype="float32",
                                        train_dtype="float32", lora_alpha=8.0, max_sample_batch=16, **kw)
    yield made
    for c in made.values():
        c.close()


def _pair(sc):
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()
    return tc, tc.save_weights_and_get_sampling_client()


def _prompt(tc):
    return tc.get_tokenizer().encode(PROMPT, add_special_tokens=False)


def _sample(scl, p, n=4, seed=3, max_tokens=16, **kw):
    params = types.SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 1.0), seed=seed,
                                  stop=[], **kw)
    return scl.sample(types.ModelInput.from_ints(p), n, params).result().sequences


def _mismatch(tc, p, seqs):
    """|p_sampler - p_trainer| and |logprob difference| over every sampled token (the trainer: exact)."""
    dp, dlp = [], []
    for s in seqs:
        full = p + s.tokens
        d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                        loss_fn_inputs={"target_tokens": full[1:]})
        out = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]
        trained = out["logprobs"].to_torch()[len(p) - 1:]
        sampled = torch.tensor(s.logprobs)
        dp.append((sampled.exp() - trained.exp()).abs())
        dlp.append((sampled - trained).abs())
    return torch.cat(dp), torch.cat(dlp)


def test_int4_and_logit_noise_raise_the_measured_mismatch(clients):
    """The sampler's logprobs are the quantised (noisy) sampler's, the trainer's the exact weights': the
    |p - q| the run's `mismatch/*` metrics measure grows by orders of magnitude over the exact engine's."""
    tc, scl = _pair(clients["exact"])
    p = _prompt(tc)
    exact_p, exact_lp = _mismatch(tc, p, _sample(scl, p))
    assert exact_lp.max() <= 1e-4
    for name in ("int4", "noise"):
        tc_k, scl_k = _pair(clients[name])
        seqs = _sample(scl_k, p)
        dp, dlp = _mismatch(tc_k, p, seqs)
        assert dp.quantile(0.9) > 100 * exact_p.quantile(0.9) and dlp.max() > 0.05, (name, dp, dlp)
        if name == "int4":  # the same quantised weights score the sampled tokens as the sampler drew them
            scored = scl_k.compute_logprobs(types.ModelInput.from_ints(p + seqs[0].tokens)).result()[len(p):]
            assert max(abs(a - b) for a, b in zip(seqs[0].logprobs, scored)) <= 1e-4


def test_zero_noise_is_the_exact_path_and_noise_is_seeded_and_batch_independent(clients):
    tc, scl = _pair(clients["exact"])
    p = _prompt(tc)
    exact = _sample(scl, p)
    tc0, scl0 = _pair(clients["noise0"])
    zero = _sample(scl0, p)
    assert [(s.tokens, s.logprobs) for s in zero] == [(s.tokens, s.logprobs) for s in exact]
    assert _mismatch(tc0, p, zero)[1].max() <= 1e-4  # and both are the exact engine's numbers
    _, scln = _pair(clients["noise"])
    alone = _sample(scln, p)
    assert [s.tokens for s in alone] != [s.tokens for s in exact]

    async def batched():  # the same request beside a longer one (its rows then come first in the batch)
        other = types.ModelInput.from_ints(p + p[:5])
        params = types.SamplingParams(max_tokens=16, temperature=1.0, seed=3, stop=[])
        return await asyncio.gather(scln.sample(types.ModelInput.from_ints(p), 4, params),
                                    scln.sample(other, 3, params.model_copy(update={"seed": 9})))

    again = asyncio.run(batched())[0].sequences
    assert [(s.tokens, s.logprobs) for s in again] == [(s.tokens, s.logprobs) for s in alone]
    g1 = _sample(scln, p, n=1, temperature=0.0, max_tokens=8)  # a greedy row's argmax reads the noisy logits
    assert g1[0].tokens == _sample(scln, p, n=1, temperature=0.0, max_tokens=8)[0].tokens


def test_the_knobs_are_in_the_engine_record_and_checked(clients):
    rec = clients["int4"].engine_record(TINY)
    assert (rec["sampler_quant"], rec["sampler_logit_noise"], rec["sampling_coupling"]) == ("int4", 0.0,
                                                                                            "inverse_cdf")
    assert clients["exact"].engine_record(TINY)["sampler_quant"] == "none"
    for kw, needle in (({"sampler_quant": "int3"}, "sampler_quant"), ({"sampler_logit_noise": math.nan},
                                                                        "sampler_logit_noise"),
                       ({"sampler_logit_noise": -1.0}, "sampler_logit_noise"),
                       ({"sampling_coupling": "antithetic"}, "sampling_coupling")):
        with pytest.raises(ValueError, match=needle):
            LocalServiceClient(state_dir="/nonexistent-never-created", **kw)


def test_the_run_config_reaches_the_engine(tmp_path):
    from trainer.backends import BACKENDS
    from trainer.config.compose import compose_config
    from trainer.config.schema import validate

    cfg = validate(compose_config(["backend.sampler_quant=fp8_e4m3", "backend.sampler_logit_noise=0.25",
                                   "sampling.coupling=gumbel"]))
    sc = BACKENDS["local"].build(cfg, tmp_path)
    try:
        assert sc.sampler_knobs == {"sampler_quant": "fp8_e4m3", "sampler_logit_noise": 0.25,
                                    "sampling_coupling": "gumbel"}
        assert (sc._scheduler.quant, sc._scheduler.logit_noise, sc._scheduler.coupling) == ("fp8_e4m3", 0.25,
                                                                                             "gumbel")
    finally:
        sc.close()


def test_server_flags_are_checked_and_passed_to_its_engine(tmp_path, capsys):
    from trainer.serve.__main__ import build_engine, parse_args

    for argv, needle in ((["--sampler-quant", "int3"], "--sampler-quant must be one of"),
                         (["--sampler-logit-noise", "nan"], "--sampler-logit-noise must be in"),
                         (["--sampler-logit-noise", "-0.5"], "--sampler-logit-noise must be in")):
        with pytest.raises(SystemExit) as ei:
            parse_args(argv)
        assert ei.value.code == 2 and needle in capsys.readouterr().err
    args = parse_args(["--sampler-quant", "int8", "--sampler-logit-noise", "0.3",
                       "--state-dir", str(tmp_path)])
    engine = build_engine(args)
    try:
        assert engine.sampler_knobs == {"sampler_quant": "int8", "sampler_logit_noise": 0.3,
                                        "sampling_coupling": "inverse_cdf"}
    finally:
        engine.close()


# ----------------------------------------------------------------------------- Gumbel-max coupling
def _keys(seeds, sample=0, pos=0, salt=GUMBEL_SALT):
    seeds = torch.as_tensor(seeds, dtype=torch.long)
    return row_keys(salt, seeds, torch.full_like(seeds, sample), pos)


def test_gumbel_draws_are_keyed_deterministic_and_row_independent():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 40, generator=g)
    keys = _keys(range(8))
    tok = gumbel_argmax(logits, keys)
    assert torch.equal(tok, gumbel_argmax(logits.clone(), keys.clone()))
    # a row's token depends on its own logits and key alone: alone, elsewhere in a batch, beside other rows
    other = torch.randn(8, 40, generator=g)
    other[5] = logits[0]
    k2 = _keys([11, 12, 13, 14, 15, 0, 16, 17])
    assert int(gumbel_argmax(other, k2)[5]) == int(tok[0]) == int(gumbel_argmax(logits[:1], keys[:1])[0])
    # each key part changes the draws (seed, sample index, position), and no entry is 0 or 1
    u = uniform(keys[:1], 40)
    for k in (_keys([1]), _keys([0], sample=1), _keys([0], pos=1), _keys([2 ** 40])):
        assert not torch.equal(uniform(k, 40), u)
    assert (u > 0).all() and (u < 1).all()


def test_gumbel_frequencies_follow_the_distribution():
    """Over many keys (seeds, or positions of one seed) the draws' frequencies match softmax(logits): a
    chi-square over 6 tokens (5 degrees of freedom; 30 is past its 0.99999 quantile)."""
    logits = torch.tensor([1.5, 0.3, -0.2, 0.8, -1.5, 0.0])
    probs = torch.softmax(logits.double(), -1)
    n = 30000
    for keys in (_keys(range(n)), row_keys(GUMBEL_SALT, torch.full((n,), 7), torch.zeros(n, dtype=torch.long),
                                           torch.arange(n))):
        counts = torch.bincount(gumbel_argmax(logits.expand(n, -1), keys), minlength=6).double()
        chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
        assert chi2 < 30, (chi2, counts / n, probs)
    # -inf entries (top-k / top-p truncation) are never drawn; the rest renormalise
    cut = logits.clone()
    cut[[1, 4]] = float("-inf")
    drawn = gumbel_argmax(cut.expand(n, -1), _keys(range(n)))
    assert not torch.isin(drawn, torch.tensor([1, 4])).any()


def test_gumbel_couples_two_nearby_distributions_far_tighter_than_inverse_cdf():
    """Two distributions a small step apart (as two arms' policies after one different update), sampled at
    the same keys: Gumbel-max disagrees on about the total-variation distance (at most 2 TV / (1 + TV)),
    inverse-CDF with one shared uniform over ten times more often at this size and entropy (200 tokens,
    ~3.5 nats)."""
    from trainer.backends.local.generate import inverse_cdf

    g = torch.Generator().manual_seed(5)
    a = torch.randn(200, generator=g) * 2.2
    b = a + 0.05 * torch.randn(200, generator=g)
    pa, pb = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    tv = float((pa - pb).abs().sum() / 2)
    entropy = float(-(pa * pa.log()).sum())
    assert 3.0 < entropy < 4.0, entropy
    n = 20000
    keys = _keys(range(n))
    gum = float((gumbel_argmax(a.expand(n, -1), keys) != gumbel_argmax(b.expand(n, -1), keys))
                .double().mean())
    u = uniform(keys, 1)[:, 0]
    icdf = float((inverse_cdf(pa.float().expand(n, -1), u) != inverse_cdf(pb.float().expand(n, -1), u))
                 .double().mean())
    assert gum <= 2 * tv / (1 + tv) + 3 * math.sqrt(tv / n) + 1e-3, (gum, tv)
    assert icdf > 5 * gum, (icdf, gum, tv)


def test_gumbel_through_the_engine_is_seeded_respects_temperature_and_truncation_and_couples_arms(clients):
    """Through a generate: the same seed gives the same tokens alone or batched, each logprob is the
    tempered full-vocabulary one, top-k restricts the support, and an int4 arm at the same seed draws the
    exact arm's token far more often than inverse-CDF arms do."""
    tc, scl = _pair(clients["gumbel"])
    p = _prompt(tc)
    T = 0.7
    seqs = _sample(scl, p, temperature=T)
    assert [s.tokens for s in seqs] == [s.tokens for s in _sample(scl, p, temperature=T)]
    assert len({tuple(s.tokens) for s in seqs}) == len(seqs)  # the sample index is part of the key
    V = len(tc.get_tokenizer())
    for s in seqs[:2]:
        full = p + s.tokens
        greedy1 = types.SamplingParams(max_tokens=1, temperature=0.0, stop=[])
        res = scl.sample(types.ModelInput.from_ints(full), 1, greedy1, topk_prompt_logprobs=V).result()
        rows = torch.full((len(s.tokens), V), float("nan"), dtype=D)
        for i, row in enumerate(res.topk_prompt_logprobs[len(p):]):
            ids, lps = zip(*row)
            rows[i, list(ids)] = torch.tensor(lps, dtype=D)
        want = torch.log_softmax(rows / T, -1)[torch.arange(len(s.tokens)), torch.tensor(s.tokens)]
        assert float((torch.tensor(s.logprobs, dtype=D) - want).abs().max()) <= 1e-4
    top2 = set(rows[0].topk(2).indices.tolist())  # rows[0]: the distribution right after the prompt
    assert {s.tokens[0] for s in _sample(scl, p, n=16, max_tokens=1, top_k=2)} <= top2

    def first_token_agreement(scl_a, scl_b):
        a, b = (_sample(c, p, n=48, max_tokens=1, seed=21) for c in (scl_a, scl_b))
        return sum(x.tokens[0] == y.tokens[0] for x, y in zip(a, b)) / len(a)

    coupled = first_token_agreement(scl, _pair(clients["gumbel_int4"])[1])
    uncoupled = first_token_agreement(_pair(clients["exact"])[1], _pair(clients["int4"])[1])
    assert coupled >= 2 * uncoupled and coupled >= 0.5, (coupled, uncoupled)
