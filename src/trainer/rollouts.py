"""Sample one rollout batch: every group's request in flight at once, rewards from the env."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Any, Sequence

import tinker
from tinker_cookbook.rl.problem_env import ProblemEnv

from trainer.datums import Rollout
from trainer.retry import RetryPolicy

log = logging.getLogger(__name__)
# problems whose completion budget was cut by model.max_seq_len (warned once each per process)
_warned_budget: set = set()


def request_seed(seed: int, step: int, group: int, salt: str = "rollout") -> int:
    """A per-request sampling seed fixed by (run seed, step, group): resumed runs resample identically."""
    h = hashlib.sha256(f"{salt}:{seed}:{step}:{group}".encode()).digest()
    return int.from_bytes(h[:4], "little")


def sample_seed(seed: int, step: int, group: int, sample: int) -> int:
    """The seed of one sample's own request (`sampling.requests=per_sample`): distinct within a group, so
    its samples differ by construction on any backend (tinker-feedback #79: the service may return
    identical sequences for one seeded request with num_samples > 1), and fixed, so a rerun or a resumed
    run samples the same tokens."""
    return request_seed(seed, step, group, salt=f"rollout-sample{sample}")


async def _group_rollout(task: Any, problem: Any, group: int, group_size: int, sampling_client: Any,
                         params: tinker.SamplingParams, max_seq_len: int, sem: asyncio.Semaphore,
                         retry: RetryPolicy, sample_seeds: list[int] | None = None) -> list[Rollout]:
    envs = [task.make_env(problem) for _ in range(group_size)]
    obs = await envs[0].initial_observation()
    prompt, stop = obs[0], obs[1]
    prompt_tokens = prompt.to_ints()
    budget = max_seq_len - len(prompt_tokens)
    if budget < 1:
        raise ValueError(f"prompt of problem {problem.index} has {len(prompt_tokens)} tokens, "
                         f"no room under model.max_seq_len={max_seq_len}")
    if budget < params.max_tokens and problem.index not in _warned_budget:
        _warned_budget.add(problem.index)
        log.warning("problem %s: prompt has %d tokens, so completions get %d of sampling.max_tokens=%d "
                    "(model.max_seq_len=%d)", problem.index, len(prompt_tokens), budget, params.max_tokens,
                    max_seq_len)
    params = params.model_copy(update={"stop": stop, "max_tokens": min(params.max_tokens, budget)})

    async def request(n: int, p: tinker.SamplingParams) -> list:
        async with sem:
            resp = await retry.acall("sample", lambda: _await(sampling_client.sample(
                prompt=prompt, num_samples=n, sampling_params=p)))
        if len(resp.sequences) != n:
            raise RuntimeError(f"sampler returned {len(resp.sequences)} sequences, asked for {n}")
        return list(resp.sequences)

    if sample_seeds is None:
        seqs = await request(group_size, params)
    else:
        parts = await asyncio.gather(*[request(1, params.model_copy(update={"seed": s})) for s in sample_seeds])
        seqs = [p[0] for p in parts]
    out = []
    for env, seq in zip(envs, seqs):
        if not isinstance(env, ProblemEnv):  # ProblemEnv.step keeps no state from it; it re-renders the prompt
            await env.initial_observation()  # other single-use cookbook envs expect this call first
        tokens = list(seq.tokens)
        res = await env.step(tokens)
        out.append(Rollout(group=group, prompt_tokens=prompt_tokens, tokens=tokens,
                           logprobs=list(seq.logprobs), reward=float(res.reward),
                           metrics={k: float(v) for k, v in res.metrics.items()},
                           stop_reason=str(seq.stop_reason)))
    return out


async def _await(fut: Any) -> Any:
    return await fut


async def sample_batch(task: Any, problems: Sequence[Any], sampling_client: Any, params: tinker.SamplingParams,
                       *, seed: int, step: int, group_size: int, max_seq_len: int, concurrency: int,
                       retry: RetryPolicy, per_sample: bool = False) -> list[list[Rollout]]:
    """All groups of one step, submitted concurrently (bounded by `concurrency` requests); one request per
    group seeded by `request_seed`, or with `per_sample` one per sample (seeded by `sample_seed`).
    `params`: the run's sampling parameters (`tinker_params.sampling_params`), without a seed."""
    sem = asyncio.Semaphore(concurrency)
    coros = []
    for g, problem in enumerate(problems):
        group_params = params.model_copy(update={"seed": request_seed(seed, step, g)})
        seeds = [sample_seed(seed, step, g, i) for i in range(group_size)] if per_sample else None
        coros.append(_group_rollout(task, problem, g, group_size, sampling_client, group_params, max_seq_len,
                                    sem, retry, seeds))
    return list(await asyncio.gather(*coros))
