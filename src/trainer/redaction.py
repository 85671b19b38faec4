"""One function every way out of a run passes through: `scrub`, which replaces the run's secrets (the
environment's keys, the values of secret-looking config keys) and the credentials inside URLs
(`http://user:password@host`) with `<redacted>`.

The files a run writes are redacted where they are written (`trainer.run_info`: config.yaml, .hydra/,
wandb's config and argv). What leaves the process otherwise goes through `scrub` here, once `install`
has run (train.py calls it before Hydra starts, and again once the config and Hydra's log handlers exist):

- stderr and stdout: the streams are wrapped, so a message printed by this code (`setup.fail`'s
  `error: ...` lines), by Hydra (its report of a task's exception) or by a library is scrubbed per write;
- logs: a filter on every handler of the root logger (the console and Hydra's `train.log`) scrubs each
  record's message, its exception's traceback and its stack before it is formatted;
- exceptions nobody catches: Python prints their tracebacks (in threads too) to the wrapped stderr;
- wandb: `wandb_run.init_redacted` passes the argv and config through `run_info.redact`, the same rule.

A secret split across two writes to a stream would not be matched; print and logging write whole
messages, which is how every message of the project leaves.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Iterable
from typing import Any, TextIO

from trainer.run_info import current_secrets, redact

_SECRETS: set[str] = set()


def add_secrets(values: Iterable[str]) -> None:
    """Secrets to scrub besides the environment's (values of 4 characters or more)."""
    _SECRETS.update(v for v in values if v and len(v) >= 4)


def scrub(text: str) -> str:
    """`text` with every known secret and every URL's userinfo replaced by `<redacted>`."""
    secrets = sorted(_SECRETS.union(current_secrets()), key=len, reverse=True)
    return redact(text, secrets)


class ScrubFilter(logging.Filter):
    """Scrubs a record's message (with its arguments filled in), traceback and stack in place."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it; keep the raw text
            msg = str(record.msg)
        record.msg, record.args = scrub(msg), None
        if record.exc_info and not record.exc_text:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = scrub(record.exc_text)
        if record.stack_info:
            record.stack_info = scrub(record.stack_info)
        return True


class _ScrubbingStream:
    """A text stream whose writes are scrubbed; everything else is the wrapped stream's."""

    def __init__(self, inner: TextIO):
        self._inner = inner

    def write(self, s: str) -> int:
        self._inner.write(scrub(s))
        return len(s)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_FILTER = ScrubFilter()


def install(secrets: Iterable[str] = ()) -> None:
    """Route stdout, stderr (where uncaught exceptions are printed, in threads too) and the root logger's
    handlers through `scrub` (again after new handlers were added: each call covers the handlers that
    exist then)."""
    add_secrets(secrets)
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _ScrubbingStream):
            setattr(sys, name, _ScrubbingStream(stream))
    for handler in logging.getLogger().handlers:
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)
