"""Local sampler: logprob agreement with scoring and training, snapshots, stops, seeds, batching."""

from __future__ import annotations

import asyncio

import pytest
import torch
from local_client import local_service_client
from tinker import types

from trainer.backends.local import LocalServiceClient

TINY = "pairedrl/tiny-random"
PROMPTS = ["<|im_start|>user\nWhat is 12 + 7?<|im_end|>\n<|im_start|>assistant\n",
           "Natalia sold clips to 48 of her friends",
           "<|im_start|>user\nHow much did she earn?<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    yield from local_service_client(tmp_path_factory, "sampler", micro_batch_size=4, max_sample_batch=8)


@pytest.fixture(scope="module")
def tc(sc):
    """A client with every LoRA target (lm_head included) moved away from its init."""
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0, train_unembed=True).result()
    tok = tc.get_tokenizer()
    data = []
    for t in ["12 + 7 = 19", "She earned 10 dollars.", "48 / 2 = 24 clips in May"]:
        s = tok.encode(t, add_special_tokens=False)
        data.append(types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                                loss_fn_inputs={"target_tokens": s[1:]}))
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
    return tc


def mi(tok, text):
    return types.ModelInput.from_ints(tok.encode(text, add_special_tokens=False))


def greedy(max_tokens=12, **kw):
    return types.SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=[], **kw)


def test_sampled_logprobs_match_compute_logprobs_and_forward(tc):
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    prompt = mi(tok, PROMPTS[0])
    res = scl.sample(prompt, 3, types.SamplingParams(max_tokens=16, temperature=1.0, seed=3, stop=[])).result()
    p = prompt.to_ints()
    worst = 0.0
    for seq in res.sequences:
        assert len(seq.tokens) == 16 and len(seq.logprobs) == 16 and seq.stop_reason == "length"
        full = p + seq.tokens
        scored = scl.compute_logprobs(types.ModelInput.from_ints(full)).result()
        assert len(scored) == len(full) and scored[0] is None
        d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={"target_tokens": full[1:]})
        trained = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        sampled = torch.tensor(seq.logprobs)
        worst = max(worst, float((sampled - torch.tensor(scored[len(p):])).abs().max()),
                    float((sampled - trained[len(p) - 1:]).abs().max()))
    assert worst <= 1e-4
    assert all(s.sequence_id for s in res.sequences) and len({s.sequence_id for s in res.sequences}) == 3


def test_greedy_is_deterministic_alone_and_batched(tc):
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    alone = scl.sample(mi(tok, PROMPTS[0]), 1, greedy()).result().sequences[0]
    again = scl.sample(mi(tok, PROMPTS[0]), 2, greedy()).result().sequences

    async def batched():  # submitted together with prompts of other lengths: one padded batch
        return await asyncio.gather(*[scl.sample(mi(tok, t), 1, greedy()) for t in PROMPTS + PROMPTS[:1]])

    many = asyncio.run(batched())
    assert again[0].tokens == alone.tokens == again[1].tokens == many[0].sequences[0].tokens
    assert many[3].sequences[0].tokens == alone.tokens
    assert max(abs(a - b) for a, b in zip(alone.logprobs, many[0].sequences[0].logprobs)) <= 1e-5
    # greedy reports the T=1 logprob of the argmax token
    scored = scl.compute_logprobs(types.ModelInput.from_ints(mi(tok, PROMPTS[0]).to_ints() + alone.tokens)).result()
    n = len(alone.tokens)
    assert max(abs(a - b) for a, b in zip(alone.logprobs, scored[-n:])) <= 1e-4
    top1 = scl.sample(mi(tok, PROMPTS[0]), 1, types.SamplingParams(max_tokens=12, temperature=0.7, top_k=1,
                                                                  stop=[])).result().sequences[0]
    assert top1.tokens == alone.tokens


def test_sampling_client_is_a_snapshot(sc, tc):
    tok = tc.get_tokenizer()
    prompt = mi(tok, PROMPTS[2])
    before = tc.save_weights_and_get_sampling_client()
    first = before.sample(prompt, 1, greedy(16)).result().sequences[0]
    first_lp = before.compute_logprobs(prompt).result()
    s = tok.encode("the answer is 42 and 42 again", add_special_tokens=False)
    d = types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
    for _ in range(3):
        tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=0.1))
    after = tc.save_weights_and_get_sampling_client()  # queued behind the steps above
    assert before.sample(prompt, 1, greedy(16)).result().sequences[0].tokens == first.tokens
    assert before.compute_logprobs(prompt).result() == first_lp
    assert after.compute_logprobs(prompt).result() != first_lp


def test_stop_tokens_strings_and_length(tc):
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    prompt = mi(tok, PROMPTS[1])
    free = scl.sample(prompt, 1, greedy(12)).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 12
    k = 4
    stop_tok = free.tokens[k]
    first = free.tokens.index(stop_tok)
    by_id = scl.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0,
                                                       stop=[stop_tok])).result().sequences[0]
    assert by_id.stop_reason == "stop" and by_id.tokens == free.tokens[: first + 1]
    assert by_id.tokens.count(stop_tok) == 1
    text = tok.decode(free.tokens)
    stop_str = text[len(tok.decode(free.tokens[:6])) - 2: len(tok.decode(free.tokens[:6]))]
    if stop_str.strip():
        by_str = scl.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0,
                                                            stop=[stop_str])).result().sequences[0]
        assert by_str.stop_reason == "stop" and stop_str in tok.decode(by_str.tokens)
        assert stop_str not in tok.decode(by_str.tokens[:-1]) and by_str.tokens == free.tokens[: len(by_str.tokens)]
    # stop=None means the tokenizer's EOS
    none_stop = scl.sample(prompt, 1, types.SamplingParams(max_tokens=12, temperature=0.0)).result().sequences[0]
    eos = tok.eos_token_id
    if eos in free.tokens:
        assert none_stop.tokens[-1] == eos and none_stop.stop_reason == "stop"
    else:
        assert none_stop.tokens == free.tokens


def test_seeded_sampling_is_reproducible_and_independent_of_batch(tc):
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=1234, stop=[])
    a = scl.sample(mi(tok, PROMPTS[0]), 3, params).result()

    async def crowd():
        other = types.SamplingParams(max_tokens=6, temperature=0.8, seed=7, stop=[], top_p=0.9)
        return await asyncio.gather(scl.sample(mi(tok, PROMPTS[1]), 2, other),
                                    scl.sample(mi(tok, PROMPTS[0]), 3, params),
                                    scl.sample(mi(tok, PROMPTS[2]), 1, other))

    b = asyncio.run(crowd())[1]
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1  # the rows of one request differ
    c = scl.sample(mi(tok, PROMPTS[0]), 3, params.model_copy(update={"seed": 99})).result()
    assert [s.tokens for s in c.sequences] != [s.tokens for s in a.sequences]


def test_top_k_and_top_p_restrict_the_support(tc):
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    prompt = mi(tok, PROMPTS[0])
    greedy_tok = scl.sample(prompt, 1, greedy(1)).result().sequences[0].tokens[0]
    tiny_p = scl.sample(prompt, 16, types.SamplingParams(max_tokens=1, temperature=1.0, top_p=1e-6, seed=0,
                                                         stop=[])).result()
    assert {s.tokens[0] for s in tiny_p.sequences} == {greedy_tok}
    k2 = scl.sample(prompt, 32, types.SamplingParams(max_tokens=1, temperature=2.0, top_k=2, seed=0,
                                                     stop=[])).result()
    assert len({s.tokens[0] for s in k2.sequences}) <= 2


def full_logprobs(scl, tokens: list[int]) -> torch.Tensor:
    """`[len(tokens), V]` T = 1 logprobs over the whole vocabulary: row i is the distribution that
    scored token i (row 0 empty), from the top-k prompt logprobs with k = the vocabulary."""
    V = len(scl.get_tokenizer())
    res = scl.sample(types.ModelInput.from_ints(tokens), 1, greedy(1), topk_prompt_logprobs=V).result()
    rows = res.topk_prompt_logprobs
    out = torch.full((len(tokens), V), float("nan"), dtype=torch.float64)
    for i, row in enumerate(rows[1:], start=1):
        ids, lps = zip(*row)
        out[i, list(ids)] = torch.tensor(lps, dtype=torch.float64)
    return out


def test_logprobs_at_temperature_are_the_tempered_full_vocabulary_distribution(tc):
    """At T != 1 (no top-k/top-p) each sampled token's logprob is log_softmax(logits / T)[token]
    over the full vocabulary, and the draws follow that tempered distribution (not the T = 1 one):
    every loss's ratio, mask and clip divides by these numbers."""
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    p = mi(tok, PROMPTS[0]).to_ints()
    T = 0.7
    res = scl.sample(types.ModelInput.from_ints(p), 3,
                     types.SamplingParams(max_tokens=10, temperature=T, seed=11, stop=[])).result()
    worst = 0.0
    for seq in res.sequences:
        full = full_logprobs(scl, p + seq.tokens)[len(p):]  # the rows that scored the sampled tokens
        assert not torch.isnan(full).any()
        want = torch.log_softmax(full / T, -1)[torch.arange(len(seq.tokens)), torch.tensor(seq.tokens)]
        worst = max(worst, float((torch.tensor(seq.logprobs, dtype=torch.float64) - want).abs().max()))
    assert worst <= 1e-4
    # the draws: the first token's frequency over many samples against the tempered probability
    first = full_logprobs(scl, p + [0])[-1]
    top = int(first.argmax())
    p_T, p_1 = float(torch.softmax(first / T, -1)[top]), float(first[top].exp())
    n = 400
    draws = scl.sample(types.ModelInput.from_ints(p), n, types.SamplingParams(max_tokens=1, temperature=T,
                                                                              seed=3, stop=[])).result()
    freq = sum(s.tokens[0] == top for s in draws.sequences) / n
    sd = (p_T * (1 - p_T) / n) ** 0.5
    assert abs(p_T - p_1) > 8 * sd, (p_T, p_1)  # the test can tell the two temperatures apart
    assert abs(freq - p_T) < 4 * sd, (freq, p_T, p_1)


def test_top_p_keeps_the_token_that_crosses_it(tc):
    """The nucleus is the smallest prefix whose mass reaches top_p: with top_p strictly between the
    top token's probability and the top two's, both are drawn and nothing else is."""
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    p = mi(tok, PROMPTS[0]).to_ints()
    probs = full_logprobs(scl, p + [0])[-1].exp()
    top2 = torch.topk(probs, 2)
    c1, c2 = float(top2.values[0]), float(top2.values.sum())
    assert c2 - c1 > 0.02, (c1, c2)  # a second token with mass the draws below will show
    res = scl.sample(types.ModelInput.from_ints(p), 64, types.SamplingParams(
        max_tokens=1, temperature=1.0, top_p=(c1 + c2) / 2, seed=0, stop=[])).result()
    assert {s.tokens[0] for s in res.sequences} == set(top2.indices.tolist())
    for s in res.sequences:  # the logprob is the untruncated one
        assert s.logprobs[0] == pytest.approx(float(probs[s.tokens[0]].log()), abs=1e-4)


def test_more_samples_than_max_batch_and_prompt_logprobs(tc):
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    prompt = mi(tok, PROMPTS[1])
    res = scl.sample(prompt, 20, types.SamplingParams(max_tokens=3, seed=5, stop=[]),
                     include_prompt_logprobs=True).result()
    assert len(res.sequences) == 20
    scored = scl.compute_logprobs(prompt).result()
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == prompt.length
    assert max(abs(a - b) for a, b in zip(res.prompt_logprobs[1:], scored[1:])) <= 1e-5


def test_base_model_sampling_client_and_bad_requests(sc, tc):
    tok = tc.get_tokenizer()
    base = sc.create_sampling_client(base_model=TINY)
    assert base.get_base_model() == TINY
    prompt = mi(tok, PROMPTS[0])
    with pytest.raises(ValueError, match="temperature"):
        base.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=-0.5)).result()
    with pytest.raises(ValueError, match="context"):
        base.sample(types.ModelInput.from_ints([5] * 1500), 1, types.SamplingParams(max_tokens=4)).result()
    with pytest.raises(ValueError, match="context"):
        base.compute_logprobs(types.ModelInput.from_ints([5] * 1500)).result()
    with pytest.raises(ValueError, match="max_tokens"):
        base.sample(prompt, 1, types.SamplingParams(max_tokens=1020)).result()
    with pytest.raises(ValueError, match="top_p"):
        base.sample(prompt, 1, types.SamplingParams(max_tokens=4, top_p=0.0)).result()
    with pytest.raises(ValueError, match="num_samples"):
        base.sample(prompt, 0, types.SamplingParams(max_tokens=4)).result()
    with pytest.raises(ValueError, match="does not support"):
        base.sample(prompt, 1, types.SamplingParams(max_tokens=4), topk_sample_logprobs=3).result()
    # still serving
    out = base.sample(prompt, 2, types.SamplingParams(max_tokens=4, seed=0)).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) <= 4 for s in out.sequences)


@pytest.mark.bf16
def test_bf16_sampler_matches_hf_bf16_and_stays_close_to_fp32(tmp_path, sc):
    from trainer.model_registry import resolve_base_model

    c = LocalServiceClient(state_dir=tmp_path, sampler_dtype="bfloat16", train_dtype="float32")
    b16 = c.create_sampling_client(base_model=TINY)
    f32 = sc.create_sampling_client(base_model=TINY)
    factory, tok = resolve_base_model(TINY)
    prompt = mi(tok, PROMPTS[0])
    seq = b16.sample(prompt, 1, types.SamplingParams(max_tokens=24, temperature=1.0, seed=0, stop=[])).result()
    toks = seq.sequences[0].tokens
    full = prompt.to_ints() + toks
    lp16 = torch.tensor(seq.sequences[0].logprobs)
    lp32 = torch.tensor(f32.compute_logprobs(types.ModelInput.from_ints(full)).result()[prompt.length:])
    with torch.no_grad():  # transformers' own bf16 forward of the same tokens
        logits = factory(torch.bfloat16)(torch.tensor([full])).logits[0].float()
    hf16 = torch.log_softmax(logits, -1)[prompt.length - 1:-1].gather(1, torch.tensor(toks)[:, None])[:, 0]
    # bf16 projections on both sides; ours runs RoPE and attention in fp32 where transformers' bf16 forward
    # runs them in bf16, so the two differ by more than kernel rounding (measured max 0.016-0.027)
    assert float((lp16 - hf16).abs().max()) <= 4e-2
    assert 0 < float((lp16 - lp32).abs().max()) < 0.1
    c.close()


def _tiny_weights(pack, dtype=torch.float32, with_base=False, on_torch=False):
    """The tiny model's sampler weights under this machine's engine plan (`on_torch`: every op on torch)."""
    from trainer.backends.local.model import dims, rotary_tables
    from trainer.model_registry import resolve_base_model
    from trainer.backends.local.ops import sampler_ops
    from trainer.backends.local.plan import sampler_plan_for
    from trainer.backends.local.sampler_weights import build_weights

    factory, _ = resolve_base_model(TINY)
    model = factory(torch.float32)
    cos, sin = rotary_tables(model, 256)
    base = dict(model.state_dict())
    plan = sampler_plan_for(dims(model.config), dtype)
    W = build_weights(model.config, base, cos, sin, dtype, pack=pack,
                      ops=sampler_ops(plan.on_torch() if on_torch else plan))
    return (W, base) if with_base else W


def test_bf16_sampler_logits_are_the_trainers_fp32_logits():
    """A bf16 sampler's logprobs come from fp32 logits computed as the bf16 trainer computes them (same
    input rounding, fp32 output): rounding the logits to bf16 would put up to ~|logit| / 512 between the
    two sides' logprobs of every token, the largest part of their gap (`bench/drift.py`)."""
    from trainer.backends.local import train_forward
    from trainer.backends.local.model import matmul_inputs, unembed_inputs, unembed_weight
    from trainer.backends.local.sampler_forward import logits

    W, base = _tiny_weights(None, torch.bfloat16, with_base=True)
    W32 = unembed_weight(base)
    g = torch.Generator().manual_seed(0)
    h = 4 * torch.randn(40, W32.shape[1], generator=g)  # |logits| of several units, as a trained model's
    y = torch.randint(0, W32.shape[0], (40,), generator=g)
    lg = logits(W, h)
    assert lg.dtype == torch.float32 and not torch.equal(lg, lg.bfloat16().float())  # fp32 values, not bf16
    sampled = torch.log_softmax(lg, -1).gather(1, y[:, None])[:, 0]
    inputs = unembed_inputs(torch.bfloat16)
    packed = train_forward.pack_unembed(W32) if inputs == torch.float32 else None
    with matmul_inputs(inputs):
        trained = train_forward.target_logprobs(h, W32, None, 1.0, y, packed)
    assert float(lg.abs().max()) > 4
    assert float((sampled - trained).abs().max()) <= 1e-4


def test_packed_sampler_head_computes_the_plain_products_numbers():
    """Where the sampler's fp32 output projection runs on oneDNN's packed kernel under bf16 inputs, it
    gives the bits of the plain product on the same rounded inputs (a packed kernel that kept fp32 inputs
    would be off by ~1e-3 at these logits), and in fp32 it agrees with the plain fp32 product."""
    from trainer.backends.local.model import (
        ONEDNN_PACKING,
        matmul_inputs,
        packed_bf16_inputs_honoured,
        unembed_inputs,
        unembed_weight,
    )
    from trainer.backends.local.sampler_forward import logits
    from trainer.backends.local.sampler_weights import ROW_BLOCK

    g = torch.Generator().manual_seed(1)
    for dtype in (torch.bfloat16, torch.float32):
        W, base = _tiny_weights(ONEDNN_PACKING, dtype, with_base=True)
        W32 = unembed_weight(base)
        assert (W.lm_head.packed is not None) == (ONEDNN_PACKING and (
            unembed_inputs(dtype) == torch.float32 or packed_bf16_inputs_honoured()))
        h = 4 * torch.randn(ROW_BLOCK, W32.shape[1], generator=g)
        with matmul_inputs(W.head_inputs):
            plain = torch.nn.functional.linear(h, W32)
        if W.head_inputs == torch.bfloat16:
            assert torch.equal(logits(W, h), plain)
            assert float((plain - h @ W32.T).abs().max()) > 1e-4  # the inputs really were rounded
        else:
            assert torch.allclose(logits(W, h), plain, atol=1e-4)


def test_prefill_cache_blocked_rows_and_packed_decode_weights():
    """Prompts prefilled in one call give each prompt the hidden states and K/V of prefilling it alone
    (at cache indices [0, T_i) of its row); a projection over fixed row blocks returns each row exactly
    what a block holding only that row returns; oneDNN-packed decode projections equal plain F.linear."""
    from trainer.backends.local.model import ONEDNN_PACKING
    from trainer.backends.local.sampler_forward import prefill
    from trainer.backends.local.sampler_weights import PACKED_MAX_ROWS, ROW_BLOCK, with_factors

    W = _tiny_weights(pack=ONEDNN_PACKING)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, W.vocab_size, (n,), generator=g) for n in (5, 17, 1, 9)]
    L = 20
    cache = [(torch.zeros(4, W.n_kv, L, W.head_dim), torch.zeros(4, W.n_kv, L, W.head_dim)) for _ in W.layers]
    together = prefill(W, prompts, cache, range(4))
    for i, p in enumerate(prompts):
        one = [(torch.zeros(1, W.n_kv, L, W.head_dim), torch.zeros(1, W.n_kv, L, W.head_dim)) for _ in W.layers]
        alone = prefill(W, [p], one, [0])[0]
        assert together[i].shape == (len(p), W.embed.shape[1]) and torch.equal(together[i], alone)
        for (k, v), (k1, v1) in zip(cache, one):
            assert torch.equal(k[i], k1[0]) and torch.equal(v[i], v1[0])
        assert float(cache[0][0][i, :, len(p):].abs().max()) == 0.0  # right of the prompt stays empty
    for lin in (W.layers[0].qkv, W.layers[0].down, W.lm_head):
        x = torch.randn(2 * ROW_BLOCK + 5, lin.w.shape[1], generator=g)
        rows = lin.blocked(x)
        assert rows.shape == (x.shape[0], lin.out_features)
        for i in (0, ROW_BLOCK + 3, x.shape[0] - 1):
            assert torch.equal(rows[i], lin.blocked(x[i: i + 1])[0])
    if ONEDNN_PACKING:
        lin = W.layers[0].gate_up
        assert lin.packed is not None
        x = torch.randn(7, lin.w.shape[1], generator=g)
        assert torch.allclose(lin(x), torch.nn.functional.linear(x, lin.w), atol=1e-5)
        big = torch.randn(PACKED_MAX_ROWS + 1, lin.w.shape[1], generator=g)
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.w))  # large M: plain sgemm
        # a snapshot's LoRA on packed weights is merged and re-packed: both row regimes equal the
        # unmerged x W^T + s (x A^T) B^T of each stacked projection
        half = lin.w.shape[0] // 2
        lora = {n: (torch.randn(3, lin.w.shape[1], generator=g), torch.randn(half, 3, generator=g))
                for n in ("gate", "up")}
        merged = with_factors(lin, ["gate", "up"], [half, half], lora, 0.7, torch.float32, W.ops)
        assert merged.w is None and merged.lora_a is None and merged.out_features == lin.w.shape[0]
        for rows in (x, big):
            ref = torch.cat([torch.nn.functional.linear(rows, w) + 0.7 * (rows @ lora[n][0].T) @ lora[n][1].T
                             for w, n in zip(lin.w.split(half), ("gate", "up"))], -1)
            assert torch.allclose(merged(rows), ref, atol=1e-4)


def test_bf16_projections_on_the_amx_tiles_and_their_merged_lora():
    """On an AMX CPU every bf16 layer projection has the tiles' copy (not oneDNN's), rows of any count
    agree with the plain bf16 product to its rounding, and a snapshot's LoRA merged into it gives the
    product with `W + s B A` (summed in fp32, rounded once to bf16) to the same rounding."""
    from trainer.backends.local import kernels
    from trainer.backends.local.sampler_weights import with_factors

    if not kernels.amx_head():
        pytest.skip("no AMX-BF16 here (or the OS does not grant the tiles)")
    W = _tiny_weights(True, torch.bfloat16)
    assert all(p.amx is not None and p.packed is None for L in W.layers for p in (L.qkv, L.o, L.gate_up, L.down))
    g = torch.Generator().manual_seed(2)
    lin = W.layers[0].gate_up
    half = lin.out_features // 2
    x = torch.randn(45, lin.w.shape[1], generator=g).bfloat16()
    plain = x.float() @ lin.w.float().T
    assert torch.allclose(lin(x).float(), plain, rtol=2 ** -7, atol=1e-3)
    # rows over fixed blocks (what batch invariance asks for) take one call here: the same bits
    assert torch.equal(lin.blocked(x, 16), torch.cat([lin(x[i: i + 16]) for i in range(0, 45, 16)]))
    lora = {n: (torch.randn(3, lin.w.shape[1], generator=g), torch.randn(half, 3, generator=g))
            for n in ("gate", "up")}
    merged = with_factors(lin, ["gate", "up"], [half, half], lora, 0.7, torch.bfloat16, W.ops)
    assert merged.w is None and merged.amx is not None and merged.out_features == lin.out_features
    # the merged weight is W + s B A summed in fp32 and rounded once to bf16
    w_merged = torch.cat([w.float() + 0.7 * lora[n][1] @ lora[n][0] for w, n in zip(lin.w.split(half), ("gate", "up"))])
    ref = x.float() @ w_merged.bfloat16().float().T
    assert torch.allclose(merged(x).float(), ref, rtol=2 ** -7, atol=1e-3)


def test_inverse_cdf_matches_the_full_cumsum_and_skips_zero_mass_tokens():
    from trainer.backends.local.generate import inverse_cdf

    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(64, 1000, generator=g) * 3, -1)  # 1000 = 3 blocks + a partial one
    u = torch.rand(64, generator=g, dtype=torch.float64)
    cdf = probs.double().cumsum(-1)
    ref = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    assert torch.equal(inverse_cdf(probs, u), ref)
    # all the mass on two tokens in different blocks; u at the extremes never lands on a zero-mass id
    p = torch.zeros(3, 700)
    p[:, 3], p[:, 600] = 0.25, 0.75
    out = inverse_cdf(p, torch.tensor([0.0, 0.2499, 1.0], dtype=torch.float64))
    assert out.tolist() == [3, 3, 600]
    # frequencies follow the probabilities
    q = torch.softmax(torch.randn(1, 300, generator=g), -1).expand(100_000, 300).contiguous()
    freq = torch.bincount(inverse_cdf(q, torch.rand(100_000, generator=g, dtype=torch.float64)), minlength=300)
    assert float((freq / 100_000 - q[0]).abs().max()) < 0.005


def test_jobs_that_each_fit_the_context_share_a_batch(tc):
    """A long prompt with a short budget and a short prompt with a long one fit the context alone, so they fit
    together too (the batch's cache is as long as its longest job, not longest prompt + largest budget), and
    each returns what it returns alone."""
    tok = tc.get_tokenizer()
    scl = tc.save_weights_and_get_sampling_client()
    ctx = 1024
    short = mi(tok, PROMPTS[0])
    long_ids = (tok.encode(PROMPTS[1], add_special_tokens=False) * 200)[: ctx - 40]
    long_p = types.ModelInput.from_ints(long_ids)
    long_params = types.SamplingParams(max_tokens=8, temperature=1.0, seed=5, stop=[])
    short_params = types.SamplingParams(max_tokens=ctx - short.length - 1, temperature=1.0, seed=6, stop=[])
    alone_long = scl.sample(long_p, 2, long_params).result()

    async def together():
        return await asyncio.gather(scl.sample(long_p, 2, long_params), scl.sample(short, 1, short_params))

    both_long, both_short = asyncio.run(together())
    assert [s.tokens for s in both_long.sequences] == [s.tokens for s in alone_long.sequences]
    assert len(both_short.sequences[0].tokens) == short_params.max_tokens


def test_the_scheduler_serves_a_tenant_not_yet_served_before_another_batch_of_a_served_one():
    """Fair turns (`SampleScheduler._take_batch`): tenant A queued three batches (three snapshots) before
    B's one request; once A's first batch has run, B's request goes next, ahead of A's other two."""
    from concurrent.futures import Future

    from trainer.backends.local.common import Faults
    from trainer.backends.local.engine import LoraSnapshot
    from trainer.backends.local.generate import SampleJob
    from trainer.backends.local.sampling import SampleScheduler, _Request

    sched = SampleScheduler(torch.float32, max_batch=8, faults=Faults(None), batch_wait_s=0.0, start=False)
    base = object()

    def request(tenant: str, snap: str) -> _Request:
        job = SampleJob(prompt=[1, 2], num_samples=1, max_tokens=1)
        return _Request(base, LoraSnapshot(snap, {}, 0.0), "sample", job, Future(), tenant=tenant)

    for r in (request("A", "a1"), request("A", "a2"), request("A", "a3"), request("B", "b1")):
        sched.submit(r)
    order = []
    for _ in range(4):
        batch = sched._take_batch({})
        assert len(batch) == 1
        order.append(batch[0].snap.id)
    assert order == ["a1", "b1", "a2", "a3"]
    sched.submit(request("A", "a4"))
    sched.submit(request("B", "b2"))
    running = {"B": object()}  # a tenant with a batch running gets no second one
    assert [r.snap.id for r in sched._take_batch(running)] == ["a4"]
    sched.close()
