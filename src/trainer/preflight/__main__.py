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
        activation,
        design,
        feasibility,
        pilot_failed,
        preflight_dir,
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

        overrides, n_seeds = plan_seeds(overrides)
        cfg = validate(compose_config(overrides))
    except (ConfigError, DesignError) as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - Hydra composition errors name the key
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = preflight_dir(cfg)
    out.mkdir(parents=True, exist_ok=True)
    todo = list(GATES) if gate == "all" else [gate]
    pilot = None
    for g in todo:
        if g == "correctness":
            report = correctness.run(None)
        elif g == "restoration":
            report = restoration(cfg, out, overrides)
        elif g == "design":
            report = design(cfg, out, n_seeds)
        else:
            if pilot is None:
                try:
                    pilot = run_pilot(cfg, out)
                except ValueError as e:  # a request the plan makes cannot run (a prompt over the context, ...)
                    report = pilot_failed(g, cfg, e)
                    pilot = None
            if pilot is not None:
                report = (activation(cfg, out, pilot) if g == "activation" else
                          feasibility(cfg, out, pilot, n_seeds))
        report.write(out)
        report.print_table()
        print(f"-> {Path(out) / 'preflight' / (g + '.json')}: {'PASSED' if report.passed else 'FAILED'}")
        if not report.passed:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
