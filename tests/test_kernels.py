"""The sampler's native kernels (`kernels.c`): decode attention against a float64 reference and the cache it
writes, the row kernels (residual add + RMSNorm, SiLU gate) against torch's ops, batch invariance,
agreement with the torch path through prefill and whole decode steps, and the fallback where they
cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_sampler import _tiny_weights
from third_party_warnings import own_warning_lines

from trainer.backends.local import kernels
from trainer.backends.local import sampler_forward as sf
from trainer.backends.local.model import rms_norm, rope

needs_native = pytest.mark.skipif(kernels.library() is None, reason=f"no native kernels here: {kernels.describe()}")


def _reference(qkv, k_raw, v, pos_B, cos, sin, nh):
    """float64 attention of each row over cache indices [0, pos] with the new token's k/v in place, keys and
    queries rotated as model.rope rotates them in fp32."""
    B, KV, _, D = k_raw.shape
    G = nh // KV
    out = torch.empty(B, nh * D, dtype=torch.float64)
    for b in range(B):
        p = int(pos_B[b])
        row = qkv[b].float()
        q = rope(row[: nh * D].view(nh, D), cos[p], sin[p])
        k = k_raw[b].float().clone()
        vv = v[b].float().clone()
        k[:, p] = row[nh * D: (nh + KV) * D].view(KV, D)
        vv[:, p] = row[(nh + KV) * D:].view(KV, D)
        kr = rope(k[:, : p + 1].transpose(0, 1), cos[: p + 1, None], sin[: p + 1, None]).transpose(0, 1)
        for h in range(nh):
            s = (q[h].double() @ kr[h // G].double().T) * D ** -0.5
            out[b, h * D: (h + 1) * D] = torch.softmax(s, -1) @ vv[h // G, : p + 1].double()
    return out


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_attention_against_float64_and_its_cache_writes(dtype):
    g = torch.Generator().manual_seed(0)
    B, KV, D, L, nh = 5, 2, 64, 40, 6  # 3 query heads per key/value head
    cos_t, sin_t = torch.randn(64, D, generator=g), torch.randn(64, D, generator=g)
    qkv = torch.randn(B, (nh + 2 * KV) * D + 7, generator=g).to(dtype)[:, 7:]  # a row stride beyond its width
    kc, vc = torch.randn(B, KV, L, D, generator=g).to(dtype), torch.randn(B, KV, L, D, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 17, 39, 17])
    before_k, before_v = kc.clone(), vc.clone()
    ref = _reference(qkv, kc, vc, pos, cos_t, sin_t, nh)
    out = kernels.decode_layer_attention(qkv, cos_t, sin_t, kc, vc, pos, nh)
    assert out.dtype == dtype and out.shape == (B, nh * D)
    if dtype == torch.float32:
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # the fp32 result rounded once: within one bf16 step (2^-8 relative) of the exact value
        assert float(((out.double() - ref).abs() / ref.abs().clamp(min=1e-3)).max()) <= 2 ** -8
    for b in range(B):  # the new k (before RoPE) and v at pos, bit for bit; nothing else touched
        p = int(pos[b])
        assert torch.equal(kc[b, :, p], qkv[b, nh * D: (nh + KV) * D].view(KV, D))
        assert torch.equal(vc[b, :, p], qkv[b, (nh + KV) * D:].view(KV, D))
        keep = torch.ones(L, dtype=torch.bool)
        keep[p] = False
        assert torch.equal(kc[b][:, keep], before_k[b][:, keep]) and torch.equal(vc[b][:, keep], before_v[b][:, keep])
    # a position beyond the cache: an error naming it, and nothing written
    kb, vb = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="position outside"):
        kernels.decode_layer_attention(qkv, cos_t, sin_t, kc, vc, torch.tensor([0, 3, 17, 39, L]), nh)
    assert torch.equal(kc, kb) and torch.equal(vc, vb)
    # batch invariance: each row alone gives its batched bits
    for b in range(B):
        k1, v1 = before_k[b: b + 1].clone(), before_v[b: b + 1].clone()
        one = kernels.decode_layer_attention(qkv[b: b + 1], cos_t, sin_t, k1, v1, pos[b: b + 1], nh)
        assert torch.equal(one[0], out[b])


@pytest.mark.skipif(not kernels.avx512(), reason="no AVX-512 build here: the decode kernel has only its portable "
                                                  "loop, which this test would compare with itself")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("nh", [6, 8])
def test_vectorized_decode_attention_has_the_portable_loops_bits(dtype, nh):
    """The AVX-512 variant (head size 64: keys scored 16 at a time) gives the portable loop's bits: every
    length around a 16-key block edge, 3 query heads per key/value head (the specialized count) and 4."""
    g = torch.Generator().manual_seed(1)
    B, KV, D, L = 12, 2, 64, 70
    cos_t, sin_t = torch.randn(L, D, generator=g), torch.randn(L, D, generator=g)
    qkv = torch.randn(B, (nh + 2 * KV) * D, generator=g).to(dtype)
    kc, vc = torch.randn(B, KV, L, D, generator=g).to(dtype), torch.randn(B, KV, L, D, generator=g).to(dtype)
    pos = torch.tensor([0, 1, 14, 15, 16, 17, 31, 32, 33, 47, 48, 69])
    fast = kernels.decode_layer_attention(qkv, cos_t, sin_t, kc.clone(), vc.clone(), pos, nh)
    portable = kernels.decode_layer_attention(qkv, cos_t, sin_t, kc.clone(), vc.clone(), pos, nh, portable=True)
    assert torch.equal(fast, portable)


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units of the last place (same-sign values)."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_against_torch(dtype):
    """`residual_rms_norm`: the add in place and exact (one fp32 rounding, as torch's promoting add), the
    norm as `F.rms_norm` up to summation order (fp32) or within one bf16 rounding step; `silu_mul` as
    `F.silu(g) * u` in the same dtype; each row alone gives its batched bits; bad shapes are named."""
    g = torch.Generator().manual_seed(1)
    B, H, I = 7, 96, 80
    x = torch.randn(B, H, generator=g) * 3
    y = (torch.randn(B, H + 5, generator=g) * 2).to(dtype)[:, 5:]  # rows with a stride beyond their width
    w = torch.randn(H, generator=g)
    xk = x.clone()
    out = kernels.residual_rms_norm(xk, y, w, 1e-5, dtype)
    assert out.dtype == dtype and torch.equal(xk, x + y)
    ref = F.rms_norm(x + y, (H,), w, 1e-5)
    if dtype == torch.float32:
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert _ulps_bf16(out, ref.to(dtype)) <= 1
    x0 = x.clone()  # no residual: the norm alone, x untouched
    assert torch.allclose(kernels.residual_rms_norm(x0, None, w, 1e-5, torch.float32), F.rms_norm(x, (H,), w, 1e-5),
                          rtol=1e-6, atol=1e-6) and torch.equal(x0, x)
    gu = (torch.randn(B, 2 * I, generator=g) * 4).to(dtype)
    m = kernels.silu_mul(gu)
    ref_m = F.silu(gu[:, :I]) * gu[:, I:]
    if dtype == torch.float32:
        assert torch.allclose(m, ref_m, rtol=1e-5, atol=1e-6)
    else:
        assert _ulps_bf16(m, ref_m) <= 1
    for b in range(B):
        xb = x[b: b + 1].clone()
        assert torch.equal(kernels.residual_rms_norm(xb, y[b: b + 1], w, 1e-5, dtype)[0], out[b])
        assert torch.equal(kernels.silu_mul(gu[b: b + 1])[0], m[b])
    with pytest.raises(ValueError, match="residual_rms_norm"):
        kernels.residual_rms_norm(x.clone(), y, w[:-1], 1e-5, dtype)
    with pytest.raises(ValueError, match="silu_mul"):
        kernels.silu_mul(gu[:, :-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_agree_on_the_native_and_torch_paths(dtype):
    """The same prompts prefilled and decoded for a few steps, rows at different lengths, on each path:
    fp32 logprobs agree to fp32 noise, bf16 ones to bf16's (the paths differ in summation order only)."""
    if kernels.library() is None:
        pytest.skip(f"no native kernels here: {kernels.describe()}")
    g = torch.Generator().manual_seed(0)
    out = {}
    for path in ("native", "torch"):
        W = _tiny_weights(None, dtype, on_torch=path == "torch")
        assert W.ops.plan.decode_attention == W.ops.plan.sampler_rows == (path == "native")
        if path == "native":
            prompts = [torch.randint(0, W.vocab_size, (n,), generator=g) for n in (9, 4, 13)]
            toks = torch.randint(0, W.vocab_size, (4, 3), generator=g)
        cache = sf.new_cache(W, 3, 20)
        assert cache[0][0].dtype == (dtype if path == "native" else torch.float32)
        sf.prefill(W, prompts, cache, range(3))
        steps = []
        for s in range(4):
            pos = torch.tensor([len(p) + s for p in prompts])
            spans = [(i, i + 1, int(pos[i]) + 1) for i in range(3)]
            steps.append(torch.log_softmax(sf.decode_step(W, toks[s], pos, spans, cache), -1))
        out[path] = torch.stack(steps)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    assert float((out["native"] - out["torch"]).abs().max()) < tol


def test_native_kernels_fall_back_where_they_cannot_be_built(monkeypatch, tmp_path):
    """A compiler that fails, no compiler, or PAIREDRL_NATIVE_KERNELS=0: no library, a reason, and the
    sampler on its torch path (fp32 cache of rotated keys); nothing is left in the cache folder."""
    monkeypatch.setenv("PAIREDRL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PAIREDRL_NATIVE_KERNELS", raising=False)
    monkeypatch.delenv(kernels.LIBRARY_ENV, raising=False)
    for env, why in (({"CC": "/bin/false"}, "did not build"), ({"CC": str(tmp_path / "no-such-cc")}, "not an executable"),
                     ({"PAIREDRL_NATIVE_KERNELS": "0"}, "PAIREDRL_NATIVE_KERNELS=0")):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(kernels, "_state", {})
        assert kernels.library() is None and why in kernels.describe()
        W = _tiny_weights(None, torch.float32)  # the plan made now: every op on torch
        assert "torch path" in W.ops.plan.kernels and not W.ops.plan.decode_attention
        assert sf.new_cache(W, 1, 4)[0][0].dtype == torch.float32
        for k in env:
            monkeypatch.delenv(k)
    assert not any(p.suffix == ".so" for p in tmp_path.rglob("*"))
    with pytest.raises(RuntimeError, match="does not run here"):
        kernels.decode_layer_attention(torch.zeros(1, 4 * 8), W.cos, W.sin, torch.zeros(1, 1, 4, 8),
                                       torch.zeros(1, 1, 4, 8), torch.tensor([0]), 2)


def test_a_missing_compiler_warns_once_and_is_recorded(tmp_path):
    """A process that cannot build the library says so: one line on stderr naming the cause and the torch
    path, once however often the library is asked for, and the engine record (run_info.json's `engine`) names
    the same cause, with every native choice off. A fresh cache folder, so no earlier build is found."""
    code = ("from trainer.backends.local import kernels\n"
            "from trainer.backends.local.service import LocalServiceClient\n"
            "assert kernels.library() is None and kernels.library() is None\n"
            "kernels._state.clear()\n"  # a second load in the same process: still one warning
            "sc = LocalServiceClient(state_dir=r'%s', sampler_dtype='float32', train_dtype='float32')\n"
            "rec = sc.engine_record('pairedrl/tiny-random')\n"
            "print(rec['kernels'])\n"
            "assert rec['kernels'] == kernels.describe()\n"
            "assert not (rec['decode_attention'] or rec['train_rows'])\n"
            ) % (tmp_path / "state")
    env = {k: v for k, v in os.environ.items() if k not in (kernels.NATIVE_ENV, kernels.LIBRARY_ENV)}
    env.update(CC="/nonexistent", PAIREDRL_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(Path(kernels.__file__).parents[3]), env.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0, p.stderr
    warnings = [line for line in own_warning_lines(p.stderr) if "warning" in line]
    assert len(warnings) == 1, p.stderr
    assert "CC=/nonexistent is not an executable" in warnings[0] and "running the torch path" in warnings[0]
    assert p.stdout.strip() == "torch path (CC=/nonexistent is not an executable)"
    assert not (tmp_path / "cache" / "kernels").exists() or not any((tmp_path / "cache" / "kernels").iterdir())
    # the deliberate choice prints nothing
    env[kernels.NATIVE_ENV] = "0"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       check=False)
    assert p.returncode == 0 and own_warning_lines(p.stderr) == [], p.stderr
    assert p.stdout.strip() == f"torch path ({kernels.NATIVE_ENV}=0)"


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_custom_ops_match_torch_autograd(dtype):
    """The training forward's native steps as custom ops (`custom_ops.py`, `torch.ops.pairedrl`) against the
    torch ops they replace, forward and backward: RoPE of q|k|v to the bit (its gradient computed in fp32
    and rounded once), the norm (with and without the residual add before it) and the SiLU gate up to
    summation order and the exp (fp32) or within one bf16 rounding step; each op and its backward through
    `torch.library.opcheck` (schema, fake shapes, autograd registration)."""
    from trainer.backends.local import custom_ops

    def NormCast(x, w, eps, dt):  # noqa: N802 - the steps under test, as the training forward calls them
        return custom_ops.rms_norm_cast(x, w, eps, dt)[0]

    def AddNormCast(x, y, w, eps, dt):  # noqa: N802
        return custom_ops.add_rms_norm_cast(x, y, w, eps, dt)[:2]

    RopeQKV, SiluMul = custom_ops.rope_qkv, custom_ops.silu_mul  # noqa: N806

    g = torch.Generator().manual_seed(3)
    N, H, nh, kv, D, I = 11, 48, 6, 2, 8, 40

    def close(a, b):
        if dtype == torch.float32 or a.dtype == torch.float32:
            return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-5)
        return _ulps_bf16(a, b) <= 1

    # norm + cast
    x = (torch.randn(N, H, generator=g) * 2).requires_grad_()
    w = torch.randn(H, generator=g)
    dy = torch.randn(N, H, generator=g).to(dtype)
    out = NormCast(x, w, 1e-5, dtype)
    (dx,) = torch.autograd.grad(out, x, dy)
    ref = rms_norm(x, w, 1e-5).to(dtype)
    (dx_ref,) = torch.autograd.grad(ref, x, dy)
    assert out.dtype == dtype and close(out, ref) and torch.allclose(dx, dx_ref, rtol=1e-4, atol=1e-5)
    # residual add + norm + cast: both outputs used downstream, as the residual stream and the norm are
    y = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    x_in = x.detach().clone()
    s_out, out = AddNormCast(x, y, w, 1e-5, dtype)
    ds = torch.randn(N, H, generator=g)
    dx, dyy = torch.autograd.grad((s_out, out), (x, y), (ds, dy))
    s_ref = x + y
    ref = rms_norm(s_ref, w, 1e-5).to(dtype)
    dx_ref, dy_ref = torch.autograd.grad((s_ref, ref), (x, y), (ds, dy))
    assert torch.equal(x.detach(), x_in) and torch.equal(s_out, s_ref)  # x itself is left as it was
    assert close(out, ref) and torch.allclose(dx, dx_ref, rtol=1e-4, atol=1e-5)
    assert dyy.dtype == dtype and close(dyy, dy_ref)
    # RoPE of q and k, v as fp32
    cos_t, sin_t = torch.randn(32, D, generator=g), torch.randn(32, D, generator=g)
    pos = torch.randint(0, 32, (N,), generator=g)
    qkv = torch.randn(N, (nh + 2 * kv) * D, generator=g).to(dtype).requires_grad_()
    outs = RopeQKV(qkv, pos, cos_t, sin_t, nh, kv)
    q, k, v = qkv.split([nh * D, kv * D, kv * D], -1)
    c, s = cos_t[pos].unsqueeze(1), sin_t[pos].unsqueeze(1)
    refs = (rope(q.view(N, nh, D), c, s), rope(k.view(N, kv, D), c, s), v.view(N, kv, D).float())
    for o, r in zip(outs, refs):
        assert o.dtype == torch.float32 and torch.equal(o, r)
    grads = [torch.randn(o.shape, generator=g) for o in outs]
    (dqkv,) = torch.autograd.grad(outs, qkv, grads)
    # the gradient in fp32, rounded once to the dtype (autograd on bf16 inputs would round each of RoPE's
    # two terms to bf16 before their sum)
    q32 = qkv.detach().float().requires_grad_()
    q, k, v = q32.split([nh * D, kv * D, kv * D], -1)
    refs = (rope(q.view(N, nh, D), c, s), rope(k.view(N, kv, D), c, s), v.view(N, kv, D))
    (dqkv_ref,) = torch.autograd.grad(refs, q32, grads)
    assert dqkv.dtype == dtype and torch.equal(dqkv, dqkv_ref.to(dtype))
    # SiLU gate
    gu = (torch.randn(N, 2 * I, generator=g) * 3).to(dtype).requires_grad_()
    dm = torch.randn(N, I, generator=g).to(dtype)
    m = SiluMul(gu)
    (dgu,) = torch.autograd.grad(m, gu, dm)
    gg, uu = gu.split(I, -1)
    m_ref = F.silu(gg) * uu
    (dgu_ref,) = torch.autograd.grad(m_ref, gu, dm)
    assert close(m, m_ref) and close(dgu, dgu_ref)
    ops = torch.ops.pairedrl
    for op, args in ((ops.rms_norm_cast, (x.detach().requires_grad_(), w, 1e-5, dtype)),
                     (ops.add_rms_norm_cast, (x.detach().requires_grad_(), y.detach().requires_grad_(), w, 1e-5,
                                              dtype)),
                     (ops.rope_qkv, (qkv.detach().requires_grad_(), pos, cos_t, sin_t, nh, kv)),
                     (ops.silu_mul, (gu.detach().requires_grad_(),))):
        torch.library.opcheck(op, args)


@pytest.mark.skipif(not kernels.amx_head(), reason="no AMX-BF16 here (or the OS does not grant the tiles)")
def test_amx_head_logits():
    """The AMX unembedding (`kernels.BlockedHead`): fp32 logits of bf16-rounded inputs and weights, as the
    exact product of those values up to fp32 accumulation and as the fp32 product under bf16 inputs
    (`matmul_inputs`); any row count (padded to its tiles); each row alone gives its batched bits; shapes
    that do not fit the tiles get no blocked head."""
    from trainer.backends.local.model import matmul_inputs

    g = torch.Generator().manual_seed(4)
    W = torch.randn(96, 64, generator=g)
    h = torch.randn(21, 64, generator=g)
    head = kernels.blocked_head(W)
    out = head.logits(h)
    assert out.shape == (21, 96) and out.dtype == torch.float32
    exact = h.bfloat16().double() @ W.bfloat16().double().T
    assert float((out.double() - exact).abs().max()) < 1e-5
    with matmul_inputs(torch.bfloat16):
        ref = F.linear(h, W)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)
    for r in (0, 7, 20):
        assert torch.equal(head.logits(h[r: r + 1])[0], out[r])
    assert kernels.blocked_head(W[:-16]) is None and kernels.blocked_head(W[:, :-8]) is None


@pytest.mark.skipif(not kernels.amx_head(), reason="no AMX-BF16 here (or the OS does not grant the tiles)")
def test_amx_layer_projection():
    """`BlockedLinear`: bf16 rows times a bf16 weight on the tiles, each output within one bf16 rounding of
    the exact product, a row's bits the same alone or among others (any row count, padded to 16), the
    same bits as oneDNN's product on a weight packed for 32 rows where that runs (the sampler's decode
    block, so decode numbers do not change with the kernel), and shapes off the tiles refused."""
    from trainer.backends.local.model import ONEDNN_PACKING, onednn_linear, onednn_pack

    g = torch.Generator().manual_seed(3)
    W = (0.05 * torch.randn(96, 160, generator=g)).bfloat16()
    x = torch.randn(37, 160, generator=g).bfloat16()
    lin = kernels.blocked_linear(W)
    assert lin is not None and (lin.out_features, lin.in_features) == (96, 160)
    out = lin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (37, 96)
    exact = x.double() @ W.double().T
    assert float(((out.double() - exact).abs() / exact.abs().clamp(min=1e-2)).max()) <= 2 ** -8
    for r in (0, 16, 36):
        assert torch.equal(lin(x[r: r + 1])[0], out[r])
    assert torch.equal(lin(x[:32]), out[:32])
    if ONEDNN_PACKING:
        assert torch.equal(lin(x[:32]), onednn_linear(x[:32], onednn_pack(W, 32)))
    assert kernels.blocked_linear(W[:-16]) is None and kernels.blocked_linear(W[:, :-8]) is None
    assert kernels.blocked_linear(W.float()) is None
    with pytest.raises(ValueError, match="expected"):
        lin(x.float())


def test_training_rows_run_only_where_the_row_kernels_fit():
    """The plan takes the training forward's native element-wise steps only for SiLU, fp32/bf16 and widths
    the row kernels take; anything else keeps torch's ops (a wider model would otherwise fail inside a
    kernel)."""
    from dataclasses import replace

    from trainer.backends.local.model import Dims
    from trainer.backends.local.plan import train_plan_for

    d = Dims(n_layers=1, hidden=576, n_heads=9, n_kv=3, head_dim=64, intermediate=1536, eps=1e-5, act=F.silu,
             act_name="silu")
    here = kernels.library() is not None
    assert train_plan_for(d, torch.bfloat16).train_rows == here
    assert not train_plan_for(replace(d, act_name="gelu"), torch.bfloat16).train_rows
    assert not train_plan_for(d, torch.float16).train_rows
    assert not train_plan_for(replace(d, hidden=kernels.MAX_HIDDEN + 1), torch.float32).train_rows
    assert not train_plan_for(replace(d, intermediate=kernels.MAX_INTERMEDIATE + 1), torch.float32).train_rows


def test_the_plan_is_made_once_and_a_choice_can_be_put_back_on_torch(monkeypatch):
    """The plans probe every capability once; `PAIREDRL_TORCH_OPS` puts named choices back on torch (how
    bench/tiers.py times what each tier buys), the decode kernel taking the row kernels with it (they share
    its cache layout), and a name that is no choice is refused naming the valid ones."""
    from trainer.backends.local.model import dims
    from trainer.backends.local.ops import ATTN_DTYPE, sampler_ops
    from trainer.backends.local.plan import (NATIVE_CHOICES, TORCH_OPS_ENV, EnginePlan, sampler_plan_for,
                                             train_plan_for)

    W = _tiny_weights(None, torch.float32)
    d = dims(SimpleNamespace(num_hidden_layers=len(W.layers), hidden_size=W.embed.shape[1],
                             num_attention_heads=W.n_heads, num_key_value_heads=W.n_kv, head_dim=W.head_dim,
                             intermediate_size=W.intermediate, rms_norm_eps=W.eps, hidden_act=W.act_name))
    monkeypatch.delenv(TORCH_OPS_ENV, raising=False)
    here = EnginePlan(sampler_plan_for(d, torch.float32), train_plan_for(d, torch.float32), None)
    assert here.sampler == W.ops.plan and here.sampler.kernels == here.train.kernels == kernels.describe()
    assert here.sampler.decode_attention == (kernels.library() is not None)
    monkeypatch.setenv(TORCH_OPS_ENV, "decode_attention, amx_unembedding")
    off = EnginePlan(sampler_plan_for(d, torch.float32), train_plan_for(d, torch.float32), None)
    assert not (off.sampler.decode_attention or off.sampler.sampler_rows or off.sampler.amx_unembedding
                or off.train.train_amx_unembedding)
    assert (off.train.train_rows, off.sampler.onednn_packing, off.train.train_packed_weights) == \
        (here.train.train_rows, here.sampler.onednn_packing, here.train.train_packed_weights)
    assert sampler_ops(off.sampler).cache_dtype == ATTN_DTYPE and "decode_attention" not in off.line()
    assert not {"decode_attention", "sampler_rows", "amx_unembedding"} & set(off.native())
    torch_only = EnginePlan(here.sampler.on_torch(), here.train.on_torch(), None)
    assert set(torch_only.native()) <= {"onednn_packing"} and set(NATIVE_CHOICES) >= set(here.native())
    monkeypatch.setenv(TORCH_OPS_ENV, "decode_atention")
    with pytest.raises(ValueError, match="unknown choice.*decode_atention.*choose from decode_attention"):
        sampler_plan_for(d, torch.float32)
