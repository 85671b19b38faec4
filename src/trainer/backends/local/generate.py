"""The sampling loop of the local engine: sample `SampleJob`s together, as small named steps
(`prefill`, `sample`, `record`, `compact`, `decode_one_token`), returning each sampled token's logprob.

Why not `transformers.generate`: with `output_scores` it keeps `B x vocab` floats per step (8-16 GB
at batch 64 for SmolLM2) and its per-step Python overhead dominates a 135M model on CPU. Here each
layer is a handful of fused matmuls (q|k|v and gate|up stacked), decode attends over a static cache
slice, and only the sampled token's logprob is kept (`bench/sampler.py` times both).

Batch invariance (a request's tokens and logprobs are bit-identical alone or in any batch, for one
machine and thread count): the scheduler batches requests by arrival timing, so besides the forward's
own invariance (`sampler_forward`) each row's token and logprob come from its own logits by the same
formulas whatever the other rows do, and its draws come from its own request's generator.

Sampling conventions (Tinker leaves them undocumented):
- logprob of a sampled token = log softmax(logits / T) over the FULL vocabulary (before top-k/top-p
  truncation), i.e. the tempered distribution; greedy (T = 0 or top_k = 1) reports the T = 1 logprob.
- a stop token id ends the sequence and is included once; a stop string ends it at the token whose
  decoding completes the string (that token included); stop_reason "stop", else "length".
- seeded requests draw from their own `torch.Generator` (one uniform per row per step, inverse-CDF),
  so the draws do not depend on which other requests share the batch.
- `coupling="gumbel"` (`sampling.coupling`) draws instead by Gumbel-max over the tempered (and top-k / top-p
  truncated) vocabulary with noise keyed by (request seed, sample index, response position, token id)
  (`keyed.gumbel_argmax`): two batches at one seed whose distributions differ slightly draw the same token
  far more often than inverse-CDF's shared uniform allows, and no row's noise depends on another's.
- `logit_noise` sigma > 0 (`backend.sampler_logit_noise`) adds sigma times a standard normal keyed by (request
  seed, sample index, response position, token id) (`keyed.normal`) to every sampled row's logits before
  anything reads them: the token, its logprob (of the noisy distribution) and a greedy row's argmax. Prompt
  logprobs and `compute_logprobs` stay noise-free.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from trainer.backends.local import keyed, sampler_forward
from trainer.backends.local.sampler_forward import KVCache, new_cache, prompt_logprobs, prompt_topk
from trainer.backends.local.sampler_weights import SamplerWeights
from trainer.config.enums import SAMPLING_COUPLINGS


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
    topk_prompt: int = 0  # top-k prompt logprobs per position (0 = none)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass
class SampleResult:
    sequences: list[tuple[list[int], list[float], str]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    topk_prompt: tuple[Any, Any] | None = None  # (token_ids [T, k], logprobs [T, k]), `prompt_topk`


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
    costs a large share of a decode step at vocabulary 49152; never returns a zero-probability token.
    Blocks are summed in fp32 (relative error ~1e-7 per block, far below any sampling noise; converting
    the whole [rows, vocab] to fp64 first is slower) and accumulated across blocks in fp64."""
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


@dataclass
class _Batch:
    """The rows of one `generate` call and what the steps share about them."""

    jobs: Sequence[SampleJob]
    order: list[int]  # job indices, longest prompt first
    rows: list[_Row]  # each job's rows together and in order, jobs in `order`
    job_rows: list[list[int]]  # job -> its row indices
    cache_len: int  # the largest prompt + max_tokens of one job
    temp_B: torch.Tensor  # per row: its job's temperature (1 for greedy jobs)
    plen_B: torch.Tensor  # per row: its prompt length
    sample_B: torch.Tensor  # per row: its sample index within its job
    gens: dict[int, torch.Generator] = field(default_factory=dict)  # per sampling (non-greedy) job
    job_done: list[bool] = field(default_factory=list)
    live: torch.Tensor | None = None  # batch index -> row index (shrinks when finished rows are compacted)
    logit_noise: float = 0.0  # sd of the keyed logit noise (0: none)
    coupling: str = "inverse_cdf"  # inverse_cdf | gumbel
    seed_B: torch.Tensor | None = None  # per row: its job's seed (int64), where noise or gumbel key on it


def _plan(W: SamplerWeights, jobs: Sequence[SampleJob]) -> _Batch:
    # each job must fit on its own; the cache is as long as the longest job needs (a long prompt with a
    # short budget and a short prompt with a long one share a batch: rows past their own budget are
    # finished, and `decode_one_token` holds their position inside the cache)
    L = max(len(j.prompt) + j.max_tokens for j in jobs)
    if L > W.max_context:
        j = max(jobs, key=lambda j: len(j.prompt) + j.max_tokens)
        raise ValueError(f"prompt ({len(j.prompt)} tokens) + max_tokens ({j.max_tokens}) exceeds the model "
                         f"context ({W.max_context})")
    # rows grouped by prompt length (longest first; a job's rows stay together and in order), so the rows
    # attending over the same cache length are one contiguous span at every step
    order = sorted(range(len(jobs)), key=lambda ji: -len(jobs[ji].prompt))
    rows = [_Row(job=ji) for ji in order for _ in range(jobs[ji].num_samples)]
    job_rows: list[list[int]] = [[] for _ in jobs]
    for b, r in enumerate(rows):
        job_rows[r.job].append(b)
    return _Batch(
        jobs=jobs, order=order, rows=rows, job_rows=job_rows, cache_len=L,
        temp_B=torch.tensor([1.0 if jobs[r.job].greedy else float(jobs[r.job].temperature) for r in rows]),
        plen_B=torch.tensor([len(jobs[r.job].prompt) for r in rows], dtype=torch.long),
        sample_B=torch.tensor([k for ji in order for k in range(jobs[ji].num_samples)], dtype=torch.long),
        job_done=[False] * len(jobs), live=torch.arange(len(rows)))


def prefill(W: SamplerWeights, batch: _Batch, results: list[SampleResult]) -> tuple[torch.Tensor, KVCache]:
    """Every job's prompt prefilled once, all together (`sampler_forward.prefill`: prompts stay
    independent of each other), each into its own cache slot (indices `[0, len)`), then its K/V copied
    to each of its rows. Records the prompt logprobs the jobs asked for; returns the first
    token's logits `[rows, V]` and the rows' cache."""
    jobs, R = batch.jobs, len(batch.jobs)
    cache_R = new_cache(W, R, batch.cache_len)
    ids = [torch.tensor(j.prompt, dtype=torch.long) for j in jobs]
    hidden = sampler_forward.prefill(W, ids, cache_R, range(R))
    for ji, j in enumerate(jobs):
        if j.include_prompt_logprobs:
            results[ji].prompt_logprobs = prompt_logprobs(W, hidden[ji], ids[ji])
        if j.topk_prompt:
            results[ji].topk_prompt = prompt_topk(W, hidden[ji], j.topk_prompt)
    src_B = torch.tensor([r.job for r in batch.rows], dtype=torch.long)
    logits = sampler_forward.logits(W, torch.stack([h[-1] for h in hidden]))[src_B]  # [B, V]
    return logits, [(kc.index_select(0, src_B), vc.index_select(0, src_B)) for kc, vc in cache_R]


def _seeds(jobs: Sequence[SampleJob], greedy_too: bool = False) -> dict[int, int]:
    """The seed of every sampling job (and with `greedy_too` of every greedy one): its own, else one drawn
    from the global generator, sampling jobs first in job order. Greedy jobs draw nothing unless
    `greedy_too` (the logit noise keys on a seed; nothing else of a greedy job does)."""
    seeds: dict[int, int] = {}
    for ji, j in enumerate(jobs):
        if not j.greedy:
            seeds[ji] = int(j.seed) if j.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    for ji, j in enumerate(jobs):
        if greedy_too and j.greedy:
            seeds[ji] = int(j.seed) if j.seed is not None else int(torch.randint(0, 2**62, (1,)).item())
    return seeds


def _generators(jobs: Sequence[SampleJob], seeds: dict[int, int]) -> dict[int, torch.Generator]:
    """One generator per sampling job, from its seed (`_seeds`)."""
    return {ji: torch.Generator().manual_seed(seeds[ji]) for ji, j in enumerate(jobs) if not j.greedy}


def _int64(seed: int) -> int:
    """`seed` modulo 2^64 as a signed int64 (its 64 bits are what the keys mix in)."""
    u = seed % 2**64
    return u - 2**64 if u >= 2**63 else u


def sample(batch: _Batch, logits: torch.Tensor, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A token and its logprob for every live row (`logits`: `[live rows, V]`) at response position `step`;
    each row's token and logprob come from its own logits by the same formulas whatever the other rows do."""
    jobs, live = batch.jobs, batch.live
    if batch.logit_noise > 0:  # the sampler's numbers perturbed: the draw, logprob and argmax read them
        keys = keyed.row_keys(keyed.NOISE_SALT, batch.seed_B[live], batch.sample_B[live], step)
        logits = logits + batch.logit_noise * keyed.normal(keys, logits.shape[-1])
    gumbel = batch.coupling == "gumbel"
    gkeys = (keyed.row_keys(keyed.GUMBEL_SALT, batch.seed_B[live], batch.sample_B[live], step) if gumbel
             else None)
    temps = batch.temp_B[live]
    scaled = logits if bool((temps == 1.0).all()) else logits / temps.unsqueeze(1)
    probs = torch.softmax(scaled, -1)  # the tempered distribution over the full vocabulary
    # greedy rows take the argmax; a full-vocabulary argmax per step is skipped when no live job is greedy
    # (rows of finished jobs keep a placeholder token: nothing reads their outputs)
    tok = (torch.argmax(logits, -1) if any(jobs[ji].greedy and not batch.job_done[ji] for ji in batch.order)
           else torch.zeros(logits.shape[0], dtype=torch.long))
    pos_of = {int(r): i for i, r in enumerate(live.tolist())}
    idx_l, u_l = [], []  # rows drawing from the full tempered distribution
    for ji in batch.order:
        j = jobs[ji]
        if batch.job_done[ji] or j.greedy:
            continue
        idx = [pos_of[b] for b in batch.job_rows[ji]]
        if gumbel:  # keyed noise, nothing drawn from the generator
            if j.top_k > 0 or j.top_p < 1.0:
                ii = torch.tensor(idx)
                tok[ii] = keyed.gumbel_argmax(_filter_top(scaled[ii], j.top_k, j.top_p), gkeys[ii])
            else:
                idx_l += idx
            continue
        # inverse-CDF draws: one uniform per row per step from the request's own generator (cheaper
        # than torch.multinomial, and independent of the other requests in the batch)
        u = torch.rand(len(idx), generator=batch.gens[ji], dtype=torch.float64)
        if j.top_k > 0 or j.top_p < 1.0:
            ii = torch.tensor(idx)
            tok[ii] = inverse_cdf(torch.softmax(_filter_top(scaled[ii], j.top_k, j.top_p), -1), u)
        else:
            idx_l += idx
            u_l.append(u)
    if idx_l and gumbel:
        if idx_l == list(range(len(live))):
            tok = keyed.gumbel_argmax(scaled, gkeys)
        else:
            ii = torch.tensor(idx_l)
            tok[ii] = keyed.gumbel_argmax(scaled[ii], gkeys[ii])
    elif idx_l:  # one call for all of them (a row's draw depends on its own row only)
        if idx_l == list(range(len(live))):
            tok = inverse_cdf(probs, torch.cat(u_l))
        else:
            ii = torch.tensor(idx_l)
            tok[ii] = inverse_cdf(probs[ii], torch.cat(u_l))
    # log of an fp32 probability: abs. error ~1e-7
    lp = probs.gather(1, tok.unsqueeze(1)).squeeze(1).log()
    return tok, lp


def record(batch: _Batch, tok: torch.Tensor, lp: torch.Tensor, tokenizer: Any) -> None:
    """Append each unfinished live row's token and logprob; mark rows (and jobs) that hit a stop token,
    a stop string or their max_tokens."""
    tok_l, lp_l = tok.tolist(), lp.tolist()
    for i, b in enumerate(batch.live.tolist()):
        r = batch.rows[b]
        if r.done:
            continue
        j = batch.jobs[r.job]
        if len(r.tokens) >= j.max_tokens:
            r.done = True
            continue
        r.tokens.append(tok_l[i])
        r.logprobs.append(lp_l[i])
        if tok_l[i] in j.stop_ids or (j.stop_strs and _hits_stop_string(r.tokens, j.stop_strs, tokenizer)):
            r.done, r.reason = True, "stop"
        elif len(r.tokens) >= j.max_tokens:
            r.done = True
    for ji in range(len(batch.jobs)):
        batch.job_done[ji] = all(batch.rows[b].done for b in batch.job_rows[ji])


def compact(batch: _Batch, tok: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, KVCache]:
    """Drop finished jobs' rows once they are half the batch (a job's rows stay together)."""
    keep = [i for i, b in enumerate(batch.live.tolist()) if not batch.job_done[batch.rows[b].job]]
    if len(keep) <= len(batch.live) // 2:
        k = torch.tensor(keep, dtype=torch.long)
        batch.live = batch.live[k]
        tok = tok[k]
        cache = [(kc.index_select(0, k), vc.index_select(0, k)) for kc, vc in cache]
    return tok, cache


def decode_one_token(W: SamplerWeights, batch: _Batch, tok: torch.Tensor, step: int, cache: KVCache
                     ) -> torch.Tensor:
    """The next logits of every live row, its token `tok` written at cache index = prompt length + step."""
    # a finished row (its job done or its own budget spent) still decodes until compaction drops it; its
    # output is discarded, so its position is held at the cache's last slot instead of running past it
    pos = (batch.plen_B[batch.live] + step).clamp_(max=batch.cache_len - 1)
    return sampler_forward.decode_step(W, tok, pos, _spans(pos.tolist()), cache)


def generate(W: SamplerWeights, jobs: Sequence[SampleJob], tokenizer: Any = None, *, logit_noise: float = 0.0,
             coupling: str = "inverse_cdf") -> list[SampleResult]:
    """Sample all `jobs` together: the prompts prefilled in one pass, then one decode loop over all rows.

    Every row's numbers are independent of the other jobs in the batch (see `sampler_forward`), and its
    draws come from its job's generator (or its keys), so a seeded job returns the same tokens and
    bit-identical logprobs alone or in any batch (same machine and thread count). `logit_noise`, `coupling`:
    see the module docstring."""
    steps = generate_steps(W, jobs, tokenizer, logit_noise=logit_noise, coupling=coupling)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


@torch.no_grad()
def generate_steps(W: SamplerWeights, jobs: Sequence[SampleJob], tokenizer: Any = None, *,
                   logit_noise: float = 0.0, coupling: str = "inverse_cdf"
                   ) -> Generator[None, None, list[SampleResult]]:
    """`generate` one step at a time: yields after the prefill and after each decode step, returns the
    results. The scheduler interleaves batches of different clients this way; a batch's numbers do not
    depend on what runs between its steps (its state is its own: cache, rows, generators)."""
    if not jobs:
        return []
    if not (math.isfinite(logit_noise) and logit_noise >= 0) or coupling not in SAMPLING_COUPLINGS:
        raise ValueError(f"logit_noise must be a finite number >= 0 and coupling one of "
                         f"{list(SAMPLING_COUPLINGS)}, got {logit_noise!r}, {coupling!r}")
    batch = _plan(W, jobs)
    results = [SampleResult() for _ in jobs]
    logits, cache = prefill(W, batch, results)
    seeds = _seeds(jobs, greedy_too=logit_noise > 0)
    batch.gens = _generators(jobs, seeds)
    if logit_noise > 0 or coupling != "inverse_cdf":  # the keyed draws' seed per row
        batch.logit_noise, batch.coupling = float(logit_noise), coupling
        batch.seed_B = torch.tensor([_int64(seeds.get(r.job, 0)) for r in batch.rows], dtype=torch.long)
    max_steps = max(j.max_tokens for j in jobs)
    for step in range(max_steps):
        yield
        tok, lp = sample(batch, logits, step)
        record(batch, tok, lp, tokenizer)
        if all(batch.job_done) or step == max_steps - 1:
            break
        tok, cache = compact(batch, tok, cache)
        logits = decode_one_token(W, batch, tok, step, cache)
    for r in batch.rows:
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
