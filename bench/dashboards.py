"""What the dashboards cost a run: wandb logging per rollout step (offline) and writing the run report.

    python bench/dashboards.py [--steps 200] [--updates 2] [--rollouts 4]

Logs `--steps` steps of `--updates` metric rows plus a `--rollouts`-row rollout table to an offline
wandb run (the trainer's WandbRun, as train.py uses it), then writes the run report of a run with
that many steps. Prints the wandb start, the mean logging time per step, and the report time."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _row(step: int, update: int, updates: int) -> dict:
    row = {"step": step, "update": update, "global_update": step * updates + update, "loss/value": 0.5,
           "env/reward_mean": 0.3 + 0.001 * step, "env/completion_len_mean": 300.0, "env/frac_truncated": 0.1,
           "time/step": 60.0, "time/sample": 40.0, "time/train": 18.0, "loss/dppo_masked_frac": 0.01,
           "loss/grpo_clip_frac": 0.02}
    row.update({f"drift/abs_p_{q}": 1e-3 * (i + 1) for i, q in enumerate(("q50", "q90", "q99", "max"))})
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--updates", type=int, default=2)
    p.add_argument("--rollouts", type=int, default=4)
    a = p.parse_args()
    os.environ["WANDB_MODE"] = "offline"
    from eval.run_report import write_run_report
    from trainer.wandb_run import WandbRun

    sample = {"group": 0, "prompt": "x" * 400, "completion": "y" * 1200, "parsed": "42", "gold": "42",
              "correct": True, "reward": 1.0, "advantage": 0.5, "stop_reason": "stop"}
    with tempfile.TemporaryDirectory() as d:
        run = Path(d)
        lc = SimpleNamespace(project="pairedrl-bench", entity=None, group=None, mode="offline")
        t0 = time.perf_counter()
        wb = WandbRun(run, lc, "bench", {"loss": {"name": "grpo"}, "seed": 0}, None, False, a.updates)
        t_init = time.perf_counter() - t0
        t0 = time.perf_counter()
        with (run / "metrics.jsonl").open("w") as f:
            for s in range(a.steps):
                for u in range(a.updates):
                    row = _row(s, u, a.updates)
                    f.write(json.dumps(row) + "\n")
                    wb.log_update(row)
                wb.log_rollouts([{**sample, "step": s}] * a.rollouts, s, (s + 1) * a.updates - 1)
        t_log = (time.perf_counter() - t0) / a.steps
        wb.finish()
        t0 = time.perf_counter()
        write_run_report(run)
        t_report = time.perf_counter() - t0
    print(f"wandb start {t_init:.2f} s | logging per step ({a.updates} rows + {a.rollouts}-row table) "
          f"{1e3 * t_log:.1f} ms | run report of {a.steps} steps {t_report:.2f} s")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
