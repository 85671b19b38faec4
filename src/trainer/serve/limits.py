"""Bounds on what one request may ask of the server, checked before any work starts.

The server shares one process (and one machine's memory) among every client, so a single
request must not be able to exhaust it or stall the others: each size a client chooses (body
bytes, samples, tokens, LoRA rank, live models) has a ceiling here, and each number it sends is
checked for NaN / inf and for its range (`x < 0` is false for NaN, so every check below is
written as "inside the range", which NaN never is). A refused request gets a 4xx naming the
field, its value and the bound; nothing has been queued when that happens.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from tinker import types

MiB = 2**20
# a session whose heartbeats stop ends after SESSION_TIMEOUT_S: the SDK heartbeats every 10 s and warns after
# 120 s without one that "the session will be terminated" (tinker 0.38,
# `lib/internal_client_holder.py::_session_heartbeat`: SESSION_HEARTBEAT_PERIOD_SEC,
# SESSION_MISSED_HEARTBEAT_WARNING_THRESHOLD_SEC)
SDK_HEARTBEAT_S = 10.0
SESSION_TIMEOUT_S = 120.0
# a checkpoint name becomes a folder name under the state dir: a plain word, never a path
CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


class LimitExceeded(ValueError):
    """A request asks for more than a configured bound (answered 413)."""


@dataclass(frozen=True)
class Limits:
    """Per-request ceilings; each is a `python -m trainer.serve --max-...` flag."""

    json_body_mb: float = 8.0
    proto_body_mb: float = 64.0
    num_samples: int = 128
    max_tokens: int = 4096
    prompt_tokens: int = 8192
    sample_tokens: int = 1_000_000  # num_samples x (prompt + max_tokens): the decode work of one request
    batch_tokens: int = 262_144  # tokens of all datums in one forward / forward_backward
    batch_datums: int = 4096
    lora_rank: int = 128
    models_per_key: int = 8
    sessions_per_key: int = 32  # live sessions; each heartbeats, so a dead client's expire and free theirs
    inflight_per_key: int = 256  # accepted requests of one key whose result is not ready yet (429 beyond)
    connections: int = 512  # open connections (each holds a file descriptor; `connections.py`)
    connections_per_key: int = 320  # requests of one key being handled at once (the SDK polls each in flight)
    # sampling sessions of one session (its least recently used idle one is retired for a new one) and of
    # the server (`serve/samplers.py`); a snapshot sampler holds a float32 copy of its adapter
    samplers_per_session: int = 16
    samplers: int = 64
    # server-wide totals over every key: without --api-key, invented keys share these (`serve/samplers.py`)
    models: int = 32
    sessions: int = 256
    inflight: int = 1024
    session_metadata_kb: float = 64.0  # user_metadata of one session or model, as JSON
    # a custom-loss graph's cost in one forward_backward, in element operations (`graph_cost.py`): every
    # project loss fits on 512 datums of 512 tokens (about 2.6e9 with gspo's 190 nodes); at the review's
    # timings it allows about 165,000 node runs, near the time of the largest built-in request (4096 datums)
    loss_cost: int = 2**32
    loss_nodes: int = 512  # nodes of one uploaded custom-loss graph (the project's losses have 150-210)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{Limits.flag(f.name)} must be a positive number, got {v!r}")

    @staticmethod
    def flag(name: str) -> str:
        """The `python -m trainer.serve` flag that sets limit `name` (errors name it, so it is written once)."""
        special = {"json_body_mb": "--max-json-body-mb", "proto_body_mb": "--max-proto-body-mb",
                   "max_tokens": "--max-tokens"}
        return special.get(name, "--max-" + name.replace("_", "-"))

    def body_limit(self, endpoint: str) -> tuple[int, str]:
        """(bytes, flag) of an endpoint's body limit: `forward_backward` carries a protobuf, the rest JSON."""
        name = "proto_body_mb" if endpoint == "forward_backward" else "json_body_mb"
        return int(getattr(self, name) * MiB), self.flag(name)


def finite_in(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False) -> float:
    """`value` as a float inside [lo, hi] (or (lo, hi]); NaN and inf are outside every range."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    inside = (lo < v if lo_open else lo <= v) and v <= hi
    if not (math.isfinite(v) and inside):
        bracket = "(" if lo_open else "["
        raise ValueError(f"{name} must be a finite number in {bracket}{lo:g}, {hi:g}], got {value!r}")
    return v


# the most top-k entries per position this server returns (not configurable: the engine's own bound)
MAX_TOPK = 64


def at_most(what: str, value: int, limits: Limits, name: str, hint: str = "") -> None:
    """LimitExceeded naming `what`, the value, the bound `limits.<name>` and the flag that sets it (then
    `hint`: what the client can change)."""
    bound = getattr(limits, name)
    if value > bound:
        raise LimitExceeded(f"{what} = {value} exceeds this server's limit {bound} ({Limits.flag(name)})"
                            + (f"; {hint}" if hint else ""))


def check_sample(req: types.SampleRequest, limits: Limits) -> None:
    at_most("num_samples", req.num_samples, limits, "num_samples")
    if req.num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {req.num_samples}")
    p = req.sampling_params
    finite_in("sampling_params.temperature", p.temperature, 0.0, 100.0)
    finite_in("sampling_params.top_p", p.top_p, 0.0, 1.0, lo_open=True)
    max_tokens = limits.max_tokens if p.max_tokens is None else int(p.max_tokens)
    at_most("sampling_params.max_tokens", max_tokens, limits, "max_tokens",
            hint="ask for fewer: tinker-cookbook programs set it in their config (max_tokens=..., e.g. "
                 "BenchmarkConfig(max_tokens=...) for its eval runner), and a longer generation does not fit "
                 "the served models' context anyway")
    prompt = req.prompt.length
    at_most("prompt length", prompt, limits, "prompt_tokens")
    at_most("num_samples x (prompt + max_tokens)", req.num_samples * (prompt + max_tokens), limits, "sample_tokens")
    for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        if int(getattr(req, k) or 0) > MAX_TOPK:
            raise LimitExceeded(f"{k} = {getattr(req, k)} exceeds this server's limit {MAX_TOPK} (fixed)")


def check_adam(p: types.AdamParams | types.OptimParamsBase | None) -> None:
    """AdamW's hyper-parameters inside the ranges where an update is defined (NaN would destroy the adapter).

    `OptimStepRequest.optim_params` parses any other family (`DimuonParams`, or a `type` this SDK does not
    know) as an `OptimParamsBase`, which has none of Adam's fields: it is refused here by its family name,
    since the engine (like `create_model`, which refuses `DimuonOptimizerConfig`) implements AdamW only.
    """
    if p is None:
        return
    if not isinstance(p, types.AdamParams):
        family = str(getattr(p, "type", type(p).__name__))[:40]
        raise ValueError(  # noqa: TRY004 - the middleware answers a ValueError with a 400 (a TypeError: 500)
            f"optim_params of type {family!r}: this server implements the AdamW optimizer only (send "
            "tinker.AdamParams; a training client made with DimuonOptimizerConfig is refused at creation "
            "too)")
    finite_in("learning_rate", p.learning_rate, 0.0, 1.0)
    finite_in("beta1", p.beta1, 0.0, 1.0)
    finite_in("beta2", p.beta2, 0.0, 1.0)
    finite_in("eps", p.eps, 0.0, 1.0)
    finite_in("weight_decay", p.weight_decay, 0.0, 1.0)
    finite_in("grad_clip_norm", p.grad_clip_norm, 0.0, 1e6)


def check_metadata(meta: dict[str, Any] | None, limits: Limits, what: str = "user_metadata") -> None:
    """`user_metadata` is kept in memory (and in run.json) for as long as its session or run: bounded."""
    if meta:
        size = len(json.dumps(meta, default=str))
        if size > limits.session_metadata_kb * 1024:
            raise LimitExceeded(f"{what} of {size} bytes exceeds this server's limit "
                                f"{limits.session_metadata_kb:g} kB ({Limits.flag('session_metadata_kb')})")


def check_optimizer_config(optimizer_config: Any) -> None:
    """A new training client's optimizer family: AdamW only, refused before the model is built (its
    `optim_step` would be refused anyway; see `check_adam`)."""
    family = str(getattr(optimizer_config, "type", "adamw"))[:40]
    if optimizer_config is not None and family != "adamw":
        raise ValueError(f"optimizer_config of type {family!r}: this server implements the AdamW optimizer "
                         "only (leave optimizer unset, or pass tinker.AdamOptimizerConfig())")


def check_lora(rank: int, limits: Limits) -> None:
    at_most("lora_config.rank", rank, limits, "lora_rank")
    if rank < 1:
        raise ValueError(f"lora_config.rank must be >= 1, got {rank}")


def check_checkpoint_name(name: str) -> str:
    if not CHECKPOINT_NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"checkpoint name {name[:80]!r} must be a plain name ([A-Za-z0-9_.-], <= 128 "
                         "characters, no path separators)")
    return name


def check_text_only(model_input: types.ModelInput, what: str) -> None:
    """The served models read token ids: a prompt or datum with an image or audio chunk is refused by its
    type (tinker 0.38 `types/model_input_chunk.py`: EncodedTextChunk, ImageChunk, ImageAssetPointerChunk,
    DmelChunk), not sampled or trained on without it."""
    for chunk in model_input.chunks:
        kind = str(getattr(chunk, "type", type(chunk).__name__))
        if kind != "encoded_text":
            raise ValueError(f"{what} holds a {kind!r} chunk ({type(chunk).__name__}); this server's models "
                             "read token ids only (EncodedTextChunk, ModelInput.from_ints): image and audio "
                             "(DmelChunk) input is not implemented")


def check_loss_fn(loss_fn: str, config: dict[str, Any] | None) -> None:
    """A built-in loss's name and config as the engine will resolve them, refused before the request is
    queued (`dro` and `gspo` without their config would otherwise fail later, as a future)."""
    from trainer.backends.local.losses import resolve_config

    resolve_config(loss_fn, config or None)


def check_batch(data: list[types.Datum], config: dict[str, Any], limits: Limits) -> None:
    """A forward / forward_backward batch: its size, and every number in its config and inputs finite."""
    at_most("datums in one request", len(data), limits, "batch_datums")
    for i, d in enumerate(data):
        check_text_only(d.model_input, f"datum[{i}].model_input")
    tokens = sum(d.model_input.length for d in data)
    at_most("tokens in one request", tokens, limits, "batch_tokens")
    for k, v in config.items():
        if not isinstance(v, str):
            finite_in(f"loss_fn_config[{k!r}]", v, -1e6, 1e6)
    for i, d in enumerate(data):
        for name, td in d.loss_fn_inputs.items():
            arr = np.asarray(td.to_numpy())
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                raise ValueError(f"datum[{i}].loss_fn_inputs[{name!r}] holds NaN or inf")
