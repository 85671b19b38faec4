"""The RL loop turns each group's rewards into advantages with the configured estimator (`advantage`).

Every other run in the suite pins `advantage=none` (a tiny random model scores every GSM8K completion
alike, so only A = R gives it a learning signal), which leaves the loop's use of `cfg.advantage`
unchecked: a loop that ignored it would pass them all. Here the env's reward is rewritten to vary
within each group, the loop runs with `group_zscore`, and the advantages it logs (rollouts.jsonl) are
compared with the values computed by hand; each estimator gives a different number for them. The same
rewritten env checks the loop's use of the lr schedule's horizon and of `drop_constant_groups`."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
from runs import TINY

GROUP = 3
# the first sample of each group scores 3, the others 0: mean 1, population std sqrt(2)
REWARDS = [3.0, 0.0, 0.0]
BY_ESTIMATOR = {"none": 3.0, "group_mean": 2.0, "group_zscore": 2.0 / (math.sqrt(2.0) + 1e-6)}


def _run_loop(tmp_path, overrides: list[str], reward_of) -> tuple:
    """One RLLoop run of the tiny model whose env rewards the n-th env made with `reward_of(n)`; returns
    (cfg, run folder). A group's envs are made one after another (rollouts._group_rollout), so n // group
    size is the env's group and n mod group size its place in it, the order the loop lists rollouts in."""
    from trainer.backends import build_service_client
    from trainer.config.compose import run_config
    from trainer.loop import RLLoop
    from trainer.run_info import resolved_config_dict
    from trainer.setup import build_components, make_loss

    cfg = run_config([*(o for o in TINY if not o.startswith("advantage=")), *overrides, "eval=none"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    client = build_service_client(cfg, run_dir)
    try:
        _, _, task = build_components(cfg)
        make_env, made = task.make_env, itertools.count()

        def scored_env(problem):
            env, reward = make_env(problem), reward_of(next(made))
            step = env.step

            async def rescored(tokens, **kw):
                return dataclasses.replace(await step(tokens, **kw), reward=reward)

            env.step = rescored
            return env

        task.make_env = scored_env
        loop = RLLoop(cfg, run_dir, client, task, make_loss(cfg, client), resolved_config_dict(cfg), progress=False)
        loop.run()
    finally:
        client.close()
    return cfg, run_dir


def test_the_loop_applies_the_configured_advantage_estimator(tmp_path):
    assert len(set(BY_ESTIMATOR.values())) == 3
    cfg, run_dir = _run_loop(tmp_path, ["advantage=group_zscore", f"schedule.group_size={GROUP}"],
                             lambda n: REWARDS[n % GROUP])
    samples = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    # the first sample of every group of both steps
    assert len(samples) == cfg.schedule.num_steps * cfg.schedule.groups_per_batch
    for s in samples:
        assert s["reward"] == REWARDS[0]
        assert math.isclose(s["advantage"], BY_ESTIMATOR["group_zscore"], rel_tol=1e-12), s
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/reward_mean"] == sum(REWARDS) / GROUP for r in rows)


def test_the_lr_schedule_spans_every_update_and_constant_groups_are_dropped(tmp_path):
    """With K = 2 updates per batch the linear schedule decays over num_steps * K optimizer steps (a
    horizon of num_steps would reach the floor halfway); with `drop_constant_groups` only the mixed group's
    rollouts are trained on (group 0 mixed, groups 1 and 2 all zero)."""
    peak, steps, K = 0.01, 2, 2
    _, run_dir = _run_loop(tmp_path, ["advantage=group_mean", f"schedule.group_size={GROUP}",
                                        "schedule.groups_per_batch=3", f"schedule.num_steps={steps}",
                                        f"schedule.updates_per_batch={K}", "schedule.lr_schedule=linear",
                                        "schedule.drop_constant_groups=true", f"optimizer.lr={peak}"],
                             lambda n: REWARDS[n % GROUP] if (n // GROUP) % 3 == 0 else 0.0)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["global_update"] for r in rows] == [0, 1, 2, 3]
    # linear from the peak to 0 over 4 updates: 0.01, 0.0075, 0.005, 0.0025
    assert [r["optim/lr"] for r in rows] == pytest.approx([peak * (1 - u / (steps * K)) for u in range(4)],
                                                          rel=1e-12)
    assert all(r["env/rollouts_trained"] == GROUP for r in rows)  # 3 of 9
    assert all(r["env/frac_mixed_groups"] == pytest.approx(1 / 3) for r in rows)
