"""The training forward of the local engine: the Llama block (`model.py`) over packed token rows, LoRA
folded into each projection's GEMM, and a prompt shared by several datums computed once.

Why not call the peft-wrapped HF model (`bench/train_forward.py` times both):
- peft adds LoRA as `base(x) + lora_B(lora_A(x)) * scaling`, i.e. a multiply and an add over every
  `[rows, out]` projection output, and their backward; here `torch.addmm(x W^T, x A^T, B^T, alpha=s)`
  puts both inside the GEMM.
- rows are packed without padding, so no GEMM row goes to padding.
- a GRPO group's G samples start with the same prompt: its rows are computed once, every sample's
  completion attends to them, and autograd sums the samples' gradients into them (exact, not an
  approximation: the prompt's activations do not depend on what follows it).
- q|k|v and gate|up run as one GEMM each over stacked weights (shared with the fp32 sampler), and
  LoRA projections use a hand-written backward (`LoraLinear`) that forms the factor gradients as
  `du^T x` / `u^T dy` instead of autograd's `x^T du` / `dy^T u` (same numbers, in the GEMM shapes
  MKL runs fast at these skinny sizes).

Numerics are those of transformers 5.5 `models/llama/modeling_llama.py` (the same helpers as the
sampler, from `model.py`: fp32 RMSNorm then cast, `rotate_half` RoPE from the model's rotary tables,
SDPA with scale head_dim^-0.5, SiLU-gated MLP) and of peft 0.21 `tuners/lora/layer.py::Linear.forward`
(`y = W x + (alpha / r) B A x`, no dropout); tests check logprobs and LoRA gradients against the peft
model's own forward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from trainer.backends.local.model import (EMBED, FINAL_NORM, Layer, dims, fuse_base, layer, layer_names,
                                          onednn_linear, onednn_pack, weight)
from trainer.backends.local.ops import TrainOps


@dataclass
class Packing:
    """Where every datum's positions live among the packed rows.

    Attention runs per datum over its own positions (`idx_BT`: its rows, right-padded), so it keeps the
    plain causal kernel; a shared prompt row's attention output is taken from its first datum."""

    ids_N: torch.Tensor  # long [N] token of each packed row
    pos_N: torch.Tensor  # long [N] its position in its sequence (RoPE)
    rows: list[torch.Tensor]  # datum i -> long [len_i]: the packed row of each of its positions
    idx_BT: torch.Tensor  # long [B, T]: datum b's rows, padded with row 0 (right padding: never attended)
    out_idx: torch.Tensor  # long [N]: the slot (b * T + t) whose attention output packed row n takes
    shared_rows: int  # rows not recomputed thanks to sharing


def pack(seqs: Sequence[Sequence[int]], share: Sequence[int]) -> Packing:
    """Pack `seqs`; consecutive datums with the same `share[i] = c > 0` and identical first `c` tokens
    (a group's prompt: the tokens before the first loss position) share those rows."""
    ids: list[int] = []
    pos: list[int] = []
    rows: list[list[int]] = [[] for _ in seqs]
    owner: list[tuple[int, int]] = []  # packed row -> (datum, position) computing its attention output
    saved, i, n = 0, 0, len(seqs)
    while i < n:
        c, j = int(share[i]), i + 1
        head = list(seqs[i][:c])
        if 0 < c <= len(seqs[i]):
            while j < n and int(share[j]) == c and len(seqs[j]) >= c and list(seqs[j][:c]) == head:
                j += 1
        c = c if j - i >= 2 else 0  # nothing to share: the whole sequence is the datum's own
        pre = list(range(len(ids), len(ids) + c))
        ids += head[:c]
        pos += range(c)
        owner += [(i, t) for t in range(c)]
        for d in range(i, j):
            L = len(seqs[d])
            rows[d] = pre + list(range(len(ids), len(ids) + L - c))
            ids += list(seqs[d][c:])
            pos += range(c, L)
            owner += [(d, t) for t in range(c, L)]
        saved += (j - i - 1) * c
        i = j
    T = max(len(s) for s in seqs)
    idx = torch.zeros(len(seqs), T, dtype=torch.long)
    for d, r in enumerate(rows):
        idx[d, : len(r)] = torch.tensor(r, dtype=torch.long)
    out_idx = torch.tensor([d * T + t for d, t in owner], dtype=torch.long)
    return Packing(torch.tensor(ids, dtype=torch.long), torch.tensor(pos, dtype=torch.long),
                   [torch.tensor(r, dtype=torch.long) for r in rows], idx, out_idx, saved)


Lora = dict[str, tuple[torch.Tensor, torch.Tensor]]
# the unembedding's base product: plain (None), a oneDNN-packed weight, or the AMX head kernel's weights
# (`kernels.BlockedHead`, anything with `.logits(h)`)
Head = Any




# a frozen weight `W [out, in]` packed for oneDNN twice: for `x W^T` and, as `W^T`, for the backward's
# `dy W` (`pack_weight`)
Packed = tuple[torch.Tensor, torch.Tensor]
# the row count training products are packed for (a micro-batch holds ~1000-2000 packed rows)
TRAIN_PACK_ROWS = 1024


def pack_weight(w: torch.Tensor) -> Packed:
    """`w` and its transpose reordered for oneDNN products of training size (needs `ONEDNN_PACKING`)."""
    return onednn_pack(w, TRAIN_PACK_ROWS), onednn_pack(w.t().contiguous(), TRAIN_PACK_ROWS)


class PackedLinear(torch.autograd.Function):
    """`x W^T` for a frozen, packed `W`: forward and input gradient both on oneDNN's packed kernel."""

    @staticmethod
    def forward(ctx: Any, x_NI: torch.Tensor, fwd: torch.Tensor, bwd: torch.Tensor) -> torch.Tensor:
        ctx.bwd = bwd
        return onednn_linear(x_NI, fwd)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy_NO: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return onednn_linear(dy_NO.contiguous(), ctx.bwd), None, None


def linear(x: torch.Tensor, w: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None,
           scale: float, packed: Packed | None = None) -> torch.Tensor:
    """`x W^T + scale (x A^T) B^T`, the LoRA term accumulated by the GEMM itself. With a frozen `W`, one
    dtype and no autocast this is `LoraLinear` (its backward in fast GEMM shapes); otherwise plain
    autograd through the ops below. `packed`: `pack_weight(W)`, whose products then run on oneDNN's
    packed kernel (same dtype as `x` only; used on that fast path)."""
    fast = not torch.is_autocast_enabled("cpu") and not w.requires_grad
    packed = packed if fast and packed is not None and packed[0].dtype == x.dtype else None
    if lora is None:
        if packed is not None:
            return PackedLinear.apply(x.reshape(-1, x.shape[-1]), *packed).view(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)
    A, B = lora
    if fast and x.dtype == w.dtype and A.dtype != w.dtype:  # bf16 compute, fp32 LoRA parameters
        A, B = A.to(w.dtype), B.to(w.dtype)
    if fast and x.dtype == w.dtype == A.dtype == B.dtype:
        return LoraLinear.apply(x.reshape(-1, x.shape[-1]), w, A, B, scale, packed).view(*x.shape[:-1], w.shape[0])
    y = F.linear(x, w)
    u, Bt = F.linear(x, A), B.t()
    if u.dtype != y.dtype or Bt.dtype != y.dtype:  # under bf16 autocast the in-place op is not cast for us
        u, Bt = u.to(y.dtype), Bt.to(y.dtype)
    # in place: the base GEMM's output is not saved for its backward, and addmm (out of place) would
    # first copy it
    return y.addmm_(u, Bt, alpha=scale)


class LoraLinear(torch.autograd.Function):
    """`x W^T + s (x A^T) B^T` (W frozen) with a hand-written backward whose products have the shapes
    MKL runs fast. Autograd's own backward of `F.linear(x, W).addmm_(x A^T, B^T)` forms the LoRA
    gradients as `x^T du` and `dy^T u` ([in, N] x [N, r] and [out, N] x [N, r]: long reductions into a
    skinny output), which MKL runs several times slower than `du^T x` and `u^T dy`, the same numbers.
    `A` [R, in] and `B` [out, R] may stack several projections' factors (B block-diagonal). `packed`:
    `pack_weight(W)`, the base products `x W^T` and `dy W` then on oneDNN's packed kernel."""

    @staticmethod
    def forward(ctx: Any, x_NI: torch.Tensor, W_OI: torch.Tensor, A_RI: torch.Tensor, B_OR: torch.Tensor,
                scale: float, packed: Packed | None = None) -> torch.Tensor:
        u_NR = F.linear(x_NI, A_RI)
        base = F.linear(x_NI, W_OI) if packed is None else onednn_linear(x_NI, packed[0])
        y_NO = base.addmm_(u_NR, B_OR.t(), alpha=scale)
        ctx.save_for_backward(x_NI, W_OI, A_RI, B_OR, u_NR)
        ctx.scale, ctx.packed = scale, packed
        return y_NO

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dy_NO: torch.Tensor) -> tuple[torch.Tensor | None, None, torch.Tensor | None,
                                                          torch.Tensor | None, None, None]:
        x_NI, W_OI, A_RI, B_OR, u_NR = ctx.saved_tensors
        s = ctx.scale
        dy_NO = dy_NO.contiguous()
        du_NR = torch.mm(dy_NO, B_OR).mul_(s)
        dx = None
        if ctx.needs_input_grad[0]:
            base = torch.mm(dy_NO, W_OI) if ctx.packed is None else onednn_linear(dy_NO, ctx.packed[1])
            dx = base.addmm_(du_NR, A_RI)
        dA = torch.mm(du_NR.t(), x_NI) if ctx.needs_input_grad[2] else None
        dB = torch.mm(u_NR.t(), dy_NO).t().mul_(s) if ctx.needs_input_grad[3] else None
        return dx, None, dA, dB, None, None


def stacked_linear(x: torch.Tensor, w: torch.Tensor, outs: Sequence[int],
                   loras: Sequence[tuple[torch.Tensor, torch.Tensor] | None], scale: float,
                   packed: Packed | None = None) -> torch.Tensor:
    """`linear` for projections of the same input stacked into one weight `w` (their `outs` rows in
    order: q|k|v, gate|up): one GEMM with more columns instead of several narrow ones. With a LoRA on
    every projection (the engine's targets come in these groups) their factors are stacked (A rows
    concatenated, B block-diagonal) into one `linear`; a mixed stack splits back into projections (and
    runs unpacked). `packed`: `pack_weight(w)` of the whole stack."""
    x2 = x.reshape(-1, x.shape[-1])
    if all(lr is None for lr in loras):
        y = linear(x2, w, None, scale, packed)
    elif any(lr is None for lr in loras):
        y = torch.cat([linear(x2, wi, lr, scale) for wi, lr in zip(w.split(list(outs), 0), loras)], -1)
    else:
        A = loras[0][0] if len(loras) == 1 else torch.cat([lr[0] for lr in loras], 0)
        B = loras[0][1] if len(loras) == 1 else torch.block_diag(*[lr[1] for lr in loras])
        y = linear(x2, w, (A, B), scale, packed)
    return y.view(*x.shape[:-1], w.shape[0])


def _attend(q_NhD: torch.Tensor, k_NhD: torch.Tensor, v_NhD: torch.Tensor, pk: Packing) -> torch.Tensor:
    """Causal attention of every datum over its own rows (`pk.idx_BT`), fp32, on torch's SDPA; each packed
    row's output taken from the datum that owns it."""
    B, T = pk.idx_BT.shape
    nh, nkv, hd = q_NhD.shape[1], k_NhD.shape[1], q_NhD.shape[2]
    idx = pk.idx_BT.view(-1)  # index_select: its backward (index_add) beats advanced indexing's
    q = q_NhD.index_select(0, idx).view(B, T, nh, hd)
    k = k_NhD.index_select(0, idx).view(B, T, nkv, hd)
    v = v_NhD.index_select(0, idx).view(B, T, nkv, hd)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=nkv != nh).transpose(1, 2)
    return o.reshape(B * T, nh * hd).index_select(0, pk.out_idx)


def forward(config: Any, base: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, lora: Lora,
            scale: float, pk: Packing, fused: dict[str, torch.Tensor] | None = None,
            dtype: torch.dtype = torch.float32, packed: dict[str, Packed] | None = None, *,
            ops: TrainOps) -> torch.Tensor:
    """Final-normed hidden states `[N, H]` of the packed rows. `base`: the frozen weights under HF names;
    `lora`: HF module name -> (A [r, in], B [out, r]) parameters (their gradients accumulate); `fused`:
    `fuse_base(config, base)` (built here when not given).

    `dtype`: the precision of the projections (`base`'s projection weights and `fused` must be in it). In
    bf16 this is what `torch.autocast` would do to the fp32 model (bf16 GEMMs, fp32 residual stream,
    norms and RoPE in fp32), without casting a weight per call and with LoRA kept on `LoraLinear`'s
    backward; attention runs in fp32, whose CPU flash backward is several times faster than bf16's at
    these short sequences (and more exact). `packed`: weight key (as in `base` / `fused`) -> `pack_weight`
    of it, for the projections to run on oneDNN's packed kernel (`SharedBase.packed_projections`). `ops`:
    the element-wise steps and attention, from the plan the caller was given (`SharedBase.train_ops`)."""
    d = dims(config)
    nh, nkv, hd, inter = d.n_heads, d.n_kv, d.head_dim, d.intermediate
    fused = fused if fused is not None else fuse_base(config, base)

    def lin(x: torch.Tensor, key: str, outs: Sequence[int], names: Sequence[str]) -> torch.Tensor:
        w = fused[key] if key in fused else base[key]
        return stacked_linear(x, w, outs, [lora.get(n) for n in names], scale, (packed or {}).get(key))

    if any(base[weight(k)].requires_grad for i in range(d.n_layers)
           for k in (layer_names(i).input_norm, layer_names(i).post_norm)):
        ops = ops.with_trainable_norms()

    qkv_split = ops.rope(pk.pos_N, cos, sin, nh, nkv, hd)

    def attend(qkv: torch.Tensor) -> torch.Tensor:
        return _attend(*qkv_split(qkv, d.qkv_outs), pk).to(dtype)

    x = F.embedding(pk.ids_N, base[weight(EMBED)])
    y = None  # the previous product's output, not yet added to x
    for n in map(layer_names, range(d.n_layers)):
        L = Layer(base[weight(n.input_norm)], base[weight(n.post_norm)],
                  qkv=functools.partial(lin, key=n.stacked_qkv, outs=d.qkv_outs, names=n.qkv),
                  o=functools.partial(lin, key=weight(n.o), outs=(d.hidden,), names=[n.o]),
                  gate_up=functools.partial(lin, key=n.stacked_gate_up, outs=(inter, inter), names=n.gate_up),
                  down=functools.partial(lin, key=weight(n.down), outs=(d.hidden,), names=[n.down]))
        x, y = layer(x, y, L, attend, ops, d, dtype)
    return ops.add_norm(x, y, base[weight(FINAL_NORM)], d.eps, torch.float32)[1]


# rows per unembedding block: its [rows, vocab] fp32 logits (25 MB at SmolLM2's 49152) stay below
# glibc's 32 MB mmap threshold, so blocks reuse heap memory; a whole [rows, vocab] logits tensor would
# be mapped afresh for every update, and its copies and zero-fills are a visible share of one
UNEMBED_ROWS = 128


def unembed_block(h_NH: torch.Tensor, W_VH: torch.Tensor, packed: Head,
                  lora: tuple[torch.Tensor, torch.Tensor] | None = None, scale: float = 1.0,
                  u_NR: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 logits `h W^T (+ s (h A^T) B^T)` of one row block: the base product on oneDNN's packed kernel
    when `packed` is a packed tensor, on the AMX head kernel when it is a `kernels.BlockedHead`, the LoRA
    term accumulated into it (`u_NR`: `h A^T` when already formed). Every unembedding path computes its
    logits here, so they agree to the bit."""
    if packed is None:
        logits = F.linear(h_NH, W_VH)
    elif isinstance(packed, torch.Tensor):
        logits = onednn_linear(h_NH, packed)
    else:
        logits = packed.logits(h_NH)
    if lora is not None:
        A_RH, B_VR = lora
        logits.addmm_(F.linear(h_NH, A_RH) if u_NR is None else u_NR, B_VR.t(), alpha=scale)
    return logits


class _TargetLogprob(torch.autograd.Function):
    """`log softmax(h W^T)[y]` per row, in row blocks. d/dh = W[y] - softmax(h W^T) W is formed in the
    forward while a block's logits are at hand, so the backward only scales it: no [rows, vocab] tensor
    outlives its block (the FLOPs are those of the usual forward + backward). `grad_packed`: `Wg^T`
    packed for oneDNN (`pack_unembed_grad`), which runs the `[rows, vocab] x [vocab, H]` product ~1.5x
    (bf16) to ~2.3x (fp32) as fast as the plain addmm (`bench/gemm.py`, "unembed grad")."""

    @staticmethod
    def forward(ctx: Any, h_NH: torch.Tensor, W_VH: torch.Tensor, y_N: torch.Tensor,
                packed: Head, Wg_VH: torch.Tensor, grad_packed: torch.Tensor | None) -> torch.Tensor:
        need = ctx.needs_input_grad[0]
        N = h_NH.shape[0]
        out_N = h_NH.new_empty(N)
        dh_NH = torch.empty_like(h_NH) if need else None
        for a in range(0, N, UNEMBED_ROWS):
            b = min(N, a + UNEMBED_ROWS)
            logits = unembed_block(h_NH[a:b], W_VH, packed)
            target = logits.gather(1, y_N[a:b, None]).squeeze(1)
            top = logits.amax(-1, keepdim=True)
            z = logits.sub_(top).exp_().sum(-1, keepdim=True)  # logits now hold exp(logits - top)
            out_N[a:b] = target - (top + z.log()).squeeze(1)
            probs = logits.div_(z).to(Wg_VH.dtype) if need else None
            if need:
                if grad_packed is None:
                    dh_NH[a:b] = torch.addmm(Wg_VH.index_select(0, y_N[a:b]), probs, Wg_VH, alpha=-1)
                else:  # the product rounded once to the gradient dtype, the difference taken in fp32
                    dh_NH[a:b] = Wg_VH.index_select(0, y_N[a:b])
                    dh_NH[a:b].sub_(onednn_linear(probs, grad_packed))
        if need:
            ctx.save_for_backward(dh_NH)
        return out_N

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_N: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        (dh_NH,) = ctx.saved_tensors
        return g_N.unsqueeze(1) * dh_NH, None, None, None, None, None


class _TargetLogprobLora(torch.autograd.Function):
    """`log softmax(h W^T + s (h A^T) B^T)[y]` per row, in row blocks, with a LoRA (`A [r, H]`, `B [vocab, r]`)
    on the unembedding. The factor gradients sum over rows with each row's upstream gradient inside the
    sum (`dB = s sum_n g_n (onehot(y_n) - p_n) u_n^T`), so they cannot be formed in the forward the way
    `_TargetLogprob` forms d/dh; the backward recomputes each block's logits instead (one more unembedding
    product per block) and never holds a `[rows, vocab]` tensor beyond its block. With
    `d_n = g_n (onehot(y_n) - p_n)`: `dh = d W + (s d B) A`, `dB = s d^T u`, `dA = (s d B)^T h`."""

    @staticmethod
    def forward(ctx: Any, h_NH: torch.Tensor, A_RH: torch.Tensor, B_VR: torch.Tensor, W_VH: torch.Tensor,
                y_N: torch.Tensor, scale: float, packed: Head, Wg_VH: torch.Tensor,
                grad_packed: torch.Tensor | None) -> torch.Tensor:
        N = h_NH.shape[0]
        u_NR = F.linear(h_NH, A_RH)
        out_N, lse_N = h_NH.new_empty(N), h_NH.new_empty(N)
        for a in range(0, N, UNEMBED_ROWS):
            b = min(N, a + UNEMBED_ROWS)
            logits = unembed_block(h_NH[a:b], W_VH, packed, (A_RH, B_VR), scale, u_NR[a:b])
            target = logits.gather(1, y_N[a:b, None]).squeeze(1)
            top = logits.amax(-1, keepdim=True)
            lse_N[a:b] = (top + logits.sub_(top).exp_().sum(-1, keepdim=True).log()).squeeze(1)
            out_N[a:b] = target - lse_N[a:b]
        if any(ctx.needs_input_grad[:3]):
            ctx.save_for_backward(h_NH, A_RH, B_VR, u_NR, y_N, lse_N)
            ctx.W_VH, ctx.scale, ctx.packed, ctx.Wg_VH, ctx.grad_packed = W_VH, scale, packed, Wg_VH, grad_packed
        return out_N

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, g_N: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h_NH, A_RH, B_VR, u_NR, y_N, lse_N = ctx.saved_tensors
        s, Wg_VH = ctx.scale, ctx.Wg_VH
        dh_NH, dA_RH = torch.empty_like(h_NH), torch.zeros_like(A_RH)
        dB_RV = B_VR.new_zeros(B_VR.shape[1], B_VR.shape[0])  # dB^T: the wide [r, vocab] product is the fast one
        for a in range(0, h_NH.shape[0], UNEMBED_ROWS):
            b = min(h_NH.shape[0], a + UNEMBED_ROWS)
            logits = unembed_block(h_NH[a:b], ctx.W_VH, ctx.packed, (A_RH, B_VR), s, u_NR[a:b])
            g = g_N[a:b].unsqueeze(1)
            d = logits.sub_(lse_N[a:b, None]).exp_().mul_(-g)  # -g p
            d.scatter_add_(1, y_N[a:b, None], g)  # + g onehot(y)
            dg = d.to(Wg_VH.dtype)
            dh_NH[a:b] = torch.mm(dg, Wg_VH) if ctx.grad_packed is None else onednn_linear(dg, ctx.grad_packed)
            du = torch.mm(d, B_VR).mul_(s)  # [rows, r]
            dh_NH[a:b].addmm_(du, A_RH)
            dB_RV.addmm_(u_NR[a:b].t(), d, alpha=s)
            dA_RH.addmm_(du.t(), h_NH[a:b])
        return dh_NH, dA_RH, dB_RV.t().contiguous(), None, None, None, None, None, None


def pack_unembed(W_VH: torch.Tensor) -> torch.Tensor | None:
    """The fp32 unembedding pre-packed for oneDNN at `UNEMBED_ROWS` rows (None without oneDNN): MKL
    sgemm is slow on that wide, shallow product, oneDNN's packed kernel is not (the layer GEMMs gain
    nothing from packing; `bench/gemm.py`). Only where the plan packs (`TrainPlan.onednn_packing`)."""
    if W_VH.dtype != torch.float32:
        return None
    return onednn_pack(W_VH, UNEMBED_ROWS)


def pack_unembed_grad(Wg_VH: torch.Tensor) -> torch.Tensor | None:
    """`Wg^T` (`[H, vocab]`, any dtype) pre-packed for the logprob gradient's `probs Wg` product at
    `UNEMBED_ROWS` rows (only where the plan packs)."""
    return onednn_pack(Wg_VH.t().contiguous(), UNEMBED_ROWS)


@torch.no_grad()
def target_logprobs_and_entropy(h_NH: torch.Tensor, W_VH: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None,
                                scale: float, y_N: torch.Tensor, packed: Head = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of `y_N[n]`, exact entropy of row n's next-token distribution), fp32, in row blocks and
    without gradients: H = log Z - sum_v softmax_v * (l_v - max l). Kept off the training path (it costs
    one more pass over each [rows, vocab] block); the no-grad `forward` uses it. `packed`: as in
    `target_logprobs` (the same logits as the training path's)."""
    h_NH = h_NH.float()
    N = h_NH.shape[0]
    lp_N, ent_N = h_NH.new_empty(N), h_NH.new_empty(N)
    for a in range(0, N, UNEMBED_ROWS):
        b = min(N, a + UNEMBED_ROWS)
        shifted = unembed_block(h_NH[a:b], W_VH, packed, lora, scale)
        shifted = shifted - shifted.amax(-1, keepdim=True)
        e = shifted.exp()
        z = e.sum(-1)
        lp_N[a:b] = shifted.gather(1, y_N[a:b, None]).squeeze(1) - z.log()
        ent_N[a:b] = z.log() - (e * shifted).sum(-1) / z
    return lp_N, ent_N


def target_logprobs(h_NH: torch.Tensor, W_VH: torch.Tensor, lora: tuple[torch.Tensor, torch.Tensor] | None,
                    scale: float, y_N: torch.Tensor, packed: Head = None,
                    grad_weight: torch.Tensor | None = None, grad_packed: torch.Tensor | None = None) -> torch.Tensor:
    """Logprob of target `y_N[n]` under row n's next-token distribution, in fp32 (`packed`: the
    `pack_unembed(W_VH)` copy). `grad_weight`: `W_VH` in the precision of the backward (bf16 training:
    the `[rows, vocab] x [vocab, H]` gradient product then runs as fast as the layers' GEMMs, while the
    logits, whose rounding would show in the logprobs, stay fp32); `grad_packed`: `pack_unembed_grad` of
    that weight (the gradient product then runs on oneDNN's packed kernel). A LoRA on the unembedding (fp32
    factors) runs `_TargetLogprobLora`; a trainable `W_VH` the plain logits + cross-entropy path."""
    h_NH = h_NH.float()
    Wg_VH = W_VH if grad_weight is None else grad_weight
    if W_VH.requires_grad or (lora is not None and lora[0].dtype != torch.float32):
        return -F.cross_entropy(linear(h_NH, W_VH, lora, scale), y_N, reduction="none")
    if lora is None:
        return _TargetLogprob.apply(h_NH, W_VH, y_N, packed, Wg_VH, grad_packed)
    return _TargetLogprobLora.apply(h_NH, lora[0], lora[1], W_VH, y_N, scale, packed, Wg_VH, grad_packed)
