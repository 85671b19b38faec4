"""Requests and wall time per optimizer update over the Tinker wire, with and without pipelining.

Starts `python -m trainer.serve` with a per-request latency (default 200 ms, a stand-in for the network
round trip to the service), runs the same short `backend=tinker` training twice through the real SDK,
once with `backend.pipeline_optim_step=false` (wait for forward_backward's result, then send optim_step)
and once with `true` (send optim_step right behind it), and reports, per update: HTTP requests the
server saw for forward_backward + optim_step + retrieve_future, and `time/update` from metrics.jsonl.

    python bench/wire_pipeline.py [--latency-s 0.2] [--steps 3] [--updates 4] [--loss-path two_pass]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["model=tiny_random", "schedule=smoke", "env=gsm8k", "env.n_examples=16", "env.convo_prefix=none",
         "advantage=none", "sampling.max_tokens=12", "eval=none", "optimizer.lr=0.01", "sampling.concurrency=8",
         "backend=tinker", "schedule.save_every=0"]
TRAIN_ENDPOINTS = ("forward_backward", "optim_step", "retrieve_future")


def start_server(state: Path, latency_s: float) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--state-dir", str(state), "--lora-alpha", "8",
                             "--sampler-dtype", "float32", "--train-dtype", "float32", "--latency-s", str(latency_s)],
                            stdout=subprocess.PIPE, text=True, env=env)
    line = proc.stdout.readline().strip()
    if not line.startswith("listening on "):
        raise SystemExit(f"server did not start: {line!r}")
    return proc, line.split()[-1]


def counts(url: str) -> dict[str, int]:
    import httpx

    return httpx.get(url + "/stats", headers={"X-API-Key": "tml-local"}, timeout=10).json()["requests"]


def run(url: str, out: Path, pipeline: bool, args: argparse.Namespace) -> dict:
    overrides = [*TRAIN, f"schedule.num_steps={args.steps}", f"schedule.updates_per_batch={args.updates}",
                 f"schedule.groups_per_batch={args.updates}", f"backend.loss_path={args.loss_path}",
                 f"backend.pipeline_optim_step={str(pipeline).lower()}", f"hydra.run.dir={out}"]
    before = counts(url)
    env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_BASE_URL": url, "TINKER_TELEMETRY": "0",
           "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *overrides], capture_output=True, text=True, env=env,
                       check=False)
    if p.returncode != 0:
        raise SystemExit(p.stderr[-3000:])
    after = counts(url)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    n = len(rows)
    # sampling and checkpoints also use retrieve_future; count it over the updates only by subtracting the
    # sampling share: each update's calls are forward_backward (1 or 2 chunks) + optim_step + their polls
    per = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in ("forward_backward", "optim_step")}
    t = [r["time/update"] for r in rows[args.updates:]]  # the first step warms up the server
    return {"pipeline": pipeline, "updates": n, **per, "time_update_s": float(np.median(t)),
            "time_update_mean_s": float(np.mean(t))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency-s", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--loss-path", default="two_pass", choices=("one_pass", "two_pass"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp) / "state", args.latency_s)
        try:
            res = [run(url, Path(tmp) / f"run{int(p)}", p, args) for p in (False, True)]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print(f"latency {args.latency_s * 1000:.0f} ms per request, {args.loss_path}, {args.updates} updates per step")
    print("| optim_step sent | forward_backward POSTs / update | optim_step POSTs / update | "
          "time per update (median) |")
    print("|---|---|---|---|")
    for r in res:
        print(f"| {'right behind forward_backward' if r['pipeline'] else 'after its result'} | "
              f"{r['forward_backward']:.1f} | {r['optim_step']:.1f} | {r['time_update_s']:.2f} s |")
    print(json.dumps(res))


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
