"""The sampler's Llama forward over `SamplerWeights`: per-prompt prefill into a static KV cache, one
decode step for a batch of rows, and prompt scoring.

Batch invariance (a request's numbers are bit-identical alone or in any batch, for one machine and
thread count): GEMM libraries pick kernels, hence summation orders, by row count, so each prompt is
prefilled on its own (its row count is its length); every decode product that mixes rows of different
requests runs over fixed `ROW_BLOCK`-row blocks; and decode attention runs per run of rows of equal
length over cache indices `[0, n)`, with no padding or mask, as two batched products and a softmax
(`decode_attention`): torch's CPU flash-attention kernel splits the key/value length across threads
when a call has few batch rows, so one row's attention could differ with the number of rows beside it.

Attention runs in fp32 in either sampler dtype, as in the training forward: RoPE on fp32 tables, the KV
cache in fp32 (a bf16 projection's k/v are cast exactly), scores and softmax in fp32; only the
projections run in the sampler dtype. The sampled tokens' logprobs then differ from the training
forward's by the projections' rounding alone.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from trainer.backends.local.model import rms_norm, rope
from trainer.backends.local.sampler_weights import LayerWeights, SamplerWeights

KVCache = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [rows, n_kv, length, head_dim]
# the dtype of the KV cache and of attention (see the module docstring)
ATTN_DTYPE = torch.float32


def _mlp(W: SamplerWeights, L: LayerWeights, x: torch.Tensor, blocked: bool = False) -> torch.Tensor:
    if blocked:
        g, u = L.gate_up.blocked(x).split(W.intermediate, dim=-1)
        return L.down.blocked(W.act(g) * u)
    g, u = L.gate_up(x).split(W.intermediate, dim=-1)
    return L.down(W.act(g) * u)


def prefill(W: SamplerWeights, prompts: Sequence[torch.Tensor], cache: KVCache | None = None,
            rows: Sequence[int] | None = None) -> list[torch.Tensor]:
    """Each prompt (`[T_i]`) on its own, so its GEMMs have its own row count and its numbers do not
    depend on the other prompts of the batch; when `cache` is given, write prompt i's K/V into
    `cache[l][rows[i], :, :T_i]`. Returns the final-normed hidden states `[T_i, H]` of each prompt."""
    return [_prefill_one(W, p, cache, None if rows is None else rows[i]) for i, p in enumerate(prompts)]


def _prefill_one(W: SamplerWeights, ids: torch.Tensor, cache: KVCache | None, row: int | None) -> torch.Tensor:
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    N = int(ids.shape[0])
    cos = W.cos[:N].view(N, 1, hd)
    sin = W.sin[:N].view(N, 1, hd)
    x = F.embedding(ids, W.embed)  # [N, H]
    for li, L in enumerate(W.layers):
        q, k, v = L.qkv(rms_norm(x, L.in_norm, W.eps)).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = rope(q.view(N, nh, hd), cos, sin).transpose(0, 1)  # [nh, N, hd], fp32 (fp32 tables)
        k = rope(k.view(N, nkv, hd), cos, sin).transpose(0, 1)
        v = v.view(N, nkv, hd).transpose(0, 1).to(ATTN_DTYPE)
        if cache is not None:
            cache[li][0][row, :, :N] = k
            cache[li][1][row, :, :N] = v
        attn = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=nkv != nh)[0]
        x = x + L.o(attn.transpose(0, 1).reshape(N, nh * hd).to(W.dtype))
        x = x + _mlp(W, L, rms_norm(x, L.post_norm, W.eps))
    return rms_norm(x, W.final_norm, W.eps)


def decode_step(W: SamplerWeights, tok_B: torch.Tensor, pos_B: torch.Tensor, spans: Sequence[tuple[int, int, int]],
                cache: KVCache) -> torch.Tensor:
    """One token per row, written at cache index = rope position `pos_B` (each row's prompt starts at cache
    index 0); `spans`: `(first row, end row, n)` runs of rows that all attend over cache indices `[0, n)`.
    Returns fp32 logits `[B, V]`.

    Batch invariance: projections run in fixed `ROW_BLOCK`-row blocks, and attention runs per span with
    no padding or mask, so a row's numbers depend only on its own tokens (a padded, masked attention
    over the batch's longest row would change the summation order with the batch)."""
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
        vc[rows_B, :, pos_B] = v.view(B, nkv, hd).to(ATTN_DTYPE)
        # GQA without repeating K/V: q head h uses kv head h // g, so group the g query heads of one
        # kv head as g "positions" of a single-query attention over that head's cache.
        qg = q.view(B, nkv, g, hd)
        a = torch.cat([decode_attention(qg[r0:r1], kc[r0:r1, :, :n], vc[r0:r1, :, :n])
                       for r0, r1, n in spans]) if len(spans) > 1 else \
            decode_attention(qg, kc[:, :, : spans[0][2]], vc[:, :, : spans[0][2]])
        x = x + L.o.blocked(a.reshape(B, nh * hd).to(W.dtype))
        x = x + _mlp(W, L, rms_norm(x, L.post_norm, W.eps), blocked=True)
    return W.lm_head.blocked(rms_norm(x, W.final_norm, W.eps)).float()


def decode_attention(q_BKGD: torch.Tensor, k_BKND: torch.Tensor, v_BKND: torch.Tensor) -> torch.Tensor:
    """Softmax attention of `q` (`[rows, kv heads, queries, head_dim]`) over all `N` cached positions, as
    `softmax(q k^T / sqrt(d)) v` in two batched products. Each (row, head) is its own small matrix
    product whose kernel depends only on (queries, N, head_dim), so a row's result does not depend on
    the rows beside it (unlike the fused SDPA kernel, see the module docstring); at decode shapes it is
    as fast as that kernel."""
    s = torch.matmul(q_BKGD, k_BKND.transpose(-1, -2)).mul_(q_BKGD.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(s, -1), v_BKND)


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
