"""Helpers shared by the tests that run `train.py`: the tiny-model overrides, a subprocess run, reading a
run's metrics, and comparing two runs (rows and final weights)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# A tiny model gives reward -0.1 (no \boxed{}) to every GSM8K rollout; advantage=none turns that
# into a non-zero learning signal, so the weights move and the second update sees drift.
TINY = [
    "model=tiny_random", "schedule=smoke", "env=gsm8k", "env.n_examples=16", "env.convo_prefix=none",
    "advantage=none", "sampling.max_tokens=12", "eval=gsm8k_test", "eval.n_examples=4", "eval.max_tokens=8",
    "backend.sampler_dtype=float32", "backend.train_dtype=float32", "optimizer.lr=0.01",
    "sampling.concurrency=1",
]


def run_train(args: list[str], cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python train.py *args` in a subprocess (train.py puts this checkout's src/ first on sys.path)."""
    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=e, check=False)


_TRAIN_MODULE = None


def train_entry(args: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """`python train.py *args` run inside this process (train.py's own Hydra entry point, with that argv and
    cwd, both undone by `monkeypatch`); returns the exit code. Spares the subprocess's seconds of importing
    torch/transformers/tinker. The root logger's handlers are put back as they were: Hydra's job logging
    adds some, which a fixture wider than one test would otherwise leave behind."""
    import importlib.util
    import logging

    from hydra.core.global_hydra import GlobalHydra

    global _TRAIN_MODULE
    if _TRAIN_MODULE is None:
        spec = importlib.util.spec_from_file_location("pairedrl_train_entry", ROOT / "train.py")
        _TRAIN_MODULE = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_TRAIN_MODULE)
        # Hydra finds `conf/` next to the script only for a task function of module "__main__"
        _TRAIN_MODULE.main.__wrapped__.__module__ = "__main__"

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    GlobalHydra.instance().clear()
    try:
        _TRAIN_MODULE.entry()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
        for h in root.handlers[:]:
            if h not in handlers:
                root.removeHandler(h)
                h.close()
        root.setLevel(level)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def safe_rows(run: Path) -> list[dict]:
    """The complete rows of a metrics.jsonl that a running (or killed) process may be writing."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def strip_times(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def final_logprobs(run_dir: Path) -> np.ndarray:
    """Logprobs of the run's final checkpoint on a fixed batch (equal weights <=> equal logprobs)."""
    import tinker

    from trainer.backends.local import LocalServiceClient

    ck = json.loads((run_dir / "checkpoint.json").read_text())
    # the run's own engine folder: a checkpoint path names a folder under the state dir that saved it
    sc = LocalServiceClient(state_dir=run_dir / "engine", sampler_dtype="float32", train_dtype="float32")
    try:
        tc = sc.create_training_client_from_state_with_optimizer(ck["tinker_path"]).result()
        toks = list(range(5, 45))
        d = tinker.Datum(model_input=tinker.ModelInput.from_ints(toks[:-1]),
                         loss_fn_inputs={"target_tokens": np.asarray(toks[1:], dtype=np.int64),
                                         "weights": np.ones(len(toks) - 1, dtype=np.float32)})
        out = tc.forward([d], "cross_entropy").result()
        return np.asarray(out.loss_fn_outputs[0]["logprobs"].to_numpy())
    finally:
        sc.close()


def assert_same_run(a: Path, b: Path) -> None:
    """Run b logged the same (step, update) rows with the same values as run a, and ends on the same weights.

    A redone step may batch its sampling requests differently: tokens are then identical and logprobs equal
    to float rounding (~1e-6), which grows to ~2e-5 relative in grad norms; a lost or doubled optimizer
    step moves these values by orders of magnitude more."""
    ra, rb = strip_times(read_metrics(a)), strip_times(read_metrics(b))
    assert [(r["step"], r["update"]) for r in rb] == [(r["step"], r["update"]) for r in ra]
    for x, y in zip(ra, rb):
        for k, v in x.items():
            if k == "faults/retries":
                continue
            if isinstance(v, float):
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-6), (x["step"], x["update"], k)
            else:
                assert y[k] == v, (x["step"], x["update"], k)
    np.testing.assert_allclose(final_logprobs(b), final_logprobs(a), atol=1e-5, rtol=0)
