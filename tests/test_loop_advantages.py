"""The RL loop turns each group's rewards into advantages with the configured estimator (`advantage`).

Every other run in the suite pins `advantage=none` (a tiny random model scores every GSM8K completion
alike, so only A = R gives it a learning signal), which leaves the loop's use of `cfg.advantage`
unchecked: a loop that ignored it would pass them all. Here the env's reward is rewritten to vary
within each group, the loop runs with `group_zscore`, and the advantages it logs (rollouts.jsonl) are
compared with the values computed by hand; each estimator gives a different number for them."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

from runs import TINY

GROUP = 3
# the first sample of each group scores 3, the others 0: mean 1, population std sqrt(2)
REWARDS = [3.0, 0.0, 0.0]
BY_ESTIMATOR = {"none": 3.0, "group_mean": 2.0, "group_zscore": 2.0 / (math.sqrt(2.0) + 1e-6)}


def test_the_loop_applies_the_configured_advantage_estimator(tmp_path):
    from trainer.backends import build_service_client
    from trainer.config.compose import compose_config
    from trainer.loop import RLLoop
    from trainer.run_info import resolved_config_dict
    from trainer.setup import build_components, make_loss

    assert len(set(BY_ESTIMATOR.values())) == 3
    overrides = [o for o in TINY if not o.startswith("advantage=")]
    cfg = compose_config([*overrides, "advantage=group_zscore", f"schedule.group_size={GROUP}", "eval=none"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    client = build_service_client(cfg, run_dir)
    try:
        _, _, task = build_components(cfg)
        make_env, made = task.make_env, itertools.count()

        def scored_env(problem):
            # a group's envs are made one after another (rollouts._group_rollout), so the count's position
            # mod GROUP is the sample's place in its group, and the loop lists a group's rollouts in it
            env, reward = make_env(problem), REWARDS[next(made) % GROUP]
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
    samples = [json.loads(x) for x in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    # the first sample of every group of both steps
    assert len(samples) == cfg.schedule.num_steps * cfg.schedule.groups_per_batch
    for s in samples:
        assert s["reward"] == REWARDS[0]
        assert math.isclose(s["advantage"], BY_ESTIMATOR["group_zscore"], rel_tol=1e-12), s
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["env/reward_mean"] == sum(REWARDS) / GROUP for r in rows)
