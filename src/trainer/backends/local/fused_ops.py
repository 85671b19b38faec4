"""The training forward's element-wise steps as autograd functions on the native row kernels (`kernels.c`):
RMSNorm with its cast to the projection dtype, RoPE of q and k out of the stacked q|k|v product, and the
SiLU gate out of the stacked gate|up product.

Why: in torch each of these is several passes over `[rows, width]` tensors, forward and backward (the
norm: square, mean, rsqrt, two products, a cast; RoPE: a concatenation, a negation, two products and a sum
per tensor, plus the split of q|k|v and the concatenation of its gradient; the gate: SiLU, a product, and
their backward, plus the concatenation of the gate and up gradients), and at a micro-batch of about a
thousand rows these passes cost about as much as the layer products. Here each step is one pass per row
each way, computing what the torch ops compute (`tests/test_kernels.py` checks them against autograd).

`usable` says where they run: the native library is here, the activation is SiLU, the widths fit the row
kernels, and the norm weights are frozen (LoRA training); elsewhere `train_forward` runs the torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from trainer.backends.local import kernels


def usable(act_name: str, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether the training forward's element-wise steps run on the native kernels here
    (`kernels.row_kernels`)."""
    return kernels.row_kernels(act_name, dtype, hidden, intermediate)


class NormCast(torch.autograd.Function):
    """`rms_norm(x, w, eps).to(dtype)` for the fp32 residual stream `x_NH` and a frozen fp32 `w`."""

    @staticmethod
    def forward(ctx: Any, x_NH: torch.Tensor, w_H: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
        x_NH = x_NH.contiguous()
        rstd_N = torch.empty(x_NH.shape[0])
        out = kernels.residual_rms_norm(x_NH, None, w_H, eps, dtype, rstd_N)
        ctx.save_for_backward(x_NH, w_H, rstd_N)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy_NH: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        x_NH, w_H, rstd_N = ctx.saved_tensors
        return kernels.rms_norm_backward(x_NH, w_H, rstd_N, dy_NH.contiguous()), None, None, None


class AddNormCast(torch.autograd.Function):
    """`(x + y, rms_norm(x + y, w, eps).to(dtype))` for the fp32 residual stream `x_NH`, a layer product's output
    `y_NH` (bf16 or fp32) and a frozen fp32 `w`: the residual add in the norm's pass, forward, and in the
    backward the residual's gradient added in the norm gradient's pass."""

    @staticmethod
    def forward(ctx: Any, x_NH: torch.Tensor, y_NH: torch.Tensor, w_H: torch.Tensor, eps: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x_NH = x_NH.contiguous()
        s_NH, rstd_N = torch.empty_like(x_NH), torch.empty(x_NH.shape[0])
        out = kernels.residual_rms_norm(x_NH, y_NH, w_H, eps, dtype, rstd_N, s_NH)
        ctx.save_for_backward(s_NH, w_H, rstd_N)
        ctx.y_dtype = y_NH.dtype
        return s_NH, out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, ds_NH: torch.Tensor, dy_NH: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None, None, None]:
        s_NH, w_H, rstd_N = ctx.saved_tensors  # both output gradients arrive (autograd materializes unused ones)
        dx = kernels.rms_norm_backward(s_NH, w_H, rstd_N, dy_NH.contiguous(), ds_NH)
        return dx, dx.to(ctx.y_dtype), None, None, None


class RopeQKV(torch.autograd.Function):
    """fp32 `(rope(q), rope(k), v)`, each `[N, heads, D]`, of a stacked q|k|v product `qkv_NC` at positions
    `pos_N`: `model.rope` on fp32 tables, and `v.float()`. Its backward writes the gradient of the
    stacked product directly (no split, no concatenation)."""

    @staticmethod
    def forward(ctx: Any, qkv_NC: torch.Tensor, pos_N: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                n_heads: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(pos_N, cos, sin)
        ctx.dtype = qkv_NC.dtype
        return kernels.rope_qkv(qkv_NC, pos_N, cos, sin, n_heads, n_kv)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor
                 ) -> tuple[torch.Tensor, None, None, None, None, None]:
        pos_N, cos, sin = ctx.saved_tensors
        return kernels.rope_qkv_backward(dq, dk, dv, pos_N, cos, sin, ctx.dtype), None, None, None, None, None


class SiluMul(torch.autograd.Function):
    """`F.silu(g) * u` of a stacked gate|up product `gu_NC = [g | u]`, in its dtype."""

    @staticmethod
    def forward(ctx: Any, gu_NC: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gu_NC)
        return kernels.silu_mul(gu_NC)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dm_NI: torch.Tensor) -> torch.Tensor:
        (gu_NC,) = ctx.saved_tensors
        return kernels.silu_mul_backward(gu_NC, dm_NI.contiguous())


class Attention(torch.autograd.Function):
    """Causal grouped-query attention of right-padded sequences in fp32 (`kernels.attention_forward`):
    `q [B, T, heads, D]`, `k`, `v [B, T, kv, D]` -> `[B, T, heads, D]`, what `F.scaled_dot_product_attention(...,
    is_causal=True, enable_gqa=True)` computes on the transposed layout, up to summation order."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        o, lse = kernels.attention_forward(q, k, v)
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.attention_backward(*ctx.saved_tensors, do)
