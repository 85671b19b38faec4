"""Hydra entry point: `python train.py loss=dppo`, `python train.py --multirun loss=grpo,dppo seed=0`.

`--multirun ... --cfg job` (which Hydra itself refuses) prints the composed config of every job
of the sweep, so a researcher can check that the arms differ only in the swept group.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from trainer.config.compose import HydraEntry  # noqa: E402
from trainer.config.schema import register_configs  # noqa: E402

register_configs()
ENTRY = HydraEntry()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    ENTRY.composed()
    from trainer.main import run_training

    return run_training(cfg)


def entry() -> None:
    """Run `main` with the command line (a config Hydra cannot compose exits 2: `HydraEntry`)."""
    from trainer.redaction import install

    install()  # what this process prints, logs or raises leaves through trainer.redaction.scrub
    argv = sys.argv[1:]
    if ("--multirun" in argv or "-m" in argv) and ("--cfg" in argv or "-c" in argv):
        from trainer.config.compose import print_sweep_configs

        sys.exit(print_sweep_configs(ROOT / "conf", argv))
    ENTRY.run(main)


if __name__ == "__main__":
    entry()
