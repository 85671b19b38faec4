"""The sampler's decode step on its native kernels (decode attention, and the row kernels between the layer
products: residual add + RMSNorm + cast, SiLU gate) next to its torch path, interleaved in one process.
The unembedding and the layer products are the same on both sides (on AMX CPUs the AMX head kernel, and in
bf16 the layer products on the tiles too: `kernels.BlockedLinear`); where those run, a third side times the
native kernels with the layer products on oneDNN's packed weights instead (what the tiles replace). Each
side is the same snapshot under another engine plan (`plan.SamplerPlan.on_torch`, `amx_projections` off).

SmolLM2-135M-Instruct with a rank-8 LoRA merged (as a sampling snapshot is), 32 rows in 8 runs of 4 (a
GRPO batch of 8 prompts x 4 samples) at cache lengths 107-170, random cache contents (the time does not
depend on them). Each side decodes into its own cache layout (native: keys before RoPE in the sampler
dtype; torch: rotated fp32 keys). The two sides alternate `--reps` times, `--inner` steps each; min and
median ms per step are printed.

    python bench/decode.py [--dtype bfloat16|float32] [--reps 10] [--inner 3]

Without a native library here (no C compiler, or PAIREDRL_NATIVE_KERNELS=0) it says why and times the
torch path only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

ROWS, RUNS, NEW_POS = 32, 8, 150


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--inner", type=int, default=3)
    args = ap.parse_args()

    import torch

    from trainer.backends.local import kernels
    from trainer.backends.local import sampler_forward as sf
    from trainer.backends.local.common import COMPUTE
    from trainer.backends.local.engine import shared_base
    from trainer.model_registry import SMOLLM2
    from trainer.backends.local.ops import sampler_ops
    from trainer.backends.local.sampler_weights import build_weights, with_lora
    from trainer.utils.machine import cpu_model

    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}; native kernels: {kernels.describe()}")
    base = shared_base(SMOLLM2)
    name = base.add_adapter(8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0)
    snap = base.snapshot(name, 2.0)

    def run() -> None:
        dtype = getattr(torch, args.dtype)
        W = base.sampler_weights(snap, dtype)
        per = ROWS // RUNS
        pos = torch.tensor([NEW_POS - 9 * (i // per) for i in range(ROWS)])
        spans = [(per * i, per * (i + 1), NEW_POS + 1 - 9 * i) for i in range(RUNS)]
        tok = torch.randint(100, 40000, (ROWS,))
        plan = W.ops.plan

        def weights(p: object) -> object:  # the same snapshot under another plan
            return with_lora(build_weights(base.config, base.base_state, base.cos, base.sin, dtype,
                                           head_tiles=W.head_blocked, ops=sampler_ops(p)), snap.tensors, snap.scale)

        sides = {"native kernels": W, "torch path": weights(plan.on_torch())}
        if not plan.decode_attention:
            del sides["native kernels"]
        elif plan.amx_projections:  # the same snapshot with the layer products on oneDNN
            sides = {"native kernels": W,
                     "native kernels, oneDNN layer products": weights(replace(plan, amx_projections=False)),
                     "torch path": sides["torch path"]}
        caches = {}
        for side, Ws in sides.items():
            caches[side] = sf.new_cache(Ws, ROWS, NEW_POS + 90)
            for k, v in caches[side]:
                k.normal_()
                v.normal_()
        times: dict[str, list[float]] = {s: [] for s in sides}
        with torch.no_grad():
            for rep in range(args.reps + 1):
                for side, Ws in sides.items():
                    t = time.perf_counter()
                    for _ in range(args.inner):
                        sf.decode_step(Ws, tok, pos, spans, caches[side])
                    if rep:  # the first round warms up
                        times[side].append((time.perf_counter() - t) / args.inner * 1e3)
        for side, ts in times.items():
            print(f"{args.dtype} decode step, {side}: min {min(ts):.1f} ms, median {statistics.median(ts):.1f} ms")
        if len(times) >= 2:
            first = min(times["native kernels"])
            for side in list(sides)[1:]:
                print(f"native kernels / {side} (min): {first / min(times[side]):.3f}")

    COMPUTE.run(run)


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
