"""One full RL step on CPU: pairedrl's local engine next to TRL's GRPOTrainer, same work, one run.

Workload (issue 9): SmolLM2-135M-Instruct, LoRA rank 8 (alpha 16, attention + MLP projections),
8 prompts x 4 samples x 64 new tokens (EOS disabled on both sides so every sample is exactly 64
tokens), then 2 minibatch updates of 16 samples (each sample used once, 2 optimizer steps). All 32
samples are trained on both sides (`schedule.drop_constant_groups=false`; `--with-drop` also times
the default that skips zero-advantage groups, which is less work).

TRL setting doing the same work: GRPOConfig(num_generations=4, generation_batch_size=32,
per_device_train_batch_size=16, steps_per_generation=2, num_iterations=1,
max_completion_length=64, min_new_tokens=64 via generation_kwargs): one generation of 32
completions feeding two optimizer steps of 16. (`num_iterations=2` instead reuses the whole batch
twice, i.e. twice the training work; run with --trl-num-iterations-2 to time that too.)

    pip install -e ".[bench]"       # trl
    python bench/step.py [--steps 3] [--skip-trl]

Each side runs `--steps` steps; the first warms up caches and allocators, and the fastest of the
others is reported for both (this VM's speed drifts by 20-40% over minutes; every step's time is
printed too).

Each side's roofline fraction is the time the step's useful GEMM work would take at this CPU's measured
ceilings in the step's precision (bench/gemm.py: training shapes for prefill and training, the faster
decode path for decode), over the measured step time. Useful work is counted the same for both sides:
2 FLOPs per multiply-add of every projection and the unembedding, each prompt once per group, every
sampled token once, and each update's forward + input-gradient backward over its packed rows.

Precision is the same on both sides: `--precision auto` (default) is what the engine's `auto` picks on
this CPU (bf16 where it has AVX512_BF16/AMX, else fp32); with bf16 ours samples from bf16 weights and
trains under bf16 autocast, and TRL loads the model in bf16 (generation in bf16; peft keeps the LoRA
factors in fp32) with `bf16=True` (training under autocast).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

N_PROMPTS, N_SAMPLES, NEW_TOKENS, UPDATES, RANK = 8, 4, 64, 2, 8


class _NoStopEnv:
    """Wraps a cookbook env so sampling ignores EOS (fixed 64-token completions)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.stop: list = []

    async def initial_observation(self) -> Any:
        ob, self.stop = await self.env.initial_observation()
        return ob, []

    async def step(self, tokens: list[int]) -> Any:
        # grade only up to the first stop token, as a stopping sampler would have returned
        for i, t in enumerate(tokens):
            if t in self.stop:
                tokens = tokens[: i + 1]
                break
        return await self.env.step(tokens)


class _NoStopTask:
    def __init__(self, task: Any) -> None:
        self.task = task
        self.renderer = task.renderer

    def train_problems(self) -> list:
        return self.task.train_problems()

    def make_env(self, problem: Any) -> _NoStopEnv:
        return _NoStopEnv(self.task.make_env(problem))

    def decode(self, tokens: list[int]) -> str:
        return self.renderer.tokenizer.decode(tokens)

    def parse_answer(self, text: str) -> str | None:
        return self.task.parse_answer(text)


def ours(steps: int, precision: str, drop_constant_groups: bool = False) -> dict:
    from trainer.backends import build_service_client
    from trainer.backends.local.precision import dtype_name
    from trainer.config.compose import run_config
    from trainer.loop import RLLoop
    from trainer.setup import build_components, make_loss
    from trainer.run_info import resolved_config_dict

    cfg = run_config([
        "model=smollm2_135m", f"model.lora_rank={RANK}", "model.lora_alpha=16", "env=arithmetic", "eval=none",
        f"schedule.num_steps={steps}", f"schedule.groups_per_batch={N_PROMPTS}", f"schedule.group_size={N_SAMPLES}",
        f"schedule.updates_per_batch={UPDATES}", "schedule.save_every=0", f"sampling.max_tokens={NEW_TOKENS}",
        "loss=grpo", f"schedule.drop_constant_groups={str(drop_constant_groups).lower()}",
        f"backend.sampler_dtype={precision}", f"backend.train_dtype={precision}"])
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        sc = build_service_client(cfg, Path(d))
        dtypes = (dtype_name(sc.sampler_dtype), dtype_name(sc.train_dtype))
        _, _, task = build_components(cfg)
        loop = RLLoop(cfg, Path(d), sc, _NoStopTask(task), make_loss(cfg, sc), resolved_config_dict(cfg),
                      progress=False)
        setup = time.perf_counter() - t0
        loop.run()
        rows = [json.loads(x) for x in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        import asyncio

        obs = [asyncio.run(task.make_env(p).initial_observation())[0].to_ints()
               for p in task.train_problems()[:N_PROMPTS]]
        prompts = [task.renderer.tokenizer.decode(o) for o in obs]
    timed = [s for s in range(1, steps)] or [0]
    per_step = {s: [r for r in rows if r["step"] == s] for s in timed}
    best = min(timed, key=lambda s: per_step[s][-1]["time/step"])
    last = per_step[best]
    return {"step_s": last[-1]["time/step"], "sample_s": last[0]["time/sample"], "train_s": last[0]["time/train"],
            "all_s": [per_step[s][-1]["time/step"] for s in timed],
            "trained": last[0]["env/rollouts_trained"],
            "setup_s": setup, "tokens": last[0]["tokens/sampled"], "loss_path": last[0]["loss/path"],
            "dtypes": dtypes, "prompt_tokens": sum(len(o) for o in obs),
            "prompts": prompts}


def trl(prompts: list[str], steps: int, num_iterations: int, bf16: bool) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainer.model_registry import model_dir

    path = model_dir("HuggingFaceTB/SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32)
    ds = Dataset.from_dict({"prompt": prompts * 4})

    def reward(completions: list[str], **_: Any) -> list[float]:
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            times.append(time.perf_counter())

    per_gen = UPDATES if num_iterations == 1 else 1
    with tempfile.TemporaryDirectory() as d:
        args = GRPOConfig(
            output_dir=d, use_cpu=True, bf16=bf16, report_to=[], logging_steps=1000, save_strategy="no",
            num_generations=N_SAMPLES,
            per_device_train_batch_size=(N_PROMPTS * N_SAMPLES) // per_gen, steps_per_generation=per_gen,
            num_iterations=num_iterations, max_completion_length=NEW_TOKENS, learning_rate=2e-4, beta=0.0,
            max_steps=UPDATES * steps, temperature=1.0,
            generation_kwargs={"min_new_tokens": NEW_TOKENS}, seed=0, dataloader_num_workers=0)
        lora = LoraConfig(r=RANK, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                              peft_config=lora, callbacks=[Clock()])
        t0 = time.perf_counter()
        trainer.train()
    # a "step" = one generation of 32 completions and the optimizer steps it feeds (UPDATES of them)
    k = UPDATES
    boundaries = [t0] + times
    per_step = [boundaries[(i + 1) * k] - boundaries[i * k] for i in range(steps)]
    return {"step_s": min(per_step[1:] or per_step), "steps": per_step}


def step_flops(prompt_tokens: int, sampled_tokens: int) -> dict[str, float]:
    """Useful FLOPs of one step (see the module docstring): prefill, decode and training."""
    from gemm import MACS_PER_TOKEN

    rows = prompt_tokens + sampled_tokens  # packed training rows over all updates: each prompt once per group
    return {"prefill": 2 * MACS_PER_TOKEN * prompt_tokens, "decode": 2 * MACS_PER_TOKEN * sampled_tokens,
            "train": 2 * 2 * MACS_PER_TOKEN * rows}


def roofline(flops: dict[str, float], ceil: dict, step_s: float) -> tuple[float, float]:
    """(seconds the GEMM work takes at the ceilings, that over the measured step time)."""
    t = (flops["prefill"] + flops["train"]) / (ceil["train_gflops"] * 1e9) + flops["decode"] / (
        ceil["decode_gflops"] * 1e9)
    return t, t / step_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--trl-num-iterations-2", action="store_true")
    ap.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                    help="both sides (auto: the engine's choice on this CPU)")
    ap.add_argument("--with-drop", action="store_true",
                    help="also time pairedrl with schedule.drop_constant_groups=true (less work than TRL)")
    a = ap.parse_args()
    import torch

    print(f"torch threads: {torch.get_num_threads()}, load: {os.getloadavg()[0]:.2f}")
    r = ours(a.steps, a.precision)
    bf16 = r["dtypes"] == ("bfloat16", "bfloat16")
    if not bf16 and "bfloat16" in r["dtypes"]:
        raise SystemExit(f"mixed engine precision {r['dtypes']}: pass --precision float32 or bfloat16")
    print(f"precision on both sides: {'bf16' if bf16 else 'fp32'} (engine sampler/train: {r['dtypes']})")
    print(f"pairedrl local engine, all 32 rollouts trained (same work as TRL): step {r['step_s']:.1f} s "
          f"(sample {r['sample_s']:.1f} s, train {r['train_s']:.1f} s, {r['tokens']} sampled tokens, loss path "
          f"{r['loss_path']}; setup {r['setup_s']:.1f} s; timed steps {', '.join(f'{x:.1f}' for x in r['all_s'])})")
    from gemm import DTYPES, ceilings

    from trainer.backends.local.common import COMPUTE

    flops = step_flops(r["prompt_tokens"], r["tokens"])
    ceil = COMPUTE.run(lambda: ceilings(DTYPES[r["dtypes"][0]]))
    gemm_s, frac = roofline(flops, ceil, r["step_s"])
    print(f"step work {sum(flops.values()) / 1e12:.3f} TFLOP (prefill {flops['prefill'] / 1e12:.3f}, decode "
          f"{flops['decode'] / 1e12:.3f}, train {flops['train'] / 1e12:.3f}); {r['dtypes'][0]} GEMM ceilings on this "
          f"CPU: train {ceil['train_gflops']:.0f} GFLOPS [{ceil['train_kernel']}], decode {ceil['decode_gflops']:.0f} "
          f"GFLOPS [{ceil['decode_kernel']}] -> {gemm_s:.2f} s at the ceilings")
    print(f"pairedrl roofline fraction {frac:.3f}")
    if a.with_drop:
        d = ours(a.steps, a.precision, drop_constant_groups=True)
        print(f"pairedrl, schedule.drop_constant_groups=true (zero-advantage groups skipped, {d['trained']} of 32 "
              f"trained): step {d['step_s']:.1f} s (sample {d['sample_s']:.1f} s, train {d['train_s']:.1f} s)")
    if a.skip_trl:
        return
    from trainer.backends.local.common import COMPUTE

    # TRL runs on the engine's compute thread as well: a second thread's OpenMP pool would slow it down
    t = COMPUTE.run(lambda: trl(r["prompts"], a.steps, 1, bf16))
    print(f"TRL GRPOTrainer (1 generation -> 2 half-batch optimizer steps, same work): step {t['step_s']:.1f} s "
          f"(all steps {', '.join(f'{x:.1f}' for x in t['steps'])})")
    print(f"TRL roofline fraction {roofline(flops, ceil, t['step_s'])[1]:.3f} (same useful work)")
    print(f"ratio pairedrl / TRL = {r['step_s'] / t['step_s']:.3f}")
    if a.trl_num_iterations_2:
        t2 = COMPUTE.run(lambda: trl(r["prompts"], a.steps, 2, bf16))
        print(f"TRL GRPOTrainer num_iterations=2 (whole batch twice): step {t2['step_s']:.1f} s; "
              f"ratio {r['step_s'] / t2['step_s']:.3f}")


if __name__ == "__main__":
    from trainer.utils.load import BenchLoad  # the load beside the timings; warns when contended

    with BenchLoad(Path(__file__).name):
        main()
