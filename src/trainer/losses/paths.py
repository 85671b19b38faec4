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

A trainer holds one path. Per rollout step it first passes the step's datums through
`path.fetch_inputs(datums, clients)`, which adds the optional inputs the loss declares (`loss.needs`: the
recomputed anchor, the initial weights' logprobs) through the clients it is given; then, per update, it
sends `path.prepare(minibatch)` and logs `path.metrics(result, call.data)`; `path.name` is what it records
as `loss/path`. The trainer so never reads the loss's settings to know what to fetch.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import numpy as np
import tinker
import torch
from torch.nn.utils.rnn import pad_sequence

from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.inputs import ANCHOR_KEY, MASK_KEY, REF_KEY, LossNeeds, datum_inputs, optional_input
from trainer.losses.per_datum import finalize_per_datum_metrics, make_loss_handle, with_per_datum_inputs

log = logging.getLogger(__name__)


class CustomLossCall(NamedTuple):
    """The arguments of `training_client.forward_backward_custom(data, loss_fn)` for one update."""

    data: list
    loss_fn: Any  # a CustomLossFnV1 callable (two-pass) or a LossHandle (one-pass)


@dataclass(frozen=True)
class InputClients:
    """What `LossPath.fetch_inputs` fetches the loss's optional inputs through: the trainer's clients, and
    its wrapper of backend calls, so that these calls are retried and their failures recovered like the
    trainer's own (the path owns no client: the trainer replaces them when it recovers)."""

    #: the training client: its `forward` of the current weights gives the recomputed anchor
    training: Any
    #: a sampling client of the initial weights (the base model: LoRA starts with B = 0); called only when
    #: the loss needs the reference logprobs, so a trainer may create it on first use
    reference_sampler: Callable[[], Any]
    #: `call(what, fn)`: runs `fn()` as the trainer runs a backend call named `what`
    call: Callable[[str, Callable[[], Any]], Any]


class LossPath(ABC):
    """A loss plugin bound to one way of computing it through `forward_backward_custom`."""

    #: recorded as the `loss/path` metric; `eval.compare` refuses arms whose paths differ
    name: ClassVar[str]

    def __init__(self, loss: Any) -> None:
        #: the loss plugin (a `PolicyLoss`): its `needs` says which extra inputs `fetch_inputs` adds
        self.loss = loss

    def fetch_inputs(self, datums: list, clients: InputClients) -> tuple[list, dict[str, float]]:
        """The step's datums with the optional inputs `loss.needs` names, and the step metrics of fetching
        them: `time/anchor_forward` and `entropy/exact` (the anchor pass), `time/ref_logprobs`. Runs once per
        rollout step, before its first update, over the whole batch: the anchor is the weights the step
        starts from, not those of a later minibatch. A loss that needs nothing gets `datums` itself back and
        no metrics, and no backend call is made."""
        return fetch_loss_inputs(self.loss.needs, datums, clients)

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
        """The server returns per-datum sums only; quantiles, maxima and the rules not counted per datum
        (`RuleSpec.per_datum`) are recomputed here from the current logprobs the forward pass returned,
        one row per datum (a rule may act along a sequence). A server that drops either still gives what
        the other allows (with one warning), since the update has already been applied."""
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
                            "ratio quantile and max diagnostics and the rules not counted per datum are not "
                            "logged", len(logp), len(data))
        else:
            slp, adv, mask = zip(*[datum_inputs(d, i, len(lp)) for i, (d, lp) in enumerate(zip(data, logp))])
            rows = [pad_sequence(list(x), batch_first=True) for x in (logp, slp, adv, mask)]
            anchors = [optional_input(d, ANCHOR_KEY, i, len(lp)) for i, (d, lp) in enumerate(zip(data, logp))]
            anchor = pad_sequence(anchors, batch_first=True) if all(a is not None for a in anchors) else None
            diag = self.loss.diagnostics(*rows, anchor)
            out.update({k: v for k, v in diag.items() if k not in out})
        return out

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


def fetch_loss_inputs(needs: LossNeeds, datums: list,
                      clients: InputClients) -> tuple[list, dict[str, float]]:
    """`datums` with `needs` fetched and added, and the metrics of the extra passes (see
    `LossPath.fetch_inputs`). The input datums are not changed."""
    metrics: dict[str, float] = {}
    extra: list[dict[str, Any]] = [{} for _ in datums]
    if needs.anchor:
        t0 = time.time()
        outputs = _anchor_forward(datums, clients)
        for e, o in zip(extra, outputs):
            e[ANCHOR_KEY] = o["logprobs"]
        metrics["time/anchor_forward"] = time.time() - t0
        if all("entropy" in o for o in outputs):  # the local engine's forward has full logits
            metrics["entropy/exact"] = _exact_entropy(outputs, datums)
    if needs.reference:
        t0 = time.time()
        for e, lp in zip(extra, _reference_logprobs(datums, clients)):
            e[REF_KEY] = lp
        metrics["time/ref_logprobs"] = time.time() - t0
    if not metrics:
        return datums, metrics
    return [tinker.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, **e})
            for d, e in zip(datums, extra)], metrics


def _anchor_forward(datums: list, clients: InputClients) -> list:
    """The outputs of one forward pass of the current weights over the datums' targets (as Stable-RL's
    `*_recompute` modes): each carries the trainer's `logprobs`, and on the local engine `entropy`."""
    fwd = [tinker.Datum(model_input=d.model_input, loss_fn_inputs={
        "target_tokens": d.loss_fn_inputs["target_tokens"], "weights": d.loss_fn_inputs[MASK_KEY]})
        for d in datums]
    out = clients.call("forward", lambda: clients.training.forward(fwd, "cross_entropy").result())
    if len(out.loss_fn_outputs) != len(datums):
        raise ValueError(f"anchor forward returned {len(out.loss_fn_outputs)} outputs for "
                         f"{len(datums)} datums")
    return list(out.loss_fn_outputs)


def _exact_entropy(outputs: list, datums: list) -> float:
    """The trainer's mean next-token entropy over the batch's loss tokens, before the first update."""
    ent = np.concatenate([o["entropy"].to_numpy() for o in outputs])
    mask = np.concatenate([d.loss_fn_inputs[MASK_KEY].to_numpy() for d in datums]) > 0
    return float(ent[mask].astype(np.float64).mean())


def _reference_logprobs(datums: list, clients: InputClients) -> list:
    """Each datum's target logprobs under the initial weights: the reference sampler's `compute_logprobs`
    of the whole sequence, shifted by one since position i of a datum predicts token i + 1 of the
    sequence; the first token's None (it has no context) goes with the shift, a later None becomes 0.
    The sequence is the datum's input and its last target, as tinker_cookbook 0.5.8
    rl/metrics.py::incorporate_kl_penalty rebuilds it, but in one token chunk (not `append_int`'s
    second): the prompt and completion tokens of the rollout, the request a rollout would make."""
    sampler = clients.reference_sampler()
    sequences = [tinker.ModelInput.from_ints(
        d.model_input.to_ints() + d.loss_fn_inputs["target_tokens"].tolist()[-1:]) for d in datums]

    def compute() -> list:
        futures = [sampler.compute_logprobs(seq) for seq in sequences]
        return [f.result() for f in futures]

    return [tinker.TensorData.from_numpy(np.asarray([0.0 if v is None else v for v in lps[1:]],
                                                    dtype=np.float32))
            for lps in clients.call("compute_logprobs", compute)]
