"""The engine's native kernels (`kernels.py`) as torch custom ops in the `pairedrl` namespace
(`torch.ops.pairedrl.<op>`), each with a torch implementation and, where the library is built and the
inputs fit the kernel, the native one.

Ops (schemas: `torch.ops.pairedrl.<op>.default._schema`; shapes as in `kernels.py`):

- sampler (inference, no autograd): `add_rms_norm(x!, y?, w, eps, dtype)` (`x += y` in place, then
  `rms_norm(x, w, eps).to(dtype)`), `silu_mul(gu)`, `lora_merge(w, A, B)`;
- training (autograd through `torch.library.register_autograd`; the backward of each is an op too):
  `rms_norm_cast(x, w, eps, dtype) -> (out, rstd)`, `add_rms_norm_cast(x, y, w, eps, dtype) -> (x + y, out,
  rstd)`, `rope_qkv(qkv, pos, cos, sin, n_heads, n_kv) -> (q, k, v)`, `silu_mul(gu)`,
  `attention(q, k, v) -> (o, lse)`; backwards `rms_norm_backward`, `rope_qkv_backward`, `silu_mul_backward`,
  `attention_backward`;
- the training unembedding's `softmax_target(logits!, y, probs_dtype?) -> (logprob, probs)`.

`rstd` and `lse` are outputs only so the backward can use them (they get no gradient); `softmax_target`
overwrites `logits` (with fp32 probabilities where `probs_dtype` is fp32, which its `probs` output then is
not: an op's output may not alias an input, so `probs` is empty there and `softmax_target()` below hands
back `logits`). The sampler's decode attention (`kernels.decode_layer_attention`, with its KV-cache layout
and cache writes) and the AMX products (`BlockedLinear`, `BlockedHead`, `DecodeLayers`, which hold packed
weights and ctypes pointers) are not ops here.

Choosing the implementation: each op has one registered implementation, which per call runs the native
kernel when `use_native` is on (the default), `kernels.library()` is built (not `PAIREDRL_NATIVE_KERNELS=0`,
a compiler is there) and the inputs pass the op's capability check (dtypes, layout, sizes within the
kernel's bounds; the training attention and the softmax also need AVX-512, as in the engine), else the
torch ops. Why a switch inside the op rather than a torch implementation registered as the default and the
native one registered for CPU once at import (`register_kernel("cpu", ...)`): a registered kernel cannot
be taken back (only registered over), and the engine and its tests need both paths in one process (the torch
path's numbers differ from the native ones, and `PAIREDRL_NATIVE_KERNELS=0` runs are compared with native
ones); a native kernel also fits only some inputs, so a per-call check is needed either way. The choice
happens at run time inside the op, so a `torch.compile`d graph (the op is opaque to it) follows
`use_native` too. `register_fake` gives every op its output shapes, so `torch.library.opcheck`, meta
tensors and `torch.compile` work without running a kernel.

API: the ops (`torch.ops.pairedrl.<op>`, or the functions below of the same names); `use_native(enabled)`
(process-wide, returns the previous setting) and the `native(enabled)` block; `native_enabled()`;
`fits_native(op, *args)`, whether a call runs the native kernel; `softmax_target()`, `kernels.py`'s interface.
Cost: the `custom_op` layer (its autograd wrapper, dispatch, output checks) adds ~10-30 us per call
(`bench/custom_ops.py`): nothing at a training micro-batch, 2-4x the kernel itself at decode's few rows.

The torch implementations compute what the engine's torch path computes, to the bit where that path has
the same ops (the norms through `aten._fused_rms_norm`, which is `F.rms_norm`; the gate through `F.silu` and
`aten.silu_backward`; RoPE as `model.rope`); the norm's backward is its formula from the saved `rstd`, in
fp32 (torch's own runs inside autograd only); the training attention runs torch's CPU
flash kernel, the one `F.scaled_dot_product_attention` picks there, with the key/value heads repeated
for grouped queries.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from trainer.backends.local import kernels
from trainer.backends.local.model import rms_norm, rope

_native = True
_F32_BF16 = (torch.float32, torch.bfloat16)


def use_native(enabled: bool) -> bool:
    """Whether the ops may run the native kernels (where built and the inputs fit); returns the previous
    setting. Off: every op runs its torch implementation."""
    global _native
    before, _native = _native, bool(enabled)
    return before


def native_enabled() -> bool:
    """Whether the ops run the native kernels where they fit: `use_native` on and the library built."""
    return _native and kernels.library() is not None


@contextlib.contextmanager
def native(enabled: bool) -> Iterator[None]:
    """`use_native(enabled)` inside the block, the previous setting after it."""
    before = use_native(enabled)
    try:
        yield
    finally:
        use_native(before)


def _rows(t: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _F32_BF16) -> bool:
    return t.dim() == 2 and t.dtype in dtypes and t.stride(-1) == 1


def _fp32_vector(w: torch.Tensor, n: int) -> bool:
    return w.dtype == torch.float32 and w.shape == (n,) and w.is_contiguous()


# -- the residual add and the norm (sampler) --------------------------------------------------------------


def _norm_fits(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, dtype: torch.dtype) -> bool:
    if not (x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous() and dtype in _F32_BF16):
        return False
    B, H = x.shape
    return (1 <= H <= kernels.MAX_HIDDEN and _fp32_vector(w, H)
            and (y is None or (_rows(y) and y.shape == (B, H))))


@torch.library.custom_op("pairedrl::add_rms_norm", mutates_args=("x",))
def add_rms_norm(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float, dtype: torch.dtype
                 ) -> torch.Tensor:
    """`x += y` on the fp32 residual stream `x [B, H]` (y bf16 or fp32, or None: no add), then
    `rms_norm(x, w, eps)` (fp32 `w`) in `dtype` (`kernels.residual_rms_norm`)."""
    if native_enabled() and _norm_fits(x, y, w, dtype):
        return kernels.residual_rms_norm(x, y, w, eps, dtype)
    if y is not None:
        x.add_(y)
    return rms_norm(x, w, eps).to(dtype)


@add_rms_norm.register_fake
def _(x, y, w, eps, dtype):
    return x.new_empty(x.shape, dtype=dtype)


# -- the SiLU gate (sampler and training) ------------------------------------------------------------------


def _gate_fits(gu: torch.Tensor) -> bool:
    return _rows(gu) and gu.shape[1] % 2 == 0 and 1 <= gu.shape[1] // 2 <= kernels.MAX_INTERMEDIATE


@torch.library.custom_op("pairedrl::silu_mul", mutates_args=())
def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """`F.silu(g) * u` of a stacked gate|up product `gu = [g | u]` (`[N, 2 I]`), in its dtype."""
    if native_enabled() and _gate_fits(gu):
        return kernels.silu_mul(gu)
    g, u = gu.split(gu.shape[-1] // 2, dim=-1)
    return F.silu(g) * u


@silu_mul.register_fake
def _(gu):
    return gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2)


@torch.library.custom_op("pairedrl::silu_mul_backward", mutates_args=())
def silu_mul_backward(gu: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """`d gu` (`gu`'s dtype and shape) of `silu_mul(gu)` from the gradient `dm` of its output: the
    roundings of torch's autograd through `F.silu(g) * u`."""
    if (native_enabled() and _gate_fits(gu) and gu.is_contiguous() and dm.dtype == gu.dtype and dm.dim() == 2
            and dm.stride(-1) == 1 and dm.shape == (gu.shape[0], gu.shape[1] // 2)):
        return kernels.silu_mul_backward(gu, dm)
    g, u = gu.split(gu.shape[-1] // 2, dim=-1)
    dm = dm.to(gu.dtype)
    return torch.cat([torch.ops.aten.silu_backward(dm * u, g), dm * F.silu(g)], -1)


@silu_mul_backward.register_fake
def _(gu, dm):
    return torch.empty_like(gu, memory_format=torch.contiguous_format)


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_mul_bwd(ctx, dm):
    (gu,) = ctx.saved_tensors
    return silu_mul_backward(gu, dm.contiguous())


silu_mul.register_autograd(_silu_mul_bwd, setup_context=_silu_mul_setup)


# -- the LoRA merge (sampler weights) ----------------------------------------------------------------------


def _lora_fits(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> bool:
    O, I = w.shape
    R = A.shape[0]
    return (w.dtype in _F32_BF16 and w.is_contiguous() and A.dtype == B.dtype == torch.float32
            and A.shape == (R, I) and B.shape == (O, R) and 1 <= I <= kernels.MAX_INTERMEDIATE)


@torch.library.custom_op("pairedrl::lora_merge", mutates_args=())
def lora_merge(w: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """`w + B A` in `w`'s dtype (`w [O, I]` bf16 or fp32, `A [r, I]`, `B [O, r]`), summed in fp32 and rounded
    once: `torch.addmm(w.float(), B, A).to(w.dtype)`; a new tensor."""
    if native_enabled() and _lora_fits(w, A, B):
        return kernels.lora_merge(w, A, B)
    return torch.addmm(w.float(), B.float(), A.float()).to(w.dtype)


@lora_merge.register_fake
def _(w, A, B):
    return torch.empty_like(w, memory_format=torch.contiguous_format)


# -- the norms of the training forward, with autograd ------------------------------------------------------


def _torch_norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """`F.rms_norm(x, w, eps).to(dtype)` (the same bits: `aten._fused_rms_norm` is what it runs) and fp32
    rstd."""
    out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, eps)
    return out.to(dtype), rstd.reshape(x.shape[0]).float()


@torch.library.custom_op("pairedrl::rms_norm_cast", mutates_args=())
def rms_norm_cast(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x, w, eps).to(dtype), rstd)` of the fp32 residual stream `x [N, H]` with fp32 `w`;
    `rstd [N]` fp32 (`rsqrt(mean(x^2) + eps)`), kept for the backward (no gradient flows through it)."""
    if native_enabled() and _norm_fits(x, None, w, dtype):
        rstd = torch.empty(x.shape[0])
        return kernels.residual_rms_norm(x, None, w, eps, dtype, rstd), rstd
    return _torch_norm(x, w, eps, dtype)


@rms_norm_cast.register_fake
def _(x, w, eps, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[0], dtype=torch.float32)


@torch.library.custom_op("pairedrl::add_rms_norm_cast", mutates_args=())
def add_rms_norm_cast(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(x + y, rms_norm(x + y, w, eps).to(dtype), rstd)` for the fp32 residual stream `x [N, H]`, a layer
    product's output `y` (bf16 or fp32) and fp32 `w`; `x` is left as it is."""
    if native_enabled() and _norm_fits(x, y, w, dtype):
        s, rstd = torch.empty_like(x), torch.empty(x.shape[0])
        out = kernels.residual_rms_norm(x, y, w, eps, dtype, rstd, s)
        return s, out, rstd
    s = x + y
    return (s, *_torch_norm(s, w, eps, dtype))


@add_rms_norm_cast.register_fake
def _(x, y, w, eps, dtype):
    return (torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape, dtype=dtype),
            x.new_empty(x.shape[0], dtype=torch.float32))


@torch.library.custom_op("pairedrl::rms_norm_backward", mutates_args=())
def rms_norm_backward(x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
                      add: torch.Tensor | None) -> torch.Tensor:
    """fp32 `dx` of `rms_norm(x, w)` (fp32 `x [N, H]`, fp32 `w`, the forward's `rstd [N]`) from `dy` (bf16 or
    fp32), plus `add` (`[N, H]`) where given."""
    N, H = x.shape
    if (native_enabled() and x.dtype == torch.float32 and x.is_contiguous() and _fp32_vector(w, H)
            and _fp32_vector(rstd, N) and _rows(dy) and dy.shape == (N, H) and 1 <= H <= kernels.MAX_HIDDEN):
        return kernels.rms_norm_backward(x, w, rstd, dy, add)
    r = rstd.reshape(N, 1)
    xhat, g = x * r, dy.float() * w
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx if add is None else dx + add.float()


@rms_norm_backward.register_fake
def _(x, w, rstd, dy, add):
    return x.new_empty(x.shape, dtype=torch.float32)


def _norm_weight_grad(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """`d w` of `rms_norm(x, w)`: the kernels take a frozen weight (LoRA training); a trained one gets its
    gradient here, in torch."""
    return (dy.float() * x * rstd.unsqueeze(-1)).sum(0)


def _rms_norm_cast_setup(ctx, inputs, output):
    x, w, _, _ = inputs
    ctx.save_for_backward(x, w, output[1])
    ctx.mark_non_differentiable(output[1])


def _rms_norm_cast_bwd(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx = rms_norm_backward(x, w, rstd, dy.contiguous(), None) if ctx.needs_input_grad[0] else None
    dw = _norm_weight_grad(x, rstd, dy) if ctx.needs_input_grad[1] else None
    return dx, dw, None, None


rms_norm_cast.register_autograd(_rms_norm_cast_bwd, setup_context=_rms_norm_cast_setup)


def _add_rms_norm_cast_setup(ctx, inputs, output):
    _, y, w, _, _ = inputs
    ctx.save_for_backward(output[0], w, output[2])
    ctx.mark_non_differentiable(output[2])
    ctx.y_dtype = y.dtype


def _add_rms_norm_cast_bwd(ctx, ds, dy, _drstd):
    s, w, rstd = ctx.saved_tensors
    dx = rms_norm_backward(s, w, rstd, dy.contiguous(), ds)
    dw = _norm_weight_grad(s, rstd, dy) if ctx.needs_input_grad[2] else None
    return dx, dx.to(ctx.y_dtype), dw, None, None


add_rms_norm_cast.register_autograd(_add_rms_norm_cast_bwd, setup_context=_add_rms_norm_cast_setup)


# -- RoPE of the stacked q|k|v product (training) ----------------------------------------------------------


def _tables_fit(cos: torch.Tensor, sin: torch.Tensor) -> bool:
    D = cos.shape[-1]
    return (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape and cos.dim() == 2 and 2 <= D <= kernels.MAX_HEAD_DIM and D % 2 == 0)


def _rope_fits(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
               n_kv: int) -> bool:
    return (_rows(qkv) and _tables_fit(cos, sin) and qkv.shape[1] == (n_heads + 2 * n_kv) * cos.shape[-1]
            and pos.shape == qkv.shape[:1])


@torch.library.custom_op("pairedrl::rope_qkv", mutates_args=())
def rope_qkv(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
             n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `(rope(q), rope(k), v)` (`[N, heads, D]` each, contiguous) of a stacked q|k|v product
    `qkv [N, (n_heads + 2 n_kv) D]` (bf16 or fp32) at positions `pos [N]` (integer), as `model.rope` on fp32
    tables `cos`, `sin [ctx, D]`. A position outside the tables raises (native) or indexes out of range."""
    if native_enabled() and _rope_fits(qkv, pos, cos, sin, n_heads, n_kv):
        return kernels.rope_qkv(qkv, pos, cos, sin, n_heads, n_kv)
    N, D = qkv.shape[0], cos.shape[-1]
    q, k, v = qkv.split([n_heads * D, n_kv * D, n_kv * D], -1)
    c, s = cos[pos].unsqueeze(1).float(), sin[pos].unsqueeze(1).float()
    return (rope(q.reshape(N, n_heads, D), c, s), rope(k.reshape(N, n_kv, D), c, s),
            v.reshape(N, n_kv, D).to(torch.float32, copy=True))


@rope_qkv.register_fake
def _(qkv, pos, cos, sin, n_heads, n_kv):
    N, D = qkv.shape[0], cos.shape[-1]
    return (qkv.new_empty(N, n_heads, D, dtype=torch.float32), qkv.new_empty(N, n_kv, D, dtype=torch.float32),
            qkv.new_empty(N, n_kv, D, dtype=torch.float32))


def _rope_back(d: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The transpose of `model.rope` (`x c + rot(x) s`, `rot(x) = [-x2 | x1]`): `d c + [z2 | -z1]`,
    `z = d s`."""
    h = d.shape[-1] // 2
    z = d * s
    return d * c + torch.cat((z[..., h:], -z[..., :h]), dim=-1)


@torch.library.custom_op("pairedrl::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, pos: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`d qkv` (`[N, (nh + 2 kv) D]` in `dtype`) of `rope_qkv` from the gradients of its three outputs,
    computed in fp32 and rounded once."""
    N, D = dq.shape[0], dq.shape[-1]
    if native_enabled() and dtype in _F32_BF16 and _tables_fit(cos, sin) and cos.shape[1] == D:
        return kernels.rope_qkv_backward(dq, dk, dv, pos, cos, sin, dtype)
    c, s = cos[pos].unsqueeze(1).float(), sin[pos].unsqueeze(1).float()
    parts = (_rope_back(dq.float(), c, s), _rope_back(dk.float(), c, s), dv.float())
    return torch.cat([p.reshape(N, -1) for p in parts], -1).to(dtype)


@rope_qkv_backward.register_fake
def _(dq, dk, dv, pos, cos, sin, dtype):
    N, nh, D = dq.shape
    return dq.new_empty(N, (nh + 2 * dk.shape[1]) * D, dtype=dtype)


def _rope_qkv_setup(ctx, inputs, output):
    qkv, pos, cos, sin, _, _ = inputs
    ctx.save_for_backward(pos, cos, sin)
    ctx.dtype = qkv.dtype


def _rope_qkv_bwd(ctx, dq, dk, dv):
    pos, cos, sin = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, pos, cos, sin, ctx.dtype), None, None, None, None, None


rope_qkv.register_autograd(_rope_qkv_bwd, setup_context=_rope_qkv_setup)


# -- causal grouped-query attention (training) -------------------------------------------------------------


def _attention_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    return (q.dim() == k.dim() == 4 and k.shape == v.shape and k.shape[:2] == q.shape[:2]
            and k.shape[3] == q.shape[3] and kernels.native_attention(q.shape[3], q.shape[2], k.shape[2])
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (q, k, v)))


def _heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`q`, `k`, `v` in SDPA's `[B, heads, T, D]` layout, the key/value heads repeated for their query
    group."""
    G = q.shape[2] // k.shape[2]
    return (q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1),
            v.transpose(1, 2).repeat_interleave(G, 1))


@torch.library.custom_op("pairedrl::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal grouped-query attention, fp32, scale `D^-0.5`: `q [B, T, heads, D]`, `k`, `v [B, T, kv, D]` ->
    `(o [B, T, heads, D], lse [B, heads, T])`; `lse` (the log-sum-exp of each query's scaled scores) is
    kept for the backward (no gradient flows through it)."""
    if native_enabled() and _attention_fits(q, k, v):
        return kernels.attention_forward(q, k, v)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*_heads(q, k, v), 0.0, True)
    return o.transpose(1, 2).contiguous(), lse.contiguous()


@attention.register_fake
def _(q, k, v):
    B, T, nh, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(B, nh, T)


@torch.library.custom_op("pairedrl::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
                       do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(dq, dk, dv)` of `attention` from the gradient `do` of its output `o` (`lse`: its second output)."""
    if native_enabled() and _attention_fits(q, k, v):
        return kernels.attention_backward(q, k, v, o, lse, do)
    B, T, kv, D = k.shape
    G = q.shape[2] // kv
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.float().transpose(1, 2), *_heads(q, k, v), o.transpose(1, 2), lse, 0.0, True)

    def grouped(d: torch.Tensor) -> torch.Tensor:  # the repeated heads' gradients summed per key/value head
        return d.reshape(B, kv, G, T, D).sum(2).transpose(1, 2).contiguous()

    return dq.transpose(1, 2).contiguous(), grouped(dk), grouped(dv)


@attention_backward.register_fake
def _(q, k, v, o, lse, do):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _attention_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)
    ctx.mark_non_differentiable(output[1])


def _attention_bwd(ctx, do, _dlse):
    return attention_backward(*ctx.saved_tensors, do.contiguous())


attention.register_autograd(_attention_bwd, setup_context=_attention_setup)


# -- the training unembedding's softmax --------------------------------------------------------------------


def _softmax_fits(logits: torch.Tensor, y: torch.Tensor, probs_dtype: torch.dtype | None) -> bool:
    return (kernels.avx512() and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.is_contiguous() and y.shape == logits.shape[:1])


@torch.library.custom_op("pairedrl::softmax_target", mutates_args=("logits",))
def softmax_target_op(logits: torch.Tensor, y: torch.Tensor, probs_dtype: torch.dtype | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(log softmax(logits)[y] per row, probs)` of fp32 `logits [R, V]` (contiguous), `y [R]` integer.
    `logits` is overwritten: with the fp32 probabilities where `probs_dtype` is fp32 (then `probs` is
    empty), else with something unspecified; `probs`: the probabilities in bf16 where `probs_dtype` is
    bf16, empty where it is None or fp32. Use `softmax_target()`, which returns the probabilities."""
    if native_enabled() and _softmax_fits(logits, y, probs_dtype):
        lp, probs = kernels.softmax_target(logits, y, probs_dtype)
        return lp, (probs if probs_dtype == torch.bfloat16 else logits.new_empty(0))
    target = logits.gather(1, y.long()[:, None]).squeeze(1)
    top = logits.amax(-1, keepdim=True)
    z = logits.sub_(top).exp_().sum(-1, keepdim=True)  # logits now hold exp(logits - top)
    lp = target - (top + z.log()).squeeze(1)
    logits.div_(z)
    return lp, (logits.to(torch.bfloat16) if probs_dtype == torch.bfloat16 else logits.new_empty(0))


@softmax_target_op.register_fake
def _(logits, y, probs_dtype):
    R, V = logits.shape
    bf16 = probs_dtype == torch.bfloat16
    probs = logits.new_empty(R, V, dtype=torch.bfloat16) if bf16 else logits.new_empty(0)
    return logits.new_empty(R), probs


def softmax_target(logits: torch.Tensor, y: torch.Tensor, probs_dtype: torch.dtype | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kernels.softmax_target`'s interface on the op: `(logprob [R], probs in probs_dtype or None)`, where
    fp32 probabilities are `logits` itself, overwritten."""
    if probs_dtype not in (None, torch.float32, torch.bfloat16):
        raise ValueError(f"softmax_target: probabilities in {probs_dtype}, expected None, fp32 or bf16")
    lp, probs = softmax_target_op(logits, y, probs_dtype)
    return lp, None if probs_dtype is None else logits if probs_dtype == torch.float32 else probs


# each op's capability check on its arguments (its backward runs native where its forward did)
_CHECKS = {
    "add_rms_norm": lambda x, y, w, eps, dtype: _norm_fits(x, y, w, dtype),
    "rms_norm_cast": lambda x, w, eps, dtype: _norm_fits(x, None, w, dtype),
    "add_rms_norm_cast": lambda x, y, w, eps, dtype: _norm_fits(x, y, w, dtype),
    "silu_mul": _gate_fits,
    "lora_merge": _lora_fits,
    "rope_qkv": _rope_fits,
    "attention": _attention_fits,
    "softmax_target": _softmax_fits,
}


def fits_native(name: str, *args: object) -> bool:
    """Whether `torch.ops.pairedrl.<name>(*args)` runs the native kernel now: `use_native` on, the library
    built, and the op's capability check passes on these arguments."""
    return native_enabled() and bool(_CHECKS[name](*args))
