"""fp32 GEMM throughput at the shapes of one bench/step.py step, the ceiling the step is measured against.

Training shapes: ~1200 packed rows times SmolLM2's stacked projections (q|k|v, o, gate|up, down), as
`F.linear` (MKL sgemm) like the training forward runs them. Decode shapes: 32 rows (one decode step of 8
prompts x 4 samples) through oneDNN with the weights pre-packed, as the sampler runs them, the
49152-wide unembedding included.

    python bench/gemm.py [--rows 1184] [--decode-rows 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.backends.local.common import COMPUTE  # noqa: E402
from trainer.backends.local.sampler import _MKLDNN  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152
SHAPES = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}
VOCAB = 49152


def _time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def _sweep(label: str, shapes: dict[str, tuple[int, int]], rows: int, product, reps: int) -> None:
    """Time `product(x, w)` ([rows, in] x [out, in]^T) at each shape; print per-shape and overall GFLOPS."""
    total_f, total_t = 0.0, 0.0
    for name, (o, i) in shapes.items():
        x, w = torch.randn(rows, i), torch.randn(o, i)
        fn = product(x, w)
        t = _time(fn, reps)
        fl = 2 * rows * o * i
        total_f, total_t = total_f + fl, total_t + t
        print(f"{label:7s} {rows} x {i} -> {o:5d} ({name:7s}): {fl / t / 1e9:6.1f} GFLOPS")
    print(f"{label:7s} all shapes: {total_f / total_t / 1e9:.1f} GFLOPS")


def run(rows: int, decode_rows: int) -> None:
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    _sweep("train", SHAPES, rows, lambda x, w: lambda: F.linear(x, w), 20)
    if not _MKLDNN:
        print("no oneDNN in this torch build: decode shapes skipped")
        return

    def packed(x: torch.Tensor, w: torch.Tensor):
        p = torch.ops.mkldnn._reorder_linear_weight(w, decode_rows)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")

    _sweep("decode", {**SHAPES, "unembed": (VOCAB, 576)}, decode_rows, packed, 100)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1184)
    ap.add_argument("--decode-rows", type=int, default=32)
    a = ap.parse_args()
    # on the engine's compute thread, like the engine's own kernels
    COMPUTE.run(lambda: run(a.rows, a.decode_rows))


if __name__ == "__main__":
    main()
