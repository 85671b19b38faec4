"""CPU time of one testbed run, this checkout against a base commit, in one run of the bench.

    python bench/testbed.py --base <commit> [--repeats 2] [--steps 12] [--threads 1] [--eval-items 200]

A seed costs one `+experiment=local_testbed` run per arm, so the CPU seconds of that run are what a sweep's
seeds are bought with. For the base commit and for this checkout (both as `git worktree`s of the same
repository, so nothing uncommitted is timed by mistake unless `--head worktree` names the checkout as it is)
the bench runs `python train.py +experiment=local_testbed loss=grpo seed=0` with `backend.num_threads`
(1 by default: how a joblib sweep runs its workers), alternating base and head `--repeats` times, and
prints per run:
- the CPU seconds of the run's process (user + system, from the kernel's accounting of the child), which
  another process's load inflates far less than wall time;
- the wall time and the run's own phases from result.json (`time/setup`, `time/start_eval`,
  `time/train_total`, `time/eval`);
- whether the two sides' metrics rows (outside `time/`) and eval answers agree bit for bit, which they
  must unless the change is meant to alter the numbers (then say why beside the figures).
The load over each run is printed (BenchLoad); a figure taken with more than a fraction of a core busy
elsewhere is not a quiet machine's and is flagged. Results: bench/README.md, "A testbed run's CPU time".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from trainer.utils.load import BenchLoad  # noqa: E402

PHASES = ("time/setup", "time/start_eval", "time/train_total", "time/eval")


def checkout(commit: str, where: Path) -> Path:
    """A detached worktree of `commit` at `where` (removed by `cleanup`)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(where), commit],
                   check=True, capture_output=True, text=True)
    return where


def cleanup(where: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)], check=False,
                   capture_output=True, text=True)


def command(tree: Path, out: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, str(tree / "train.py"), "+experiment=local_testbed", "loss=grpo", "seed=0",
            f"schedule.num_steps={args.steps}", f"eval.n_examples={args.eval_items}",
            f"backend.num_threads={args.threads}", "report.enabled=false", f"hydra.run.dir={out}"]


def one_run(name: str, tree: Path, out: Path, args: argparse.Namespace) -> dict:
    cmd = command(tree, out, args)
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with BenchLoad(f"testbed {name}") as load:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(tree / "src")})
        wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"[{name}] the run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads((out / "result.json").read_text())
    row = {"side": name, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
           **{k.split("/")[1]: round(float(result.get(k, float("nan"))), 1) for k in PHASES},
           "other_cores": load.start_rec.get("other_cores")}
    print(f"[{name}] cpu {cpu:.1f} s, wall {wall:.1f} s, phases "
          + ", ".join(f"{k.split('/')[1]} {result.get(k, float('nan')):.1f} s" for k in PHASES), flush=True)
    return row


def fingerprint(out: Path) -> tuple[list[dict], list[tuple[str, str]]]:
    """What must agree bit for bit between the two sides: metrics outside time/ and engine/, and the eval
    answers."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [{k: v for k, v in r.items() if not k.startswith(("time/", "engine/"))} for r in rows]
    evals = sorted((p.name, p.read_text()) for p in (out / "eval").glob("*.jsonl"))
    return rows, evals


def agreement(base: tuple, head: tuple) -> str:
    """Whether the two sides computed the same: every metric both sides log equal in every row, and the
    eval answers identical; metrics only one side logs (a new diagnostic) are named, not counted as a
    difference."""
    (rows_b, evals_b), (rows_h, evals_h) = base, head
    keys_b = set().union(*rows_b) if rows_b else set()
    keys_h = set().union(*rows_h) if rows_h else set()
    common = keys_b & keys_h
    same_rows = len(rows_b) == len(rows_h) and all(
        {k: v for k, v in a.items() if k in common} == {k: v for k, v in b.items() if k in common}
        for a, b in zip(rows_b, rows_h))
    said = "identical" if same_rows and evals_b == evals_h else "DIFFER"
    extra = [f"only in head: {sorted(keys_h - keys_b)}"] if keys_h - keys_b else []
    extra += [f"only in base: {sorted(keys_b - keys_h)}"] if keys_b - keys_h else []
    return said + (f" ({'; '.join(extra)})" if extra else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="the commit to time against (e.g. the round's first commit)")
    p.add_argument("--head", default="HEAD",
                   help="the commit to time (default HEAD); `worktree` times this checkout as it is")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="schedule.num_steps (the testbed's own is 12)")
    p.add_argument("--eval-items", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args()
    if args.repeats < 1 or args.steps < 1 or args.threads < 1 or args.eval_items < 1:
        sys.exit("error: --repeats, --steps, --threads and --eval-items must be >= 1")
    root = Path(tempfile.mkdtemp(prefix="pairedrl-testbed-bench-"))
    trees = {"base": checkout(args.base, root / "base")}
    trees["head"] = ROOT if args.head == "worktree" else checkout(args.head, root / "head")
    rows, prints = [], {}
    try:
        for rep in range(args.repeats):
            for side in ("base", "head"):
                out = root / f"{side}-{rep}"
                rows.append(one_run(side, trees[side], out, args))
                prints.setdefault(side, fingerprint(out))
    finally:
        for side, tree in trees.items():
            if tree != ROOT:
                cleanup(tree)
        if args.keep:
            print(f"runs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    same = agreement(prints["base"], prints["head"])
    print("\n| side | run CPU (s) | wall (s) | setup | start eval | train | final eval | cores busy "
          "elsewhere |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['side']} | {r['cpu_s']} | {r['wall_s']} | {r['setup']} | {r['start_eval']} | "
              f"{r['train_total']} | {r['eval']} | {r['other_cores']} |")
    med = {s: sorted(r["cpu_s"] for r in rows if r["side"] == s) for s in ("base", "head")}
    mid = {s: v[len(v) // 2] for s, v in med.items()}
    print(f"\nmedian run CPU: base {mid['base']} s, head {mid['head']} s, "
          f"head/base {mid['head'] / mid['base']:.3f}; metrics and eval answers "
          f"{same} between the two sides")


if __name__ == "__main__":
    main()
