"""Reliability: injected faults, repeated SIGKILLs and a corpus of bad inputs never corrupt a run."""

from __future__ import annotations

import hashlib
import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_trainer_e2e import TINY, _final_logprobs, _safe_rows, _strip_times, read_metrics, run_train

ROOT = Path(__file__).resolve().parents[1]
SHORT = [*TINY, "schedule.num_steps=3", "schedule.save_every=1", "eval=none"]


def _same_run(a: Path, b: Path) -> None:
    # A redone step may batch its sampling requests differently: tokens are then identical and logprobs equal
    # to float rounding (~1e-6), which grows to ~2e-5 relative in grad norms; a lost or doubled optimizer
    # step moves these values by orders of magnitude more.
    ra, rb = _strip_times(read_metrics(a)), _strip_times(read_metrics(b))
    assert [(r["step"], r["update"]) for r in rb] == [(r["step"], r["update"]) for r in ra]
    for x, y in zip(ra, rb):
        for k, v in x.items():
            if k == "faults/retries":
                continue
            if isinstance(v, float):
                assert y[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
            else:
                assert y[k] == v, k
    np.testing.assert_allclose(_final_logprobs(b), _final_logprobs(a), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_injected_faults_give_the_fault_free_result(tmp_path):
    ref, faulty = tmp_path / "ref", tmp_path / "faulty"
    assert run_train([*SHORT, f"hydra.run.dir={ref}"], tmp_path).returncode == 0
    faults = [f"backend.faults.{k}=0.1" for k in ("p_sample", "p_forward_backward", "p_optim_step", "p_save_state")]
    p = run_train([*SHORT, *faults, "backend.faults.seed=3", "retry.backoff_s=0.0",
                   f"hydra.run.dir={faulty}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(faulty)
    assert rows[-1]["faults/retries"] > 0, "no fault was injected: the test would prove nothing"
    _same_run(ref, faulty)


def _timeout() -> Exception:
    import httpx
    import tinker

    return tinker.APITimeoutError(request=httpx.Request("POST", "http://tinker.invalid/forward_backward"))


@pytest.mark.parametrize("what", ["forward_backward", "optim_step"])
def test_weight_changing_calls_are_not_resent_after_an_ambiguous_error(what):
    """A timeout may arrive after the server applied the call: resending forward_backward / optim_step
    could accumulate a gradient or apply an update twice, so the loop hands it to checkpoint recovery
    (one attempt); an error that guarantees nothing was applied is retried in place, and idempotent
    calls (save_state) are retried after a timeout too."""
    from trainer.backends.errors import TransientBackendError
    from trainer.loop import RLLoop, _ClientFailure
    from trainer.retry import RetryPolicy

    loop = RLLoop.__new__(RLLoop)
    loop.retry = RetryPolicy(max_attempts=3, backoff_s=0.0)

    def failing_once(exc: Exception):
        calls = []

        def fn():
            calls.append(1)
            if len(calls) == 1:
                raise exc
            return "ok"
        return fn, calls

    fn, calls = failing_once(_timeout())
    with pytest.raises(_ClientFailure, match=f"{what}: APITimeoutError"):
        loop._train_call(what, fn)
    assert len(calls) == 1
    fn, calls = failing_once(TransientBackendError("refused before doing any work"))
    assert loop._train_call(what, fn) == "ok" and len(calls) == 2
    fn, calls = failing_once(_timeout())
    assert loop._train_call("save_state", fn) == "ok" and len(calls) == 2
    from trainer.losses.adapter import LossFunctionError

    fn, calls = failing_once(LossFunctionError("loss grpo_custom_loss raised RuntimeError: bug"))
    with pytest.raises(LossFunctionError):  # a bug in the loss: no retry, no checkpoint recovery
        loop._train_call(what, fn)
    assert len(calls) == 1


@pytest.mark.slow
def test_five_sigkills_then_resume_equal_uninterrupted(tmp_path):
    args = [*TINY, "schedule.num_steps=4", "schedule.save_every=1", "eval=none"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert run_train([*args, f"hydra.run.dir={ref}"], tmp_path).returncode == 0
    rng = random.Random(0)
    landed = []  # (checkpointed step, steps logged) at each kill that hit a running process
    for _ in range(5):
        proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # wait for the run to make progress past start-up, then kill at a random moment
        t0 = time.time()
        n0 = len(_safe_rows(run)) if (run / "metrics.jsonl").exists() else 0
        while time.time() - t0 < 120 and proc.poll() is None:
            if (run / "metrics.jsonl").exists() and len(_safe_rows(run)) > n0:
                break
            time.sleep(0.02)
        # the first kill lands as the first step is logged (a quick machine finishes the tiny run within the
        # random delay, so the other kills may land after the last step, during the end-of-run report)
        time.sleep(rng.uniform(0.0, 1.5) if landed else 0.0)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            assert proc.wait() == -signal.SIGKILL
            ck = run / "checkpoint.json"
            landed.append((json.loads(ck.read_text())["step"] if ck.exists() else 0,
                           len({r["step"] for r in _safe_rows(run)}) if (run / "metrics.jsonl").exists() else 0))
        proc.wait()
    # at least one kill hit the run mid-way: after some steps were logged, before the last checkpoint
    assert any(n_logged >= 1 and ck_step < 4 for ck_step, n_logged in landed), landed
    p = run_train([*args, f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    _same_run(ref, run)
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


def test_secrets_never_written(tmp_path):
    secret_t, secret_w = "tml-SECRET-do-not-log-1234", "wandb-SECRET-5678"
    run = tmp_path / "run"
    p = run_train([*TINY, "schedule.num_steps=1", "eval=none", "logger=wandb", "logger.mode=offline",
                   f"hydra.run.dir={run}"], tmp_path,
                  env={"TINKER_API_KEY": secret_t, "WANDB_API_KEY": secret_w, "WANDB_MODE": "offline"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert secret_t not in p.stdout + p.stderr and secret_w not in p.stdout + p.stderr
    for f in run.rglob("*"):
        if f.is_file() and f.stat().st_size < 50_000_000:
            data = f.read_bytes()
            assert secret_t.encode() not in data and secret_w.encode() not in data, f


# ----------------------------------------------------------------------------- bad input corpus
def _snapshot(d: Path) -> dict[str, str]:
    # Hydra's own .hydra/ record of each invocation is excluded: it is Hydra's log, not run output
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.rglob("*")) if f.is_file() and ".hydra" not in f.parts}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    """A finished short run whose files the bad inputs must leave untouched."""
    d = tmp_path_factory.mktemp("done")
    run = d / "run"
    p = run_train([*TINY, "schedule.num_steps=1", "eval=none", f"hydra.run.dir={run}"], d)
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def _gsm_dir(tmp: Path, train_text: str) -> Path:
    d = tmp / "data"
    d.mkdir(exist_ok=True)
    good = (ROOT / "src/envs/data/gsm8k/test.jsonl").read_text().splitlines()[:5]
    (d / "train.jsonl").write_text(train_text)
    (d / "test.jsonl").write_text("\n".join(good) + "\n")
    return d


GOOD_LINE = json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"})

# (name, overrides or callable(tmp)->overrides, setup of the run folder, expected text in the message)
CASES = [
    ("unknown key", ["loss.clip_epsilon=0.1"], None, "clip_epsilon"),
    ("wrong type", ["schedule.num_steps=many"], None, "schedule.num_steps"),
    ("out of range eps", ["loss.clip_eps=-1"], None, "loss.clip_eps"),
    ("out of range delta", ["loss=dppo", "loss.delta=2"], None, "loss.delta"),
    ("zero updates", ["schedule.updates_per_batch=0"], None, "schedule.updates_per_batch"),
    ("too many updates", ["schedule.updates_per_batch=1000"], None, "schedule.updates_per_batch"),
    ("unknown group option", ["loss=ppo2"], None, "loss"),
    ("zero temperature", ["sampling.temperature=0"], None, "sampling.temperature"),
    ("unknown model", ["model.base_model=nobody/no-model"], None, "nobody/no-model"),
    ("unknown renderer", ["model.renderer=no_such_renderer"], None, "no_such_renderer"),
    ("tinker without key", ["backend=tinker"], None, "TINKER_API_KEY"),
    ("missing data folder", ["env=gsm8k", "env.source=/nonexistent/gsm8k"], None, "/nonexistent/gsm8k"),
    ("malformed data line", lambda t: ["env=gsm8k", f"env.source={_gsm_dir(t, GOOD_LINE + chr(10) + '{bad json' + chr(10))}"],
     None, "train.jsonl:2"),
    ("truncated data file", lambda t: ["env=gsm8k", f"env.source={_gsm_dir(t, GOOD_LINE + chr(10) + GOOD_LINE[:20])}"],
     None, "train.jsonl:2"),
    ("data line missing key", lambda t: ["env=gsm8k", f"env.source={_gsm_dir(t, json.dumps({'question': 'q'}) + chr(10))}"],
     None, "train.jsonl:1"),
    ("eval larger than test set", ["eval.n_examples=100000"], None, "100000"),
    ("resume=true without a checkpoint", ["resume=true"], None, "holds no checkpoint.json"),
]
RUN_CASES = [
    ("corrupt checkpoint json", lambda r: (r / "checkpoint.json").write_text("{not json"), "checkpoint"),
    ("truncated checkpoint json", lambda r: (r / "checkpoint.json").write_text(
        (r / "checkpoint.json").read_text()[:40]), "checkpoint"),
    ("checkpoint missing keys", lambda r: (r / "checkpoint.json").write_text('{"step": 1}'), "missing keys"),
    ("checkpoint path gone", lambda r: (r / "checkpoint.json").write_text(json.dumps({
        **json.loads((r / "checkpoint.json").read_text()), "tinker_path": "tinker://local/nonexistent/ckpt"})),
     "nonexistent"),
    ("corrupt metrics mid-file", lambda r: (r / "metrics.jsonl").write_text(
        "garbage\n" + (r / "metrics.jsonl").read_text()), "metrics.jsonl:1"),
    ("checkpoint of another config", None, "different config"),
]


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


_TRAIN_MODULE = None


def train_in_process(args: list[str], cwd: Path, capfd, monkeypatch) -> tuple[int, str]:
    """`python train.py *args` run inside this process (the same Hydra entry point, argv and cwd):
    (exit code, stdout + stderr). The bad-input corpus runs this way because each subprocess spent
    ~7 s importing torch/transformers/tinker before failing; `tests/test_config.py` and the read-only
    folder case below still go through a real subprocess."""
    global _TRAIN_MODULE
    import importlib.util

    from hydra.core.global_hydra import GlobalHydra

    if _TRAIN_MODULE is None:
        spec = importlib.util.spec_from_file_location("pairedrl_train_entry", ROOT / "train.py")
        _TRAIN_MODULE = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_TRAIN_MODULE)
        # Hydra finds `conf/` next to the script only for a task function of module "__main__"
        _TRAIN_MODULE.main.__wrapped__.__module__ = "__main__"
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    capfd.readouterr()
    GlobalHydra.instance().clear()
    try:
        _TRAIN_MODULE.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        GlobalHydra.instance().clear()
    out = capfd.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("name,overrides,_setup,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly(tmp_path, capfd, monkeypatch, name, overrides, _setup, needle):
    ov = overrides(tmp_path) if callable(overrides) else overrides
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    base = [a for a in TINY if not a.startswith("backend.")] if "backend=tinker" in ov else TINY
    code, out = train_in_process([*base, *ov, f"hydra.run.dir={tmp_path}/run"], tmp_path, capfd, monkeypatch)
    assert code != 0, name
    assert needle in out, (name, out[-2000:])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("name,setup,needle", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_bad_run_folder_fails_and_is_untouched(tmp_path, capfd, monkeypatch, done_run, name, setup, needle):
    run = _copy_run(done_run, tmp_path / "run")
    # the same config as the finished run, so each case reaches the check it targets
    extra = ["schedule.num_steps=1"]
    if setup is not None:
        setup(run)
    else:
        extra.append("optimizer.lr=0.5")  # a different config than the one that wrote the checkpoint
    before = _snapshot(run)
    code, out = train_in_process([*TINY, "eval=none", *extra, f"hydra.run.dir={run}"], tmp_path, capfd, monkeypatch)
    assert code != 0, name
    assert needle in out, (name, out[-2000:])
    assert _snapshot(run) == before


def test_read_only_output_folder(tmp_path):
    """The project's own check (trainer.main.check_output_dir) rejects the folder, not Hydra.

    Hydra creates the run folder and writes `.hydra/` and its log there before the task runs, so
    a folder Hydra cannot write fails with Hydra's traceback before the project's check. The
    folder here is one Hydra can use but the project's write probe cannot: `.write_probe` already
    exists as a folder. (chmod cannot do this: root, as in CI, ignores permission bits.)"""
    target = tmp_path / "run"
    (target / ".write_probe").mkdir(parents=True)
    p = run_train([*TINY, f"hydra.run.dir={target}"], tmp_path)
    out = p.stderr + p.stdout
    assert p.returncode == 2, out[-2000:]
    assert f"error: output folder {target} is not writable" in p.stderr, out[-2000:]
    assert "Traceback" not in out
    assert not (target / "metrics.jsonl").exists()


def test_resume_redoes_a_periodic_eval_killed_after_its_checkpoint_and_a_foreign_start_eval(
        tmp_path, capfd, monkeypatch):
    """Killed during the step-2 periodic eval (after the step-2 checkpoint): the resumed run evaluates
    step 2 (the loop's step-end hook runs again for the step it restarts from; finished evals are kept).
    A start eval made under another config in the folder is redone rather than paired with this run."""
    run = tmp_path / "run"
    args = [*TINY, "schedule.num_steps=3", "schedule.save_every=1", "eval.every=1", "eval.at_start=true",
            f"hydra.run.dir={run}"]
    code, out = train_in_process(args, tmp_path, capfd, monkeypatch)
    assert code == 0, out[-3000:]
    ev = run / "eval"
    ck = json.loads((run / "checkpoint.json").read_text())
    cfg_hash = ck["config_hash"]
    step1 = (ev / "gsm8k_test_step1.summary.json").read_text()
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

    code, out = train_in_process(args, tmp_path, capfd, monkeypatch)
    assert code == 0, out[-3000:]
    assert "resuming the run" in out
    assert json.loads((ev / "gsm8k_test_step2.summary.json").read_text())["step"] == 2
    assert (ev / "gsm8k_test_step1.summary.json").read_text() == step1  # finished: not redone
    assert json.loads((ev / "gsm8k_test_start.summary.json").read_text())["config_hash"] == cfg_hash
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(s, u) for s in range(3) for u in range(2)]


def test_a_failed_final_save_is_recovered_like_a_step(tmp_path):
    """The final save_state failing for good (a _ClientFailure) recovers from the last checkpoint and redoes
    the steps after it, then saves again, instead of ending the run without a final checkpoint."""
    from omegaconf import OmegaConf

    from trainer.checkpoint import CheckpointInfo
    from trainer.loop import LoopState, RLLoop, _ClientFailure
    from trainer.retry import RetryPolicy

    cfg = OmegaConf.create({"schedule": {"num_steps": 3, "save_every": 0}, "retry": {"max_attempts": 3},
                            "logger": {"name": "jsonl", "rollouts_per_step": 0}, "loss": {"name": "grpo"},
                            "seed": 0, "run_name": None})
    loop = RLLoop.__new__(RLLoop)
    loop.cfg, loop.run_dir, loop.progress, loop.config_dict, loop.sweep_dir = cfg, tmp_path, False, {}, None
    loop.retry, loop.recoveries, loop.info, loop.on_step_end = RetryPolicy(), 0, {}, None
    calls = {"start": 0, "steps": 0, "final_saves": 0}

    def start():
        calls["start"] += 1
        return LoopState()

    def do_step(state, sink):
        calls["steps"] += 1
        state.step += 1
        return 0.0

    def save(state, final=False):
        assert final and state.step == 3
        calls["final_saves"] += 1
        if calls["final_saves"] == 1:
            raise _ClientFailure("save_state: APITimeoutError: timed out")
        state.last_checkpoint = CheckpointInfo("tinker://local/x", state.step, 6, 9, "h")

    loop._start, loop._do_step, loop._save = start, do_step, save
    out = loop.run()
    assert out["steps"] == 3 and out["checkpoint"] == "tinker://local/x" and out["recoveries"] == 1
    assert calls == {"start": 2, "steps": 6, "final_saves": 2}


def test_drop_constant_groups_keeps_mixed_rollouts_first_when_topping_up():
    from trainer.datums import Rollout
    from trainer.loop import select_for_training

    def ro(group: int, i: int) -> Rollout:
        return Rollout(group=group, prompt_tokens=[1], tokens=[2, 3], logprobs=[-1.0, -1.0], reward=float(i),
                       metrics={}, stop_reason="stop")

    rollouts = [ro(g, i) for g in range(3) for i in range(2)]  # group_size 2; only group 2 is mixed
    mixed_G = [False, False, True]
    assert select_for_training(rollouts, mixed_G, False, 4) == rollouts
    assert select_for_training(rollouts, mixed_G, True, 2) == rollouts[4:]
    # 4 updates need 4 rollouts: both mixed ones, then the first constant ones (not the constant ones only)
    assert select_for_training(rollouts, mixed_G, True, 4) == rollouts[4:] + rollouts[:2]
    assert select_for_training(rollouts, [False] * 3, True, 2) == rollouts[:2]
