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

# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152
SHAPES = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}
VOCAB = 49152


def _time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def run(rows: int, decode_rows: int) -> None:
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    total_f, total_t = 0.0, 0.0
    for name, (o, i) in SHAPES.items():
        x, w = torch.randn(rows, i), torch.randn(o, i)
        t = _time(lambda: F.linear(x, w), 20)
        fl = 2 * rows * o * i
        total_f, total_t = total_f + fl, total_t + t
        print(f"train   {rows} x {i} -> {o:5d} ({name:7s}): {fl / t / 1e9:6.1f} GFLOPS")
    print(f"train   all layer shapes: {total_f / total_t / 1e9:.1f} GFLOPS")
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        print("no oneDNN in this torch build: decode shapes skipped")
        return
    total_f, total_t = 0.0, 0.0
    for name, (o, i) in {**SHAPES, "unembed": (VOCAB, 576)}.items():
        x, w = torch.randn(decode_rows, i), torch.randn(o, i)
        p = torch.ops.mkldnn._reorder_linear_weight(w, decode_rows)
        t = _time(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""), 100)
        fl = 2 * decode_rows * o * i
        total_f, total_t = total_f + fl, total_t + t
        print(f"decode  {decode_rows} x {i} -> {o:5d} ({name:7s}): {fl / t / 1e9:6.1f} GFLOPS")
    print(f"decode  all shapes: {total_f / total_t / 1e9:.1f} GFLOPS")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1184)
    ap.add_argument("--decode-rows", type=int, default=32)
    a = ap.parse_args()
    # on the engine's compute thread, like the engine's own kernels
    COMPUTE.run(lambda: run(a.rows, a.decode_rows))


if __name__ == "__main__":
    main()
