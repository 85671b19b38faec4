"""Secrets leave a run through `trainer.redaction.scrub` only: stderr, stdout, log files, uncaught
exceptions (wandb's argv and config: test_serve_sessions.py::test_url_credentials_are_redacted_like_keys).

The real-client review (round 5, D) found `error: the Tinker service at http://alice:URLSECRET42@127.0.0.1:1
did not answer ...` on the terminal of a failing run, while its files were redacted."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from runs import ROOT, run_train

SECRET = "URLSECRET42"
URL = f"http://alice:{SECRET}@127.0.0.1:1"


def test_a_failing_run_leaks_the_url_password_through_no_output(tmp_path):
    """`backend=tinker` against an address that does not answer fails with rc 2 and a line naming the
    service; the password is in neither stream nor in any file of the run folder (train.log, .hydra/)."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TINKER_BASE_URL"}
    p = run_train(["backend=tinker", f"backend.base_url={URL}", "backend.connect_timeout_s=1",
                   f"hydra.run.dir={run}"], tmp_path,
                  env={**env, "TINKER_API_KEY": "tml-local-key", "TINKER_TELEMETRY": "0"}, timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "did not answer" in p.stderr and "http://<redacted>@127.0.0.1:1" in p.stderr, p.stderr[-2000:]
    assert SECRET not in p.stdout + p.stderr
    files = [f for f in run.rglob("*") if f.is_file()]
    assert any(f.suffix == ".log" for f in files) and any(f.name == "overrides.yaml" for f in files), files
    for f in files:
        assert SECRET.encode() not in f.read_bytes(), f


def test_logs_prints_and_uncaught_exceptions_are_scrubbed(tmp_path):
    """Once installed, a log file handler made before (as Hydra's train.log is), a print to stderr, a
    logged exception, an exception in a thread and one nobody catches all come out scrubbed; a secret
    registered with `add_secrets` (a config key's value) too."""
    log_file = tmp_path / "train.log"
    script = textwrap.dedent(f"""
        import logging, sys, threading
        sys.path.insert(0, {str(ROOT / "src")!r})
        logging.getLogger().addHandler(logging.FileHandler({str(log_file)!r}))
        from trainer.redaction import install
        install(["CONFIGSECRET7"])
        log = logging.getLogger("pairedrl")
        log.warning("service at %s", {URL!r})
        try:
            raise ValueError("key CONFIGSECRET7 at {URL}")
        except ValueError:
            log.exception("request failed")
        print("printed {URL}", file=sys.stderr)
        t = threading.Thread(target=lambda: (_ for _ in ()).throw(RuntimeError("thread {URL}")))
        t.start(); t.join()
        raise RuntimeError("uncaught {URL}")
    """)
    p = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert p.returncode == 1
    log = Path(log_file).read_text()
    for text in (p.stderr, log):
        assert SECRET not in text and "CONFIGSECRET7" not in text, text
    assert "service at http://<redacted>@127.0.0.1:1" in log and "ValueError: key <redacted>" in log, log
    for what in ("printed", "thread", "uncaught"):
        assert f"{what} http://<redacted>@127.0.0.1:1" in p.stderr, (what, p.stderr)
