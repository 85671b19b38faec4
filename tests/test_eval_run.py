"""`python -m eval.run checkpoint=<run folder>`: the standalone greedy eval of a saved checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from runs import ROOT, TINY, run_train


def _records(path) -> list[tuple]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(r["index"], r["question_sha256"], r["completion"], r["parsed"], r["correct"]) for r in rows]


@pytest.mark.slow
def test_eval_run_on_a_run_folder_repeats_the_runs_final_eval(tmp_path):
    """Greedy decoding is deterministic, so evaluating the run's final checkpoint again gives the run's own
    final eval item by item, written beside it (the run's file is kept). The initial weights' eval of the
    same items differs, so a checkpoint that was not loaded (the base model) would be caught."""
    run = tmp_path / "run"
    p = run_train([*TINY, "eval.at_start=true", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    ev = run / "eval"
    final, start = _records(ev / "gsm8k_test.jsonl"), _records(ev / "gsm8k_test_start.jsonl")
    assert [r[2] for r in final] != [r[2] for r in start], "training did not change a greedy completion"
    before = (ev / "gsm8k_test.jsonl").read_bytes()

    # the run's model, env (gsm8k, not the default arithmetic), backend and seed come from its config.yaml
    eval_args = [a for a in TINY if a.startswith("eval")]
    c = subprocess.run([sys.executable, "-m", "eval.run", f"checkpoint={run}", *eval_args,
                        f"hydra.run.dir={tmp_path / 'eval_out'}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert c.returncode == 0, c.stderr[-3000:]
    (written,) = ev.glob("gsm8k_test_standalone_*.jsonl")
    assert f"-> {written}" in c.stdout, c.stdout[-2000:]
    assert (ev / "gsm8k_test.jsonl").read_bytes() == before
    assert _records(written) == final
    ck = json.loads((run / "checkpoint.json").read_text())
    summary = json.loads(written.with_name(written.name[:-len(".jsonl")] + ".summary.json").read_text())
    assert summary["checkpoint"] == ck["tinker_path"] and summary["n"] == 4

    # bad input: neither a run folder nor a tinker:// path
    c = subprocess.run([sys.executable, "-m", "eval.run", f"checkpoint={tmp_path / 'nowhere'}", *eval_args,
                        f"hydra.run.dir={tmp_path / 'eval_bad'}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, check=False, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert c.returncode == 2 and "is neither a run folder nor a tinker:// path" in c.stderr, c.stderr[-2000:]
    assert "Traceback" not in c.stderr
