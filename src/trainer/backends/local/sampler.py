"""Fast batched sampler for Llama-architecture models: fused weights, batched prefill, static
KV-cache decode, per-token logprobs gathered as it goes.

Why not `transformers.generate`: with `output_scores` it keeps `B x vocab` floats per step (8-16 GB
at batch 64 for SmolLM2) and its per-step Python overhead dominates a 135M model on CPU. Here each
layer is a handful of fused matmuls (q|k|v and gate|up concatenated), decode attends over a static
cache slice, and only the sampled token's logprob is kept (local-model.md §2: the bf16 static-cache
loop is ~2x HF generate fp32).

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

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

_PROJ_QKV = ("q_proj", "k_proj", "v_proj")
_PROJ_GU = ("gate_proj", "up_proj")


# ----------------------------------------------------------------------------------- weights
@dataclass
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class SamplerWeights:
    """One immutable weight set (base + merged LoRA delta) in the sampler dtype."""

    embed: torch.Tensor
    lm_head: torch.Tensor
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
        return self.lm_head.shape[0]


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


def build_weights(config: Any, base: dict[str, torch.Tensor], deltas: dict[str, torch.Tensor],
                  cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> SamplerWeights:
    """Fuse base weights (fp32, HF names) plus merged LoRA deltas (`module name -> dW`) into `dtype`."""
    check_architecture(config)

    def w(name: str) -> torch.Tensor:
        t = base[name + ".weight"]
        d = deltas.get(name)
        return (t + d if d is not None else t).to(dtype)

    def norm(name: str) -> torch.Tensor:
        return base[name + ".weight"].to(dtype)

    layers = []
    with torch.no_grad():
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}"
            layers.append(_Layer(
                in_norm=norm(f"{p}.input_layernorm"),
                qkv=torch.cat([w(f"{p}.self_attn.{n}") for n in _PROJ_QKV], 0).contiguous(),
                o=w(f"{p}.self_attn.o_proj"),
                post_norm=norm(f"{p}.post_attention_layernorm"),
                gate_up=torch.cat([w(f"{p}.mlp.{n}") for n in _PROJ_GU], 0).contiguous(),
                down=w(f"{p}.mlp.down_proj")))
        embed = base["model.embed_tokens.weight"].to(dtype)
        head_w = base.get("lm_head.weight", base["model.embed_tokens.weight"])
        if "lm_head" in deltas:  # an unembedding LoRA changes the output projection only
            lm_head = (head_w + deltas["lm_head"]).to(dtype)
        elif head_w.data_ptr() == base["model.embed_tokens.weight"].data_ptr():
            lm_head = embed  # tied: share the sampler copy too
        else:
            lm_head = head_w.to(dtype)
    from transformers.activations import ACT2FN

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return SamplerWeights(
        embed=embed, lm_head=lm_head, final_norm=norm("model.norm"), layers=layers,
        n_heads=config.num_attention_heads, n_kv=config.num_key_value_heads, head_dim=head_dim,
        intermediate=config.intermediate_size, eps=float(config.rms_norm_eps), act=ACT2FN[config.hidden_act],
        cos=cos.to(dtype), sin=sin.to(dtype), max_context=cos.shape[0], dtype=dtype)


# ----------------------------------------------------------------------------------- forward
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


def _mlp(W: SamplerWeights, L: _Layer, x: torch.Tensor) -> torch.Tensor:
    gu = F.linear(x, L.gate_up)
    g, u = gu.split(W.intermediate, dim=-1)
    return F.linear(W.act(g) * u, L.down)


def prefill(W: SamplerWeights, ids_T: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
            row: int = 0, offset: int = 0) -> torch.Tensor:
    """Run one prompt `[T]` (unpadded: no FLOPs on padding); write its K/V into
    `cache[l][row, :, offset:offset + T]` when given. Returns final-normed hidden states `[T, H]`."""
    T = ids_T.shape[0]
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    cos = W.cos[:T].view(1, 1, T, hd)
    sin = W.sin[:T].view(1, 1, T, hd)
    x = F.embedding(ids_T.view(1, T), W.embed)
    for li, L in enumerate(W.layers):
        h = _rms(x, L.in_norm, W.eps)
        q, k, v = F.linear(h, L.qkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = _rope(q.view(1, T, nh, hd).transpose(1, 2), cos, sin)
        k = _rope(k.view(1, T, nkv, hd).transpose(1, 2), cos, sin)
        v = v.view(1, T, nkv, hd).transpose(1, 2)
        if cache is not None:
            cache[li][0][row, :, offset: offset + T] = k[0]
            cache[li][1][row, :, offset: offset + T] = v[0]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=nkv != nh)
        x = x + F.linear(a.transpose(1, 2).reshape(1, T, nh * hd), L.o)
        x = x + _mlp(W, L, _rms(x, L.post_norm, W.eps))
    return _rms(x, W.final_norm, W.eps)[0]


def decode_step(W: SamplerWeights, tok_B: torch.Tensor, t: int, pos_B: torch.Tensor, valid_BL: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """One token per row at cache index `t` (rope position `pos_B`); returns fp32 logits `[B, V]`."""
    B = tok_B.shape[0]
    nh, nkv, hd = W.n_heads, W.n_kv, W.head_dim
    g = nh // nkv
    cos = W.cos[pos_B].view(B, 1, 1, hd)
    sin = W.sin[pos_B].view(B, 1, 1, hd)
    mask = valid_BL[:, : t + 1].view(B, 1, 1, t + 1)
    x = F.embedding(tok_B, W.embed)  # [B, H]
    for li, L in enumerate(W.layers):
        h = _rms(x, L.in_norm, W.eps)
        q, k, v = F.linear(h, L.qkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        q = _rope(q.view(B, nh, 1, hd), cos, sin)
        k = _rope(k.view(B, nkv, 1, hd), cos, sin)
        kc, vc = cache[li]
        kc[:, :, t: t + 1] = k
        vc[:, :, t: t + 1] = v.view(B, nkv, 1, hd)
        # GQA without repeating K/V: q head h uses kv head h // g, so group the g query heads of one
        # kv head as g "positions" of a single-query attention over that head's cache.
        a = F.scaled_dot_product_attention(q.view(B, nkv, g, hd), kc[:, :, : t + 1], vc[:, :, : t + 1],
                                           attn_mask=mask)
        x = x + F.linear(a.reshape(B, nh * hd), L.o)
        x = x + _mlp(W, L, _rms(x, L.post_norm, W.eps))
    return F.linear(_rms(x, W.final_norm, W.eps), W.lm_head).float()


def _target_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden_TH, W.lm_head).float()
    return logits.gather(-1, targets_T.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


def prompt_logprobs(W: SamplerWeights, hidden_TH: torch.Tensor, ids_T: torch.Tensor) -> list[float | None]:
    """`[None, logp(tok_1 | tok_0), ...]` of one prefilled prompt."""
    if ids_T.shape[0] <= 1:
        return [None] * ids_T.shape[0]
    return [None] + _target_logprobs(W, hidden_TH[:-1], ids_T[1:]).tolist()


@torch.no_grad()
def score(W: SamplerWeights, prompts: Sequence[Sequence[int]]) -> list[list[float | None]]:
    """Prompt logprobs of each prompt (entry 0 is None)."""
    out = []
    for p in prompts:
        ids = torch.tensor(list(p), dtype=torch.long)
        out.append(prompt_logprobs(W, prefill(W, ids), ids))
    return out


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


@dataclass
class _Row:
    job: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    reason: str = "length"


@torch.no_grad()
def generate(W: SamplerWeights, jobs: Sequence[SampleJob], tokenizer: Any = None) -> list[SampleResult]:
    """Sample all `jobs` together: one prefill of the distinct prompts, then a decode loop over all rows."""
    if not jobs:
        return []
    T = max(len(j.prompt) for j in jobs)
    L = T + max(j.max_tokens for j in jobs)
    if L > W.max_context:
        raise ValueError(f"longest prompt ({T}) + max_tokens exceeds the model context ({W.max_context})")
    rows: list[_Row] = []
    src = []
    for ji, j in enumerate(jobs):
        for _ in range(j.num_samples):
            rows.append(_Row(job=ji))
            src.append(ji)
    B = len(rows)
    src_B = torch.tensor(src, dtype=torch.long)
    R = len(jobs)
    # prompts are left-aligned to T in the cache (prompt i occupies [T - len_i, T)); each is prefilled
    # on its own, so no compute goes to padding, and its K/V are copied to its job's sample rows
    cache_R = [(torch.zeros(R, W.n_kv, L, W.head_dim, dtype=W.dtype),
                torch.zeros(R, W.n_kv, L, W.head_dim, dtype=W.dtype)) for _ in W.layers]
    results = [SampleResult() for _ in jobs]
    last = []
    for ji, j in enumerate(jobs):
        ids = torch.tensor(j.prompt, dtype=torch.long)
        hidden = prefill(W, ids, cache_R, ji, T - len(j.prompt))
        if j.include_prompt_logprobs:
            results[ji].prompt_logprobs = prompt_logprobs(W, hidden, ids)
        last.append(hidden[-1])
    logits = F.linear(torch.stack(last), W.lm_head).float()[src_B]  # [B, V]
    cache = [(kc.index_select(0, src_B), vc.index_select(0, src_B)) for kc, vc in cache_R]
    del cache_R
    pad_B = torch.tensor([T - len(jobs[r.job].prompt) for r in rows], dtype=torch.long)
    valid_BL = torch.arange(L).unsqueeze(0) >= pad_B.unsqueeze(1)
    gens = []
    for j in jobs:
        if j.seed is not None:
            gens.append(torch.Generator().manual_seed(int(j.seed)))
        else:
            gens.append(torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item())))
    temp_B = torch.tensor([1.0 if jobs[r.job].greedy else float(jobs[r.job].temperature) for r in rows])
    job_rows: list[list[int]] = [[] for _ in jobs]
    for b, r in enumerate(rows):
        job_rows[r.job].append(b)
    live = torch.arange(B)  # batch index -> row index (shrinks when finished rows are compacted)
    job_done = [False] * len(jobs)
    max_steps = max(j.max_tokens for j in jobs)
    for step in range(max_steps):
        # ---- choose tokens for every live row (logits: [len(live), V])
        scaled = logits / temp_B[live].unsqueeze(1)
        lse = torch.logsumexp(scaled, -1)
        tok = torch.argmax(logits, -1)
        pos_of = {int(r): i for i, r in enumerate(live.tolist())}
        idx_l, u_l = [], []
        filt = scaled
        for ji, j in enumerate(jobs):
            if job_done[ji] or j.greedy:
                continue
            idx = [pos_of[b] for b in job_rows[ji]]
            if j.top_k > 0 or j.top_p < 1.0:
                if filt is scaled:
                    filt = scaled.clone()
                ii = torch.tensor(idx)
                filt[ii] = _filter_top(scaled[ii], j.top_k, j.top_p)
            idx_l += idx
            u_l.append(torch.rand(len(idx), generator=gens[ji], dtype=torch.float64))
        if idx_l:
            # inverse-CDF draw: one uniform per row from the request's own generator (cheaper than
            # torch.multinomial, and independent of the other requests in the batch)
            ii = torch.tensor(idx_l)
            cdf = torch.softmax(filt[ii], -1).double().cumsum(-1)
            u = torch.cat(u_l).unsqueeze(1) * cdf[:, -1:]
            tok[ii] = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[1] - 1)
        lp = scaled.gather(1, tok.unsqueeze(1)).squeeze(1) - lse
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
        t = T + step
        logits = decode_step(W, tok, t, (t - pad_B[live]), valid_BL[live], cache)
    for b, r in enumerate(rows):
        results[r.job].sequences.append((r.tokens, r.logprobs, r.reason))
    return results


def _hits_stop_string(tokens: list[int], stops: tuple[str, ...], tokenizer: Any) -> bool:
    longest = max(len(s) for s in stops)
    tail = tokenizer.decode(tokens[-(longest + 2):])
    return any(s in tail for s in stops)
