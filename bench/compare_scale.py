"""CPU seconds of `eval.compare` at the sizes issue #51 states: a sweep and a folder of per-item files.

    python bench/compare_scale.py [--which runs|items|both] [--bootstrap N] [--small]

`runs`: a sweep of 2 arms (grpo, dppo) x 10 seeds, each run folder written as the trainer writes it
(config.yaml and run_info.json by trainer.run_info.write_run_files, a metrics.jsonl of 4 steps x 2 updates,
eval/arithmetic.jsonl of 1319 items, GSM8K test's size), compared with eval.compare.compare_paths (finding
the runs, the config checks, the activity, the looks ledger, compare.json / compare.md, no plots).
`items`: 10 arms x 10 seeds x 10,000 items of plain JSONL (item_id, correct), compared with
eval.items.compare_item_files (seed t, Holm over 9 treatments). Each arm is right with its own
probability (the treatments a little above the baseline), so the verdicts are not all alike.

Times the comparison alone (time.process_time, this process's CPU; the data are written before), with
--bootstrap unset the default (a bootstrap only where it decides: none under seed t), or N resamples for
every bootstrap (what the default was before issue #51). `--small` runs 2 x 2 x 50 (runs) and 3 x 2 x 100
(items): a check that the script works, not a figure. Prints the load average beside the figures; run it
on an otherwise idle machine (bench/README.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

EVAL = "arithmetic"  # eval.name of the default config: the run folders' eval file is eval/arithmetic.jsonl


def make_sweep(root: Path, arms: tuple[str, ...], seeds: int, items: int, rng: np.random.Generator) -> Path:
    """A sweep folder of len(arms) x seeds run folders, jobs in Hydra's order (arm outer, seed inner)."""
    from eval.records import write_item_records
    from trainer.config.compose import run_config
    from trainer.run_info import write_run_files

    sweep = root / "sweep"
    sweep.mkdir()
    names, job = {}, 0
    for k, loss in enumerate(arms):
        for s in range(seeds):
            run = sweep / str(job)
            run.mkdir()
            write_run_files(run, run_config([f"loss={loss}", f"seed={s}"]), {})
            with (run / "metrics.jsonl").open("w") as f:
                for step in range(4):
                    for u in range(2):
                        row = {"step": step, "update": u, "env/reward_mean": 0.1 * step + 0.01 * k,
                               "loss/dppo_masked_frac": 0.02 * (k + 1) + 0.001 * u,
                               "loss/grpo_clip_frac": 0.01 * (k + 1) + 0.001 * u}
                        f.write(json.dumps(row) + "\n")
            correct = rng.random(items) < 0.40 + 0.02 * k
            write_item_records(run / "eval" / f"{EVAL}.jsonl", [
                {"index": i, "question_sha256": f"{i:064x}", "completion": "", "parsed": None, "gold": str(i),
                 "correct": bool(c)} for i, c in enumerate(correct)])
            names[str(job)] = f"{loss}_seed{s}"
            job += 1
    (sweep / "arms.json").write_text(json.dumps(names))
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep


def make_item_files(root: Path, arms: int, seeds: int, items: int, rng: np.random.Generator) -> list[str]:
    """One plain JSONL file per (arm, seed); returns the --items specs."""
    specs = []
    for a in range(arms):
        files = []
        for s in range(seeds):
            correct = rng.random(items) < 0.40 + 0.01 * a
            path = root / f"arm{a}_seed{s}.jsonl"
            path.write_text("".join(json.dumps({"item_id": f"q{i}", "correct": bool(c)}) + "\n"
                                    for i, c in enumerate(correct)))
            files.append(str(path))
        specs.append(f"arm{a}=" + ",".join(files))
    return specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--which", choices=("runs", "items", "both"), default="both")
    p.add_argument("--bootstrap", type=int, default=None,
                   help="resamples of every bootstrap (default: compare's own: only where it decides)")
    p.add_argument("--small", action="store_true", help="a tiny size: checks the script, no useful time")
    a = p.parse_args(argv)
    if a.bootstrap is not None and a.bootstrap < 0:
        p.error(f"--bootstrap must be >= 0, got {a.bootstrap}")
    from eval.compare import CompareRequest, compare_paths
    from eval.items import compare_item_files

    runs_size, items_size = ((2, 2, 50), (3, 2, 100)) if a.small else ((2, 10, 1319), (10, 10, 10000))
    rng = np.random.default_rng(0)
    boot = "default" if a.bootstrap is None else f"{a.bootstrap} resamples"
    with tempfile.TemporaryDirectory(prefix="bench_compare_") as tmp:
        if a.which in ("runs", "both"):
            n_arms, seeds, items = runs_size
            (Path(tmp) / "runs").mkdir()
            sweep = make_sweep(Path(tmp) / "runs", ("grpo", "dppo")[:n_arms], seeds, items, rng)
            load = os.getloadavg()[0]
            t0 = time.process_time()
            c = compare_paths([sweep], CompareRequest(n_bootstrap=a.bootstrap, make_plots=False))
            cpu = time.process_time() - t0
            print(f"runs: {n_arms} arms x {seeds} seeds x {items} items ({c.rule.method}, bootstrap {boot}): "
                  f"{cpu:.2f} CPU-s (load average before {load:.2f}; {os.cpu_count()} CPUs); verdict "
                  f"{c.rows[0].verdict}")
        if a.which in ("items", "both"):
            n_arms, seeds, items = items_size
            folder = Path(tmp) / "items"
            folder.mkdir()
            specs = make_item_files(folder, n_arms, seeds, items, rng)
            load = os.getloadavg()[0]
            t0 = time.process_time()
            c = compare_item_files(specs, CompareRequest(n_bootstrap=a.bootstrap, make_plots=False,
                                                         out=folder / "out"))
            cpu = time.process_time() - t0
            print(f"--items: {n_arms} arms x {seeds} seeds x {items} items ({c.rule.method}, "
                  f"{len(c.treatments)} treatments, Holm, bootstrap {boot}): {cpu:.2f} CPU-s (load average "
                  f"before {load:.2f}; {os.cpu_count()} CPUs); verdicts "
                  + ", ".join(f"{r.treatment} {r.verdict}" for r in c.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
