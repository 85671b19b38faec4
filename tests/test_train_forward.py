"""The local engine's own training forward (packed rows, shared prompts, fused LoRA, blocked
unembedding) against the peft-wrapped HF model, the independent reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from local_client import local_service_client
from lora_grads import grads, zero
from tinker import types

from trainer.backends.local import LocalServiceClient
from trainer.backends.local import train_forward
from trainer.backends.local.model import ONEDNN_PACKING

TINY = "pairedrl/tiny-random"


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    yield from local_service_client(tmp_path_factory, "tf", micro_batch_size=16)


def test_pack_shares_only_identical_prompts_of_neighbours():
    p, q = [5, 6, 7], [5, 6, 9]
    seqs = [p + [1, 2], p + [3], p + [4, 4, 4], q + [1], [8, 8], p + [2]]
    share = [3, 3, 3, 3, 0, 3]
    pk = train_forward.pack(seqs, share)
    # the first three share p (3 rows once instead of 3 times); q differs, [8, 8] shares nothing and the
    # last datum is not a neighbour of the first group
    assert pk.shared_rows == 6
    assert pk.ids_N.shape[0] == sum(map(len, seqs)) - 6
    for s, rows in zip(seqs, pk.rows):
        assert pk.ids_N[rows].tolist() == s
        assert pk.pos_N[rows].tolist() == list(range(len(s)))
    assert pk.rows[0][:3].tolist() == pk.rows[1][:3].tolist() == pk.rows[2][:3].tolist()
    assert pk.rows[3][:3].tolist() != pk.rows[0][:3].tolist()
    # every packed row takes its attention output from exactly one slot, and that slot holds the row
    assert pk.out_idx.shape[0] == pk.ids_N.shape[0]
    assert torch.equal(pk.idx_BT.view(-1)[pk.out_idx], torch.arange(pk.ids_N.shape[0]))
    # a different share boundary or a lone datum shares nothing
    assert train_forward.pack([p + [1], p + [2]], [3, 2]).shared_rows == 0
    assert train_forward.pack([p + [1]], [3]).shared_rows == 0


def _trained(sc, seed, train_unembed=True):
    tc = sc.create_lora_training_client(TINY, rank=4, seed=seed, train_unembed=train_unembed).result()
    with torch.no_grad():  # non-zero B so every factor gets a gradient
        g = torch.Generator().manual_seed(seed)
        for p in tc.compute.params:
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return tc


def _grouped_data(tok, n_groups=3, group=3, seed=0):
    """GRPO-like datums: each group's samples share a prompt (mask 0 there), completions differ."""
    g = torch.Generator().manual_seed(seed)
    data, weights = [], []
    for k in range(n_groups):
        prompt = tok.encode(f"Question {k}: what is {k + 3} + {2 * k}?", add_special_tokens=False)
        for s in range(group):
            comp = torch.randint(0, tok.vocab_size, (3 + 2 * s + k,), generator=g).tolist()
            seq = prompt + comp
            n = len(seq) - 1
            mask = torch.zeros(n)
            mask[len(prompt) - 1:] = 1.0
            data.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                    loss_fn_inputs={"target_tokens": seq[1:], "mask": mask}))
            weights.append(torch.randn(n, generator=g))
    return data, weights


def _peft_logprobs(tc, data):
    """Target logprobs straight from the peft model (one datum at a time, no packing)."""
    b = tc.compute.base
    b.activate(tc.model_id)
    lm = b.causal_lm()
    out = []
    for d in data:
        logits = lm(input_ids=torch.tensor([d.model_input.to_ints()])).logits[0].float()
        tgt = d.loss_fn_inputs["target_tokens"].to_torch().long()
        out.append(logits.log_softmax(-1).gather(-1, tgt[:, None]).squeeze(1))
    return out



@pytest.mark.parametrize("unembed_rows,train_unembed", [(128, False), (4, False), (128, True)])
def test_logprobs_and_lora_gradients_match_the_peft_model(sc, monkeypatch, unembed_rows, train_unembed):
    # without an unembedding LoRA the blocked logprob kernel runs (4 rows: many blocks); with one, the
    # plain cross-entropy path
    monkeypatch.setattr(train_forward, "UNEMBED_ROWS", unembed_rows)
    tc = _trained(sc, seed=3, train_unembed=train_unembed)
    assert any(m == "lm_head" for m, _, _ in tc.compute.modules) == train_unembed
    data, weights = _grouped_data(tc.get_tokenizer())
    assert train_forward.pack([d.model_input.to_ints() for d in data],
                   [tc.compute.prepare([d])[0].share for d in data]).shared_rows > 0

    def loss_fn(data, lps):
        return sum((lp * w).sum() for lp, w in zip(lps, weights)), {}

    zero(tc)
    out = tc.forward_backward_custom(data, loss_fn).result()
    g_engine = grads(tc)
    zero(tc)
    with tc.compute.base.lock:
        ref = _peft_logprobs(tc, data)
        loss_fn(data, ref)[0].backward()
    g_ref = grads(tc)
    zero(tc)
    for o, r in zip(out.loss_fn_outputs, ref):
        assert torch.allclose(o["logprobs"].to_torch(), r.detach(), atol=2e-5)
    scale = max(float(g.abs().max()) for g in g_ref)
    assert scale > 1e-3
    assert max(float((a - b).abs().max()) for a, b in zip(g_engine, g_ref)) <= 1e-4 * scale


@pytest.mark.parametrize("with_lora", [(True, True), (True, False), (False, False)])
def test_stacked_lora_linear_equals_separate_projections(with_lora):
    # q|k-like stack of two projections (3 and 2 outputs) sharing x; the fused backward (hand-written
    # products) against autograd through the plain per-projection formula, in float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 6, dtype=torch.float64, generator=g, requires_grad=True)
    ws = [torch.randn(o, 6, dtype=torch.float64, generator=g) for o in (3, 2)]
    loras = [(torch.randn(2, 6, dtype=torch.float64, generator=g).requires_grad_(),
              torch.randn(o, 2, dtype=torch.float64, generator=g).requires_grad_()) if on else None
             for o, on in zip((3, 2), with_lora)]
    params = [x] + [t for lr in loras if lr is not None for t in lr]
    dy = torch.randn(7, 5, dtype=torch.float64, generator=g)
    y = train_forward.stacked_linear(x, torch.cat(ws), (3, 2), loras, 1.5)
    got = torch.autograd.grad((y * dy).sum(), params)
    ref_y = torch.cat([x @ w.T + (0 if lr is None else 1.5 * (x @ lr[0].T) @ lr[1].T) for w, lr in zip(ws, loras)], -1)
    ref = torch.autograd.grad((ref_y * dy).sum(), params)
    assert torch.allclose(y, ref_y, atol=1e-12)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-12)
    if all(with_lora):  # and the analytic backward passes gradcheck on its own
        A, B = loras[0]
        assert torch.autograd.gradcheck(lambda x, A, B: train_forward.LoraLinear.apply(x, ws[0], A, B, 1.5), (x, A, B))


def test_blocked_unembedding_equals_cross_entropy(monkeypatch):
    monkeypatch.setattr(train_forward, "UNEMBED_ROWS", 7)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (30,), generator=g)
    h1 = torch.randn(30, 16, generator=g, requires_grad=True)
    h2 = h1.detach().clone().requires_grad_(True)
    up = torch.randn(30, generator=g)
    a = train_forward.target_logprobs(h1, W, None, 1.0, y)
    b = -F.cross_entropy(h2 @ W.t(), y, reduction="none")
    (a * up).sum().backward()
    (b * up).sum().backward()
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(h1.grad, h2.grad, atol=1e-5)
    packed = train_forward.pack_unembed(W) if ONEDNN_PACKING else None
    if packed is not None:  # the oneDNN-packed products give the same values and gradients
        assert torch.allclose(train_forward.target_logprobs(h1.detach(), W, None, 1.0, y, packed), b.detach(), atol=1e-5)
        h3 = h1.detach().clone().requires_grad_(True)
        c = train_forward.target_logprobs(h3, W, None, 1.0, y, packed, W, train_forward.pack_unembed_grad(W))
        (c * up).sum().backward()
        assert torch.allclose(c, b, atol=1e-5)
        assert torch.allclose(h3.grad, h2.grad, atol=1e-5)


def test_blocked_unembedding_with_lora_equals_cross_entropy(monkeypatch):
    """A LoRA on the unembedding: the blocked logprobs (logits recomputed in the backward) give the plain
    cross-entropy's values and its gradients for h, A and B, over several row blocks."""
    monkeypatch.setattr(train_forward, "UNEMBED_ROWS", 7)
    g = torch.Generator().manual_seed(1)
    W = torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (30,), generator=g)
    up = torch.randn(30, generator=g)
    h0, A0, B0 = torch.randn(30, 16, generator=g), torch.randn(3, 16, generator=g) * 0.3, torch.randn(300, 3, generator=g) * 0.3

    def run(blocked: bool, packed=None):
        h, A, B = (t.clone().requires_grad_(True) for t in (h0, A0, B0))
        if blocked:
            lp = train_forward.target_logprobs(h, W, (A, B), 1.5, y, packed)
        else:
            lp = -F.cross_entropy(h @ W.t() + 1.5 * (h @ A.t()) @ B.t(), y, reduction="none")
        (lp * up).sum().backward()
        return lp.detach(), h.grad, A.grad, B.grad

    ref = run(False)
    got = run(True)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, atol=1e-5)
    packed = train_forward.pack_unembed(W) if ONEDNN_PACKING else None
    if packed is not None:  # the base product on oneDNN's packed kernel: the same values
        for a, b in zip(run(True, packed), ref):
            assert torch.allclose(a, b, atol=1e-5)
    with torch.no_grad():  # without gradients: the same logprobs, nothing kept for a backward
        assert torch.allclose(train_forward.target_logprobs(h0, W, (A0, B0), 1.5, y), ref[0], atol=1e-5)


@pytest.mark.skipif(not ONEDNN_PACKING, reason="torch built without oneDNN packing")
def test_packed_linear_equals_f_linear():
    """A projection without LoRA on packed weights: its value and input gradient are F.linear's, and a
    stacked no-LoRA projection takes that path."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 24, generator=g)
    x1 = torch.randn(50, 24, generator=g, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    dy = torch.randn(50, 40, generator=g)
    y1 = train_forward.stacked_linear(x1, w, (30, 10), [None, None], 1.0, train_forward.pack_weight(w))
    y2 = F.linear(x2, w)
    (y1 * dy).sum().backward()
    (y2 * dy).sum().backward()
    fn, names = y1.grad_fn, []
    while fn is not None:  # the views down to the product
        names.append(fn.name())
        fn = fn.next_functions[0][0] if fn.next_functions else None
    assert any(n.startswith("PackedLinear") for n in names), names
    assert torch.allclose(y1, y2, atol=1e-5) and torch.allclose(x1.grad, x2.grad, atol=1e-5)


@pytest.mark.skipif(not ONEDNN_PACKING, reason="torch built without oneDNN packing")
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.bf16)])
def test_packed_training_weights_give_the_unpacked_numbers(tmp_path, monkeypatch, dtype):
    """The layer GEMMs on oneDNN-packed weights (the training plan's `train_packed_weights`, forced both
    ways here) give the unpacked forward's logprobs and LoRA gradients up to kernel rounding, on every
    projection."""
    from trainer.backends.local import engine

    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("PAIREDRL_TRAIN_PACKING", flag)
        # the plans are made once per process and model: each setting as a fresh process would load the model
        monkeypatch.setattr(engine, "_bases", {})
        c = LocalServiceClient(state_dir=tmp_path / flag, sampler_dtype="float32", train_dtype=dtype)
        tc = _trained(c, seed=5, train_unembed=False)
        assert tc.compute.ops.plan.train_packed_weights is (flag == "1")
        assert c.engine_record(TINY)["train_packing"] == f"PAIREDRL_TRAIN_PACKING={flag}"
        data, weights = _grouped_data(tc.get_tokenizer())
        res = tc.forward_backward_custom(data, lambda d, lps: (sum((lp * w).sum() for lp, w in zip(lps, weights)), {}))
        out[flag] = (torch.cat([o["logprobs"].to_torch() for o in res.result().loss_fn_outputs]), grads(tc))
        c.close()
    (lp0, g0), (lp1, g1) = out["0"], out["1"]
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert float((lp0 - lp1).abs().max()) <= tol
    for a, b in zip(g1, g0):
        assert float(b.norm()) > 0
        assert float((a - b).norm() / b.norm()) <= (1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.bf16
def test_bf16_training_stays_close_to_fp32(tmp_path):
    """train_dtype=bfloat16 (the `auto` choice on CPUs with fast bf16 matmuls: bf16 weight copies, LoRA
    factors cast per forward, fp32 attention, the unembedding's gradient product in bf16): logprobs stay
    within bf16 rounding of the fp32 ones and so do the LoRA gradients."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        c = LocalServiceClient(state_dir=tmp_path / dtype, sampler_dtype="float32", train_dtype=dtype)
        tc = _trained(c, seed=4, train_unembed=False)
        data, weights = _grouped_data(tc.get_tokenizer(), n_groups=2, group=2)
        res = tc.forward_backward_custom(data, lambda d, lps: (sum((lp * w).sum() for lp, w in zip(lps, weights)), {}))
        out[dtype] = (torch.cat([o["logprobs"].to_torch() for o in res.result().loss_fn_outputs]), grads(tc))
        c.close()
    lp32, g32 = out["float32"]
    lp16, g16 = out["bfloat16"]
    assert float((lp32 - lp16).abs().max()) < 0.1
    assert all(bool(torch.isfinite(g).all()) for g in g16)
    # the bf16 gradient is the fp32 one up to rounding: same direction, same size, for every LoRA factor
    # (a dropped cast, a wrong scale or a wrong bf16 weight copy moves these far outside)
    flat32, flat16 = torch.cat([g.flatten() for g in g32]), torch.cat([g.flatten() for g in g16])
    assert float((flat16 - flat32).norm() / flat32.norm()) < 0.05
    for a, b in zip(g16, g32):
        assert float(b.norm()) > 0
        assert float(F.cosine_similarity(a.flatten(), b.flatten(), dim=0)) > 0.99
        assert abs(float(a.norm() / b.norm()) - 1) < 0.05


def test_one_plan_per_side_and_dtype_is_what_a_client_logs_records_and_runs(tmp_path, monkeypatch):
    """The engine plan a client logs and records is the very sampler and training plans its ops run, one
    per side and dtype of the model: a second client shares the plans of its dtypes, and a bf16 training
    forward makes no plan of another dtype (the fp32 unembedding it may use is read from its own plan)."""
    import dataclasses

    from trainer.backends.local import engine
    from trainer.backends.local.plan import SamplerPlan, TrainPlan

    monkeypatch.setattr(engine, "_bases", {})  # a fresh process's engine: no plan made yet
    c = LocalServiceClient(state_dir=tmp_path / "a", sampler_dtype="float32", train_dtype="bfloat16")
    c2 = LocalServiceClient(state_dir=tmp_path / "b", sampler_dtype="float32", train_dtype="bfloat16")
    tc = _trained(c, seed=3, train_unembed=False)
    data, weights = _grouped_data(tc.get_tokenizer(), n_groups=1, group=2)
    tc.forward_backward_custom(data, lambda d, lps: (sum((lp * w).sum() for lp, w in zip(lps, weights)), {})
                               ).result()
    base = engine.shared_base(TINY)
    plan = c.plan(TINY)
    assert plan.sampler is base.sampler_ops(torch.float32).plan and plan.train is tc.compute.ops.plan
    assert c2.plan(TINY).sampler is plan.sampler and c2.plan(TINY).train is plan.train
    assert sorted((side, str(dt)) for side, dt in base._plans) == [("sampler", "torch.float32"),
                                                                  ("train", "torch.bfloat16")]
    rec = c.engine_record(TINY)
    # the plan's record, then the sampler's mismatch knobs and draw (here their defaults)
    assert rec == {**plan.record(), "sampler_quant": "none", "sampler_logit_noise": 0.0,
                   "sampling_coupling": "inverse_cdf"}
    assert {k: rec[k] for k in ("sampler_dtype", "train_dtype", "auto")} == \
        {"sampler_dtype": "float32", "train_dtype": "bfloat16", "auto": None}
    fields = {f.name for cls in (SamplerPlan, TrainPlan) for f in dataclasses.fields(cls)}
    assert set(rec) == fields | {"auto", "sampler_quant", "sampler_logit_noise", "sampling_coupling"}
    assert rec["train_packed_weights"] == plan.train.train_packed_weights
    assert rec["train_head_inputs"] == str(plan.train.train_head_inputs).removeprefix("torch.")
    c.close()
    c2.close()
