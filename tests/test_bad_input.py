"""Bad input (overrides, data files, run folders) stops the run with a message naming the problem and
leaves every file already written untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from runs import ROOT, TINY, run_train


def _snapshot(d: Path) -> dict[str, str]:
    # Hydra's own .hydra/ record of each invocation is excluded: it is Hydra's log, not run output
    return {str(f.relative_to(d)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(d.rglob("*")) if f.is_file() and ".hydra" not in f.parts}


@pytest.fixture(scope="module")
def done_run(tmp_path_factory) -> Path:
    """A finished short run whose files the bad inputs must leave untouched."""
    d = tmp_path_factory.mktemp("done")
    run = d / "run"
    # no end-of-run report (seconds of plotting): the checks below are about the run's own records
    p = run_train([*TINY, "schedule.num_steps=1", "eval=none", "report.enabled=false", f"hydra.run.dir={run}"], d)
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
    ("empty train set", lambda t: ["env=gsm8k", f"env.source={_gsm_dir(t, '')}"], None, "the train set is empty"),
    ("group of one with a group advantage", ["advantage=group_mean", "schedule.group_size=1"], None,
     "schedule.group_size=1 with advantage=group_mean"),
    ("call deadline of zero", ["backend=tinker", "backend.call_deadline_s=0"], None,
     "backend.call_deadline_s must be in [1, 86400] seconds"),
    ("call deadline NaN", ["backend=tinker", "backend.call_deadline_s=nan"], None,
     "backend.call_deadline_s must be in [1, 86400] seconds"),
]
# every case exits 2 with no traceback; those refused by the project's own checks end in one line on stderr
ONE_LINE = {"empty train set", "group of one with a group advantage", "resume=true without a checkpoint",
            "call deadline of zero", "call deadline NaN"}
_OTHER_PRECISION = ("the run started at sampler bfloat16, training bfloat16 (run_info.json), but the engine "
                    "now resolves to sampler float32, training float32")
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
    # a resume redoes only the steps after the checkpoint: rows of the steps before it must all be there
    ("metrics.jsonl deleted", lambda r: (r / "metrics.jsonl").unlink(), "holds 0 of the 2 update rows"),
    ("metrics row of a checkpointed step torn", lambda r: (r / "metrics.jsonl").write_bytes(
        (r / "metrics.jsonl").read_bytes()[:-40]), "missing global_update 1"),
    ("rollouts.jsonl deleted", lambda r: (r / "rollouts.jsonl").unlink(), "rollouts.jsonl holds no row of step(s) 0"),
    ("run_info.json missing", lambda r: (r / "run_info.json").unlink(), "run_info.json is missing"),
    # what a run started where `auto` resolved to bf16 records (the config pins nothing else here)
    ("precision resolves differently", lambda r: _write_info(r, lambda info: {**info, "engine": {
        **info["engine"], "sampler_dtype": "bfloat16", "train_dtype": "bfloat16"}}), _OTHER_PRECISION),
    # the same, as a run of an older build recorded it: the dtypes in a `precision` record beside the plan's
    ("precision resolves differently (older record)", lambda r: _write_info(r, lambda info: {
        **{k: v for k, v in info.items() if k != "engine"},
        "precision": {"sampler_dtype": "bfloat16", "train_dtype": "bfloat16", "auto": None}}),
     _OTHER_PRECISION),
]


def _write_info(run: Path, edit) -> None:
    path = run / "run_info.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name,overrides,_setup,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly(tmp_path, monkeypatch, train_in_process, name, overrides, _setup, needle):
    ov = overrides(tmp_path) if callable(overrides) else overrides
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    base = [a for a in TINY if not a.startswith("backend.")] if "backend=tinker" in ov else TINY
    code, out = train_in_process([*base, *ov, f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert code == 2 and "Traceback" not in out, (name, code, out[-2000:])
    assert needle in out, (name, out[-2000:])
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    if name in ONE_LINE:
        assert out.strip().splitlines()[-1].startswith("error: "), (name, out[-2000:])


@pytest.mark.parametrize("name,setup,needle", RUN_CASES, ids=[c[0] for c in RUN_CASES])
def test_bad_run_folder_fails_and_is_untouched(tmp_path, train_in_process, done_run, name, setup, needle):
    run = _copy_run(done_run, tmp_path / "run")
    # the same config as the finished run, so each case reaches the check it targets
    extra = ["schedule.num_steps=1"]
    if setup is not None:
        setup(run)
    else:
        extra.append("optimizer.lr=0.5")  # a different config than the one that wrote the checkpoint
    before = _snapshot(run)
    code, out = train_in_process([*TINY, "eval=none", "report.enabled=false", *extra, f"hydra.run.dir={run}"],
                                 tmp_path)
    assert code == 2, (name, out[-2000:])
    assert needle in out, (name, out[-2000:])
    assert "Traceback" not in out, (name, out[-2000:])
    assert _snapshot(run) == before




def test_a_misspelled_torch_ops_choice_fails_before_the_model_loads(tmp_path, monkeypatch, train_in_process):
    """`PAIREDRL_TORCH_OPS` (the engine plan's choices put back on torch) with a name that is no choice: one
    line naming it and the valid choices, exit code 2, no run files."""
    monkeypatch.setenv("PAIREDRL_TORCH_OPS", "decode_atention")
    code, out = train_in_process([*TINY, f"hydra.run.dir={tmp_path}/run"], tmp_path)
    assert code == 2 and "Traceback" not in out, out[-2000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: backend=local: PAIREDRL_TORCH_OPS='decode_atention'") and \
        "choose from decode_attention" in last, last
    assert not (tmp_path / "run" / "run_info.json").exists()
