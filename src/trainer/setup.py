"""The run's parts, built from its config: tokenizer, renderer and task, the eval task, and the loss
path. Every entry point builds them here (train.py through trainer/main.py, the preflight gates,
`python -m eval.run`, the bench scripts), so they all run what a training run runs."""

from __future__ import annotations

import logging
import sys
from typing import Any, NoReturn

from envs import build_task
from envs.renderers import get_renderer
from envs.tokenizers import get_tokenizer
from trainer.backends import backend_of
from trainer.config.schema import Config, env_schema
from trainer.losses import build_loss
from trainer.losses.paths import LossPath, OnePassLossPath, TwoPassLossPath

log = logging.getLogger("pairedrl")


def fail(msg: str) -> NoReturn:
    """Stop before any compute with a message naming the problem (exit code 2), secrets scrubbed."""
    from trainer.redaction import scrub

    print(f"error: {scrub(msg)}", file=sys.stderr)
    raise SystemExit(2)


def build_components(cfg: Config) -> tuple[Any, Any, Any]:
    """(tokenizer, renderer, task) for the configured model and env."""
    tokenizer = get_tokenizer(cfg.model)
    renderer = get_renderer(cfg.model, tokenizer)
    task = build_task(cfg.env, renderer)
    return tokenizer, renderer, task


def eval_task(cfg: Config, renderer: Any, train_task: Any) -> Any:
    """The task the evals run (None for `eval=none`): the train task when the eval names the train env,
    else that env built with its schema's defaults."""
    if cfg.eval.task is None or cfg.eval.name == "none":
        return None
    if cfg.eval.task == cfg.env.name:
        return train_task
    return build_task(env_schema(cfg.eval.task)(), renderer)


def make_loss(cfg: Config, service_client: Any) -> LossPath:
    """The loss plugin on its path, by `backend.loss_path`: `two_pass` the client-side callable; `one_pass` a
    handle registered with `create_custom_loss` (the per-datum form, which needs `aggregation=sum`), failing
    the run when that is impossible; `auto` the handle where the loss and backend allow it, else the
    callable, with a warning when registering failed (the arms of a sweep would otherwise run different
    paths unnoticed; `eval.compare` refuses such a sweep)."""
    loss = build_loss(cfg.loss)
    want = cfg.backend.loss_path
    if want == "two_pass":
        return TwoPassLossPath(loss)
    if cfg.loss.aggregation != "sum" or not backend_of(cfg).custom_losses:
        if want == "one_pass":
            fail(f"backend.loss_path=one_pass needs loss.aggregation=sum (got {cfg.loss.aggregation}) and a "
                 "backend with create_custom_loss; use backend.loss_path=auto or two_pass")
        return TwoPassLossPath(loss)
    try:
        path = OnePassLossPath.register(loss, service_client)
    except Exception as e:  # noqa: BLE001 - reported, and the run fails or falls back by loss_path
        if want == "one_pass":
            fail(f"backend.loss_path=one_pass: registering the loss with create_custom_loss failed: "
                 f"{type(e).__name__}: {e}")
        log.warning("backend.loss_path=auto: registering the loss failed (%s: %s); this run computes its loss on "
                    "the two-pass path (same gradients, other cost and metric rounding); pin "
                    "backend.loss_path so that every arm of a sweep runs the same path", type(e).__name__, e)
        return TwoPassLossPath(loss)
    if backend_of(cfg).reports_loss_placement and getattr(path.handle, "loss_id", None) is None:
        log.info("the service runs registered losses client-side (custom_loss_server_side=false): one-pass "
                 "semantics, two model passes per update")
    return path
