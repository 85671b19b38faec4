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

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from trainer.backends.local.model import layer
from trainer.backends.local.ops import ATTN_DTYPE, rope_qk
from trainer.backends.local.sampler_weights import ROW_BLOCK, SamplerWeights

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [rows, n_kv, length, head_dim]
# rows per prefill product block (`prefill`): any fixed count keeps prompts independent of each other; 64
# rows already run near the speed of training-size products (bench/README), and few prompts pad much
PREFILL_BLOCK = 64


def new_cache(W: SamplerWeights, rows: int, length: int) -> KVCache:
    """An empty KV cache for `rows` rows of up to `length` positions, in the layout `decode_step` reads
    (its dtype is the plan's: `ops.SamplerOps.cache_dtype`)."""
    shape = (rows, W.n_kv, length, W.head_dim)
    return [(torch.zeros(shape, dtype=W.ops.cache_dtype), torch.zeros(shape, dtype=W.ops.cache_dtype))
            for _ in W.layers]


def logits(W: SamplerWeights, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of final-normed hidden states, each row computed alike whatever the others (fixed
    `ROW_BLOCK`-row blocks, or the AMX head kernel: `SamplerWeights.head_logits`)."""
    return W.head_logits(hidden.float(), blocked=True)


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
    ops = W.ops
    x = F.embedding(torch.cat(list(prompts)), W.embed)  # [N, H], fp32
    y = None  # the previous product's output, not yet added to x
    for li, L in enumerate(W.layers):
        def attend(qkv: torch.Tensor, li: int = li) -> torch.Tensor:
            q, k, v = rope_qk(qkv, cos, sin, nh, nkv, hd)  # [N, heads, hd]
            attn = []
            for i, (a, n) in enumerate(zip(starts, lens)):
                qi, ki, vi = (t[a: a + n].transpose(0, 1) for t in (q, k, v))
                vi = vi.to(ATTN_DTYPE)
                if cache is not None:  # into a sampler-dtype cache, v goes back exactly (it came from that dtype)
                    cache[li][0][rows[i], :, :n] = ops.prefill_keys(qkv[a: a + n], ki, nh, nkv, hd)
                    cache[li][1][rows[i], :, :n] = vi
                o = F.scaled_dot_product_attention(qi[None], ki[None], vi[None], is_causal=True,
                                                   enable_gqa=nkv != nh)[0]
                attn.append(o.transpose(0, 1).reshape(n, nh * hd))
            return torch.cat(attn).to(W.dtype)
        x, y = layer(x, y, L.blocked(PREFILL_BLOCK), attend, ops, W, W.dtype)
    _, x = ops.add_norm(x, y, W.final_norm, W.eps, torch.float32)
    return list(x.split(lens))


def decode_step(W: SamplerWeights, tok_B: torch.Tensor, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                cache: KVCache) -> torch.Tensor:
    """One token per row, written at cache index = rope position `pos_B` (each row's prompt starts at cache
    index 0); `spans`: `(first row, end row, n)` runs of rows that all attend over cache indices `[0, n)`.
    Returns fp32 logits `[B, V]`.

    Batch invariance: projections run in fixed `ROW_BLOCK`-row blocks, and attention runs per row over
    its own cache length (the native kernel: one task per row and key/value head; the torch path: per
    span, with no padding or mask), so a row's numbers depend only on its own tokens (a padded, masked
    attention over the batch's longest row would change the summation order with the batch)."""
    x = F.embedding(tok_B, W.embed)  # [B, H], fp32
    ops = W.ops
    attend = ops.attention(W, pos_B, spans, cache[0][0].shape[2])
    y = None  # the previous product's output, not yet added to x
    for L, (kc, vc) in zip(W.layers, cache):
        x, y = layer(x, y, L.blocked(ROW_BLOCK), lambda qkv: attend(qkv, kc, vc), ops, W, W.dtype)  # noqa: B023
    return logits(W, ops.add_norm(x, y, W.final_norm, W.eps, torch.float32)[1])


def _target_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    lg = W.head_logits(hidden_TH.float())
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
        lg = W.head_logits(hidden_TH[a:min(a + TOPK_ROWS, T - 1)].float())
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
