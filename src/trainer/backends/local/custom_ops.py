"""The training forward's native row kernels (`kernels.c`) as torch custom ops, `torch.ops.pairedrl.<op>`:
the norm with its cast (`rms_norm_cast`; `add_rms_norm_cast` with the residual add in the norm's pass),
RoPE of q and k out of the stacked q|k|v product (`rope_qkv`) and the SiLU gate (`silu_mul`). Each has its
backward registered (`register_autograd`; the backward is one native pass as well and an op of its own) and
its output shapes (`register_fake`), so autograd, `torch.library.opcheck`, meta tensors and `torch.compile`
see them as ops.

An op's implementation is the native kernel only. The torch implementation of the same step is the torch
variant in `ops.py`, the default wherever the plan does not choose the kernel (`TrainPlan.train_rows`), so
an op never decides per call which one runs.

Why the sampler's row kernels and decode attention are called directly instead: at decode's few rows a
call through torch's dispatcher into a custom op costs about 8-14 us, two to four times the kernel itself,
and a decode step makes about 90 of them (`bench/custom_ops.py`); at a training micro-batch's ~1000 rows
the same cost is lost in the kernel's time.
"""

from __future__ import annotations

import torch

from trainer.backends.local import kernels

# ------------------------------------------------------------------------------------------ the norm


@torch.library.custom_op("pairedrl::rms_norm_cast", mutates_args=())
def rms_norm_cast(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x, w, eps).to(dtype), rstd)` of the fp32 residual stream `x [N, H]` (contiguous) with a
    frozen fp32 `w`; `rstd [N]` (`rsqrt(mean(x^2) + eps)`) is kept for the backward."""
    rstd = torch.empty(x.shape[0])
    return kernels.residual_rms_norm(x, None, w, eps, dtype, rstd), rstd


@rms_norm_cast.register_fake
def _(x, w, eps, dtype):
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[0])


@torch.library.custom_op("pairedrl::add_rms_norm_cast", mutates_args=())
def add_rms_norm_cast(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(x + y, rms_norm(x + y, w, eps).to(dtype), rstd)` for the fp32 residual stream `x` (contiguous), a
    layer product's output `y` (bf16 or fp32) and a frozen fp32 `w`; `x` is left as it is."""
    s, rstd = torch.empty_like(x), torch.empty(x.shape[0])
    return s, kernels.residual_rms_norm(x, y, w, eps, dtype, rstd, s), rstd


@add_rms_norm_cast.register_fake
def _(x, y, w, eps, dtype):
    return torch.empty_like(x), x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape[0])


@torch.library.custom_op("pairedrl::rms_norm_backward", mutates_args=())
def rms_norm_backward(x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor,
                      add: torch.Tensor | None) -> torch.Tensor:
    """fp32 `dx` of `rms_norm(x, w)` from `dy`, plus `add` (the residual stream's own gradient) where given."""
    return kernels.rms_norm_backward(x, w, rstd, dy.contiguous(), add)


@rms_norm_backward.register_fake
def _(x, w, rstd, dy, add):
    return torch.empty_like(x)


def _norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], output[1])
    ctx.mark_non_differentiable(output[1])


def _norm_backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    return rms_norm_backward(x, w, rstd, dy, None), None, None, None


def _add_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(output[0], inputs[2], output[2])  # x + y: the norm's input
    ctx.mark_non_differentiable(output[2])
    ctx.y_dtype = inputs[1].dtype


def _add_norm_backward(ctx, ds, dy, _drstd):
    s, w, rstd = ctx.saved_tensors
    dx = rms_norm_backward(s, w, rstd, dy, ds)
    return dx, dx.to(ctx.y_dtype), None, None, None


rms_norm_cast.register_autograd(_norm_backward, setup_context=_norm_setup)
add_rms_norm_cast.register_autograd(_add_norm_backward, setup_context=_add_norm_setup)

# ------------------------------------------------------------------------------------------- RoPE


@torch.library.custom_op("pairedrl::rope_qkv", mutates_args=())
def rope_qkv(qkv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
             n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `(rope(q), rope(k), v)` (`[N, heads, D]` each) of a stacked q|k|v product at positions `pos`,
    as `model.rope` on fp32 tables; its backward writes the stacked product's gradient directly."""
    return kernels.rope_qkv(qkv, pos, cos, sin, n_heads, n_kv)


@rope_qkv.register_fake
def _(qkv, pos, cos, sin, n_heads, n_kv):
    N, D = qkv.shape[0], cos.shape[-1]
    return (qkv.new_empty(N, n_heads, D, dtype=torch.float32), qkv.new_empty(N, n_kv, D, dtype=torch.float32),
            qkv.new_empty(N, n_kv, D, dtype=torch.float32))


@torch.library.custom_op("pairedrl::rope_qkv_backward", mutates_args=())
def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`d qkv` in `dtype` from the gradients of `rope_qkv`'s outputs (computed in fp32, rounded once)."""
    return kernels.rope_qkv_backward(dq, dk, dv, pos, cos, sin, dtype)


@rope_qkv_backward.register_fake
def _(dq, dk, dv, pos, cos, sin, dtype):
    N, nh, D = dq.shape
    return dq.new_empty(N, (nh + 2 * dk.shape[1]) * D, dtype=dtype)


def _rope_setup(ctx, inputs, output):
    qkv, pos, cos, sin = inputs[:4]
    ctx.save_for_backward(pos, cos, sin)
    ctx.dtype = qkv.dtype


def _rope_backward(ctx, dq, dk, dv):
    pos, cos, sin = ctx.saved_tensors
    return rope_qkv_backward(dq, dk, dv, pos, cos, sin, ctx.dtype), None, None, None, None, None


rope_qkv.register_autograd(_rope_backward, setup_context=_rope_setup)

# ---------------------------------------------------------------------------------- the SiLU gate


@torch.library.custom_op("pairedrl::silu_mul", mutates_args=())
def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """`F.silu(g) * u` of a stacked gate|up product `gu = [g | u]`, in its dtype."""
    return kernels.silu_mul(gu)


@silu_mul.register_fake
def _(gu):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.custom_op("pairedrl::silu_mul_backward", mutates_args=())
def silu_mul_backward(gu: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """`d gu` of `silu_mul(gu)` from `dm`, with the roundings of torch's autograd through it."""
    return kernels.silu_mul_backward(gu, dm.contiguous())


@silu_mul_backward.register_fake
def _(gu, dm):
    return gu.new_empty(gu.shape)


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _gate_backward(ctx, dm):
    return silu_mul_backward(ctx.saved_tensors[0], dm)


silu_mul.register_autograd(_gate_backward, setup_context=_gate_setup)
