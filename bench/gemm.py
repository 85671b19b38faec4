"""GEMM throughput at the shapes of one bench/step.py step, in fp32 and bf16: the ceiling a step is
measured against, and which kernel path torch takes for each.

Training shapes: ~1200 packed rows times SmolLM2's stacked projections (q|k|v, o, gate|up, down), as
`F.linear` and on oneDNN-packed weights (the training forward's two paths); the faster is the training
ceiling. Decode shapes: 32 rows (one decode step of 8 prompts x 4
samples), the 49152-wide unembedding included, both as plain `F.linear` and through oneDNN with the weights
pre-packed for that row count; the faster of the two is the decode ceiling. Then the training
unembedding's two products (fp32 logits and the logprob gradient's product, plain and packed), which the
ceilings leave out.

The kernel path is read from oneDNN's own verbose log of one call (e.g. `brg_matmul:avx10_1_512_amx` is
oneDNN on AMX tiles); a call that leaves no oneDNN record ran in MKL/ATen (fp32 sgemm, or ATen's own
bf16 fallback on CPUs without bf16 instructions).

    python bench/gemm.py [--dtype both|float32|bfloat16] [--rows 1184] [--decode-rows 32]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.backends.local.common import COMPUTE  # noqa: E402
from trainer.backends.local.model import ONEDNN_PACKING, onednn_linear, onednn_pack  # noqa: E402
from trainer.backends.local.train_forward import TRAIN_PACK_ROWS  # noqa: E402
from trainer.backends.local.precision import dtype_name  # noqa: E402

# SmolLM2-135M: hidden 576, 9 query / 3 kv heads of 64, MLP 1536, vocab 49152
SHAPES = {"q|k|v": (960, 576), "o": (576, 576), "gate|up": (3072, 576), "down": (576, 1536)}
VOCAB = 49152
N_LAYERS = 30
# multiply-adds per token through every projection and the unembedding (attention scores are <2% here)
MACS_PER_TOKEN = N_LAYERS * sum(o * i for o, i in SHAPES.values()) + VOCAB * 576
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def kernel_path(fn: Callable[[], object]) -> str:
    """The oneDNN implementation one call of `fn` ran, or MKL/ATen when oneDNN was not called."""
    if not ONEDNN_PACKING:
        return "MKL/ATen"
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)  # oneDNN writes its verbose records to the C stdout
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                fn()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = log.read().decode(errors="replace").splitlines()
    impls = {ln.split(",")[6] for ln in lines if ",exec,cpu," in ln and ln.split(",")[5] in ("matmul", "inner_product")}
    return "oneDNN " + "/".join(sorted(impls)) if impls else "MKL/ATen"


def _sweep(label: str, shapes: dict[str, tuple[int, int]], rows: int, dtype: torch.dtype,
           product: Callable, reps: int, quiet: bool = False) -> tuple[float, str]:
    """Time `product(x, w)` ([rows, in] x [out, in]^T) at each shape; (overall GFLOPS, kernel path)."""
    total_f, total_t, paths = 0.0, 0.0, set()
    for name, (o, i) in shapes.items():
        x, w = torch.randn(rows, i).to(dtype), torch.randn(o, i).to(dtype)
        fn = product(x, w)
        paths.add(kernel_path(fn))
        t = _time(fn, reps)
        fl = 2 * rows * o * i
        total_f, total_t = total_f + fl, total_t + t
        if not quiet:
            print(f"{label:14s} {rows} x {i} -> {o:5d} ({name:7s}): {fl / t / 1e9:7.1f} GFLOPS")
    gflops, path = total_f / total_t / 1e9, " + ".join(sorted(paths))
    if not quiet:
        print(f"{label:14s} all shapes: {gflops:.1f} GFLOPS  [{path}]")
    return gflops, path


def _linear(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: F.linear(x, w)


def _packed(hint_rows: int) -> Callable:
    """Products on a weight packed as the engine packs it (`hint_rows`: the batch size oneDNN tunes for)."""
    def make(x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
        p = onednn_pack(w, hint_rows)
        return lambda: onednn_linear(x, p)
    return make


def ceilings(dtype: torch.dtype, rows: int = 1184, decode_rows: int = 32, quiet: bool = True) -> dict:
    """GFLOPS at the step's training and decode shapes in `dtype` (decode: the faster of plain and packed).
    Call on the engine's compute thread."""
    name = dtype_name(dtype)
    train_by = {"linear": _sweep(f"train {name}", SHAPES, rows, dtype, _linear, 20, quiet)}
    if ONEDNN_PACKING:  # the training forward runs packed where `plan.train_packing` finds it faster
        train_by["packed"] = _sweep(f"trpacked {name}", SHAPES, rows, dtype, _packed(TRAIN_PACK_ROWS), 20, quiet)
    tbest = max(train_by, key=lambda k: train_by[k][0])
    train, train_path = train_by[tbest][0], f"{tbest}: {train_by[tbest][1]}"
    shapes = {**SHAPES, "unembed": (VOCAB, 576)}
    decode = {"linear": _sweep(f"decode {name}", shapes, decode_rows, dtype, _linear, 100, quiet)}
    if ONEDNN_PACKING:
        decode["packed"] = _sweep(f"packed {name}", shapes, decode_rows, dtype, _packed(decode_rows), 100, quiet)
    best = max(decode, key=lambda k: decode[k][0])
    return {"dtype": name, "train_gflops": train, "train_kernel": train_path,
            "decode_gflops": decode[best][0], "decode_kernel": f"{best}: {decode[best][1]}",
            "decode_gflops_by_path": {k: v[0] for k, v in decode.items()},
            "train_gflops_by_path": {k: v[0] for k, v in train_by.items()}}


def unembedding(dtype: torch.dtype) -> None:
    """The training unembedding's two products per 128-row block (`train_forward._TargetLogprob`): fp32
    logits (plain sgemm, oneDNN-packed, and fp32 inputs rounded to bf16 where torch honours that), and the
    gradient's `probs [rows, vocab] x W [vocab, H]` in `dtype` (plain addmm against oneDNN-packed `W^T`)."""
    from trainer.backends.local.model import bf16_inputs_honoured, matmul_inputs
    from trainer.backends.local.train_forward import UNEMBED_ROWS, pack_unembed, pack_unembed_grad

    rows, fl = UNEMBED_ROWS, 2 * UNEMBED_ROWS * VOCAB * 576
    h, W = torch.randn(rows, 576), torch.randn(VOCAB, 576) * 0.05
    logits = {"plain": lambda: F.linear(h, W)}
    if ONEDNN_PACKING:
        packed = pack_unembed(W)
        logits["packed"] = lambda: onednn_linear(h, packed)

    def bf16_inputs() -> torch.Tensor:
        with matmul_inputs(torch.bfloat16):
            return F.linear(h, W)
    logits["bf16 inputs"] = bf16_inputs
    print(f"unembedding logits fp32 ({rows} x 576 -> {VOCAB}); bf16 inputs honoured here: {bf16_inputs_honoured()}")
    for k, fn in logits.items():
        print(f"  {k:12s} {fl / _time(fn, 10) / 1e9:7.1f} GFLOPS  [{kernel_path(fn)}]")
    Wg, y = W.to(dtype), torch.randint(0, VOCAB, (rows,))
    probs = torch.softmax(torch.randn(rows, VOCAB), -1).to(dtype)
    grad = {"plain addmm": lambda: torch.addmm(Wg.index_select(0, y), probs, Wg, alpha=-1)}
    if ONEDNN_PACKING:
        gp = pack_unembed_grad(Wg)
        grad["packed W^T"] = lambda: onednn_linear(probs, gp)
    print(f"unembed grad {dtype_name(dtype)} ({rows} x {VOCAB} -> 576)")
    for k, fn in grad.items():
        print(f"  {k:12s} {fl / _time(fn, 10) / 1e9:7.1f} GFLOPS  [{kernel_path(fn)}]")


def run(dtypes: list[str], rows: int, decode_rows: int) -> None:
    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for name in dtypes:
        c = ceilings(DTYPES[name], rows, decode_rows, quiet=False)
        print(f"== {name}: training ceiling {c['train_gflops']:.1f} GFLOPS [{c['train_kernel']}], decode ceiling "
              f"{c['decode_gflops']:.1f} GFLOPS [{c['decode_kernel']}]")
        unembedding(DTYPES[name])
        print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("both", *DTYPES), default="both")
    ap.add_argument("--rows", type=int, default=1184)
    ap.add_argument("--decode-rows", type=int, default=32)
    a = ap.parse_args()
    dtypes = list(DTYPES) if a.dtype == "both" else [a.dtype]
    # on the engine's compute thread, like the engine's own kernels
    COMPUTE.run(lambda: run(dtypes, a.rows, a.decode_rows))


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
