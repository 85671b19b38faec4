"""The output folder: one that cannot be created or written is refused with one line, and no secret (from
the environment or an override) is ever written into it."""

from __future__ import annotations

from runs import TINY, run_train


def test_read_only_output_folder(tmp_path):
    """The project's own probe rejects the folder, not Hydra's traceback: Hydra creates the run folder and
    writes `.hydra/` and its log there before the task runs, so the probe runs in a Hydra callback before
    that (trainer.hydra_callbacks). The folder here exists but takes no file: `.write_probe` already exists
    as a folder. (chmod cannot do this: root, as in CI, ignores permission bits.)"""
    target = tmp_path / "run"
    (target / ".write_probe").mkdir(parents=True)
    p = run_train([*TINY, f"hydra.run.dir={target}"], tmp_path)
    out = p.stderr + p.stdout
    assert p.returncode == 2, out[-2000:]
    assert f"error: output folder {target} is not writable" in p.stderr, out[-2000:]
    assert "Traceback" not in out
    assert not (target / "metrics.jsonl").exists()


def test_output_folder_that_cannot_be_created(tmp_path, train_in_process):
    """A folder Hydra itself cannot create (here under a regular file) is refused with one line and exit code
    2 before Hydra writes anything, not with Hydra's traceback."""
    (tmp_path / "afile").write_text("not a folder")
    target = tmp_path / "afile" / "run"
    code, out = train_in_process([*TINY, f"hydra.run.dir={target}"], tmp_path)
    assert code == 2, out[-2000:]
    assert out.strip().splitlines()[-1] == (f"error: output folder {target} cannot be created (Not a directory); "
                                            "pass a writable folder as hydra.run.dir=<folder> (hydra.sweep.dir "
                                            "for --multirun)"), out[-2000:]
    assert "Traceback" not in out


def test_secrets_never_written(tmp_path):
    """No secret reaches the run folder: neither the environment's keys nor one given as an override (Hydra's
    .hydra/ record and wandb's recorded command line included); with WANDB_MODE=offline, wandb stays offline
    although a key is set and logger.mode is auto."""
    secret_t, secret_w, secret_o = "tml-SECRET-do-not-log-1234", "wandb-SECRET-5678", "tml-SECRETOVR-9012"
    run = tmp_path / "run"
    p = run_train([*TINY, "schedule.num_steps=1", "eval=none", "logger=wandb", "logger.mode=auto",
                   f"+backend.api_key={secret_o}", f"hydra.run.dir={run}"], tmp_path,
                  env={"TINKER_API_KEY": secret_t, "WANDB_API_KEY": secret_w, "WANDB_MODE": "offline"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert list((run / "wandb").glob("offline-run-*")), "wandb did not run offline"
    assert "+backend.api_key=<redacted>" in (run / ".hydra" / "overrides.yaml").read_text()
    out = p.stdout + p.stderr
    assert secret_t not in out and secret_w not in out and secret_o not in out
    for f in run.rglob("*"):
        if f.is_file() and f.stat().st_size < 50_000_000:
            data = f.read_bytes()
            for secret in (secret_t, secret_w, secret_o):
                assert secret.encode() not in data, (f, secret)


def test_wandb_mode_follows_the_environment(monkeypatch):
    from trainer.wandb_run import resolve_mode

    monkeypatch.setenv("WANDB_API_KEY", "wandb-key-1234")
    for env, mode, want in (("offline", "auto", "offline"), ("offline", "online", "offline"),
                            ("disabled", "auto", "disabled"), ("online", "auto", "online"),
                            (None, "auto", "online"), (None, "offline", "offline")):
        if env is None:
            monkeypatch.delenv("WANDB_MODE", raising=False)
        else:
            monkeypatch.setenv("WANDB_MODE", env)
        assert resolve_mode(mode) == want, (env, mode)
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_mode("auto") == "offline"


