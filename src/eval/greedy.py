"""Greedy evaluation: every test item in flight at once, one record per item, graded by the env."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tinker

from trainer.config.schema import Config

log = logging.getLogger(__name__)


def greedy_eval_budgets(cfg: Config) -> dict[str, int]:
    """`run_greedy_eval`'s budgets from a run config (the training run's evals, the preflight pilot's and
    `python -m eval.run` all take them from here): the eval group's completion length and concurrency,
    and the model's context length."""
    return {"max_tokens": cfg.eval.max_tokens, "max_seq_len": cfg.model.max_seq_len,
            "concurrency": cfg.eval.concurrency, "samples_per_item": cfg.eval.samples_per_item,
            "temperature": cfg.eval.temperature}


def greedy_params(max_tokens: int, stop: Any) -> tinker.SamplingParams:
    # temperature 0 and top_k=1 both mean argmax; set both so either convention gives greedy
    return tinker.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_k=1, stop=stop, seed=0)


def sampled_params(max_tokens: int, stop: Any, temperature: float, seed: int) -> tinker.SamplingParams:
    # K samples per item: a fixed seed per item keeps a rerun of the same checkpoint reproducible
    return tinker.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop, seed=seed)


async def _one(task: Any, problem: Any, sampling_client: Any, max_tokens: int, max_seq_len: int,
               sem: asyncio.Semaphore, retry: Any, samples_per_item: int = 1, temperature: float = 1.0) -> dict:
    from envs import problem_sha256

    env = task.make_env(problem)
    prompt, stop = await env.initial_observation()
    budget = max(1, min(max_tokens, max_seq_len - prompt.length))
    K = int(samples_per_item)
    params = (greedy_params(budget, stop) if K == 1
              else sampled_params(budget, stop, temperature, seed=int(problem.index)))
    async with sem:
        resp = await retry.acall("eval_sample", lambda: _await(sampling_client.sample(
            prompt=prompt, num_samples=K, sampling_params=params)))
    graded = []
    for k, seq in enumerate(resp.sequences[:K]):
        # each sample is graded by a fresh env of the item (an env is one episode)
        e = env if k == 0 else task.make_env(problem)
        if k:
            await e.initial_observation()
        tokens = list(seq.tokens)
        res = await e.step(tokens)
        graded.append((seq, tokens, res))
    if len(graded) != K:
        raise RuntimeError(f"eval item {problem.index}: asked for {K} samples, the sampler returned {len(graded)}")
    seq, tokens, res = graded[0]
    text = task.decode(tokens) if hasattr(task, "decode") else None
    if text is None:
        text = env.renderer.tokenizer.decode(tokens)
    parsed = task.parse_answer(text)
    rec = {
        "index": int(problem.index),
        "question_sha256": problem_sha256(problem),
        "completion": text,
        "parsed": parsed,
        "gold": str(problem.answer),
        "correct": bool(res.metrics.get("correct", 0.0) >= 0.5),
        "reward": float(res.reward),
        "n_tokens": len(tokens),
        "stop_reason": str(seq.stop_reason),
    }
    if K > 1:
        score = sum(r.metrics.get("correct", 0.0) >= 0.5 for _, _, r in graded) / K
        rec.update(score=score, samples=K, correct=score >= 0.5,
                   n_tokens=sum(len(t) for _, t, _ in graded))
    return rec


async def _await(fut: Any) -> Any:
    return await fut


async def check_greedy_determinism(task: Any, problem: Any, sampling_client: Any, max_tokens: int,
                                   max_seq_len: int) -> bool:
    """Two identical greedy requests must return identical tokens; False means eval is not reproducible."""
    env = task.make_env(problem)
    prompt, stop = await env.initial_observation()
    params = greedy_params(max(1, min(max_tokens, max_seq_len - prompt.length)), stop)
    a, b = await asyncio.gather(_await(sampling_client.sample(prompt=prompt, num_samples=1, sampling_params=params)),
                                _await(sampling_client.sample(prompt=prompt, num_samples=1, sampling_params=params)))
    return list(a.sequences[0].tokens) == list(b.sequences[0].tokens)


def run_greedy_eval(task: Any, problems: Sequence[Any], sampling_client: Any, *, max_tokens: int,
                    max_seq_len: int, concurrency: int, retry: Any, out_path: Path | None = None,
                    extra: dict | None = None, check_determinism: bool = True, samples_per_item: int = 1,
                    temperature: float = 1.0) -> dict:
    """Evaluate `problems` greedily (or, with samples_per_item K > 1, with K samples per item at `temperature`,
    each item scored by its fraction correct); write per-item records and a summary next to them."""
    from eval.records import summarize, write_item_records
    from trainer.utils.io import atomic_write_json

    async def go() -> tuple[list[dict], bool | None]:
        det = None
        if check_determinism and problems:
            det = await check_greedy_determinism(task, problems[0], sampling_client, max_tokens, max_seq_len)
        sem = asyncio.Semaphore(concurrency)
        recs = await asyncio.gather(*[_one(task, p, sampling_client, max_tokens, max_seq_len, sem, retry,
                                           samples_per_item, temperature) for p in problems])
        return list(recs), det

    t0 = time.time()
    records, deterministic = asyncio.run(go())
    if deterministic is not None:
        if deterministic:
            log.info("greedy determinism check: two identical greedy requests returned identical tokens")
        else:
            log.warning("greedy determinism check FAILED: identical greedy requests returned different tokens")
    summary = summarize(records, **(extra or {}))
    summary.update({"greedy_deterministic": deterministic, "time_s": round(time.time() - t0, 2),
                    "tokens": int(sum(r["n_tokens"] for r in records))})
    if out_path is not None:
        out_path = Path(out_path)
        write_item_records(out_path, records)
        atomic_write_json(out_path.with_suffix(".summary.json"), summary)
    return summary
