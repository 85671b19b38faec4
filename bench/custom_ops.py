"""Per-call cost of a native kernel through its `pairedrl::` custom op (`custom_ops.py`) next to the same
kernel called directly (`kernels.py`), at decode-sized rows (8, 32) and a training micro-batch (~1200
rows), SmolLM2-135M's widths (hidden 576, intermediate 1536, 9 query / 3 key-value heads of 64), plus the
dispatch floor of an op that does nothing. This is why the training forms are ops and the sampler's row
kernels are called directly (`custom_ops.py`'s docstring).

Calls are timed in blocks of ~50 ms, direct and op interleaved, and the fastest block is reported (on
shared cores the fastest is the least disturbed).

    python bench/custom_ops.py [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from trainer.backends.local import custom_ops, kernels  # noqa: E402

H, I, NH, KV, D = 576, 1536, 9, 3, 64


@torch.library.custom_op("pairedrl_bench::nothing", mutates_args=())
def nothing(t: torch.Tensor) -> torch.Tensor:
    return t.new_empty(0)


def per_call(fns: list[Callable[[], object]], reps: int, budget_s: float = 0.05) -> list[float]:
    """Fastest block's seconds per call of each of `fns`, timed in interleaved blocks of ~`budget_s`."""
    for f in fns:
        f()
    t0 = time.perf_counter()
    fns[0]()
    n = max(1, min(2000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    best = [float("inf")] * len(fns)
    for _ in range(reps):
        for i, f in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            best[i] = min(best[i], (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.library() is None:
        raise SystemExit(f"error: no native kernels here: {kernels.describe()}")
    from trainer.backends.local.plan import cpu_flags
    from trainer.utils.machine import cpu_model

    g = torch.Generator().manual_seed(0)
    cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = []
    for rows in (8, 32, 1200):
        gu = torch.randn(rows, 2 * I, generator=g).bfloat16()
        cases.append((f"silu_mul {rows}x{2 * I} bf16", lambda gu=gu: kernels.silu_mul(gu),
                      lambda gu=gu: custom_ops.silu_mul(gu)))
    x, w = torch.randn(1200, H, generator=g), torch.randn(H, generator=g)
    rstd = torch.empty(1200)
    cases.append(("rms_norm_cast 1200x576 -> bf16", lambda: kernels.residual_rms_norm(x, None, w, 1e-5, torch.bfloat16,
                                                                                      rstd),
                  lambda: custom_ops.rms_norm_cast(x, w, 1e-5, torch.bfloat16)))
    qkv = torch.randn(1200, (NH + 2 * KV) * D, generator=g).bfloat16()
    pos, cos, sin = torch.arange(1200) % 256, torch.randn(256, D, generator=g), torch.randn(256, D, generator=g)
    cases.append(("rope_qkv 1200 rows bf16", lambda: kernels.rope_qkv(qkv, pos, cos, sin, NH, KV),
                  lambda: custom_ops.rope_qkv(qkv, pos, cos, sin, NH, KV)))
    t = torch.zeros(1)
    print(f"CPU: {cpu_model()} ({cpu_flags()}); torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'call':<34} {'direct (us)':>12} {'custom op (us)':>15}")
    print(f"{'an op that does nothing':<34} {'':>12} {per_call([lambda: nothing(t)], args.reps)[0] * 1e6:>15.1f}")
    for label, direct, op in cases:
        d, o = per_call([direct, op], args.reps)
        print(f"{label:<34} {d * 1e6:>12.1f} {o * 1e6:>15.1f}")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
