"""The `pairedrl::` custom ops (`custom_ops.py`): each on every implementation available here (its torch
implementation always, the native kernel where the library is built and the op's capability check
passes), through `torch.library.opcheck` (schema and mutation declarations, fake shapes, autograd
registration, AOT dispatch), against a float64 computation with tolerances that follow from the roundings
the op makes, and, on the native implementation, against the torch one on the same inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainer.backends.local import custom_ops, kernels

OPS = torch.ops.pairedrl
IMPLS = ["torch", "native"]
EPS = 1e-5
BF16_STEP = 2 ** -8  # a bf16 rounding moves a value by at most this fraction of it (half its 2^-7 ulp)


@pytest.fixture(params=IMPLS)
def impl(request):
    """The implementation under test: the ops' switch set for it, and back after the test."""
    if request.param == "native" and kernels.library() is None:
        pytest.skip(f"no native kernels here: {kernels.describe()}")
    with custom_ops.native(request.param == "native"):
        yield request.param


def _runs(impl: str, name: str, *args) -> None:
    """The op runs the implementation under test on these arguments (the native one only where it fits)."""
    fits = custom_ops.fits_native(name, *args)
    if impl == "native" and not fits:
        pytest.skip(f"the native {name} kernel does not take these inputs here (capability check)")
    assert fits == (impl == "native")


def _torch_impl(fn, *args):
    """`fn(*args)` on the torch implementations, arguments cloned (an op may write them)."""
    args = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
    with custom_ops.native(False):
        return fn(*args)


def _within(out: torch.Tensor, ref: torch.Tensor, rel: float, atol: float = 0.0) -> None:
    """`|out - ref| <= rel |ref| + atol` elementwise (`ref` float64)."""
    err = (out.double() - ref).abs()
    bound = rel * ref.abs() + atol
    assert bool((err <= bound).all()), \
        f"max excess {float((err - bound).max()):.3g} (max error {float(err.max()):.3g})"


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> int:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def _agree(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Native and torch outputs: within one bf16 step (bf16), or close (fp32: another summation order)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.bfloat16:
        assert _ulps_bf16(a, b) <= 1
    else:
        assert torch.allclose(a, b, rtol=rtol, atol=atol), float((a - b).abs().max())


def _norm64(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w.double()


@pytest.mark.parametrize("y_dtype,dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                           (None, torch.bfloat16)])
def test_add_rms_norm(impl, y_dtype, dtype):
    """The sampler's residual add and norm: `x += y` in place, rounded once to fp32 (as torch's promoting
    add), and the norm of the sum in `dtype` within one rounding of float64's (fp32: up to summation order);
    `y` with a row stride beyond its width, as a product's slice is."""
    g = torch.Generator().manual_seed(1)
    B, H = 7, 96
    x = torch.randn(B, H, generator=g) * 3
    y = None if y_dtype is None else (torch.randn(B, H + 5, generator=g) * 2).to(y_dtype)[:, 5:]
    w = torch.randn(H, generator=g)
    _runs(impl, "add_rms_norm", x, y, w, EPS, dtype)
    torch.library.opcheck(OPS.add_rms_norm, (x.clone(), y, w, EPS, dtype))
    xk = x.clone()
    out = OPS.add_rms_norm(xk, y, w, EPS, dtype)
    s64 = x.double() + (0 if y is None else y.double())
    assert out.dtype == dtype and torch.equal(xk, s64.float())
    _within(out, _norm64(s64, w), 1e-5 if dtype == torch.float32 else BF16_STEP * 1.01, 1e-6)
    if impl == "native":
        xt = x.clone()
        _agree(out, _torch_impl(OPS.add_rms_norm, xt, y, w, EPS, dtype), 1e-6, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(impl, dtype):
    """The SiLU gate of a stacked gate|up product (rows with a stride beyond their width), forward in the
    dtype with the roundings of `F.silu(g) * u` (two in bf16), and its gradient through autograd."""
    g = torch.Generator().manual_seed(2)
    N, I = 9, 40
    gu = (torch.randn(N, 2 * I + 3, generator=g) * 3).to(dtype)[:, 3:]
    _runs(impl, "silu_mul", gu)
    gu_c = gu.contiguous().requires_grad_()
    torch.library.opcheck(OPS.silu_mul, (gu,))
    torch.library.opcheck(OPS.silu_mul, (gu_c,))
    m = OPS.silu_mul(gu)
    g64, u64 = gu.double().split(I, -1)
    m64 = F.silu(g64) * u64
    bf16 = dtype == torch.bfloat16
    _within(m, m64, 2 * BF16_STEP * 1.01 if bf16 else 1e-5, 1e-6)
    dm = torch.randn(N, I, generator=g).to(dtype)
    (dgu,) = torch.autograd.grad(OPS.silu_mul(gu_c), gu_c, dm)
    r = gu.double().requires_grad_()
    a, b = r.split(I, -1)
    (dgu64,) = torch.autograd.grad(F.silu(a) * b, r, dm.double())
    assert dgu.dtype == dtype
    # bf16: the product and the gradient each rounded (du: silu and the product; dg: dm u, then silu')
    _within(dgu, dgu64, 3 * BF16_STEP if bf16 else 1e-5, 1e-2 if bf16 else 1e-6)
    if impl == "native":
        _agree(m, _torch_impl(OPS.silu_mul, gu))
        _agree(dgu, _torch_impl(OPS.silu_mul_backward, gu_c.detach(), dm))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_merge(impl, dtype):
    """`w + B A` summed in fp32 and rounded once to `w`'s dtype, with a block-diagonal B (stacked
    projections) whose last rows have no LoRA term (their weight, exactly); `w` left as it was."""
    g = torch.Generator().manual_seed(3)
    O, I, r = 48, 40, 4
    w = torch.randn(O, I, generator=g).to(dtype)
    A = torch.randn(3 * r, I, generator=g) * 0.3
    B = torch.zeros(O, 3 * r)
    B[:16, :r] = torch.randn(16, r, generator=g)
    B[16:32, r: 2 * r] = torch.randn(16, r, generator=g)
    _runs(impl, "lora_merge", w, A, B)
    torch.library.opcheck(OPS.lora_merge, (w, A, B))
    before = w.clone()
    m = OPS.lora_merge(w, A, B)
    assert torch.equal(w, before) and m.dtype == dtype and torch.equal(m[32:], w[32:])
    exact = w.double() + B.double() @ A.double()
    _within(m, exact, 1e-6 if dtype == torch.float32 else BF16_STEP * 1.01, 1e-6)
    if impl == "native":
        _agree(m, _torch_impl(OPS.lora_merge, w, A, B), 1e-6, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_cast(impl, dtype):
    """The training norm and cast: the output within one rounding of float64's, `rstd` as float64's, and
    `dx` (and `dw` where the weight is trained, computed in torch on both paths) as float64 autograd's."""
    g = torch.Generator().manual_seed(4)
    N, H = 11, 48
    x = (torch.randn(N, H, generator=g) * 2).requires_grad_()
    w = torch.randn(H, generator=g)
    _runs(impl, "rms_norm_cast", x, w, EPS, dtype)
    torch.library.opcheck(OPS.rms_norm_cast, (x, w, EPS, dtype))
    torch.library.opcheck(OPS.rms_norm_cast, (x, w.clone().requires_grad_(), EPS, dtype))
    out, rstd = OPS.rms_norm_cast(x, w, EPS, dtype)
    x64, w64 = x.detach().double().requires_grad_(), w.double().requires_grad_()
    ref = _norm64(x64, w64)
    _within(out, ref.detach(), 1e-5 if dtype == torch.float32 else BF16_STEP * 1.01, 1e-6)
    _within(rstd, torch.rsqrt(x64.detach().pow(2).mean(-1) + EPS), 1e-6)
    dy = torch.randn(N, H, generator=g).to(dtype)
    (dx,) = torch.autograd.grad(out, x, dy)
    dx64, dw64 = torch.autograd.grad(ref, (x64, w64), dy.double())
    _within(dx, dx64, 1e-4, 1e-5)
    wt = w.clone().requires_grad_()
    (dw,) = torch.autograd.grad(OPS.rms_norm_cast(x, wt, EPS, dtype)[0], wt, dy)
    _within(dw, dw64, 1e-4, 1e-4)
    if impl == "native":
        o_t, r_t = _torch_impl(OPS.rms_norm_cast, x, w, EPS, dtype)
        _agree(out, o_t, 1e-6, 1e-6)
        _agree(rstd, r_t, 1e-6, 0)
        _agree(dx, _torch_impl(OPS.rms_norm_backward, x, w, rstd, dy, None), 1e-5, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_cast(impl, dtype):
    """The training residual add, norm and cast: `x + y` rounded once to fp32, `x` left as it is, the norm
    within one rounding of float64's, and the gradients of `x` and `y` (in `y`'s dtype) from both outputs."""
    g = torch.Generator().manual_seed(5)
    N, H = 11, 48
    x = (torch.randn(N, H, generator=g) * 2).requires_grad_()
    y = torch.randn(N, H, generator=g).to(dtype).requires_grad_()
    w = torch.randn(H, generator=g)
    _runs(impl, "add_rms_norm_cast", x, y, w, EPS, dtype)
    torch.library.opcheck(OPS.add_rms_norm_cast, (x, y, w, EPS, dtype))
    x_in = x.detach().clone()
    s, out, rstd = OPS.add_rms_norm_cast(x, y, w, EPS, dtype)
    x64, y64 = x.detach().double().requires_grad_(), y.detach().double().requires_grad_()
    s64 = x64 + y64
    ref = _norm64(s64, w)
    assert torch.equal(x.detach(), x_in) and torch.equal(s, s64.detach().float())
    _within(out, ref.detach(), 1e-5 if dtype == torch.float32 else BF16_STEP * 1.01, 1e-6)
    ds, dy = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g).to(dtype)
    dx, dyy = torch.autograd.grad((s, out), (x, y), (ds, dy))
    dx64, dy64 = torch.autograd.grad((s64, ref), (x64, y64), (ds.double(), dy.double()))
    _within(dx, dx64, 1e-4, 1e-5)
    assert dyy.dtype == dtype
    _within(dyy, dy64, 1e-4 if dtype == torch.float32 else BF16_STEP * 1.01, 1e-5)
    if impl == "native":
        s_t, o_t, _ = _torch_impl(OPS.add_rms_norm_cast, x, y, w, EPS, dtype)
        assert torch.equal(s, s_t)
        _agree(out, o_t, 1e-6, 1e-6)
        _agree(dx, _torch_impl(OPS.rms_norm_backward, s, w, rstd, dy, ds), 1e-5, 1e-5)


def _rope64(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 RoPE of `x` and the bound of fp32's error on it (two products and a sum, each rounded once)."""
    h = x.shape[-1] // 2
    x, c, s = x.double(), c.double(), s.double()
    rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * c + rot * s, 2 ** -23 * 2 * ((x * c).abs() + (rot * s).abs())


def _rope_t64(d: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 transpose of RoPE, `d c + [z2 | -z1]` with `z = d s`, flattened per row, and the bound of
    fp32's error on it."""
    h = d.shape[-1] // 2
    dc, z = d.double() * c.double(), d.double() * s.double()
    zt = torch.cat((z[..., h:], -z[..., :h]), -1)
    N = d.shape[0]
    return (dc + zt).reshape(N, -1), (2 ** -23 * 2 * (dc.abs() + zt.abs())).reshape(N, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qkv(impl, dtype):
    """RoPE of q and k out of a stacked q|k|v product (rows with a stride beyond their width), v as fp32:
    each within fp32's three roundings of float64's; the gradient of the stacked product from the three
    output gradients, computed in fp32 and rounded once to the product's dtype; native and torch to the
    bit both ways."""
    g = torch.Generator().manual_seed(6)
    N, nh, kv, D, ctx = 13, 6, 2, 8, 32
    cos, sin = torch.randn(ctx, D, generator=g), torch.randn(ctx, D, generator=g)
    pos = torch.randint(0, ctx, (N,), generator=g)
    qkv = torch.randn(N, (nh + 2 * kv) * D + 4, generator=g).to(dtype)[:, 4:]
    _runs(impl, "rope_qkv", qkv, pos, cos, sin, nh, kv)
    qkv_c = qkv.contiguous().requires_grad_()
    torch.library.opcheck(OPS.rope_qkv, (qkv, pos, cos, sin, nh, kv))
    torch.library.opcheck(OPS.rope_qkv, (qkv_c, pos, cos, sin, nh, kv))
    outs = OPS.rope_qkv(qkv_c, pos, cos, sin, nh, kv)
    q, k, v = qkv.split([nh * D, kv * D, kv * D], -1)
    c, s = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    for o, x in zip(outs[:2], (q.reshape(N, nh, D), k.reshape(N, kv, D))):
        ref, bound = _rope64(x, c, s)
        assert o.dtype == torch.float32 and bool(((o.double() - ref).abs() <= bound).all())
    assert outs[2].dtype == torch.float32 and torch.equal(outs[2], v.reshape(N, kv, D).float())
    grads = [torch.randn(o.shape, generator=g) for o in outs]
    (dqkv,) = torch.autograd.grad(outs, qkv_c, grads)
    parts = [_rope_t64(d, c, s) for d in grads[:2]]
    ref = torch.cat([p for p, _ in parts] + [grads[2].double().reshape(N, -1)], -1)
    bound = torch.cat([b for _, b in parts] + [torch.zeros(N, kv * D, dtype=torch.float64)], -1)
    assert dqkv.dtype == dtype
    step = BF16_STEP * 1.01 if dtype == torch.bfloat16 else 0.0
    assert bool(((dqkv.double() - ref).abs() <= bound * 1.01 + step * ref.abs()).all())
    if impl == "native":
        for a, b in zip(outs, _torch_impl(OPS.rope_qkv, qkv, pos, cos, sin, nh, kv)):
            assert torch.equal(a, b)
        assert torch.equal(dqkv, _torch_impl(OPS.rope_qkv_backward, *grads, pos, cos, sin, dtype))


@pytest.mark.parametrize("B,T,nh,kv,D", [(2, 19, 4, 2, 32), (1, 5, 2, 2, 16)])
def test_attention(impl, B, T, nh, kv, D):
    """Causal grouped-query attention in fp32 (a length off the native kernel's 16-query blocks, one query
    head per key/value head and two): the output and the three input gradients against float64 SDPA, and
    `lse` as float64's log-sum-exp of the scaled causal scores."""
    g = torch.Generator().manual_seed(B * T)
    ref = [torch.randn(B, T, h, D, generator=g, dtype=torch.float64, requires_grad=True)
           for h in (nh, kv, kv)]
    xs = [r.detach().float().requires_grad_() for r in ref]
    _runs(impl, "attention", *xs)
    torch.library.opcheck(OPS.attention, tuple(xs))
    o, lse = OPS.attention(*xs)
    o_ref = F.scaled_dot_product_attention(*(r.transpose(1, 2) for r in ref), is_causal=True,
                                           enable_gqa=True).transpose(1, 2)
    do = torch.randn(B, T, nh, D, generator=g, dtype=torch.float64)
    o_ref.backward(do)
    grads = torch.autograd.grad(o, xs, do.float())
    assert float((o.detach().double() - o_ref.detach()).abs().max()) < 1e-5
    for d, r in zip(grads, ref):
        assert float((d.double() - r.grad).abs().max()) < 1e-4 * max(1.0, float(r.grad.abs().max()))
    q64, k64 = ref[0].detach().transpose(1, 2), ref[1].detach().transpose(1, 2).repeat_interleave(nh // kv, 1)
    scores = (q64 @ k64.transpose(-1, -2)) * D ** -0.5
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    assert float((lse.double() - torch.logsumexp(scores, -1)).abs().max()) < 1e-5
    if impl == "native":
        o_t, lse_t = _torch_impl(OPS.attention, *xs)
        _agree(o.detach(), o_t)
        _agree(lse, lse_t)
        for a, b in zip(grads, _torch_impl(OPS.attention_backward, *xs, o, lse, do.float())):
            _agree(a, b, 1e-4, 1e-5)


@pytest.mark.parametrize("probs_dtype", [None, torch.float32, torch.bfloat16])
def test_softmax_target(impl, probs_dtype):
    """The training unembedding's softmax: each row's target logprob as float64's, the probabilities within
    fp32's roundings (in `logits`, overwritten) or one bf16 rounding; a width off the kernel's 16 lanes."""
    g = torch.Generator().manual_seed(7)
    logits = 6 * torch.randn(9, 1003, generator=g)
    y = torch.randint(0, logits.shape[1], (9,), generator=g)
    _runs(impl, "softmax_target", logits, y, probs_dtype)
    torch.library.opcheck(OPS.softmax_target, (logits.clone(), y, probs_dtype))
    work = logits.clone()
    lp, probs = custom_ops.softmax_target(work, y, probs_dtype)
    ref_lp = torch.log_softmax(logits.double(), -1).gather(1, y[:, None]).squeeze(1)
    _within(lp, ref_lp, 0, 2e-6)
    ref_p = torch.softmax(logits.double(), -1)
    if probs_dtype is None:
        assert probs is None
    else:
        assert probs.dtype == probs_dtype and (probs_dtype == torch.bfloat16 or probs is work)
        # fp32: the shifted logit x - max (up to ~40 here) is rounded before exp, a relative error of up to
        # |x - max| 2^-24 in the exponential, plus a few roundings
        rel = 2 ** -24 * (logits - logits.amax(-1, keepdim=True)).abs().double() + 4 * 2 ** -24
        _within(probs, ref_p, rel if probs_dtype == torch.float32 else BF16_STEP * 1.01 + rel, 1e-30)
    if impl == "native":
        lp_t, probs_t = _torch_impl(custom_ops.softmax_target, logits, y, probs_dtype)
        _agree(lp, lp_t, 0, 2e-6)
        if probs is not None:
            _agree(probs, probs_t, 1e-6, 1e-9)
    with pytest.raises(ValueError, match="probabilities"):
        custom_ops.softmax_target(logits.clone(), y, torch.float16)


def test_the_switch_and_the_capability_checks():
    """`use_native` turns the native kernels off and on again (returning the previous setting); inputs a
    kernel does not take run the torch implementation (here: fp16, a width past the row kernels' bound);
    fake tensors give the ops' shapes without running a kernel."""
    x, w = torch.randn(3, 8), torch.randn(8)
    before = custom_ops.use_native(False)
    try:
        assert not custom_ops.native_enabled() and not custom_ops.fits_native("rms_norm_cast", x, w, EPS,
                                                                                torch.float32)
    finally:
        assert custom_ops.use_native(before) is False
    assert custom_ops.native_enabled() == (kernels.library() is not None)
    gu16 = torch.randn(2, 16).half()
    assert not custom_ops.fits_native("silu_mul", gu16)
    assert torch.equal(OPS.silu_mul(gu16), F.silu(gu16[:, :8]) * gu16[:, 8:])
    wide = torch.randn(2, 2 * (kernels.MAX_INTERMEDIATE + 1))
    assert not custom_ops.fits_native("silu_mul", wide)
    with torch.device("meta"):
        q, k = torch.empty(2, 7, 4, 32), torch.empty(2, 7, 2, 32)
        o, lse = OPS.attention(q, k, k)
        out, rstd = OPS.rms_norm_cast(torch.empty(5, 8), torch.empty(8), EPS, torch.bfloat16)
    assert o.shape == q.shape and lse.shape == (2, 4, 7)
    assert out.shape == (5, 8) and out.dtype == torch.bfloat16 and rstd.shape == (5,)


def test_a_compiled_graph_runs_the_ops_on_either_implementation(monkeypatch):
    """`torch.compile` (fullgraph, AOT autograd) traces the ops through their fakes and their registered
    autograd; the implementation is chosen inside the op at run time, so one compiled graph follows the
    switch, forward and backward, with eager's results."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 32, generator=g).requires_grad_()
    y = torch.randn(6, 32, generator=g).bfloat16().requires_grad_()
    w = torch.randn(32, generator=g)
    gu = torch.randn(6, 64, generator=g).bfloat16().requires_grad_()

    def f(x, y, gu):
        s, h, _ = OPS.add_rms_norm_cast(x, y, w, EPS, torch.bfloat16)
        return s.sum() + h.float().square().sum() + OPS.silu_mul(gu).float().sum()

    calls = []
    native_gate = kernels.silu_mul
    monkeypatch.setattr(kernels, "silu_mul", lambda t: calls.append(1) or native_gate(t))
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for use in ([True, False] if kernels.library() is not None else [False]):
        with custom_ops.native(use):
            want = f(x, y, gu)
            calls.clear()
            got = compiled(x, y, gu)
            assert torch.equal(got, want) and len(calls) == int(use)
            for a, b in zip(torch.autograd.grad(got, (x, y, gu)), torch.autograd.grad(want, (x, y, gu))):
                assert torch.equal(a, b)
