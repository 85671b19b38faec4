"""Sampler vs trainer on the same tokens: the on-policy logprob gap of the local engine.

SmolLM2-135M-Instruct with a fresh LoRA (B = 0, so both sides are the base model), `--prompts` GSM8K
questions x `--samples` samples x `--new-tokens` tokens at T = 1 from the sampler, then the training
forward's logprobs of exactly those tokens. The gap is what DPPO's divergence mask and the activation
gate's noise floor see before any update: in fp32 it is kernel rounding (~1e-6), in bf16 the two
sides' roundings.

    python bench/drift.py [--dtype bfloat16|float32] [--prompts 8] [--samples 4] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402
from tinker import types  # noqa: E402

from trainer.backends.local import LocalServiceClient  # noqa: E402
from trainer.model_registry import SMOLLM2  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    a = ap.parse_args()
    sc = LocalServiceClient(state_dir=tempfile.mkdtemp(), sampler_dtype=a.dtype, train_dtype=a.dtype)
    tc = sc.create_lora_training_client(SMOLLM2, rank=8, seed=0, train_unembed=False).result()
    sampler = tc.save_weights_and_get_sampling_client("drift").result()
    tok = tc.get_tokenizer()
    with open(ROOT / "src" / "envs" / "data" / "gsm8k" / "train.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(a.prompts), f)]
    params = types.SamplingParams(max_tokens=a.new_tokens, temperature=1.0, seed=1, stop=[])
    data, sampled = [], []
    for q in questions:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)
        for s in sampler.sample(types.ModelInput.from_ints(prompt), a.samples, params).result().sequences:
            full = prompt + list(s.tokens)
            weights = [0.0] * (len(prompt) - 1) + [1.0] * len(s.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                    loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))
            sampled.append((len(prompt) - 1, torch.tensor(s.logprobs)))
    out = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    gap_T = torch.cat([(o["logprobs"].to_torch()[c:] - lp).abs() for o, (c, lp) in zip(out, sampled)])
    print(f"{a.dtype}, {len(gap_T)} sampled tokens: |sampler - trainer logprob| mean {gap_T.mean():.5f}, "
          f"q90 {gap_T.quantile(0.9):.5f}, max {gap_T.max():.5f}")
    sc.close()


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
