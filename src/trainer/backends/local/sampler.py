"""Fast batched sampler for Llama-architecture models: fused weights, per-prompt prefill, static
KV-cache decode, per-token logprobs gathered as it goes; batch-invariant.

Why not `transformers.generate`: with `output_scores` it keeps `B x vocab` floats per step (8-16 GB
at batch 64 for SmolLM2) and its per-step Python overhead dominates a 135M model on CPU. Here each
layer is a handful of fused matmuls (q|k|v and gate|up concatenated), decode attends over a static
cache slice, and only the sampled token's logprob is kept (local-model.md §2: the bf16 static-cache
loop is ~2x HF generate fp32).

CPU speed (measured on a 2-core AVX2 EPYC, `bench/sampler.py`): decode matmuls have only B rows, where
plain `F.linear` (MKL sgemm) reaches ~60 GFLOPS; oneDNN with the weights pre-packed for that shape
(`torch.ops.mkldnn._reorder_linear_weight` + `_linear_pointwise`, the kernels torch inductor uses on CPU)
runs the same fp32 product ~1.7x faster (2x on the 49152-wide unembedding), so fp32 decode uses packed
copies.

Batch invariance (a request's tokens and logprobs are bit-identical alone or in any batch, for one
machine and thread count): the scheduler batches requests by arrival timing, and GEMM libraries pick
kernels, hence summation orders, by row count, so every product that mixes rows of different requests
(decode projections, first-token logits) runs over fixed `ROW_BLOCK`-row blocks; each prompt is
prefilled on its own (its row count is its length); the cache holds each row's tokens from index 0 and
decode attention runs per run of rows of equal length, with no padding or mask; and each row's token
and logprob come from its own logits by the same formulas whatever the other rows do.

Numerics follow transformers 5.5 `models/llama/modeling_llama.py` (RMSNorm in fp32 then cast,
`rotate_half` RoPE with the model's own rotary tables, SDPA with scale head_dim^-0.5, SiLU-gated MLP),
so in fp32 the logprobs equal the HF/peft training forward to ~1e-6.

Sampling conventions (Tinker leaves them undocumented):
- logprob of a sampled token = log softmax(logits / T) over the FULL vocabulary (before top-k/top-p
  truncation), i.e. the tempered distribution; greedy (T = 0 or top_k = 1) reports the T = 1 logprob.
- a stop token id ends the sequence and is included once; a stop string ends it at the token whose
  decoding completes the string (that token included); stop_reason "stop", else "length".
- seeded requests draw from their own `torch.Generator` (one uniform per row per step, inverse-CDF),
  so the draws do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.nn.functional as F

_PROJ_QKV = ("q_proj", "k_proj", "v_proj")
_PROJ_GU = ("gate_proj", "up_proj")


# ----------------------------------------------------------------------------------- weights
_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# decode batches up to this many rows use the packed oneDNN weights; above it sgemm is as fast
_PACKED_MAX_ROWS = 256
# Rows per GEMM call wherever rows of different requests share one product (decode steps and the first
# token's logits). On the dev CPU the row count alone changes a row's result: MKL sgemm gives M = 1,
# 2-3 and >= 4 rows three different results, oneDNN's bf16 unembedding switches kernels above 32 rows.
# Fixed-shape blocks make each request's numbers independent of the batch it ran in.
ROW_BLOCK = 32


@dataclass
class _Lin:
    """A bias-free projection: the plain weight `[out, in]`, for fp32 on oneDNN builds a copy pre-packed
    for small-row (decode) products, and an optional unmerged LoRA (`y += (x A^T) B^T`, scale in B).

    With packed weights a snapshot's LoRA is merged (`W + s B A`) and re-packed once (`w` is then None:
    the packed copy serves every row count): ~0.3 s per SmolLM2 snapshot, against ~0.9 s of unmerged
    rank-r products over one 8 x 4 x 64-token generate (measured on the 2-core dev box). Without
    packing (bf16) the LoRA stays unmerged and its term is accumulated by the GEMM."""

    w: torch.Tensor | None
    packed: torch.Tensor | None = None
    lora_a: torch.Tensor | None = None  # [R, in]
    lora_b: torch.Tensor | None = None  # [out, R], scale folded in

    @property
    def out_features(self) -> int:
        return int((self.w if self.w is not None else self.packed).shape[0])

    def blocked(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x)` computed over fixed blocks of `ROW_BLOCK` rows (the last one zero-padded), so every
        GEMM has the same shape whatever the row count: a row's output never depends on how many other
        rows share the batch (oneDNN / MKL pick kernels, and with them the summation order, by row
        count; see `ROW_BLOCK`)."""
        lead, k = x.shape[:-1], x.shape[-1]
        x2 = x.reshape(-1, k)
        n = x2.shape[0]
        nb = -(-n // ROW_BLOCK)
        if nb * ROW_BLOCK != n:
            x2 = torch.cat([x2, x2.new_zeros(nb * ROW_BLOCK - n, k)])
        y = torch.cat([self(x2[i * ROW_BLOCK: (i + 1) * ROW_BLOCK]) for i in range(nb)]) if nb > 1 else self(x2)
        return y[:n].view(*lead, y.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and (self.w is None or x.numel() // x.shape[-1] <= _PACKED_MAX_ROWS):
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        else:
            y = F.linear(x, self.w)
        if self.lora_a is not None:  # accumulated by the GEMM (no [rows, out] temporary)
            y = y.view(-1, y.shape[-1]).addmm_(F.linear(x, self.lora_a).view(-1, self.lora_a.shape[0]),
                                                self.lora_b.t()).view(y.shape)
        return y


def _lin(w: torch.Tensor, pack: bool) -> _Lin:
    return _Lin(w, torch.ops.mkldnn._reorder_linear_weight(w, 32) if pack else None)


@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: _Lin
    o: _Lin
    post_norm: torch.Tensor
    gate_up: _Lin
    down: _Lin


@dataclass
class SamplerWeights:
    """One immutable weight set (the base, plus one snapshot's LoRA: merged into re-packed projections
    for packed fp32, unmerged factors otherwise) in the sampler dtype."""

    embed: torch.Tensor
    lm_head: _Lin
    final_norm: torch.Tensor
    layers: list[_Layer]
    n_heads: int
    n_kv: int
    head_dim: int
    intermediate: int
    eps: float
    act: Any
    cos: torch.Tensor  # [max_ctx, head_dim] in dtype
    sin: torch.Tensor
    max_context: int
    dtype: torch.dtype

    @property
    def vocab_size(self) -> int:
        return self.lm_head.out_features


def check_architecture(config: Any) -> None:
    """The sampler implements the Llama block only; anything else fails with a clear message."""
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"local sampler supports Llama-architecture models, got model_type="
                         f"{getattr(config, 'model_type', None)!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("local sampler: attention/MLP biases are not supported")


def rotary_tables(model: Any, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin `[max_context, head_dim]` from the model's own rotary module (any rope type)."""
    rot = model.model.rotary_emb if hasattr(model, "model") else model.base_model.model.model.rotary_emb
    pos = torch.arange(max_context).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].float(), sin[0].float()


def fuse_base(config: Any, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer `{prefix}.self_attn.qkv` and `{prefix}.mlp.gate_up`: the projections of one input stacked
    into one weight (rows in q|k|v and gate|up order), for the sampler and `train_forward.stacked_linear`
    (built once per base model; see `SharedBase.stacked_weights`)."""
    out = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        qkv = [base[f"{p}.self_attn.{n}.weight"] for n in _PROJ_QKV]
        out[f"{p}.self_attn.qkv"] = torch.cat(qkv).contiguous()
        out[f"{p}.mlp.gate_up"] = torch.cat([base[f"{p}.mlp.{n}.weight"] for n in _PROJ_GU]).contiguous()
    return out


def build_weights(config: Any, base: dict[str, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                  dtype: torch.dtype, pack: bool | None = None,
                  stacked: dict[str, torch.Tensor] | None = None) -> SamplerWeights:
    """Fuse base weights (fp32, HF names) into `dtype` (no LoRA; see `with_lora`); `pack` (default: fp32
    on a oneDNN build) adds decode-packed copies of every projection. `stacked`: `fuse_base(config, base)`
    when already built (shared instead of concatenated again)."""
    check_architecture(config)
    pack = (_MKLDNN and dtype in (torch.float32, torch.bfloat16)) if pack is None else pack
    stacked = fuse_base(config, base) if stacked is None else stacked

    def w(name: str) -> torch.Tensor:
        return base[name + ".weight"].to(dtype)

    layers = []
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}"
            layers.append(_Layer(
                in_norm=w(f"{p}.input_layernorm"),
                qkv=_lin(stacked[f"{p}.self_attn.qkv"].to(dtype), pack),
                o=_lin(w(f"{p}.self_attn.o_proj"), pack),
                post_norm=w(f"{p}.post_attention_layernorm"),
                gate_up=_lin(stacked[f"{p}.mlp.gate_up"].to(dtype), pack),
                down=_lin(w(f"{p}.mlp.down_proj"), pack)))
        embed = w("model.embed_tokens")
        head_w = base.get("lm_head.weight", base["model.embed_tokens.weight"])
        tied = head_w.data_ptr() == base["model.embed_tokens.weight"].data_ptr()
        lm_head = embed if tied else head_w.to(dtype)  # tied: share the sampler copy too
    from transformers.activations import ACT2FN

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return SamplerWeights(
        embed=embed, lm_head=_lin(lm_head, pack), final_norm=w("model.norm"), layers=layers,
        n_heads=config.num_attention_heads, n_kv=config.num_key_value_heads, head_dim=head_dim,
        intermediate=config.intermediate_size, eps=float(config.rms_norm_eps), act=ACT2FN[config.hidden_act],
        cos=cos.to(dtype), sin=sin.to(dtype), max_context=cos.shape[0], dtype=dtype)


def _with_factors(lin: _Lin, names: Sequence[str], outs: Sequence[int],
                  lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float, dtype: torch.dtype) -> _Lin:
    """`lin` (rows = the modules `names`, `outs` rows each, concatenated) with their LoRA factors:
    A stacked `[sum r, in]`, B block-diagonal `[sum out, sum r]` times `scale`."""
    have = [(n, o, sum(outs[:k])) for k, (n, o) in enumerate(zip(names, outs)) if n in lora]
    if not have:
        return lin
    A = torch.cat([lora[n][0] for n, _, _ in have], 0)
    B = torch.zeros(sum(outs), A.shape[0])
    r0 = 0
    for n, o, row in have:
        r = lora[n][0].shape[0]
        B[row: row + o, r0: r0 + r] = scale * lora[n][1]
        r0 += r
    if lin.packed is not None:  # merge into the base and re-pack (see `_Lin`)
        merged = torch.addmm(lin.w.float(), B, A.float()).to(lin.w.dtype)
        return _Lin(None, torch.ops.mkldnn._reorder_linear_weight(merged, 32))
    return _Lin(lin.w, None, A.to(dtype).contiguous(), B.to(dtype))


def with_lora(W: SamplerWeights, lora: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float
              ) -> SamplerWeights:
    """`W` (shared, not copied) plus one adapter: `HF module name -> (A [r, in], B [out, r])`, `scale`."""
    if not lora:
        return W
    nh, nkv, hd, inter = W.n_heads, W.n_kv, W.head_dim, W.intermediate
    known = {"lm_head"}
    layers = []
    with torch.no_grad():
        for i, L in enumerate(W.layers):
            p = f"model.layers.{i}"
            qkv = [f"{p}.self_attn.{n}" for n in _PROJ_QKV]
            gu = [f"{p}.mlp.{n}" for n in _PROJ_GU]
            o, down = f"{p}.self_attn.o_proj", f"{p}.mlp.down_proj"
            known.update(qkv + gu + [o, down])
            layers.append(_Layer(
                in_norm=L.in_norm, post_norm=L.post_norm,
                qkv=_with_factors(L.qkv, qkv, [nh * hd, nkv * hd, nkv * hd], lora, scale, W.dtype),
                o=_with_factors(L.o, [o], [L.o.w.shape[0]], lora, scale, W.dtype),
                gate_up=_with_factors(L.gate_up, gu, [inter, inter], lora, scale, W.dtype),
                down=_with_factors(L.down, [down], [L.down.w.shape[0]], lora, scale, W.dtype)))
        head = _with_factors(W.lm_head, ["lm_head"], [W.vocab_size], lora, scale, W.dtype)
    unknown = sorted(set(lora) - known)
    if unknown:
        raise ValueError(f"local sampler: LoRA on unsupported modules {unknown[:3]}")
    return replace(W, layers=layers, lm_head=head)


# ----------------------------------------------------------------------------------- forward
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def _mlp(W: SamplerWeights, L: _Layer, x: torch.Tensor, blocked: bool = False) -> torch.Tensor:
    if blocked:
        g, u = L.gate_up.blocked(x).split(W.intermediate, dim=-1)
        return L.down.blocked(W.act(g) * u)
    g, u = L.gate_up(x).split(W.intermediate, dim=-1)
    return L.down(W.act(g) * u)


def prefill(W: SamplerWeights, prompts: Sequence[torch.Tensor],
            cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None, rows: Sequence[int] | None = None
            ) -> list[torch.Tensor]:
    """Each prompt (`[T_i]`) on its own, so its GEMMs have its own row count and its numbers do not
    depend on the other prompts of the batch; when `cache` is given, write prompt i's K/V into
    `cache[l][rows[i], :, :T_i]`. Returns the final-normed hidden states `[T_i, H]` of each prompt."""
    return [_prefill_one(W, p, cache, None if rows is None else rows[i]) for i, p in enumerate(prompts)]


def _prefill_one(W: SamplerWeights, ids: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]] | None,
                 row: int | None) -> torch.Tensor:
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    N = int(ids.shape[0])
    cos = W.cos[:N].view(N, 1, hd)
    sin = W.sin[:N].view(N, 1, hd)
    x = F.embedding(ids, W.embed)  # [N, H]
    for li, L in enumerate(W.layers):
        q, k, v = L.qkv(rms_norm(x, L.in_norm, W.eps)).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = rope(q.view(N, nh, hd), cos, sin).transpose(0, 1)  # [nh, N, hd]
        k = rope(k.view(N, nkv, hd), cos, sin).transpose(0, 1)
        v = v.view(N, nkv, hd).transpose(0, 1)
        if cache is not None:
            cache[li][0][row, :, :N] = k
            cache[li][1][row, :, :N] = v
        attn = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=nkv != nh)[0]
        x = x + L.o(attn.transpose(0, 1).reshape(N, nh * hd))
        x = x + _mlp(W, L, rms_norm(x, L.post_norm, W.eps))
    return rms_norm(x, W.final_norm, W.eps)


def decode_step(W: SamplerWeights, tok_B: torch.Tensor, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One token per row, written at cache index = rope position `pos_B` (each row's prompt starts at cache
    index 0); `spans`: `(first row, end row, n)` runs of rows that all attend over cache indices `[0, n)`.
    Returns fp32 logits `[B, V]`.

    Batch invariance: projections run in fixed `ROW_BLOCK`-row blocks, and attention runs per span with
    no padding or mask, so a row's numbers depend only on its own tokens (a padded, masked attention
    over the batch's longest row changed the summation order with the batch)."""
    B = tok_B.shape[0]
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    g = nh // nkv
    cos = W.cos[pos_B].view(B, 1, 1, hd)
    sin = W.sin[pos_B].view(B, 1, 1, hd)
    rows_B = torch.arange(B)
    x = F.embedding(tok_B, W.embed)  # [B, H]
    for li, L in enumerate(W.layers):
        q, k, v = L.qkv.blocked(rms_norm(x, L.in_norm, W.eps)).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = rope(q.view(B, nh, 1, hd), cos, sin)
        k = rope(k.view(B, nkv, 1, hd), cos, sin)
        kc, vc = cache[li]
        kc[rows_B, :, pos_B] = k[:, :, 0]
        vc[rows_B, :, pos_B] = v.view(B, nkv, hd)
        # GQA without repeating K/V: q head h uses kv head h // g, so group the g query heads of one
        # kv head as g "positions" of a single-query attention over that head's cache.
        qg = q.view(B, nkv, g, hd)
        a = torch.cat([F.scaled_dot_product_attention(qg[r0:r1], kc[r0:r1, :, :n], vc[r0:r1, :, :n])
                       for r0, r1, n in spans]) if len(spans) > 1 else \
            F.scaled_dot_product_attention(qg, kc[:, :, : spans[0][2]], vc[:, :, : spans[0][2]])
        x = x + L.o.blocked(a.reshape(B, nh * hd))
        x = x + _mlp(W, L, rms_norm(x, L.post_norm, W.eps), blocked=True)
    return W.lm_head.blocked(rms_norm(x, W.final_norm, W.eps)).float()


def _target_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    logits = W.lm_head(hidden_TH).float()
    return logits.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def prompt_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, ids_T: torch.Tensor) -> list[float | None]:
    """`[None, logp(tok_1 | tok_0), ...]` of one prefilled prompt."""
    if ids_T.shape[0] <= 1:
        return [None] * ids_T.shape[0]
    return [None] + _target_logprobs(W, hidden_TH[:-1], ids_T[1:]).tolist()


@torch.no_grad()
def score(W: SamplerWeights, prompts: Sequence[Sequence[int]]) -> list[list[float | None]]:
    """Prompt logprobs of each prompt (entry 0 is None)."""
    ids = [torch.tensor(list(p), dtype=torch.long) for p in prompts]
    return [prompt_logprobs(W, h, i) for h, i in zip(prefill(W, ids), ids)]


# ----------------------------------------------------------------------------------- sampling
@dataclass
class SampleJob:
    """One `sample` request: `num_samples` continuations of one prompt."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()
    stop_strs: tuple[str, ...] = ()
    include_prompt_logprobs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class SampleResult:
    sequences: list[tuple[list[int], list[float], str]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None


def _filter_top(logits_NV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask logits outside the top-k / nucleus (top-p) set with -inf."""
    if top_k > 0 and top_k < logits_NV.shape[-1]:
        kth = torch.topk(logits_NV, top_k, dim=-1).values[:, -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_l, idx = torch.sort(logits_NV, dim=-1, descending=True)
        probs = torch.softmax(sorted_l, -1)
        drop = (probs.cumsum(-1) - probs) >= top_p  # keep the smallest prefix reaching top_p
        drop[:, 0] = False
        logits_NV = logits_NV.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return logits_NV


_CDF_BLOCK = 256


def inverse_cdf(probs_NV: torch.Tensor, u_N: torch.Tensor) -> torch.Tensor:
    """Token ids `[N]` with `F(id - 1) <= u * total < F(id)` for the CDF `F` of each row.

    Two levels (block sums, then one block's cumsum) instead of a full-vocabulary fp64 cumsum, which
    took ~20 ms per decode step at 32 x 49152; never returns a zero-probability token. Blocks are summed
    in fp32 (relative error ~1e-7 per block, far below any sampling noise; converting the whole
    [rows, vocab] to fp64 first cost ~7 ms per step) and accumulated across blocks in fp64."""
    N, V = probs_NV.shape
    nb = -(-V // _CDF_BLOCK)
    P = (probs_NV if nb * _CDF_BLOCK == V else F.pad(probs_NV, (0, nb * _CDF_BLOCK - V))).view(N, nb, _CDF_BLOCK)
    cdf_b = P.sum(-1).double().cumsum(-1)  # [N, nb]
    target = u_N.double() * cdf_b[:, -1]
    blk = torch.searchsorted(cdf_b, target.unsqueeze(1), right=True).squeeze(1)
    blk = torch.minimum(blk, (cdf_b < cdf_b[:, -1:]).sum(-1))  # last block holding mass
    before = torch.where(blk > 0, cdf_b.gather(1, (blk - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    inner = P[torch.arange(N), blk].double().cumsum(-1)  # [N, block]
    j = torch.searchsorted(inner, (target - before).unsqueeze(1), right=True).squeeze(1)
    j = torch.minimum(j, (inner < inner[:, -1:]).sum(-1))  # last token of the block holding mass
    return blk * _CDF_BLOCK + j


@dataclass
class _Row:
    job: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    reason: str = "length"


@torch.no_grad()
def generate(W: SamplerWeights, jobs: Sequence[SampleJob], tokenizer: Any = None) -> list[SampleResult]:
    """Sample all `jobs` together: each prompt prefilled on its own, then one decode loop over all rows.

    Every row's numbers are independent of the other jobs in the batch (see `decode_step`), and its
    draws come from its job's generator, so a seeded job returns the same tokens and bit-identical
    logprobs alone or in any batch (same machine and thread count)."""
    if not jobs:
        return []
    T = max(len(j.prompt) for j in jobs)
    L = T + max(j.max_tokens for j in jobs)
    if L > W.max_context:
        raise ValueError(f"longest prompt ({T}) + max_tokens exceeds the model context ({W.max_context})")
    # rows grouped by prompt length (longest first; a job's rows stay together and in order), so the rows
    # attending over the same cache length are one contiguous span at every step
    order = sorted(range(len(jobs)), key=lambda ji: -len(jobs[ji].prompt))
    rows: list[_Row] = [_Row(job=ji) for ji in order for _ in range(jobs[ji].num_samples)]
    B = len(rows)
    R = len(jobs)
    # each prompt occupies cache indices [0, len) of its job's slot; its K/V are then copied to its rows
    cache_R = [(torch.zeros(R, W.n_kv, L, W.head_dim, dtype=W.dtype),
                torch.zeros(R, W.n_kv, L, W.head_dim, dtype=W.dtype)) for _ in W.layers]
    results = [SampleResult() for _ in jobs]
    ids = [torch.tensor(j.prompt, dtype=torch.long) for j in jobs]
    hidden = prefill(W, ids, cache_R, range(R))
    for ji, j in enumerate(jobs):
        if j.include_prompt_logprobs:
            results[ji].prompt_logprobs = prompt_logprobs(W, hidden[ji], ids[ji])
    src_B = torch.tensor([r.job for r in rows], dtype=torch.long)
    logits = W.lm_head.blocked(torch.stack([h[-1] for h in hidden])).float()[src_B]  # [B, V]
    cache = [(kc.index_select(0, src_B), vc.index_select(0, src_B)) for kc, vc in cache_R]
    del cache_R
    plen_B = torch.tensor([len(jobs[r.job].prompt) for r in rows], dtype=torch.long)
    gens: dict[int, torch.Generator] = {}
    for ji, j in enumerate(jobs):  # greedy jobs draw nothing (not even from the global generator)
        if not j.greedy:
            seed = int(j.seed) if j.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
            gens[ji] = torch.Generator().manual_seed(seed)
    temp_B = torch.tensor([1.0 if jobs[r.job].greedy else float(jobs[r.job].temperature) for r in rows])
    job_rows: list[list[int]] = [[] for _ in jobs]
    for b, r in enumerate(rows):
        job_rows[r.job].append(b)
    live = torch.arange(B)  # batch index -> row index (shrinks when finished rows are compacted)
    job_done = [False] * len(jobs)
    max_steps = max(j.max_tokens for j in jobs)
    for step in range(max_steps):
        # ---- choose tokens for every live row (logits: [len(live), V]); each row's token and logprob
        # come from its own logits by the same formulas whatever the other rows do
        temps = temp_B[live]
        scaled = logits if bool((temps == 1.0).all()) else logits / temps.unsqueeze(1)
        probs = torch.softmax(scaled, -1)  # the tempered distribution over the full vocabulary
        # greedy rows take the argmax; a full-vocabulary argmax per step is skipped when no row needs it
        # (rows of finished jobs keep a placeholder token: nothing reads their outputs)
        tok = (torch.argmax(logits, -1) if any(jobs[ji].greedy and not job_done[ji] for ji in order)
               else torch.zeros(logits.shape[0], dtype=torch.long))
        pos_of = {int(r): i for i, r in enumerate(live.tolist())}
        idx_l, u_l = [], []  # rows drawing from the full tempered distribution
        for ji in order:
            j = jobs[ji]
            if job_done[ji] or j.greedy:
                continue
            idx = [pos_of[b] for b in job_rows[ji]]
            # inverse-CDF draws: one uniform per row per step from the request's own generator (cheaper
            # than torch.multinomial, and independent of the other requests in the batch)
            u = torch.rand(len(idx), generator=gens[ji], dtype=torch.float64)
            if j.top_k > 0 or j.top_p < 1.0:
                ii = torch.tensor(idx)
                tok[ii] = inverse_cdf(torch.softmax(_filter_top(scaled[ii], j.top_k, j.top_p), -1), u)
            else:
                idx_l += idx
                u_l.append(u)
        if idx_l:  # one call for all of them (a row's draw depends on its own row only)
            if idx_l == list(range(len(live))):
                tok = inverse_cdf(probs, torch.cat(u_l))
            else:
                ii = torch.tensor(idx_l)
                tok[ii] = inverse_cdf(probs[ii], torch.cat(u_l))
        # log of an fp32 probability: abs. error ~1e-7
        lp = probs.gather(1, tok.unsqueeze(1)).squeeze(1).log()
        tok_l, lp_l = tok.tolist(), lp.tolist()
        for i, b in enumerate(live.tolist()):
            r = rows[b]
            if r.done:
                continue
            j = jobs[r.job]
            if len(r.tokens) >= j.max_tokens:
                r.done = True
                continue
            r.tokens.append(tok_l[i])
            r.logprobs.append(lp_l[i])
            if tok_l[i] in j.stop_ids or (j.stop_strs and _hits_stop_string(r.tokens, j.stop_strs, tokenizer)):
                r.done, r.reason = True, "stop"
            elif len(r.tokens) >= j.max_tokens:
                r.done = True
        for ji in range(len(jobs)):
            job_done[ji] = all(rows[b].done for b in job_rows[ji])
        if all(job_done) or step == max_steps - 1:
            break
        # ---- drop finished jobs' rows once they are half the batch (a job's rows stay together)
        keep = [i for i, b in enumerate(live.tolist()) if not job_done[rows[b].job]]
        if len(keep) <= len(live) // 2:
            k = torch.tensor(keep, dtype=torch.long)
            live = live[k]
            tok = tok[k]
            cache = [(kc.index_select(0, k), vc.index_select(0, k)) for kc, vc in cache]
        pos = plen_B[live] + step  # where this step's input token goes
        logits = decode_step(W, tok, pos, _spans(pos.tolist()), cache)
    for r in rows:
        results[r.job].sequences.append((r.tokens, r.logprobs, r.reason))
    return results


def _spans(pos: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive rows at the same position: `(first, end, position + 1)`."""
    out: list[tuple[int, int, int]] = []
    for i, p in enumerate(pos):
        if out and out[-1][2] == p + 1:
            out[-1] = (out[-1][0], i + 1, p + 1)
        else:
            out.append((i, i + 1, p + 1))
    return out


def _hits_stop_string(tokens: list[int], stops: tuple[str, ...], tokenizer: Any) -> bool:
    longest = max(len(s) for s in stops)
    tail = tokenizer.decode(tokens[-(longest + 2):])
    return any(s in tail for s in stops)
