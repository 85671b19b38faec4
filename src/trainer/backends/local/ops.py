"""The engine's ops between its layer products, each with a torch implementation and, where the plan
(`plan.SamplerPlan`, `plan.TrainPlan`) says so, a native one (`kernels.py`; the training forms as custom ops
with their backward, `custom_ops.py`): one op table for the sampler and one for the training forward, built
once from its side's plan, so the model code (`sampler_forward.py`, `train_forward.py`,
`sampler_weights.py`) calls `ops.add_norm(...)` and never asks which runs.

The two implementations of an op compute the same function in a different summation order (the native
kernels document their roundings beside each); the plan fixes which one a run uses, so its bits do not
depend on anything asked later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from trainer.backends.local import custom_ops, kernels
from trainer.backends.local.model import rms_norm, rope
from trainer.backends.local.plan import SamplerPlan, TrainPlan

# the dtype of attention, and of the KV cache on the torch path (see `sampler_forward`)
ATTN_DTYPE = torch.float32
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------------------------------------- shared
def add_norm_torch(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + y` (the previous product's output added to the fp32 residual stream; None: none yet) and its
    RMSNorm (fp32 weights) cast to `dtype`."""
    x = x if y is None else x + y
    return x, rms_norm(x, w, eps).to(dtype)


def add_norm_native(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm_torch` in one native pass per row, `x` updated in place."""
    return x, kernels.residual_rms_norm(x, y, w, eps, dtype)


def gate_torch(gu: torch.Tensor, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`act(gate) * up` of a stacked gate|up product."""
    g, u = gu.split(intermediate, dim=-1)
    return act(g) * u


def gate_native(gu: torch.Tensor, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`gate_torch` for SiLU on the native row kernel (the plan checked the activation)."""
    return kernels.silu_mul(gu)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hd: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of a stacked q|k|v output (`[rows, (nh + 2 nkv) hd]`) rotated together in one RoPE (they
    are adjacent, and the rotation is per head), in fp32 (fp32 tables); v as is.
    Returns q `[rows, nh, hd]`, k `[rows, nkv, hd]`, v `[rows, nkv, hd]`."""
    rows = qkv.shape[0]
    qk = rope(qkv[:, : (nh + nkv) * hd].view(rows, nh + nkv, hd), cos, sin)
    return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd:].view(rows, nkv, hd)


def decode_attention(q_BKGD: torch.Tensor, k_BKND: torch.Tensor, v_BKND: torch.Tensor) -> torch.Tensor:
    """Softmax attention of `q` (`[rows, kv heads, queries, head_dim]`) over all `N` cached positions, as
    `softmax(q k^T / sqrt(d)) v` in two batched products. Each (row, head) is its own small matrix
    product whose kernel depends only on (queries, N, head_dim), so a row's result does not depend on
    the rows beside it (unlike the fused SDPA kernel, see `sampler_forward`); at decode shapes it is as
    fast as that kernel."""
    s = torch.matmul(q_BKGD, k_BKND.transpose(-1, -2)).mul_(q_BKGD.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(s, -1), v_BKND)


# ---------------------------------------------------------------------------------------- sampler
def _attention_torch(W: Any, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                     length: int) -> Attend:
    """One decode step's attention on torch ops: from a layer's q|k|v output, RoPE of q and k at `pos_B`,
    k and v written into the fp32 cache of rotated keys (`length` positions per row), attention per span
    of rows of equal length; `[B, n_heads * head_dim]` in the sampler dtype. The step's rotary rows and
    cache indices are formed once here for every layer."""
    B = pos_B.shape[0]
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    g = nh // nkv
    cos = W.cos[pos_B].view(B, 1, hd)
    sin = W.sin[pos_B].view(B, 1, hd)
    # row r's kv head h is written at flat cache row (r * nkv + h) * length + pos_B[r] of the cache viewed
    # as [rows * nkv * length, hd]: one index_copy_ per cache tensor, the same indices for every layer
    at = ((torch.arange(B).unsqueeze(1) * nkv + torch.arange(nkv)) * length + pos_B.unsqueeze(1)).view(-1)

    def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        q, k, v = rope_qk(qkv, cos, sin, nh, nkv, hd)
        kc.view(-1, hd).index_copy_(0, at, k.reshape(B * nkv, hd))
        vc.view(-1, hd).index_copy_(0, at, v.reshape(B * nkv, hd).to(ATTN_DTYPE))
        # GQA without repeating K/V: q head h uses kv head h // g, so group the g query heads of one
        # kv head as g "positions" of a single-query attention over that head's cache.
        qg = q.reshape(B, nkv, g, hd)
        a = torch.cat([decode_attention(qg[r0:r1], kc[r0:r1, :, :n], vc[r0:r1, :, :n])
                       for r0, r1, n in spans]) if len(spans) > 1 else \
            decode_attention(qg, kc[:, :, : spans[0][2]], vc[:, :, : spans[0][2]])
        return a.reshape(B, nh * hd).to(W.dtype)
    return attend


def _attention_native(W: Any, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                      length: int) -> Attend:
    """One decode step's attention on the native kernel: one task per (row, key/value head), over the
    row's own cache length; the cache holds keys before RoPE in the sampler dtype, rotated as read."""
    def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return kernels.decode_layer_attention(qkv, W.cos, W.sin, kc, vc, pos_B, W.n_heads)
    return attend


def _prefill_keys_raw(qkv_rows: torch.Tensor, k_rotated: torch.Tensor, nh: int, nkv: int, hd: int) -> torch.Tensor:
    """What a prompt's rows put in the native kernel's cache: keys before RoPE, in the sampler dtype."""
    n = qkv_rows.shape[0]
    return qkv_rows[:, nh * hd: (nh + nkv) * hd].view(n, nkv, hd).transpose(0, 1)


def _prefill_keys_rotated(qkv_rows: torch.Tensor, k_rotated: torch.Tensor, nh: int, nkv: int, hd: int
                          ) -> torch.Tensor:
    """What a prompt's rows put in the torch path's cache: the rotated fp32 keys."""
    return k_rotated


def _no_tiles(w: torch.Tensor) -> None:
    return None


@dataclass(frozen=True)
class SamplerOps:
    """The sampler's ops under one plan (see the module docstring)."""

    plan: SamplerPlan
    cache_dtype: torch.dtype  # of the KV cache (`new_cache`)
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    gate: Callable[..., torch.Tensor]
    attention: Callable[..., Attend]  # `(W, pos_B, spans, length) -> attend(qkv, k_cache, v_cache)`
    prefill_keys: Callable[..., torch.Tensor]  # a prompt's keys as its cache holds them
    tiles: Callable[[torch.Tensor], Any]  # a bf16 weight's AMX copy (`kernels.BlockedLinear`) or None
    pack: bool  # decode products on oneDNN-packed copies
    pack_head: bool  # the fp32 unembedding packed too


def sampler_ops(plan: SamplerPlan) -> SamplerOps:
    native = plan.decode_attention
    return SamplerOps(
        plan=plan, cache_dtype=plan.sampler_dtype if native else ATTN_DTYPE,
        add_norm=add_norm_native if plan.sampler_rows else add_norm_torch,
        gate=gate_native if plan.sampler_rows else gate_torch,
        attention=_attention_native if native else _attention_torch,
        prefill_keys=_prefill_keys_raw if native else _prefill_keys_rotated,
        tiles=kernels.blocked_linear if plan.amx_projections else _no_tiles,
        pack=plan.onednn_packing, pack_head=plan.packed_head)


# ------------------------------------------------------------------------------------ training
def _train_add_norm_native(x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, eps: float,
                           dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_norm_torch` with autograd, on the native kernels in one pass each way (frozen norm weights)."""
    if y is None:
        return x, custom_ops.rms_norm_cast(x, w, eps, dt)[0]
    s, out, _ = custom_ops.add_rms_norm_cast(x, y, w, eps, dt)
    return s, out


def _train_rope_torch(pos_N: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hd: int
                      ) -> Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, ...]]:
    """RoPE of q and k out of a stacked q|k|v product at the packed rows' positions (the rotary rows formed
    once per forward, for every layer); v in q's dtype."""
    cos_N, sin_N = cos[pos_N].unsqueeze(1), sin[pos_N].unsqueeze(1)  # [N, 1, hd]

    def qkv_split(qkv: torch.Tensor, outs: Sequence[int]) -> tuple[torch.Tensor, ...]:
        q, k, v = rope_qk(qkv, cos_N, sin_N, nh, nkv, hd)
        return q, k, v.to(q.dtype)
    return qkv_split


def _train_rope_native(pos_N: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nh: int, nkv: int, hd: int
                       ) -> Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, ...]]:
    """`_train_rope_torch` on the native kernels (fp32 tables: fp32 q and k; v in fp32 for attention)."""
    def qkv_split(qkv: torch.Tensor, outs: Sequence[int]) -> tuple[torch.Tensor, ...]:
        return custom_ops.rope_qkv(qkv, pos_N, cos, sin, nh, nkv)
    return qkv_split


def _train_gate_native(gu: torch.Tensor, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor]
                       ) -> torch.Tensor:
    return custom_ops.silu_mul(gu)


@dataclass(frozen=True)
class TrainOps:
    """The training forward's ops under one plan (see the module docstring)."""

    plan: TrainPlan
    add_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rope: Callable[..., Callable[[torch.Tensor, Sequence[int]], tuple[torch.Tensor, ...]]]
    gate: Callable[..., torch.Tensor]

    def with_trainable_norms(self) -> TrainOps:
        """These ops where the norm weights train (a full fine-tune, the peft reference): the native
        element-wise steps have no gradient for them, so those run on torch ops."""
        return TrainOps(self.plan, add_norm_torch, _train_rope_torch, gate_torch)


def train_ops(plan: TrainPlan) -> TrainOps:
    rows = plan.train_rows
    return TrainOps(
        plan=plan, add_norm=_train_add_norm_native if rows else add_norm_torch,
        rope=_train_rope_native if rows else _train_rope_torch,
        gate=_train_gate_native if rows else gate_torch)
