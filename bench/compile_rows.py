"""The training forward's element-wise steps between two layer products (residual add + RMSNorm + cast,
RoPE of q|k out of the stacked q|k|v product, the SiLU gate), forward and backward, three ways at a
training micro-batch of SmolLM2-135M (1200 packed rows, hidden 576, 9 / 3 heads of 64, MLP 1536, bf16
products): torch's eager ops (the torch path), the same function under `torch.compile` (inductor, CPU),
and the native kernels as custom ops (`custom_ops.py`, the engine's choice where the plan says
`train_rows`). Prints each one's time per call (fastest of `--reps` interleaved blocks), whether the
compiled form repeats its own bits run to run, and how far each is from the eager ops.

    python bench/compile_rows.py [--reps 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from trainer.backends.local import custom_ops, kernels  # noqa: E402
from trainer.backends.local.model import rope  # noqa: E402
from trainer.backends.local.ops import add_norm_torch, gate_torch  # noqa: E402

N, H, NH, KV, D, I = 1200, 576, 9, 3, 64, 1536
EPS = 1e-5


def eager(x, y, w, qkv, gu, pos, cos, sin):
    s, h = add_norm_torch(x, y, w, EPS, torch.bfloat16)
    q, k, v = qkv.split([NH * D, KV * D, KV * D], -1)
    c, si = cos[pos].unsqueeze(1), sin[pos].unsqueeze(1)
    q, k = rope(q.view(N, NH, D), c, si), rope(k.view(N, KV, D), c, si)
    return s, h, q, k, v.view(N, KV, D).float(), gate_torch(gu, I, torch.nn.functional.silu)


def native(x, y, w, qkv, gu, pos, cos, sin):
    s, h, _ = custom_ops.add_rms_norm_cast(x, y, w, EPS, torch.bfloat16)
    q, k, v = custom_ops.rope_qkv(qkv, pos, cos, sin, NH, KV)
    return s, h, q, k, v, custom_ops.silu_mul(gu)


TRAINED = (0, 1, 3, 4)  # x, y, qkv, gu get gradients; the norm weight and the RoPE tables are frozen


def step(fn, inputs, grads):
    leaves = [t.detach().requires_grad_() if i in TRAINED else t for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    torch.autograd.backward(outs, grads)
    return [o.detach() for o in outs] + [leaves[i].grad for i in TRAINED]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    from trainer.backends.local.plan import cpu_flags
    from trainer.utils.machine import cpu_model

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(N, H, generator=g), torch.randn(H, generator=g)
    y = torch.randn(N, H, generator=g).bfloat16()
    qkv = torch.randn(N, (NH + 2 * KV) * D, generator=g).bfloat16()
    gu = torch.randn(N, 2 * I, generator=g).bfloat16()
    pos, cos, sin = torch.arange(N) % 256, torch.randn(256, D, generator=g), torch.randn(256, D, generator=g)
    inputs = (x, y, w, qkv, gu, pos, cos, sin)
    ref = eager(*inputs)
    grads = [torch.randn(o.shape, generator=g).to(o.dtype) for o in ref]
    ways = {"eager torch ops": eager, "torch.compile (inductor)": torch.compile(eager, dynamic=False)}
    if kernels.library() is not None:
        ways["native custom ops"] = native
    t0 = time.perf_counter()
    first = {k: step(f, inputs, grads) for k, f in ways.items()}  # compiles the compiled form
    print(f"CPU: {cpu_model()} ({cpu_flags()}); torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads; first calls (compile included) {time.perf_counter() - t0:.1f} s")
    best = {k: float("inf") for k in ways}
    for _ in range(args.reps):
        for k, f in ways.items():
            t = time.perf_counter()
            step(f, inputs, grads)
            best[k] = min(best[k], time.perf_counter() - t)
    again = step(ways["torch.compile (inductor)"], inputs, grads)
    same = all(torch.equal(a, b) for a, b in zip(first["torch.compile (inductor)"], again))
    print(f"compiled form repeats its bits: {same}")
    for k in ways:
        err = max(float((a.double() - b.double()).abs().max())
                  for a, b in zip(first[k], first["eager torch ops"]))
        print(f"{k:<28} forward + backward {best[k] * 1e3:7.2f} ms   max |diff| vs eager {err:.3g}")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
