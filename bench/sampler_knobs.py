"""What each sampler mismatch knob and the Gumbel draw cost the local sampler, against the knobs off.

    python bench/sampler_knobs.py [--batch 32] [--new-tokens 64] [--repeats 3] [--threads 1]
                                  [--levels none,fp16,fp8_e4m3,int8,int4,noise=0.1,noise=0.5,gumbel]

Same model (SmolLM2-135M-Instruct), same prompts (the first `--batch` GSM8K train questions), T = 1,
every sequence forced to `--new-tokens` (no stop). Each level is a `LocalServiceClient` with that knob
(`sampler_quant`, `sampler_logit_noise`, or `sampling_coupling=gumbel`); the levels are timed in turn,
`--repeats` rounds, so a drift in the machine's load falls on every level alike. A level's first request
(which builds and, for a quantised level, rounds the sampler weights once per snapshot: what a run pays
once per step) is timed apart as `build s`; tokens/s = batch x new tokens / the decode's CPU seconds
of this process (prefill included), with the median over the rounds, and its ratio to `none`.
The load over the whole bench is printed (BenchLoad); results: bench/README.md, "The sampler's knobs".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import torch  # noqa: E402
from sampler import prompts  # noqa: E402  (bench/sampler.py: the same prompts)
from tinker import types  # noqa: E402

from trainer.backends.local import LocalServiceClient  # noqa: E402
from trainer.config.enums import SAMPLER_QUANTS  # noqa: E402
from trainer.model_registry import SMOLLM2, resolve_base_model  # noqa: E402
from trainer.utils.load import BenchLoad  # noqa: E402


def level_kwargs(level: str) -> dict:
    """The service client's keywords for a level name: a quant format, `noise=<sigma>` or `gumbel`."""
    if level in SAMPLER_QUANTS:
        return {"sampler_quant": level}
    if level.startswith("noise="):
        sigma = float(level.split("=", 1)[1])
        if not sigma >= 0:
            raise SystemExit(f"error: {level}: the noise sigma must be a number >= 0")
        return {"sampler_logit_noise": sigma}
    if level == "gumbel":
        return {"sampling_coupling": "gumbel"}
    raise SystemExit(f"error: unknown level {level!r}: a format of {list(SAMPLER_QUANTS)}, noise=<sigma> "
                     "or gumbel")


def time_level(level: str, ps: list[list[int]], new: int) -> tuple[float, float]:
    """(build CPU s, decode CPU s) of one client at `level`."""
    sc = LocalServiceClient(state_dir=tempfile.mkdtemp(), max_sample_batch=len(ps), **level_kwargs(level))
    try:
        scl = sc.create_sampling_client(base_model=SMOLLM2)
        c0 = time.process_time()
        scl.sample(types.ModelInput.from_ints(ps[0]), 1, types.SamplingParams(max_tokens=2, stop=[])).result()
        build = time.process_time() - c0
        params = types.SamplingParams(max_tokens=new, temperature=1.0, seed=0, stop=[])

        async def run():
            return await asyncio.gather(*[scl.sample(types.ModelInput.from_ints(p), 1, params) for p in ps])

        c0 = time.process_time()
        res = asyncio.run(run())
        decode = time.process_time() - c0
        assert all(len(r.sequences[0].tokens) == new for r in res)
    finally:
        sc.close()
    return build, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--levels", default="none,fp16,fp8_e4m3,int8,int4,noise=0.1,noise=0.5,gumbel")
    a = ap.parse_args()
    levels = a.levels.split(",")
    for lv in levels:
        level_kwargs(lv)
    if "none" not in levels:
        levels.insert(0, "none")
    if min(a.batch, a.new_tokens, a.repeats, a.threads) < 1:
        raise SystemExit("error: --batch, --new-tokens, --repeats and --threads must be >= 1")
    torch.set_num_threads(a.threads)
    tok = resolve_base_model(SMOLLM2)[1]
    ps = prompts(tok, a.batch)
    builds: dict[str, list[float]] = {lv: [] for lv in levels}
    decodes: dict[str, list[float]] = {lv: [] for lv in levels}
    with BenchLoad("sampler knobs"):
        for rnd in range(a.repeats):
            for lv in levels:
                b, d = time_level(lv, ps, a.new_tokens)
                builds[lv].append(b)
                decodes[lv].append(d)
                print(f"round {rnd + 1} {lv}: build {b:.2f} CPU s, decode {d:.2f} CPU s", flush=True)
    n_tok = a.batch * a.new_tokens
    base = statistics.median(decodes["none"])
    print(f"\n{a.batch} rows x {a.new_tokens} tokens, {a.threads} thread(s), median of {a.repeats} rounds "
          f"(CPU seconds of this process)\n")
    print("| level | tokens/s | vs none | build s (once per snapshot) |")
    print("|---|---:|---:|---:|")
    for lv in levels:
        d = statistics.median(decodes[lv])
        print(f"| {lv} | {n_tok / d:.0f} | {base / d:.3f} | {statistics.median(builds[lv]):.2f} |")


if __name__ == "__main__":
    main()
