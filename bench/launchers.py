"""Wall time of one paired sweep (2 arms x S seeds) under each documented way to launch it on this machine.

    python bench/launchers.py [--seeds 6] [--steps 2] [--eval-items 50] [--modes basic,joblib,joblib1]

Runs, one after the other, the same sweep of `+experiment=local_testbed` (GRPO and DPPO at seeds 0..S-1,
`schedule.num_steps` and `eval.n_examples` reduced so the three sweeps fit in minutes) as
- basic:   `python train.py --multirun ...` (Hydra's basic launcher: one run after the other, each run
           using every core);
- joblib:  `... hydra/launcher=joblib` (its default `n_jobs=-1`: one worker per core, and joblib caps each
           worker's torch at cores // workers threads, one here);
- joblib1: `... hydra/launcher=joblib hydra.launcher.n_jobs=1` (one worker, every core).
and prints each sweep's wall time, seconds per run, the torch threads its runs recorded, and the machine
load over each (a sweep timed beside other work measures the other work). The results are in bench/README.md
("Sweeps"). Each sweep writes into a fresh temporary folder, removed at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from trainer.utils.load import BenchLoad

MODES = {
    "basic": [],
    "joblib": ["hydra/launcher=joblib"],
    "joblib1": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=1"],
}


def sweep_command(mode: str, seeds: int, steps: int, eval_items: int, out: Path) -> list[str]:
    return [sys.executable, "train.py", "--multirun", "+experiment=local_testbed",
            "seed=" + ",".join(str(s) for s in range(seeds)), f"schedule.num_steps={steps}",
            f"eval.n_examples={eval_items}", "report.enabled=false", f"hydra.sweep.dir={out}", *MODES[mode]]


def run_mode(mode: str, args: argparse.Namespace, root: Path) -> dict:
    out = root / mode
    cmd = sweep_command(mode, args.seeds, args.steps, args.eval_items, out)
    print(f"[{mode}] {' '.join(cmd[1:])}", flush=True)
    with BenchLoad(f"launchers {mode}") as load:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"[{mode}] the sweep failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    infos = [json.loads(p.read_text()) for p in sorted(out.glob("*/run_info.json"))]
    runs = 2 * args.seeds
    if len(infos) != runs:
        sys.exit(f"[{mode}] expected {runs} runs in {out}, found {len(infos)}")
    threads = sorted({i.get("torch_threads") for i in infos}, key=str)
    row = {"mode": mode, "wall_s": round(wall, 1), "s_per_run": round(wall / runs, 1), "torch_threads": threads,
           "other_cores_start": load.start_rec.get("other_cores")}
    print(f"[{mode}] {wall:.1f} s for {runs} runs ({wall / runs:.1f} s per run), torch threads {threads}",
          flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=6)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--eval-items", type=int, default=50)
    p.add_argument("--modes", default="basic,joblib,joblib1")
    p.add_argument("--keep", action="store_true", help="keep the sweep folders (printed)")
    args = p.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        sys.exit(f"unknown mode(s) {unknown}; choose from {sorted(MODES)}")
    root = Path(tempfile.mkdtemp(prefix="pairedrl-launchers-"))
    try:
        rows = [run_mode(m, args, root) for m in modes]
    finally:
        if args.keep:
            print(f"sweeps kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    base = rows[0]["wall_s"]
    print("\n| launcher | wall (s) | s per run | torch threads | vs first |")
    print("|---|---:|---:|---|---:|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_s']} | {r['s_per_run']} | {r['torch_threads']} | "
              f"{r['wall_s'] / base:.2f}x |")


if __name__ == "__main__":
    main()
