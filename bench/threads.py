"""Why the local engine runs all torch work on one compute thread (trainer/backends/local/common.py).

    python bench/threads.py [--repeats 3] [--rows 64]

Times the local sampler's SmolLM2 decode step (fp32, `--rows` rows) in a fresh process per
placement, interleaved `--repeats` times (the model is loaded on the thread that runs the steps):
- main:          on the process's main thread (the only OpenMP pool);
- only-thread:   on a worker thread, the main thread never having run a parallel region;
- second-pool:   on a worker thread after the main thread ran one parallel region (two pools).
A machine's own speed can drift over minutes, hence fresh processes and interleaving. The measured
medians, and how to read them, are in bench/README.md ("Sampler").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def workload(rows: int, iters: int = 8) -> float:
    """ms per SmolLM2 decode step of the local sampler (fp32, `rows` rows, cache of 128)."""
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from trainer.backends.local.model import rotary_tables
    from trainer.model_registry import SMOLLM2, resolve_base_model
    from trainer.backends.local.sampler_forward import decode_step
    from trainer.backends.local.model import dims
    from trainer.backends.local.ops import sampler_ops
    from trainer.backends.local.plan import sampler_plan_for
    from trainer.backends.local.sampler_weights import build_weights

    factory, _ = resolve_base_model(SMOLLM2)
    model = factory(torch.float32)
    plan = sampler_plan_for(dims(model.config), torch.float32)
    W = build_weights(model.config, dict(model.state_dict()), *rotary_tables(model, 256), torch.float32,
                      ops=sampler_ops(plan))
    L = 128
    cache = [(torch.randn(rows, W.n_kv, L, W.head_dim), torch.randn(rows, W.n_kv, L, W.head_dim)) for _ in W.layers]
    tok = torch.randint(0, 1000, (rows,))
    pos = torch.full((rows,), 60)
    spans = [(0, rows, 61)]  # every row attends over cache indices [0, 61)
    with torch.no_grad():
        decode_step(W, tok, pos, spans, cache)
        t0 = time.perf_counter()
        for _ in range(iters):
            decode_step(W, tok, pos, spans, cache)
    return (time.perf_counter() - t0) / iters * 1e3


def child(placement: str, rows: int) -> None:
    out: list[float] = []
    if placement == "main":
        out.append(workload(rows))
    else:
        if placement == "second-pool":
            import torch

            torch.randn(512, 512) @ torch.randn(512, 512)  # opens the main thread's pool
        th = threading.Thread(target=lambda: out.append(workload(rows)))
        th.start()
        th.join()
    print(f"{out[0]:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child, a.rows)
        return
    placements = ["main", "only-thread", "second-pool"]
    res: dict[str, list[float]] = {p: [] for p in placements}
    for _ in range(a.repeats):
        for p in placements:
            r = subprocess.run([sys.executable, __file__, "--child", p, "--rows", str(a.rows)], capture_output=True,
                               text=True, check=True)
            res[p].append(float(r.stdout.strip().splitlines()[-1]))
    print(f"ms per SmolLM2 decode step ({a.rows} rows, fp32), {a.repeats} fresh processes each:")
    for p in placements:
        v = sorted(res[p])
        print(f"  {p:12s} median {v[len(v) // 2]:7.2f}   all {', '.join(f'{x:.1f}' for x in res[p])}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    if "--child" in sys.argv:  # one placement's fresh process: its parent reports the load
        main()
    else:
        with BenchLoad(Path(__file__).name):
            main()
