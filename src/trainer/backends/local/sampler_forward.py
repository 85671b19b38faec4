"""The sampler's Llama forward over `SamplerWeights`: prefill of a batch of prompts into a static KV cache,
one decode step for a batch of rows, and prompt scoring.

Batch invariance (a request's numbers are bit-identical alone or in any batch, for one machine and
thread count): GEMM libraries pick kernels, hence summation orders, by row count, so every product that
mixes rows of different requests runs over fixed-size row blocks (`PREFILL_BLOCK` in prefill, with
attention per prompt; `ROW_BLOCK` in the decode step), whose kernel computes each row alike whatever its
block-mates; and decode attention runs per row over cache indices
`[0, n)` with no padding or mask: on the native kernel (`kernels.c`) as one task per (row, key/value head)
whose sums run in an order fixed by n, on the torch path per run of rows of equal length as two batched
products and a softmax (`decode_attention`): torch's CPU flash-attention kernel splits the key/value
length across threads when a call has few batch rows, so one row's attention could differ with the
number of rows beside it.

Everything but the layer projections runs in fp32 in either sampler dtype, as in the training forward:
the residual stream, the embedding, RMSNorm (fp32 weights), RoPE on fp32 tables, attention and the
logits (an fp32 unembedding whose inputs are rounded as the trainer's are, `model.unembed_inputs`); each
layer projection's input is cast to the sampler dtype just before its GEMM. A bf16 sampler's logprobs
then differ from the bf16 training forward's by the projections' kernels (and attention's summation
order) alone, not by a second set of rounding points. The KV cache holds exact values either way: on the
native decode kernel (`kernels.py`) keys before RoPE and values in the sampler dtype (the projection's
own bits), rotated in fp32 as they are read; on the torch path rotated fp32 keys and fp32 values.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from trainer.backends.local import kernels
from trainer.backends.local.model import matmul_inputs, rms_norm, rope
from trainer.backends.local.sampler_weights import SamplerWeights

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [rows, n_kv, length, head_dim]
# the dtype of attention, and of the KV cache on the torch path (see the module docstring)
ATTN_DTYPE = torch.float32
# rows per prefill product block (`prefill`): any fixed count keeps prompts independent of each other; 64
# rows already run near the speed of training-size products (bench/README), and few prompts pad much
PREFILL_BLOCK = 64


def native(W: SamplerWeights) -> bool:
    """Whether this sampler's decode attention runs on the native kernel (`kernels.py`). Its KV cache
    then holds keys before RoPE and values in the sampler dtype (a projection output's own bits, so
    nothing is rounded; in bf16 half the memory of rotated fp32 keys), and keys are rotated as read."""
    return kernels.native_decode(W.n_heads, W.n_kv, W.head_dim)


def new_cache(W: SamplerWeights, rows: int, length: int) -> KVCache:
    """An empty KV cache for `rows` rows of up to `length` positions, in the layout `decode_step` reads."""
    dt = W.dtype if native(W) else ATTN_DTYPE
    shape = (rows, W.n_kv, length, W.head_dim)
    return [(torch.zeros(shape, dtype=dt), torch.zeros(shape, dtype=dt)) for _ in W.layers]


def _add_norm(W: SamplerWeights, x: torch.Tensor, y: torch.Tensor | None, w: torch.Tensor, rows: bool,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x + y` (the previous product's output added to the fp32 residual stream; `y` None: none yet) and
    its RMSNorm (fp32 weights) cast to `dtype`. `rows` (`native_rows`): both in one native pass per row,
    `x` updated in place."""
    if rows:
        return x, kernels.residual_rms_norm(x, y, w, W.eps, dtype)
    x = x if y is None else x + y
    return x, rms_norm(x, w, W.eps).to(dtype)


def _gate(W: SamplerWeights, gu: torch.Tensor, rows: bool) -> torch.Tensor:
    """`act(gate) * up` of a stacked gate|up product (`rows`: on the native SiLU kernel)."""
    if rows:
        return kernels.silu_mul(gu)
    g, u = gu.split(W.intermediate, dim=-1)
    return W.act(g) * u


def _rope_qk(W: SamplerWeights, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q and k of a stacked q|k|v output (`[rows, (nh + 2 nkv) hd]`) rotated together in one RoPE (they
    are adjacent, and the rotation is per head), in fp32 (fp32 tables); v as is.
    Returns q `[rows, nh, hd]`, k `[rows, nkv, hd]`, v `[rows, nkv, hd]`."""
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    rows = qkv.shape[0]
    qk = rope(qkv[:, : (nh + nkv) * hd].view(rows, nh + nkv, hd), cos, sin)
    return qk[:, :nh], qk[:, nh:], qkv[:, (nh + nkv) * hd:].view(rows, nkv, hd)


def logits(W: SamplerWeights, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of final-normed hidden states: on the AMX head kernel where `W.head_blocked` (each row
    computed alike whatever the others), else over fixed `ROW_BLOCK`-row blocks (`Projection.blocked`)."""
    if W.head_blocked is not None:
        return W.head_blocked.logits(hidden.float())
    with matmul_inputs(W.head_inputs):
        return W.lm_head.blocked(hidden.float())


def prefill(W: SamplerWeights, prompts: Sequence[torch.Tensor], cache: KVCache | None = None,
            rows: Sequence[int] | None = None) -> list[torch.Tensor]:
    """All prompts (`[T_i]` each) through the model together; when `cache` is given, prompt i's K/V go
    into `cache[l][rows[i], :, :T_i]`. Returns the final-normed fp32 hidden states `[T_i, H]` of each.

    The layer projections run over all prompts' rows at once, in fixed blocks of `PREFILL_BLOCK` rows
    (`Projection.blocked`): a projection streams its weight from memory once per block instead of once
    per prompt (at a few dozen rows a product costs about the same whatever its row count, the weight
    read dominates), and a row's numbers do not depend on which rows share its block. Attention runs
    per prompt (causal, over its own rows), so nothing crosses prompts: a prompt's numbers are the same
    alone or in any batch (batch invariance, see the module docstring)."""
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    lens = [int(p.shape[0]) for p in prompts]
    if not lens:
        return []
    starts = [sum(lens[:i]) for i in range(len(lens))]
    N = sum(lens)
    pos = torch.cat([torch.arange(n) for n in lens])
    cos, sin = W.cos[pos].view(N, 1, hd), W.sin[pos].view(N, 1, hd)
    raw = cache is not None and native(W)  # the cache takes keys before RoPE, in the sampler dtype
    fused = native_rows(W)
    x = F.embedding(torch.cat(list(prompts)), W.embed)  # [N, H], fp32
    y = None  # the previous product's output, not yet added to x
    for li, L in enumerate(W.layers):
        x, h = _add_norm(W, x, y, L.in_norm, fused, W.dtype)
        qkv = L.qkv.blocked(h, PREFILL_BLOCK)
        q, k, v = _rope_qk(W, qkv, cos, sin)  # [N, heads, hd]
        attn = []
        for i, (a, n) in enumerate(zip(starts, lens)):
            qi, ki, vi = (t[a: a + n].transpose(0, 1) for t in (q, k, v))
            vi = vi.to(ATTN_DTYPE)
            if cache is not None:  # into a sampler-dtype cache, v goes back exactly (it came from that dtype)
                cache[li][0][rows[i], :, :n] = (qkv[a: a + n, nh * hd: (nh + nkv) * hd].view(n, nkv, hd)
                                                .transpose(0, 1) if raw else ki)
                cache[li][1][rows[i], :, :n] = vi
            o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True, enable_gqa=nkv != nh)[0]
            attn.append(o.transpose(0, 1).reshape(n, nh * hd))
        y = L.o.blocked(torch.cat(attn).to(W.dtype), PREFILL_BLOCK)
        x, h = _add_norm(W, x, y, L.post_norm, fused, W.dtype)
        y = L.down.blocked(_gate(W, L.gate_up.blocked(h, PREFILL_BLOCK), fused), PREFILL_BLOCK)
    _, x = _add_norm(W, x, y, W.final_norm, fused, torch.float32)
    return list(x.split(lens))


def decode_step(W: SamplerWeights, tok_B: torch.Tensor, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                cache: KVCache) -> torch.Tensor:
    """One token per row, written at cache index = rope position `pos_B` (each row's prompt starts at cache
    index 0); `spans`: `(first row, end row, n)` runs of rows that all attend over cache indices `[0, n)`.
    Returns fp32 logits `[B, V]`.

    Batch invariance: projections run in fixed `ROW_BLOCK`-row blocks, and attention runs per row over
    its own cache length (the native kernel: one task per row and key/value head; the torch path: per
    span, with no padding or mask), so a row's numbers depend only on its own tokens (a padded, masked
    attention over the batch's longest row would change the summation order with the batch).

    Where every layer projection is on the AMX tiles (`W.native_layers`), all layers run in one native
    call through the same kernels in the same order (the same bits as the loop below)."""
    fused = native_rows(W)
    x = F.embedding(tok_B, W.embed)  # [B, H], fp32
    if W.native_layers is not None and native(W):
        y = W.native_layers(x, cache, pos_B, W.cos, W.sin)  # x updated in place
    else:
        x, y = _decode_layers(W, x, pos_B, spans, cache, fused)
    return logits(W, _add_norm(W, x, y, W.final_norm, fused, torch.float32)[1])


def _decode_layers(W: SamplerWeights, x: torch.Tensor, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                   cache: KVCache, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_step`'s layers one kernel (or torch op) at a time: the residual stream after the last
    residual add, and the last down product, not yet added to it."""
    if native(W):
        def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
            return kernels.decode_layer_attention(qkv, W.cos, W.sin, kc, vc, pos_B, W.n_heads)
    else:
        attend = _torch_decode_attention(W, pos_B, spans, cache[0][0].shape[2])
    y = None  # the previous product's output, not yet added to x
    for li, L in enumerate(W.layers):
        x, h = _add_norm(W, x, y, L.in_norm, fused, W.dtype)
        y = L.o.blocked(attend(L.qkv.blocked(h), *cache[li]))
        x, h = _add_norm(W, x, y, L.post_norm, fused, W.dtype)
        y = L.down.blocked(_gate(W, L.gate_up.blocked(h), fused))
    return x, y


def native_rows(W: SamplerWeights) -> bool:
    """Whether the element-wise work between the layer products (residual adds, RMSNorms, casts, the SiLU
    gate) runs on the native row kernels (`kernels.row_kernels`): one pass per row each, instead of a
    dozen small torch ops per layer whose dispatch costs more than their arithmetic at decode's few rows.
    Each residual add is then fused into the norm that follows it."""
    return native(W) and kernels.row_kernels(W.act_name, W.dtype, W.embed.shape[1], W.intermediate)


def _torch_decode_attention(W: SamplerWeights, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                            length: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The torch path's counterpart of `kernels.decode_layer_attention` for one decode step: from a
    layer's q|k|v output, RoPE of q and k at `pos_B`, k and v written into the fp32 cache of rotated keys
    (`length` positions per row), attention per span; `[B, n_heads * head_dim]` in the sampler dtype.
    The step's rotary rows and cache indices are formed once here for every layer."""
    B = pos_B.shape[0]
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    g = nh // nkv
    cos = W.cos[pos_B].view(B, 1, hd)
    sin = W.sin[pos_B].view(B, 1, hd)
    # row r's kv head h is written at flat cache row (r * nkv + h) * length + pos_B[r] of the cache viewed
    # as [rows * nkv * length, hd]: one index_copy_ per cache tensor, the same indices for every layer
    at = ((torch.arange(B).unsqueeze(1) * nkv + torch.arange(nkv)) * length + pos_B.unsqueeze(1)).view(-1)

    def attend(qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        q, k, v = _rope_qk(W, qkv, cos, sin)
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


def decode_attention(q_BKGD: torch.Tensor, k_BKND: torch.Tensor, v_BKND: torch.Tensor) -> torch.Tensor:
    """Softmax attention of `q` (`[rows, kv heads, queries, head_dim]`) over all `N` cached positions, as
    `softmax(q k^T / sqrt(d)) v` in two batched products. Each (row, head) is its own small matrix
    product whose kernel depends only on (queries, N, head_dim), so a row's result does not depend on
    the rows beside it (unlike the fused SDPA kernel, see the module docstring); at decode shapes it is
    as fast as that kernel."""
    s = torch.matmul(q_BKGD, k_BKND.transpose(-1, -2)).mul_(q_BKGD.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(s, -1), v_BKND)


def _target_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    if W.head_blocked is not None:
        lg = W.head_blocked.logits(hidden_TH.float())
    else:
        with matmul_inputs(W.head_inputs):
            lg = W.lm_head(hidden_TH.float())
    return lg.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(lg, -1)


def prompt_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, ids_T: torch.Tensor) -> list[float | None]:
    """`[None, logp(tok_1 | tok_0), ...]` of one prefilled prompt."""
    if ids_T.shape[0] <= 1:
        return [None] * ids_T.shape[0]
    return [None] + _target_logprobs(W, hidden_TH[:-1], ids_T[1:]).tolist()


TOPK_ROWS = 256  # positions per head call in prompt_topk (256 x 49152 fp32 logits: 50 MB)


def prompt_topk(W: SamplerWeights, hidden_TH: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most likely next tokens at each prompt position, aligned with `prompt_logprobs`: row i is the
    distribution that scored prompt token i, row 0 (no context) is the SDK's empty-row sentinel
    (token 0, logprob `MASK_LOGPROB`, `tinker/types/topk_logprobs.py`). Returns `(token_ids [T, k] int32,
    logprobs [T, k] float32)`, most likely first."""
    from tinker.types.topk_logprobs import MASK_LOGPROB

    T = hidden_TH.shape[0]
    ids = np.zeros((T, k), dtype=np.int32)
    lps = np.full((T, k), MASK_LOGPROB, dtype=np.float32)
    # the logits of TOPK_ROWS positions at a time: a long prompt's [T, vocab] matrix would be gigabytes
    for a in range(0, T - 1, TOPK_ROWS):
        h = hidden_TH[a:min(a + TOPK_ROWS, T - 1)].float()
        if W.head_blocked is not None:
            lg = W.head_blocked.logits(h)
        else:
            with matmul_inputs(W.head_inputs):
                lg = W.lm_head(h)
        top = torch.topk(torch.log_softmax(lg.float(), -1), min(k, lg.shape[-1]), dim=-1)
        n, kk = top.indices.shape
        ids[a + 1:a + 1 + n, :kk] = top.indices.numpy().astype(np.int32)
        lps[a + 1:a + 1 + n, :kk] = top.values.numpy().astype(np.float32)
    return ids, lps


@torch.no_grad()
def score(W: SamplerWeights, prompts: Sequence[Sequence[int]]) -> list[list[float | None]]:
    """Prompt logprobs of each prompt (entry 0 is None)."""
    ids = [torch.tensor(list(p), dtype=torch.long) for p in prompts]
    return [prompt_logprobs(W, h, i) for h, i in zip(prefill(W, ids), ids)]
