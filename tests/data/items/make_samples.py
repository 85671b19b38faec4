"""Writes the per-item sample files of tests/test_items.py (run from the repository root; the files are
committed, so the tests need none of these libraries).

- lm_eval/: written by lm-evaluation-harness 0.4.13 itself (`pip install --target DIR --no-deps
  lm-eval==0.4.13 sacrebleu portalocker tabulate sqlitedict word2number more_itertools evaluate`, then
  PYTHONPATH=DIR): its
  `dummy` model (random log-likelihoods, seeded by `--seed`) on a two-task group `arith` (arith_add,
  arith_mul: 8 multiple-choice items each, metrics acc and acc_norm) defined in lm_eval_tasks/, with
  `--log_samples`. Arm a is seeds 0 and 1, arm b seeds 100 and 101. Skipped when lm_eval is not importable.
- tinker_cookbook/: written by tinker-cookbook 0.5.8 (installed here) itself: `EvalStore.create_run`,
  `write_trajectory` with `StoredTrajectory` objects and `make_example_id` ids, as its benchmark runner does.
- prime_rl/, verl/: built field for field from the writers' code (neither installs offline here): prime-rl
  v0.6.0 `save_rollouts` (orjson lines of `FinishedRollout.to_dict()` without `trajectory`, fields from
  verifiers@78c1b3c `state_to_output`), and verl v0.7.0 `RayPPOTrainer._dump_generations`.
- plain.jsonl, plain.csv: this project's plain format (item_id, correct/score, seed, category).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent


def lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        print("lm_eval not importable: lm_eval/ left as it is")
        return
    tasks = HERE / "lm_eval_tasks"
    rng = random.Random(7)
    for name, op in (("add", "+"), ("mul", "*")):
        rows = []
        for _ in range(8):
            a, b = rng.randint(2, 20), rng.randint(2, 9)
            ans = a + b if op == "+" else a * b
            choices = [str(ans), str(ans + 1), str(ans - 1), str(ans + 2)]
            rng.shuffle(choices)
            rows.append(json.dumps({"question": f"{a} {op} {b} =", "choices": choices,
                                    "label": choices.index(str(ans))}))
        (tasks / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    out = HERE / "lm_eval"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    for run, seed in (("a_seed0", 0), ("a_seed1", 1), ("b_seed0", 100), ("b_seed1", 101)):
        # the task YAMLs name their data files relative to this folder: run from it
        subprocess.run([sys.executable, "-m", "lm_eval", "run", "--model", "dummy", "--tasks", "arith",
                        "--include_path", str(tasks), "--output_path", str(out / run), "--log_samples",
                        "--seed", str(seed)], cwd=tasks, env=env, check=False, capture_output=True)
        for f in (out / run).rglob("*"):  # one folder per run: samples_<task>_<date>.jsonl
            if f.is_file() and f.parent != out / run:
                f.rename(out / run / f.name)
        for d in sorted((out / run).iterdir()):
            if d.is_dir():
                d.rmdir()
        for f in (out / run).glob("results_*.json"):
            f.unlink()  # the aggregated results: not read by the adapter, and they hold this machine's paths


def tinker_cookbook() -> None:
    from tinker_cookbook.eval.benchmarks._common import make_example_id
    from tinker_cookbook.eval.benchmarks._types import StoredTrajectory, StoredTurn
    from tinker_cookbook.stores.eval_store import EvalStore

    out = HERE / "tinker_cookbook"
    shutil.rmtree(out, ignore_errors=True)
    questions = [f"What is {a} + {a + 3}?" for a in range(6)]
    for arm, right in (("a", {0, 2, 3}), ("b", {0, 1, 2, 3, 5})):
        store = EvalStore(out / arm)
        run_id = store.create_run(model_name="Qwen/Qwen3-8B", benchmarks=["gsm8k"],
                                  checkpoint_name=f"arm_{arm}", run_id=f"arm_{arm}")
        for idx, q in enumerate(questions):
            ok = idx in right
            answer = f"\\boxed{{{2 * idx + 3 if ok else 0}}}"
            store.write_trajectory(run_id, "gsm8k", StoredTrajectory(
                idx=idx, benchmark="gsm8k", example_id=make_example_id("gsm8k", q),
                turns=[StoredTurn(role="user", content=q, token_count=9),
                       StoredTurn(role="assistant", content=answer, token_count=5)],
                reward=1.0 if ok else 0.0, metrics={"correct": float(ok)},
                logs={"expected": str(2 * idx + 3), "extracted": str(2 * idx + 3 if ok else 0)},
                time_seconds=0.5))


def prime_rl() -> None:
    import orjson

    out = HERE / "prime_rl"
    shutil.rmtree(out, ignore_errors=True)
    rng = random.Random(3)
    for arm, p in (("a", 0.4), ("b", 0.7)):
        path = out / arm / "rollouts" / "step_20" / "eval_rollouts_gsm8k.jsonl"
        path.parent.mkdir(parents=True)
        group = str(uuid.UUID(int=rng.getrandbits(128)))
        with path.open("wb") as f:
            for example_id in range(5):
                for _ in range(2):  # group_size = 2 rollouts per example
                    ok = rng.random() < p
                    row = {
                        "example_id": example_id,
                        "prompt": [{"role": "user", "content": f"question {example_id}"}],
                        "completion": [{"role": "assistant", "content": "\\boxed{4}" if ok else "5"}],
                        "answer": "4", "info": {}, "reward": 1.0 if ok else 0.0, "error": None,
                        "timing": {"generation_ms": 812.0, "scoring_ms": 3.0, "total_ms": 815.0},
                        "is_completed": True, "is_truncated": False, "stop_condition": "no_tools_called",
                        "metrics": {"correct_answer": 1.0 if ok else 0.0, "num_turns": 1.0},
                        "tool_defs": None,
                        "token_usage": {"input_tokens": 42.0, "output_tokens": 17.0},
                        "env_name": "gsm8k", "group_id": group, "policy_version": 20,
                        "off_policy_steps": 0, "rollout_id": str(uuid.UUID(int=rng.getrandbits(128))),
                        "eval_step": 20}
                    f.write(orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE | orjson.OPT_SERIALIZE_NUMPY))


def verl() -> None:
    out = HERE / "verl"
    shutil.rmtree(out, ignore_errors=True)
    rng = random.Random(5)
    for arm, p in (("a", 0.3), ("b", 0.6)):
        path = out / arm / "40.jsonl"
        path.parent.mkdir(parents=True)
        inputs, outputs, gts, scores, accs = [], [], [], [], []
        for i in range(6):
            ok = rng.random() < p
            inputs.append(f"user\nSolve: {i} + {i} = ? Put the answer after ####.\nassistant\n")
            outputs.append(f"#### {2 * i}" if ok else "#### 1")
            gts.append(str(2 * i))
            scores.append(1.0 if ok else 0.0)
            accs.append(ok)
        base = {"input": inputs, "output": outputs, "gts": gts, "score": scores, "step": [40] * 6}
        # reward_extra_infos_dict: _validate's `reward`, the scorer's `acc`
        extra = {"reward": scores, "acc": accs}
        base.update({k: v for k, v in extra.items() if len(v) == 6})
        with path.open("w") as f:
            for i in range(6):
                entry = {k: v[i] for k, v in base.items()}
                f.write(json.dumps(entry, ensure_ascii=False, default=str) + "\n")


def plain() -> None:
    rng = random.Random(11)
    lines, rows = [], ["item_id,seed,correct,category"]
    for seed in (0, 1):
        for i in range(6):
            ok = rng.random() < 0.5
            cat = "algebra" if i < 3 else "geometry"
            lines.append(json.dumps({"item_id": f"q{i}", "seed": seed, "correct": ok, "category": cat}))
            rows.append(f"q{i},{seed},{str(ok).lower()},{cat}")
    (HERE / "plain.jsonl").write_text("\n".join(lines) + "\n")
    (HERE / "plain.csv").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    lm_eval()
    tinker_cookbook()
    prime_rl()
    verl()
    plain()
