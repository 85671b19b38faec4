"""What each native tier of the engine buys of the whole RL step on this machine.

Runs `bench/step.py --skip-trl` once with the engine plan as this CPU makes it and once per native choice
put back on torch (`PAIREDRL_TORCH_OPS=<choice>`, `trainer.backends.local.plan`), interleaved over
`--rounds` rounds so that the VM's drift falls on every configuration alike, and prints the fastest step
of each with the share of the step the tier buys: (step without it - step with it) / step without it.
The engine keeps a native tier where it buys >= 10% of the step on the CPU class it serves, or where the
determinism contract needs it (bench/README.md records the decisions).

    python bench/tiers.py [--rounds 2] [--steps 3] [--choices decode_attention,train_rows]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

STEP = re.compile(r"step (?P<step>[\d.]+) s \(sample (?P<sample>[\d.]+) s, train (?P<train>[\d.]+) s")


def run_step(off: str, steps: int) -> dict[str, float]:
    env = {**os.environ, "PAIREDRL_TORCH_OPS": off}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "step.py"), "--skip-trl", "--steps", str(steps)],
                       env=env, capture_output=True, text=True, check=False)
    m = STEP.search(p.stdout)
    if p.returncode != 0 or m is None:
        raise SystemExit(f"error: bench/step.py with PAIREDRL_TORCH_OPS={off!r} failed:\n{p.stderr[-2000:]}")
    return {k: float(v) for k, v in m.groupdict().items()}


def _plan_here() -> object:
    """The engine plan `bench/step.py` runs under here (SmolLM2-135M, `auto` precision)."""
    import torch

    from trainer.backends.local.model import dims
    from trainer.model_registry import SMOLLM2, resolve_base_model
    from trainer.backends.local.plan import EnginePlan, auto_dtype, sampler_plan_for, train_plan_for

    dtype, why = auto_dtype()
    factory, _ = resolve_base_model(SMOLLM2)
    d = dims(factory(torch.float32).config)
    return EnginePlan(sampler_plan_for(d, dtype), train_plan_for(d, dtype), why)


def main() -> None:
    from trainer.backends.local.plan import cpu_flags
    from trainer.utils.machine import cpu_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--choices", default=None,
                    help="comma-separated plan choices to time on torch, one at a time (default: every native "
                         "choice the plan makes here)")
    args = ap.parse_args()
    if args.choices is None:  # what this CPU runs natively for the bench's model and precision
        plan = _plan_here()
        chosen = [c for c in plan.native() if c != "onednn_packing"]
    else:
        chosen = [c.strip() for c in args.choices.split(",") if c.strip()]
    configs = [""] + chosen
    print(f"CPU: {cpu_model()} ({cpu_flags()}); {args.rounds} rounds x {len(configs)} configurations, "
          f"bench/step.py --skip-trl --steps {args.steps}", flush=True)
    got: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        for c in configs:
            got[c].append(run_step(c, args.steps))
            t = got[c][-1]
            print(f"round {r + 1} {c or 'plan as made'}: step {t['step']:.2f} s (sample {t['sample']:.2f}, "
                  f"train {t['train']:.2f})", flush=True)
    best = {c: min(got[c], key=lambda t: t["step"]) for c in configs}
    base = best[""]["step"]
    print("\n| on torch | step (s) | sample (s) | train (s) | the native tier buys |\n|---|---|---|---|---|")
    for c in configs:
        t = best[c]
        buys = "" if not c else f"{(t['step'] - base) / t['step']:+.1%}"
        print(f"| {c or '(none: the plan as made)'} | {t['step']:.2f} | {t['sample']:.2f} | {t['train']:.2f} "
              f"| {buys} |")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
