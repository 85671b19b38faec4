"""The sampler's weights: the base fused into stacked projections in the sampler dtype (the unembedding
in fp32), packed for oneDNN, and one snapshot's LoRA merged into re-packed copies (or kept as unmerged
factors where oneDNN is missing).

Why pack: decode products have only as many rows as the batch, a shape where plain `F.linear` is slow;
oneDNN with the weight pre-packed for that row count runs the same product faster: in fp32 (MKL sgemm
unpacked) with the widest gain on the vocabulary-wide unembedding, and in bf16 on AMX, where unpacked
bf16 weights are reordered into AMX tiles on every call (`bench/gemm.py` measures plain and packed).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from trainer.backends.local.model import (EMBED, FINAL_NORM, UNEMBED, Layer, check_architecture, dims,
                                          fuse_base, layer_names, matmul_inputs, onednn_linear, onednn_pack,
                                          unembed_weight, weight)
from trainer.backends.local.ops import SamplerOps
from trainer.backends.local.quant import fake_quant

# decode batches up to this many rows use the packed oneDNN weights; above it sgemm is as fast
PACKED_MAX_ROWS = 256
# Rows per GEMM call wherever rows of different requests share one product (decode steps and the first
# token's logits). The row count alone can change a row's result: MKL sgemm gives M = 1, 2-3 and >= 4
# rows three different results, and oneDNN's bf16 unembedding switches kernels above 32 rows.
# Fixed-shape blocks make each request's numbers independent of the batch it ran in.
ROW_BLOCK = 32
# the row count the packed decode weights are reordered for
_PACK_ROWS = 32


@dataclass
class Projection:
    """A bias-free projection: the plain weight `[out, in]`, on oneDNN builds a copy pre-packed for
    small-row (decode) products, and an optional unmerged LoRA (`y += (x A^T) B^T`, scale in B). A bf16
    projection on an AMX CPU has the tiles' blocked copy instead of the oneDNN one (`amx`,
    `kernels.BlockedLinear`): the same bits at decode's 32-row blocks, at less cost per call.

    With packed (or blocked) weights a snapshot's LoRA is merged (`W + s B A`) and re-packed once (`w` is
    then None: the packed copy serves every row count): one merge per snapshot costs less than the
    unmerged rank-r products over a generate. Without packing the LoRA stays unmerged and its term is
    accumulated by the GEMM."""

    w: torch.Tensor | None
    packed: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None  # [R, in]
    lora_b: torch.Tensor | None = None  # [out, R], scale folded in
    amx: Any = None  # `kernels.BlockedLinear`

    @property
    def out_features(self) -> int:
        if self.amx is not None:
            return self.amx.out_features
        return int((self.w if self.w is not None else self.packed).shape[0])

    def blocked(self, x: torch.Tensor, block: int = ROW_BLOCK) -> torch.Tensor:
        """`self(x)` computed over fixed blocks of `block` rows (the last one zero-padded), so every
        GEMM has the same shape whatever the row count: a row's output never depends on how many other
        rows share the batch (oneDNN / MKL pick kernels, and with them the summation order, by row
        count; see `ROW_BLOCK`). On the AMX tiles every row is computed alike whatever the row count
        (`kernels.amx_linear`), so all rows go in one call: the weight is read once, not once per block."""
        if self.amx is not None and x.dtype == torch.bfloat16:
            return self(x)
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        n = x2.shape[0]
        nb = -(-n // block)
        if nb * block != n:
            x2 = torch.cat([x2, x2.new_zeros(nb * block - n, k)])
        y = torch.cat([self(x2[i * block: (i + 1) * block]) for i in range(nb)]) if nb > 1 else self(x2)
        return y[:n].view(*lead, y.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None and x.dtype == torch.bfloat16:
            return self.amx(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.amx.out_features)
        if self.packed is not None and (self.w is None or x.numel() // x.shape[-1] <= PACKED_MAX_ROWS):
            y = onednn_linear(x, self.packed)
        else:
            y = F.linear(x, self.w)
        if self.lora_a is not None:  # accumulated by the GEMM (no [rows, out] temporary)
            y = y.view(-1, y.shape[-1]).addmm_(F.linear(x, self.lora_a).view(-1, self.lora_a.shape[0]),
                                                self.lora_b.t()).view(y.shape)
        return y


def projection(w: torch.Tensor, ops: SamplerOps, pack: bool) -> Projection:
    """`w` with its decode copy: the AMX tiles' layout for a bf16 weight where the plan runs that kernel
    and the shape fits its tiles (`pack` or not: it needs no oneDNN), else oneDNN's packing where `pack`."""
    amx = ops.tiles(w)
    if amx is not None:
        return Projection(w, None, amx=amx)
    return Projection(w, onednn_pack(w, _PACK_ROWS) if pack else None)


@dataclass
class LayerWeights:
    in_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection
    _views: dict[int, Layer] = field(default_factory=dict, repr=False, compare=False)

    def blocked(self, block: int) -> Layer:
        """This layer for `model.layer`, its products over fixed `block`-row blocks (`Projection.blocked`)."""
        view = self._views.get(block)
        if view is None:
            view = self._views[block] = Layer(
                self.in_norm, self.post_norm, functools.partial(self.qkv.blocked, block=block),
                functools.partial(self.o.blocked, block=block), functools.partial(self.gate_up.blocked, block=block),
                functools.partial(self.down.blocked, block=block))
        return view


@dataclass
class SamplerWeights:
    """One immutable weight set (the base, plus one snapshot's LoRA: merged into re-packed projections
    when packed, unmerged factors otherwise) in the sampler dtype."""

    embed: torch.Tensor  # fp32, like the norms (only the layer projections are in `dtype`)
    # fp32 (the logits are fp32 in either sampler dtype, as in training: `model.unembed_inputs`)
    lm_head: Projection
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    n_heads: int
    n_kv: int
    head_dim: int
    intermediate: int
    eps: float
    act: Any
    act_name: str  # the config's `hidden_act` (see `model.Dims`)
    cos: torch.Tensor  # [max_ctx, head_dim], fp32 (RoPE and attention run in fp32, see `sampler_forward`)
    sin: torch.Tensor
    max_context: int
    dtype: torch.dtype
    # what the unembedding's inputs are rounded to (`model.unembed_inputs`; run it under `matmul_inputs`)
    head_inputs: torch.dtype
    # the ops this weight set runs under (the engine plan's choices, `ops.sampler_ops`)
    ops: SamplerOps
    # where the plan runs the AMX head kernel: the unembedding in bf16 for it (`kernels.BlockedHead`, the
    # same logits as `lm_head` under `matmul_inputs`, reading half the bytes); None elsewhere or with a
    # LoRA on it
    head_blocked: Any = None
    # what the layer projections were fake-quantised to (`with_lora`'s `quant`; none = the exact weights)
    quant: str = "none"

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features

    def head_logits(self, h: torch.Tensor, blocked: bool = False) -> torch.Tensor:
        """fp32 logits of fp32 final-normed hidden states `h`; `blocked`: in fixed `ROW_BLOCK`-row blocks
        (a row's logits then never depend on the rows beside it; the AMX head kernel computes every row
        alike anyway)."""
        if self.head_blocked is not None:
            return self.head_blocked.logits(h)
        with matmul_inputs(self.head_inputs):
            return self.lm_head.blocked(h) if blocked else self.lm_head(h)


def build_weights(config: Any, base: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  dtype: torch.dtype, *, ops: SamplerOps, pack: bool | None = None,
                  stacked: dict[str, torch.Tensor] | None = None, head_tiles: Any = None) -> SamplerWeights:
    """Fuse base weights (fp32, HF names) into `dtype` (no LoRA; see `with_lora`) under `ops`, the op table
    of the plan the caller was given (`SharedBase.sampler_ops`: no plan is made here, on whatever thread
    calls); `pack` (default: the plan's) adds decode-packed copies
    of every projection. `stacked`: `fuse_base(config, base)` when already built (shared instead of
    concatenated again). `head_tiles`: the unembedding for the AMX head kernel
    (`kernels.blocked_head`), used where the plan runs it."""
    check_architecture(config)
    d = dims(config)
    pack = ops.pack if pack is None else pack
    stacked = fuse_base(config, base) if stacked is None else stacked

    def w(name: str) -> torch.Tensor:  # a projection weight in the sampler dtype
        return base[weight(name)].to(dtype)

    def f32(name: str) -> torch.Tensor:  # the embedding and the norms stay fp32 (see `sampler_forward`)
        return base[weight(name)].float()

    layers = []
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            n = layer_names(i)
            layers.append(LayerWeights(
                in_norm=f32(n.input_norm),
                qkv=projection(stacked[n.stacked_qkv].to(dtype), ops, pack),
                o=projection(w(n.o), ops, pack),
                post_norm=f32(n.post_norm),
                gate_up=projection(stacked[n.stacked_gate_up].to(dtype), ops, pack),
                down=projection(w(n.down), ops, pack)))
        # tied or not, the output projection in fp32, packed where the packed kernel computes what the
        # plain product would on the plan's head inputs (`SamplerPlan.packed_head`)
        head_inputs = ops.plan.head_inputs
        lm_head = projection(unembed_weight(base).float(), ops, pack and ops.pack_head)
    return SamplerWeights(
        embed=f32(EMBED), lm_head=lm_head, final_norm=f32(FINAL_NORM), layers=layers,
        n_heads=d.n_heads, n_kv=d.n_kv, head_dim=d.head_dim, intermediate=d.intermediate, eps=d.eps, act=d.act, act_name=d.act_name,
        cos=cos.float(), sin=sin.float(), max_context=cos.shape[0], dtype=dtype, head_inputs=head_inputs, ops=ops,
        head_blocked=head_tiles if ops.plan.amx_unembedding else None)


def with_factors(lin: Projection, names: Sequence[str], outs: Sequence[int],
                 lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, dtype: torch.dtype,
                 ops: SamplerOps, quant: str = "none") -> Projection:
    """`lin` (rows = the modules `names`, `outs` rows each, concatenated) with their LoRA factors:
    A stacked `[sum r, in]`, B block-diagonal `[sum out, sum r]` times `scale`. `quant` other than `none`:
    the merged weight (merged whatever the packing: the rounding applies to the weight the sampler
    computes with, `W + s B A`) fake-quantised (`quant.fake_quant`) and packed as `lin` was."""
    have = [(n, o, sum(outs[:k])) for k, (n, o) in enumerate(zip(names, outs)) if n in lora]
    if quant != "none":
        return _quantised(lin, _factors(have, lora, scale, sum(outs)) if have else None, quant, ops)
    if not have:
        return lin
    B, A = _factors(have, lora, scale, sum(outs))
    if lin.packed is not None or lin.amx is not None:  # merge into the base and re-pack (see `Projection`)
        # summed in fp32, rounded once (a bf16 addmm would round the product and the sum separately)
        merged = torch.addmm(lin.w.float(), B, A.float()).to(lin.w.dtype)
        if lin.amx is not None:
            return Projection(None, amx=ops.tiles(merged))
        return Projection(None, onednn_pack(merged, _PACK_ROWS))
    return Projection(lin.w, None, A.to(dtype).contiguous(), B.to(dtype))


def _factors(have: list[tuple[str, int, int]], lora: dict[str, tuple[torch.Tensor, torch.Tensor]],
             scale: float, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(B, A)` of `with_factors`: A stacked `[sum r, in]`, B block-diagonal `[rows, sum r]` times `scale`."""
    A = torch.cat([lora[n][0] for n, _, _ in have], 0)
    B = torch.zeros(rows, A.shape[0])
    r0 = 0
    for n, o, row in have:
        r = lora[n][0].shape[0]
        B[row: row + o, r0: r0 + r] = scale * lora[n][1]
        r0 += r
    return B, A


def _quantised(lin: Projection, BA: tuple[torch.Tensor, torch.Tensor] | None, quant: str, ops: SamplerOps
               ) -> Projection:
    """A base projection `lin` (its plain weight kept) plus `B A` where given, fake-quantised to `quant` in
    fp32, rounded to `lin`'s dtype and packed as `lin` is (AMX tiles, oneDNN, or plain)."""
    eff = lin.w.float() if BA is None else torch.addmm(lin.w.float(), BA[0], BA[1].float())
    q = fake_quant(eff, quant).to(lin.w.dtype)
    if lin.amx is not None:
        return Projection(None, amx=ops.tiles(q))
    if lin.packed is not None:
        return Projection(None, onednn_pack(q, _PACK_ROWS))
    return Projection(q)


def with_lora(W: SamplerWeights, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float,
              quant: str = "none") -> SamplerWeights:
    """`W` (shared, not copied) plus one adapter: `HF module name -> (A [r, in], B [out, r])`, `scale`.

    `quant` (`backend.sampler_quant`) other than `none`: every layer projection (q|k|v, o, gate|up, down),
    with its LoRA merged where it has one, is fake-quantised once here, once per weight set: the
    decode steps then cost what they cost unquantised. The embedding, the norms and the fp32 unembedding
    stay exact, as quantised serving checkpoints keep them (vLLM's FP8, AWQ and GPTQ leave lm_head unquantised
    by default). `W` must be a base weight set (`build_weights`: its projections keep their plain weight)."""
    if not lora and quant == "none":
        return W
    nh, nkv, hd, inter = W.n_heads, W.n_kv, W.head_dim, W.intermediate
    known = {UNEMBED}
    layers = []
    with torch.no_grad():
        for i, L in enumerate(W.layers):
            n = layer_names(i)
            known.update(n.qkv + n.gate_up + (n.o, n.down))
            layers.append(LayerWeights(
                in_norm=L.in_norm, post_norm=L.post_norm,
                qkv=with_factors(L.qkv, n.qkv, [nh * hd, nkv * hd, nkv * hd], lora, scale, W.dtype, W.ops,
                                 quant),
                o=with_factors(L.o, [n.o], [L.o.w.shape[0]], lora, scale, W.dtype, W.ops, quant),
                gate_up=with_factors(L.gate_up, n.gate_up, [inter, inter], lora, scale, W.dtype, W.ops,
                                     quant),
                down=with_factors(L.down, [n.down], [L.down.w.shape[0]], lora, scale, W.dtype, W.ops, quant)))
        head = with_factors(W.lm_head, [UNEMBED], [W.vocab_size], lora, scale, torch.float32, W.ops)
    unknown = sorted(set(lora) - known)
    if unknown:
        raise ValueError(f"local sampler: LoRA on unsupported modules {unknown[:3]}")
    return replace(W, layers=layers, lm_head=head, head_blocked=W.head_blocked if head is W.lm_head else None,
                   quant=quant)
