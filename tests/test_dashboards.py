"""What a person looks at: the wandb runs (read back from the offline files with wandb's protobuf), the
progress lines of a run without a terminal, and the per-run report with its PNGs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runs import TINY, read_metrics, run_train
from third_party_warnings import own_warning_lines
from wandb_records import offline_runs

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# smoke schedule: 2 rollout steps x 2 updates; eval of the initial weights, at step 1 and at the end
WANDB_RUN = [*TINY, "logger=wandb", "logger.mode=offline", "eval.every=1", "eval.at_start=true"]
ENV = {"WANDB_MODE": "offline", "PAIREDRL_PROGRESS": ""}


def _eval_rows(history: list[dict]) -> list[tuple[int, int, float]]:
    return [(h["_step"], h["step"], h["eval/accuracy"]) for h in history if "eval/accuracy" in h]


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    d = tmp_path_factory.mktemp("dash")
    run = d / "run"
    p = run_train([*WANDB_RUN, f"hydra.run.dir={run}"], d, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return run, p


def test_wandb_run_has_eval_curve_tables_summary_and_config(wandb_run):
    run, p = wandb_run
    (wb,) = offline_runs(run)
    # config: arm, loss and seed at the top level for wandb's grouping and filters
    assert (wb.config["arm"], wb.config["loss_name"], wb.config["seed"]) == ("grpo_seed0", "grpo", 0)
    assert wb.run.job_type == "train"
    # eval/accuracy at the start, at step 1 and at the end, each at _step = step * updates_per_batch
    summaries = [json.loads((run / "eval" / f"gsm8k_test{s}.summary.json").read_text())
                 for s in ("_start", "_step1", "")]
    assert _eval_rows(wb.history) == [(0, 0, summaries[0]["accuracy"]), (2, 1, summaries[1]["accuracy"]),
                                      (4, 2, summaries[2]["accuracy"])]
    final_row = next(h for h in wb.history if h["_step"] == 4)
    assert final_row["eval/wilson_high"] == pytest.approx(summaries[2]["wilson_high"])
    # training rows keep _step = global update, and carry the rollout step that eval/* is plotted against
    rows = read_metrics(run)
    train = {h["_step"]: h for h in wb.history if "loss/value" in h}
    assert sorted(train) == [r["global_update"] for r in rows]
    assert [train[r["global_update"]]["step"] for r in rows] == [r["step"] for r in rows]
    # ... with the values of metrics.jsonl (every number of every row)
    for r in rows:
        numbers = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        assert len(numbers) > 20 and {k: train[r["global_update"]].get(k) for k in numbers} == numbers
    axes = {m.glob_name: m.step_metric for m in wb.metrics if m.glob_name}
    assert axes["eval/*"] == "step" and axes["env/*"] == "step"
    # the final eval's items as a table, paired with the initial-weights eval
    items = wb.table(wb.summary["eval/items"])
    recs = [json.loads(x) for x in (run / "eval" / "gsm8k_test.jsonl").read_text().splitlines()]
    start = {json.loads(x)["index"]: json.loads(x)["correct"]
             for x in (run / "eval" / "gsm8k_test_start.jsonl").read_text().splitlines()}
    assert [(i["index"], i["completion"], i["parsed"], i["gold"], i["correct"], i["correct_at_start"])
            for i in items] == [(r["index"], r["completion"], r["parsed"], r["gold"], r["correct"],
                                 start[r["index"]]) for r in recs]
    assert all(isinstance(i["prompt"], str) and len(i["prompt"]) > 20 for i in items)
    # each step's logged rollouts as a table, with the fields of rollouts.jsonl
    tables = [(h["step"], wb.table(h["rollouts/samples"])) for h in wb.history if "rollouts/samples" in h]
    assert [s for s, _ in tables] == [0, 1]
    logged = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert [r for _, t in tables for r in t] == [
        {k: r[k] for k in ("step", "group", "prompt", "completion", "parsed", "gold", "correct", "reward",
                           "advantage", "stop_reason")} for r in logged]
    # summary: final accuracy and the paired start-vs-final result
    result = json.loads((run / "result.json").read_text())
    assert wb.summary["eval/final_accuracy"] == result["eval"]["accuracy"]
    assert wb.summary["eval/start_accuracy"] == summaries[0]["accuracy"]
    for k in ("diff", "mcnemar_p", "b", "c"):
        assert wb.summary[f"eval_vs_start/{k}"] == pytest.approx(result["eval_vs_start"][k]), k
    # no warning of our own making (the deprecated boolean `reinit` was one); listed third-party ones pass
    assert own_warning_lines(p.stderr) == [], p.stderr[-2000:]


def test_progress_lines_without_a_terminal(wandb_run):
    run, p = wandb_run
    rows = read_metrics(run)
    for text in (p.stdout, (run / "train.log").read_text()):
        lines = [x for x in text.splitlines() if "| reward " in x]
        assert len(lines) == 2, text[-2000:]
        for step, line in enumerate(lines, start=1):
            r = next(r for r in rows if r["step"] == step - 1)
            assert f"step {step}/2 | reward {r['env/reward_mean']:.3f} | masked " in line
            assert " clip " in line and " s/step | ETA " in line
    assert "grpo_seed0:" not in p.stderr  # no tqdm bar of the loop (its description is the arm)


def test_progress_line_adds_an_arm_s_own_rule_under_its_name():
    """A CPPO arm's line keeps DPPO's mask and GRPO's clip and adds its own rule; the arms whose rule is one
    of those two print only them."""
    from trainer.loop import ProgressLines

    rows = [{"env/reward_mean": 0.5, "time/step": 2.0, "loss/dppo_masked_frac": 0.001,
             "loss/grpo_clip_frac": 0.02, "loss/cppo_masked_frac": c, "loss/cppo_token_masked_frac": 0.007}
            for c in (0.01, 0.014)]
    line = ProgressLines(4, 0, "cppo").step_done(1, rows)
    assert line.startswith("step 1/4 | reward 0.500 | masked 0.001 | clip 0.020 | cppo_masked 0.012 | "
                           "2.0 s/step")
    for loss in ("grpo", "dppo", None):
        assert " | clip 0.020 | 2.0 s/step | ETA " in ProgressLines(4, 0, loss).step_done(1, rows), loss


def test_report_written_at_the_end_with_its_plots(wandb_run):
    run, p = wandb_run
    md = (run / "report.md").read_text()
    assert f"report:   {run / 'report.md'}" in p.stdout
    for name in ("reward", "eval_accuracy", "drift", "masked_clip", "completion_length", "step_time"):
        png = run / "report_plots" / f"{name}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5000, name
        assert f"](report_plots/{name}.png)" in md
    assert "| start | 0 | 4 |" in md and "| periodic | 1 | 4 |" in md and "| final | 2 | 4 |" in md
    # the CLI writes the same report from the folder alone
    (run / "report.md").unlink()
    c = subprocess.run([sys.executable, "-m", "eval.report", str(run)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert c.returncode == 0, c.stderr
    assert (run / "report.md").read_text() == md


def test_report_cli_on_a_folder_that_is_not_a_run(tmp_path):
    c = subprocess.run([sys.executable, "-m", "eval.report", str(tmp_path)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert c.returncode == 2 and "not a run folder" in c.stderr and not list(tmp_path.iterdir())


def test_rerun_of_the_folder_logs_no_eval_twice(wandb_run):
    """Resuming (here: rerunning the finished run's folder, which redoes the final eval) adds no eval
    row to wandb: the run folder records which evals wandb already has. Runs last: it adds to the folder."""
    run, _ = wandb_run
    p = run_train([*WANDB_RUN, f"hydra.run.dir={run}"], run.parent, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    runs = offline_runs(run)
    assert len(runs) == 2 and runs[0].run.run_id == runs[1].run.run_id
    assert [len(_eval_rows(r.history)) for r in runs] == [3, 0]


@pytest.mark.slow
def test_sweep_compare_logs_a_compare_run_in_the_arms_group(tmp_path):
    sweep = tmp_path / "sweep"
    p = run_train(["--multirun", "loss=grpo,dppo", "seed=0", *WANDB_RUN, "report.enabled=false",
                   f"hydra.sweep.dir={sweep}"], tmp_path, env=ENV, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    arms = [offline_runs(sweep / j)[0] for j in ("0", "1")]
    assert {a.config["arm"] for a in arms} == {"grpo_seed0", "dppo_seed0"}
    assert {a.run.run_group for a in arms} == {"sweep"}
    assert all(len(_eval_rows(a.history)) == 3 for a in arms)
    assert not (sweep / "0" / "report.md").exists()  # report.enabled=false

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline"}
    c = subprocess.run([sys.executable, "-m", "eval.compare", str(sweep), "--no-wandb"], capture_output=True,
                       text=True, timeout=120, cwd=tmp_path, env=env)
    assert c.returncode == 0 and not (sweep / "wandb").exists(), c.stderr[-2000:]
    c = subprocess.run([sys.executable, "-m", "eval.compare", str(sweep)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=env)
    assert c.returncode == 0, c.stderr[-3000:]
    result = json.loads((sweep / "compare.json").read_text())
    (cr,) = offline_runs(sweep)
    assert (cr.run.job_type, cr.run.run_group) == ("compare", "sweep")
    (row,) = [h for h in cr.history if "compare/verdict" in h]
    verdict = cr.table(row["compare/verdict"])
    assert [v["scope"] for v in verdict] == ["seed 0", "combined"]
    assert verdict[-1]["verdict"] == result["verdict"] and verdict[-1]["diff"] == result["diff"]
    assert {a["arm"] for a in cr.table(row["compare/arms"])} == {"grpo_seed0", "dppo_seed0"}
    for name in result["plots"]:
        img = row[f"compare/plots/{name}"]
        assert (cr.dir / "files" / img["path"]).read_bytes()[:8] == PNG_MAGIC
    assert cr.summary["compare/verdict"] == result["verdict"]


def test_terminal_keeps_the_bar_and_gets_no_progress_lines(tmp_path):
    """stderr on a terminal (a pseudo-terminal here): the tqdm bar, not the per-step log lines."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    run = tmp_path / "run"
    master, slave = pty.openpty()
    # 24 x 120 characters (a fresh pseudo-terminal is 0 wide, and the bar fits itself to the width)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:  # read while the run writes: a full terminal buffer would block it
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the other end closed
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        p = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "eval=none", "report.enabled=false",
                            f"hydra.run.dir={run}"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=slave,
                           text=True, timeout=300, env={**os.environ, "PAIREDRL_PROGRESS": ""})
    finally:
        os.close(slave)
        reader.join(timeout=10)
        os.close(master)
    tty = b"".join(chunks)
    assert p.returncode == 0, tty.decode(errors="replace")[-3000:]
    assert "| reward " not in p.stdout and "| reward " not in (run / "train.log").read_text()
    assert b"grpo_seed0: 100%" in tty and b"2/2" in tty
