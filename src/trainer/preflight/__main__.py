"""`python -m trainer.preflight <gate|all> [+experiment=dppo_vs_grpo] [overrides]`.

Gates: correctness, design, restoration, activation, feasibility. Each prints a table and writes
`<preflight.dir>/preflight/<gate>.json`; the exit code is non-zero when a gate fails. `all` runs
them in order and stops at the first failure."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

USAGE = ("usage: python -m trainer.preflight {correctness|design|restoration|activation|feasibility|all} "
         "[overrides]")


def main(argv: list[str]) -> int:
    from trainer.config.compose import compose_config
    from trainer.config.schema import ConfigError, validate
    from trainer.preflight import correctness
    from trainer.preflight.gates import (
        GATES,
        PlanError,
        activation,
        design,
        feasibility,
        pilot_failed,
        plan_arms,
        preflight_dir,
        require_treatments,
        restoration,
        run_pilot,
    )

    logging.basicConfig(level=logging.INFO, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")
    if not argv or argv[0] not in GATES + ("all",):
        print(USAGE, file=sys.stderr)
        return 2
    gate, overrides = argv[0], argv[1:]
    try:
        # `seed=0,1,2` (the sweep's seeds) tells the design gate how many seeds per arm the plan runs
        from eval.design import DesignError, plan_seeds

        sweep = overrides
        overrides, n_seeds = plan_seeds(overrides)
        cfg = validate(compose_config(overrides))
        # the arms: decision.baseline and the other losses of the sweep (`loss=grpo,dppo,cppo`)
        arms = plan_arms(cfg, sweep)
        if gate not in ("correctness", "design"):
            require_treatments(arms)
    except (ConfigError, DesignError, PlanError) as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Hydra composition errors name the key
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = preflight_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    todo = list(GATES) if gate == "all" else [gate]
    pilots: dict | None = None
    for g in todo:
        if g == "correctness":
            report = correctness.run(None)
        elif g == "restoration":
            report = restoration(cfg, out, overrides, arms)
        elif g == "design":
            report = design(cfg, out, n_seeds, arms=arms)
        else:
            if pilots is None:  # one pilot per treatment, shared by activation and feasibility
                pilots = {}
                for t in arms.treatments:
                    try:
                        pilots[t] = run_pilot(cfg, out, t)
                    except ValueError as e:  # a request the plan makes cannot run (a prompt over the context)
                        report = pilot_failed(g, cfg, e, arms, t)
                        pilots = None
                        break
            if pilots is not None:
                report = (activation(cfg, out, pilots, arms) if g == "activation" else
                          feasibility(cfg, out, pilots, n_seeds, arms))
        report.write(out)
        report.print_table()
        print(f"-> {Path(out) / 'preflight' / (g + '.json')}: {'PASSED' if report.passed else 'FAILED'}")
        if not report.passed:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
