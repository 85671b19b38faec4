"""Resume: a run killed at any moment (SIGKILL) and started again in its folder equals the uninterrupted run;
a torn log line is repaired; an eval cut short by the kill is redone."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time

import pytest
from runs import ROOT, TINY, assert_same_run, read_metrics, run_train, safe_rows


@pytest.mark.slow
def test_sigkill_and_resume_matches_uninterrupted(tmp_path):
    args = [*TINY, "schedule.num_steps=4", "schedule.save_every=1", "eval=none"]
    ref = tmp_path / "ref"
    p = run_train([*args, f"hydra.run.dir={ref}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]

    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline:  # kill once step 1 is logged, i.e. mid-run after a checkpoint
        if (run / "metrics.jsonl").exists() and any(r["step"] >= 1 for r in safe_rows(run)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the kill"
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    # the kill landed mid-run: some steps logged and checkpointed, not all
    steps_before = {r["step"] for r in safe_rows(run)}
    ck_step = json.loads((run / "checkpoint.json").read_text())["step"]
    assert 1 in steps_before and 3 not in steps_before, steps_before
    assert 1 <= ck_step < 4, ck_step
    p = run_train([*args, f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming from" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(s, u) for s in range(4) for u in range(2)]
    assert_same_run(ref, run)


@pytest.mark.slow
def test_five_sigkills_then_resume_equal_uninterrupted(tmp_path):
    args = [*TINY, "schedule.num_steps=4", "schedule.save_every=1", "eval=none"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_train([*args, f"hydra.run.dir={ref}"], tmp_path).returncode == 0
    rng = random.Random(0)
    landed = []  # the checkpointed step at each kill that hit a running process
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # the first kill lands once step 1 is logged, i.e. after the step-1 checkpoint and before the last
        # one, so the next process must resume from a checkpoint and train on (a kill before any checkpoint
        # only restarts the run from scratch, which would leave resume itself untested); the others land at
        # a random moment after this process logged a new row (a quick machine finishes the tiny run within
        # the random delay, so they may land after the last step, during the end-of-run report)
        t0 = time.time()
        n0 = len(safe_rows(run)) if (run / "metrics.jsonl").exists() else 0
        while time.time() - t0 < 120 and proc.poll() is None:
            if (run / "metrics.jsonl").exists():
                rows = safe_rows(run)
                if (any(r["step"] >= 1 for r in rows) if not landed else len(rows) > n0):
                    break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.5) if landed else 0.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL
            ck = run / "checkpoint.json"
            landed.append(json.loads(ck.read_text())["step"] if ck.exists() else 0)
        proc.wait()
    # at least one kill hit the run after a checkpoint and before the last one: a process resumed from it
    assert any(1 <= ck_step < 4 for ck_step in landed), landed
    p = run_train([*args, f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_run(ref, run)
    # resuming a finished run again changes nothing
    before = (run / "metrics.jsonl").read_bytes()
    p = run_train([*args, f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0 and (run / "metrics.jsonl").read_bytes() == before


def test_torn_metrics_line_is_repaired(tmp_path):
    from trainer.checkpoint import truncate_log

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0, "update": 0}\n{"step": 0, "update": 1}\n{"step": 1, "upd')
    kept, dropped = truncate_log(f, 1)
    assert (kept, dropped) == (2, 1)
    assert [json.loads(x) for x in f.read_text().splitlines()] == [{"step": 0, "update": 0}, {"step": 0, "update": 1}]


def test_resume_redoes_a_periodic_eval_killed_after_its_checkpoint_and_a_foreign_start_eval(
        tmp_path, train_in_process):
    """Killed during the step-2 periodic eval (after the step-2 checkpoint): the resumed run evaluates
    step 2 (the loop's step-end hook runs again for the step it restarts from; finished evals are kept).
    A start eval made under another config in the folder is redone rather than paired with this run."""
    run = tmp_path / "run"
    # no end-of-run report: its plots cost seconds of CPU per run and the resume does not read them
    args = [*TINY, "schedule.num_steps=3", "schedule.save_every=1", "eval.every=1", "eval.at_start=true",
            "report.enabled=false", f"hydra.run.dir={run}"]
    code, out = train_in_process(args, tmp_path)
    assert code == 0, out[-3000:]
    ev = run / "eval"
    ck = json.loads((run / "checkpoint.json").read_text())
    cfg_hash = ck["config_hash"]
    step1 = (ev / "gsm8k_test_step1.summary.json").read_text()

    def rollouts_of() -> list[dict]:
        return [{k: r[k] for k in ("step", "group", "prompt", "gold")}
                for r in map(json.loads, (run / "rollouts.jsonl").read_text().splitlines())]

    uninterrupted = rollouts_of()
    assert len({r["prompt"] for r in uninterrupted}) == 6  # every step draws new problems
    # roll the run back to its step-2 checkpoint with the step-2 eval unfinished
    rows = read_metrics(run)
    entry = next(h for h in ck["history"] if h["step"] == 2)
    ck.update(step=2, tinker_path=entry["tinker_path"], history=[h for h in ck["history"] if h["step"] <= 2],
              optim_steps=1 + max(r["global_update"] for r in rows if r["step"] < 2),
              data_cursor=2 * ck["data_cursor"] // 3)
    (run / "checkpoint.json").write_text(json.dumps(ck))
    for f in ev.glob("gsm8k_test_step2.*"):
        f.unlink()
    start = json.loads((ev / "gsm8k_test_start.summary.json").read_text())
    assert start["config_hash"] == cfg_hash
    (ev / "gsm8k_test_start.summary.json").write_text(json.dumps({**start, "config_hash": "another config"}))

    code, out = train_in_process(args, tmp_path)
    assert code == 0, out[-3000:]
    assert "resuming the run" in out
    assert json.loads((ev / "gsm8k_test_step2.summary.json").read_text())["step"] == 2
    assert (ev / "gsm8k_test_step1.summary.json").read_text() == step1  # finished: not redone
    assert json.loads((ev / "gsm8k_test_start.summary.json").read_text())["config_hash"] == cfg_hash
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(s, u) for s in range(3) for u in range(2)]
    # the redone step 2 continues the data order from the checkpoint's cursor
    assert rollouts_of() == uninterrupted


def test_logs_missing_rows_of_checkpointed_steps_are_refused(tmp_path):
    """A resume redoes only the steps after the checkpoint: a log missing a row of a step before it (a deleted
    file, a lost or torn row) or one written twice is refused, naming the rows, and nothing is modified; a torn row of a
    step after it is repaired by the resume as before."""
    from dataclasses import asdict

    from trainer.checkpoint import CheckpointInfo, ResumeError, check_resumable

    def write(metrics: list[dict], rollouts_text: str) -> None:
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
        (tmp_path / "rollouts.jsonl").write_text(rollouts_text)

    ck = CheckpointInfo(tinker_path="tinker://x/step000002", step=2, optim_steps=4, data_cursor=4, config_hash="h")
    (tmp_path / "checkpoint.json").write_text(json.dumps(asdict(ck)))
    metrics = [{"step": s, "update": u, "global_update": 2 * s + u} for s in range(3) for u in range(2)]
    roll = "".join(json.dumps({"step": s, "group": g, "completion": '"step": 0'}) + "\n"
                   for s in range(3) for g in range(2))
    write(metrics, roll)
    assert check_resumable(tmp_path, "h", rollouts_per_step=2).step == 2
    write(metrics, roll + '{"step": 2, "gro')  # torn row after the checkpoint: repaired on resume
    assert check_resumable(tmp_path, "h", rollouts_per_step=2).step == 2

    cases = [
        (metrics[:2] + metrics[3:], roll, "holds 3 of the 4 update rows of the 2 steps before the checkpoint "
                                          "(missing global_update 2)"),
        ([], roll, "holds 0 of the 4 update rows"),
        (metrics[:2] + metrics[1:], roll, "holds 2 rows of global_update 1"),  # a row written twice
        (metrics, "", "rollouts.jsonl holds no row of step(s) 0, 1"),
        (metrics, "".join(line + "\n" for line in roll.splitlines()[:3]) + '{"step": 1, "group": 1, "compl',
         "may be a row of step 1, before the checkpoint (step 2)"),
    ]
    for m, r, needle in cases:
        write(m, r)
        before = ((tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "rollouts.jsonl").read_bytes())
        with pytest.raises(ResumeError, match=re.escape(needle)):
            check_resumable(tmp_path, "h", rollouts_per_step=2)
        assert ((tmp_path / "metrics.jsonl").read_bytes(), (tmp_path / "rollouts.jsonl").read_bytes()) == before
    write(metrics, "")  # a run that logs no rollouts: nothing expected there
    assert check_resumable(tmp_path, "h", rollouts_per_step=0).step == 2
