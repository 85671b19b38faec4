"""The loss path: how a loss plugin reaches tinker's `forward_backward_custom`, and how its metrics come back.

Both paths give the same loss and gradient; they differ in where the loss runs and so in what the
result carries:

- `TwoPassLossPath`: the client-side callable (`adapter.make_custom_loss_fn`). tinker runs a forward
  pass, the loss and its backward run on the client, and a second pass applies the gradient. The
  loss's own metrics come back in the result, keyed `name:reduction`.
- `OnePassLossPath`: a `LossHandle` for the per-datum form registered with `create_custom_loss`
  (`per_datum.make_loss_handle`). The datums gain the keys the per-datum function reads
  (`per_datum.with_per_datum_inputs`); the server returns per-datum sums and the current logprobs,
  from which `metrics` rebuilds the shared keys, quantiles and maxima included.

A trainer holds one path and, per update, sends `path.prepare(minibatch)` and logs
`path.metrics(result, call.data)`; `path.name` is what it records as `loss/path`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar, NamedTuple

import torch

from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.inputs import ANCHOR_KEY, datum_inputs, optional_input
from trainer.losses.per_datum import finalize_per_datum_metrics, make_loss_handle, with_per_datum_inputs

log = logging.getLogger(__name__)


class CustomLossCall(NamedTuple):
    """The arguments of `training_client.forward_backward_custom(data, loss_fn)` for one update."""

    data: list
    loss_fn: Any  # a CustomLossFnV1 callable (two-pass) or a LossHandle (one-pass)


class LossPath(ABC):
    """A loss plugin bound to one way of computing it through `forward_backward_custom`."""

    #: recorded as the `loss/path` metric; `eval.compare` refuses arms whose paths differ
    name: ClassVar[str]

    def __init__(self, loss: Any) -> None:
        #: the loss plugin (a `PolicyLoss`): its `anchor` and `kl_coef` say which extra inputs the datums need
        self.loss = loss

    def rebind(self, service_client: Any) -> None:
        """Bind the path to a new service client (the trainer's recovery replaces a lost one): nothing to do
        for a loss that runs client-side."""

    @abstractmethod
    def prepare(self, minibatch: list) -> CustomLossCall:
        """What `forward_backward_custom` receives for this minibatch of datums (the input is not changed)."""

    @abstractmethod
    def metrics(self, result: Any, data: list) -> dict[str, Any]:
        """The shared loss diagnostics (`loss/`, `ratio/`, `drift/`, `entropy/` keys) of one update, from the
        `forward_backward_custom` result and the datums `prepare` returned for it."""


class TwoPassLossPath(LossPath):
    """The loss runs client-side between tinker's forward pass and its backward pass; any aggregation."""

    name = "two_pass"

    def __init__(self, loss: Any) -> None:
        super().__init__(loss)
        self.loss_fn = make_custom_loss_fn(loss)

    def prepare(self, minibatch: list) -> CustomLossCall:
        return CustomLossCall(list(minibatch), self.loss_fn)

    def metrics(self, result: Any, data: list) -> dict[str, Any]:
        """The loss's own metrics as the result carries them: `loss:sum` becomes `loss/value`, and the
        reduction suffix tinker adds (`:sum`, `:mean`, `:max`, `:min`) is dropped."""
        out: dict[str, Any] = {}
        for k, v in (getattr(result, "metrics", None) or {}).items():
            if k == "loss:sum":
                out["loss/value"] = float(v)
            elif ":" in k:
                key, red = k.rsplit(":", 1)
                out[key if red in ("sum", "mean", "max", "min") else k] = float(v)
            else:
                out[k] = float(v)
        return out


class OnePassLossPath(LossPath):
    """The per-datum form, registered once, runs where the model runs: one pass per update; `sum` only."""

    name = "one_pass"

    def __init__(self, loss: Any, handle: Any) -> None:
        super().__init__(loss)
        self.handle = handle
        self._warned: set[str] = set()

    @classmethod
    def register(cls, loss: Any, service_client: Any) -> OnePassLossPath:
        """Register `loss`'s per-datum form with `service_client.create_custom_loss`. Raises ValueError when
        the loss cannot take this path (aggregation other than `sum`) or the client has no
        `create_custom_loss`; the service's own errors pass through."""
        handle = make_loss_handle(loss, service_client)
        if handle is None:
            raise ValueError(f"{type(service_client).__name__} has no create_custom_loss")
        return cls(loss, handle)

    def rebind(self, service_client: Any) -> None:
        """Register the loss again with the new client: a registered loss lives in its client's session."""
        self.handle = type(self).register(self.loss, service_client).handle

    def prepare(self, minibatch: list) -> CustomLossCall:
        """tinker names the per-datum function's first argument `logprobs` (the current logprobs), the
        key the datums use for the sampler's: each datum gets a copy of it as `sampler_logprobs`."""
        return CustomLossCall([with_per_datum_inputs(d) for d in minibatch], self.handle)

    def metrics(self, result: Any, data: list) -> dict[str, Any]:
        """The server returns per-datum sums only; quantiles and maxima are recomputed here from the
        current logprobs the forward pass returned. A server that drops either still gives what the
        other allows (with one warning), since the update has already been applied."""
        try:
            out = finalize_per_datum_metrics(result.metrics)
        except ValueError as e:  # a server that drops the custom/...:sum keys: the logprobs still serve
            self._warn_once("sums", "one-pass loss: %s; diagnostics come from the returned logprobs", e)
            out = {}
        out["loss/value"] = float(result.metrics.get("loss:sum", float("nan")))
        outs = list(result.loss_fn_outputs or [])
        logp = [torch.as_tensor(o["logprobs"].to_numpy(), dtype=torch.float32)
                for o in outs if "logprobs" in o]
        if len(logp) != len(data):
            self._warn_once("logprobs", "one-pass loss: %d of %d datums came back with logprobs; the drift, "
                            "ratio quantile and max diagnostics are not logged", len(logp), len(data))
        else:
            slp, adv, mask = zip(*[datum_inputs(d, i, len(lp)) for i, (d, lp) in enumerate(zip(data, logp))])
            cat = [torch.cat(x) for x in (logp, slp, adv, mask)]
            anchors = [optional_input(d, ANCHOR_KEY, i, len(lp)) for i, (d, lp) in enumerate(zip(data, logp))]
            anchor = torch.cat(anchors) if all(a is not None for a in anchors) else None
            diag = self.loss.diagnostics(*cat, anchor)
            out.update({k: v for k, v in diag.items() if k not in out})
        return out

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)
