"""One training update's forward + backward on SmolLM2-135M: the engine's own forward
(`trainer/backends/local/train_forward.py`) next to the peft-wrapped HF model (the reference the
engine's forward is tested against), same LoRA parameters, same micro-batch, in one run.

Micro-batch: 4 prompts x 4 samples (18 prompt + 64 completion tokens, mask 0 on the prompt), LoRA
rank 8 on attention + MLP, loss = sum of masked completion logprobs times a random advantage, i.e.
the shape of one of bench/step.py's two updates.

    python bench/train_forward.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tinker import types  # noqa: E402

from trainer.backends.local import LocalServiceClient  # noqa: E402
from trainer.backends.local.common import COMPUTE  # noqa: E402
from trainer.model_registry import SMOLLM2  # noqa: E402

PROMPTS, SAMPLES, PROMPT_LEN, COMPLETION = 4, 4, 18, 64


def data(seed: int = 0) -> tuple[list[types.Datum], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out, adv = [], []
    for _ in range(PROMPTS):
        prompt = torch.randint(1000, 40000, (PROMPT_LEN,), generator=g).tolist()
        for _ in range(SAMPLES):
            seq = prompt + torch.randint(1000, 40000, (COMPLETION,), generator=g).tolist()
            n = len(seq) - 1
            mask = torch.zeros(n)
            mask[PROMPT_LEN - 1:] = 1.0
            out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                                   loss_fn_inputs={"target_tokens": seq[1:], "mask": mask}))
            adv.append(mask * float(torch.randn(1, generator=g)))
    return out, adv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    sc = LocalServiceClient(state_dir=tempfile.mkdtemp(), sampler_dtype="float32", train_dtype="float32")
    tc = sc.create_lora_training_client(SMOLLM2, rank=8, seed=0, train_unembed=False).result()
    batch, adv = data()
    preps = tc.compute.prepare(batch)
    grad_from = [p.mask_from for p in preps]
    b = tc.compute.base

    def ours() -> None:
        lps = tc.compute.logprobs(preps, grad_from)
        sum((lp * w).sum() for lp, w in zip(lps, adv)).backward()

    def peft() -> None:
        # the reference path: the peft model over the right-padded batch, then the unembedding with a
        # graph only from each datum's first loss position
        b.activate(tc.model_id)
        T = max(len(p.ids) for p in preps)
        ids = torch.zeros(len(preps), T, dtype=torch.long)
        for i, p in enumerate(preps):
            ids[i, : len(p.ids)] = torch.tensor(p.ids)
        hidden = b.causal_lm().model(input_ids=ids).last_hidden_state
        head = b.causal_lm().lm_head
        loss = 0.0
        for i, p in enumerate(preps):
            c, n = grad_from[i], len(p.ids)
            with torch.no_grad():
                F.cross_entropy(head(hidden[i, :c]), p.targets[:c], reduction="none")
            lp = -F.cross_entropy(head(hidden[i, c:n]), p.targets[c:], reduction="none")
            loss = loss + (lp * adv[i][c:]).sum()
        loss.backward()

    def timed(fn) -> list[float]:
        def run() -> list[float]:
            out = []
            for _ in range(a.reps + 1):
                t0 = time.perf_counter()
                with b.lock:
                    fn()
                out.append(time.perf_counter() - t0)
                for p in tc.compute.params:
                    p.grad = None
            return out[1:]  # the first one warms up
        return COMPUTE.run(run)

    print(f"torch threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; "
          f"{len(batch)} datums x {PROMPT_LEN + COMPLETION - 1} tokens")
    t_ours, t_peft = timed(ours), timed(peft)
    mo, mp = min(t_ours), min(t_peft)
    print(f"engine forward (packed, shared prompts, fused LoRA): {mo:.2f} s  (all: {', '.join(f'{x:.2f}' for x in t_ours)})")
    print(f"peft model forward (padded):                          {mp:.2f} s  (all: {', '.join(f'{x:.2f}' for x in t_peft)})")
    print(f"speed-up {mp / mo:.2f}x")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
