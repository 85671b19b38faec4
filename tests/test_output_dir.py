"""The output folder: one the project cannot write is refused by its own check, and no secret from the
environment is ever written into it."""

from __future__ import annotations

from runs import TINY, run_train


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


