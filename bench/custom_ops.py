"""Per-call cost of the `pairedrl::` custom ops (`src/trainer/backends/local/custom_ops.py`): each native
kernel called directly (the `kernels.py` function) next to the same kernel through
`torch.ops.pairedrl.<op>` (the dispatcher, the op's capability check, its output checks), and the op on its
torch implementation for scale; at decode-sized inputs (8 and 32 rows, SmolLM2-135M's widths: hidden 576,
intermediate 1536, 9 query / 3 key-value heads of 64) and at a training micro-batch (~1200 rows). The
training ops also run forward + backward through `fused_ops`' autograd functions and through the ops'
registered autograd.

Calls are timed in blocks of ~50 ms, direct and op interleaved, and the fastest block per call is reported
(on 2 shared cores other processes slow some blocks; the fastest is the least disturbed); the load average
is printed beside the table. `--threads 1` keeps the kernels' OpenMP barriers out of the figures, which on
a loaded machine cost more than the calls themselves.

    python bench/custom_ops.py [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.backends.local import custom_ops, fused_ops, kernels

OPS = torch.ops.pairedrl
H, I, NH, KV, D, VOCAB = 576, 1536, 9, 3, 64, 49152


def _cpu() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.*)$", text, re.MULTILINE)
    flags = sorted(set(re.findall(r"\b(amx_bf16|avx512_bf16)\b", text)))
    name = model.group(1) if model else "unknown CPU"
    return f"{name} ({', '.join(flags) or 'no avx512_bf16, no amx_bf16'})"


def _per_call(fns: list[Callable[[], object]], reps: int, budget_s: float = 0.05) -> list[float]:
    """Fastest block's seconds per call of each of `fns`, timed in interleaved blocks sized to ~`budget_s`."""
    for f in fns:
        f()
    t0 = time.perf_counter()
    fns[0]()
    n = max(1, min(2000, int(budget_s / max(time.perf_counter() - t0, 1e-7))))
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for f, ts in zip(fns, times):
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            ts.append((time.perf_counter() - t0) / n)
    return [min(ts) for ts in times]


def _torch(f: Callable[[], object]) -> Callable[[], object]:
    def g() -> object:
        with custom_ops.native(False):
            return f()
    return g


def cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(label, kernels.py call, op call) at each size."""
    g = torch.Generator().manual_seed(0)
    out = []
    for B in (8, 32):
        x, y = torch.randn(B, H, generator=g), (0.01 * torch.randn(B, H, generator=g)).bfloat16()
        w = torch.randn(H, generator=g)
        gu = torch.randn(B, 2 * I, generator=g).bfloat16()
        out += [
            (f"add_rms_norm {B}x{H} bf16",
             lambda x=x, y=y, w=w: kernels.residual_rms_norm(x, y, w, 1e-5, torch.bfloat16),
             lambda x=x, y=y, w=w: OPS.add_rms_norm(x, y, w, 1e-5, torch.bfloat16)),
            (f"silu_mul {B}x{2 * I} bf16", lambda gu=gu: kernels.silu_mul(gu),
             lambda gu=gu: OPS.silu_mul(gu)),
        ]
    wm = torch.randn(2 * I, H, generator=g).bfloat16()
    A, Bm = torch.randn(16, H, generator=g), torch.randn(2 * I, 16, generator=g)
    out.append((f"lora_merge {2 * I}x{H} r16 bf16", lambda: kernels.lora_merge(wm, A, Bm),
                lambda: OPS.lora_merge(wm, A, Bm)))
    N = 1200
    x, y = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g).bfloat16()
    w = torch.randn(H, generator=g)
    rstd, s = torch.empty(N), torch.empty(N, H)
    out += [
        (f"rms_norm_cast {N}x{H} bf16",
         lambda: kernels.residual_rms_norm(x, None, w, 1e-5, torch.bfloat16, rstd),
         lambda: OPS.rms_norm_cast(x, w, 1e-5, torch.bfloat16)),
        (f"add_rms_norm_cast {N}x{H} bf16",
         lambda: kernels.residual_rms_norm(x, y, w, 1e-5, torch.bfloat16, rstd, s),
         lambda: OPS.add_rms_norm_cast(x, y, w, 1e-5, torch.bfloat16)),
    ]
    qkv = torch.randn(N, (NH + 2 * KV) * D, generator=g).bfloat16()
    pos = torch.arange(N) % 150
    cos, sin = torch.randn(2048, D, generator=g), torch.randn(2048, D, generator=g)
    gu = torch.randn(N, 2 * I, generator=g).bfloat16()
    out += [
        (f"rope_qkv {N}x{qkv.shape[1]} bf16", lambda: kernels.rope_qkv(qkv, pos, cos, sin, NH, KV),
         lambda: OPS.rope_qkv(qkv, pos, cos, sin, NH, KV)),
        (f"silu_mul {N}x{2 * I} bf16", lambda: kernels.silu_mul(gu), lambda: OPS.silu_mul(gu)),
    ]
    if kernels.native_attention(D, NH, KV):
        q, k, v = (torch.randn(8, 150, h, D, generator=g) for h in (NH, KV, KV))
        out.append(("attention 8x150 9/3x64 fp32", lambda: kernels.attention_forward(q, k, v),
                    lambda: OPS.attention(q, k, v)))
    if kernels.avx512():
        logits, yv = 6 * torch.randn(128, VOCAB, generator=g), torch.randint(0, VOCAB, (128,), generator=g)
        out.append((f"softmax_target 128x{VOCAB} bf16 probs",
                     lambda: kernels.softmax_target(logits, yv, torch.bfloat16),
                     lambda: custom_ops.softmax_target(logits, yv, torch.bfloat16)))
    return out


def autograd_cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """(label, fused_ops forward + backward, op forward + backward) at the training micro-batch."""
    g = torch.Generator().manual_seed(1)
    N = 1200
    x = torch.randn(N, H, generator=g).requires_grad_()
    w = torch.randn(H, generator=g)
    dy = torch.randn(N, H, generator=g).bfloat16()
    gu = torch.randn(N, 2 * I, generator=g).bfloat16().requires_grad_()
    dm = torch.randn(N, I, generator=g).bfloat16()
    qkv = torch.randn(N, (NH + 2 * KV) * D, generator=g).bfloat16().requires_grad_()
    pos = torch.arange(N) % 150
    cos, sin = torch.randn(2048, D, generator=g), torch.randn(2048, D, generator=g)
    dq, dk, dv = (torch.randn(N, h, D, generator=g) for h in (NH, KV, KV))

    def grad(outs, ins, gs):
        return torch.autograd.grad(outs, ins, gs)

    out = [
        (f"rms_norm_cast fwd+bwd {N}x{H}",
         lambda: grad(fused_ops.NormCast.apply(x, w, 1e-5, torch.bfloat16), x, dy),
         lambda: grad(OPS.rms_norm_cast(x, w, 1e-5, torch.bfloat16)[0], x, dy)),
        (f"silu_mul fwd+bwd {N}x{2 * I}", lambda: grad(fused_ops.SiluMul.apply(gu), gu, dm),
         lambda: grad(OPS.silu_mul(gu), gu, dm)),
        (f"rope_qkv fwd+bwd {N}x{qkv.shape[1]}",
         lambda: grad(fused_ops.RopeQKV.apply(qkv, pos, cos, sin, NH, KV), qkv, (dq, dk, dv)),
         lambda: grad(OPS.rope_qkv(qkv, pos, cos, sin, NH, KV), qkv, (dq, dk, dv))),
    ]
    if kernels.native_attention(D, NH, KV):
        q, k, v = (torch.randn(8, 150, h, D, generator=g).requires_grad_() for h in (NH, KV, KV))
        do = torch.randn(8, 150, NH, D, generator=g)
        out.append(("attention fwd+bwd 8x150 9/3x64",
                    lambda: grad(fused_ops.Attention.apply(q, k, v), (q, k, v), do),
                    lambda: grad(OPS.attention(q, k, v)[0], (q, k, v), do)))
    return out


def floor_cases() -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    """The dispatch floor: an op that only allocates an empty tensor, as a plain function next to the same
    function as a `custom_op` (what every op above pays), and the same as a kernel registered with
    `torch.library.Library.impl` (no autograd wrapper, no output checks) for comparison."""
    x = torch.empty(8, 16)

    @torch.library.custom_op("pairedrl_bench::empty", mutates_args=())
    def empty(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty(0)

    lib = torch.library.Library("pairedrl_bench_raw", "DEF")
    lib.define("empty(Tensor t) -> Tensor")
    lib.impl("empty", lambda t: t.new_empty(0), "CPU")
    floor_cases.lib = lib  # kept alive while the op is timed
    raw = torch.ops.pairedrl_bench_raw.empty
    return [("empty op: custom_op", lambda: x.new_empty(0), lambda: empty(x)),
            ("empty op: Library.impl", lambda: x.new_empty(0), lambda: raw(x))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch's (and the kernels') threads; default: torch's")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernels.library() is None:
        raise SystemExit(f"no native kernels here: {kernels.describe()}")
    print(f"CPU: {_cpu()}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"load average before: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    header = f"{'torch.ops us':>12} {'overhead us':>11} {'torch impl us':>13}"
    print(f"{'call':<44} {'kernels.py us':>13} {header}")
    for label, direct, op in cases():
        d, o, t = _per_call([direct, op, _torch(op)], args.reps)
        print(f"{label:<44} {d * 1e6:>13.1f} {o * 1e6:>12.1f} {(o - d) * 1e6:>11.1f} {t * 1e6:>13.1f}")
    for label, direct, op in floor_cases():
        d, o = _per_call([direct, op], args.reps)
        print(f"{label:<44} {d * 1e6:>13.1f} {o * 1e6:>12.1f} {(o - d) * 1e6:>11.1f} {'':>13}")
    print(f"{'forward + backward':<44} {'fused_ops us':>13} {header}")
    for label, direct, op in autograd_cases():
        d, o, t = _per_call([direct, op, _torch(op)], args.reps)
        print(f"{label:<44} {d * 1e6:>13.1f} {o * 1e6:>12.1f} {(o - d) * 1e6:>11.1f} {t * 1e6:>13.1f}")
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
