"""Adapter from a loss plugin to tinker's `CustomLossFnV1` for `forward_backward_custom`.

tinker 0.38, tinker/lib/public_interfaces/training_client.py::_compute_custom_loss calls
`fn(data, logprobs_list)` with one float32 tensor per datum (shape of its `target_tokens`,
`[T]`, `requires_grad=True`), then `loss.backward()` and sends `-grad` as CE weights; every
`loss_fn_inputs` key stays client-side. The metrics dict is merged into the result's
metrics as is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

SAMPLER_LOGPROBS_KEY = "logprobs"
ADVANTAGES_KEY = "advantages"
MASK_KEY = "mask"
#: Optional per-datum inputs: the recomputed anchor and the initial weights' logprobs.
ANCHOR_KEY = "anchor_logprobs"
REF_KEY = "ref_logprobs"

CustomLossFn = Callable[[list[Any], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def default_mask(sampler_logp_T: torch.Tensor, advantages_T: torch.Tensor) -> torch.Tensor:
    """Loss mask when a datum carries none: `advantages != 0 or logprobs != 0`.

    Same rule as spindle's `build_sequence_batches` (spindle: an open-source server of
    Tinker's training API, pinned in losses/aggregate.py); prompt tokens carry A = 0 and
    sampler logprob 0 in tinker-cookbook datums.
    """
    return ((advantages_T != 0) | (sampler_logp_T != 0)).to(sampler_logp_T.dtype)


def datum_inputs(datum: Any, index: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sampler_logp_T, advantages_T, mask_T) of one datum, each checked to have `length`."""
    inputs = datum.loss_fn_inputs
    out = []
    for key in (SAMPLER_LOGPROBS_KEY, ADVANTAGES_KEY):
        if key not in inputs:
            raise ValueError(f"datum[{index}] has no loss_fn_inputs[{key!r}]")
        out.append(inputs[key].to_torch().reshape(-1).to(torch.float32))
    sampler_T, adv_T = out
    mask_T = inputs[MASK_KEY].to_torch().reshape(-1).to(torch.float32) if MASK_KEY in inputs else None
    if mask_T is None:
        mask_T = default_mask(sampler_T, adv_T)
    for key, t in ((SAMPLER_LOGPROBS_KEY, sampler_T), (ADVANTAGES_KEY, adv_T), (MASK_KEY, mask_T)):
        if t.numel() != length:
            raise ValueError(
                f"datum[{index}] loss_fn_inputs[{key!r}] has {t.numel()} entries, "
                f"but its current logprobs have {length}"
            )
    return sampler_T, adv_T, mask_T


class LossFunctionError(ValueError):
    """The client-side loss code raised: a bug or bad inputs, which no retry or recovery can fix."""


def optional_input(datum: Any, key: str, index: int, length: int) -> torch.Tensor | None:
    """A datum's optional `loss_fn_inputs[key]` as float32 `[T]`, or None when absent."""
    if key not in datum.loss_fn_inputs:
        return None
    t = datum.loss_fn_inputs[key].to_torch().reshape(-1).to(torch.float32)
    if t.numel() != length:
        raise ValueError(
            f"datum[{index}] loss_fn_inputs[{key!r}] has {t.numel()} entries, but its current logprobs have {length}"
        )
    return t


def make_custom_loss_fn(loss: Callable[..., tuple[torch.Tensor, dict[str, float]]]) -> CustomLossFn:
    """Wrap `loss(logp, sampler_logp, advantages, mask, anchor_logp, ref_logp)` as a tinker
    `CustomLossFnV1`.

    The per-datum flat tensors are right-padded with zeros (mask 0) to `[B, T]` and the
    loss is called once, so the configured aggregation sees the whole minibatch. The
    padding of `logp` is differentiable, so each datum's logprobs receive their gradient.
    `anchor_logprobs` / `ref_logprobs` are passed (as `anchor_logp=` / `ref_logp=`) when every
    datum carries them (all or none).
    """

    def custom_loss_fn(data: Sequence[Any], logprobs_list: Sequence[torch.Tensor]):
        if len(data) == 0:
            raise ValueError("custom loss: no datums given")
        if len(data) != len(logprobs_list):
            raise ValueError(f"custom loss: {len(data)} datums but {len(logprobs_list)} logprob tensors")
        sampler, advs, masks = [], [], []
        extra: dict[str, list] = {ANCHOR_KEY: [], REF_KEY: []}
        for i, (datum, logp_T) in enumerate(zip(data, logprobs_list)):
            if logp_T.dim() != 1:
                raise ValueError(
                    f"custom loss: datum[{i}] logprobs must be [T] (rank-1 target_tokens), "
                    f"got shape {tuple(logp_T.shape)}"
                )
            s_T, a_T, m_T = datum_inputs(datum, i, logp_T.shape[0])
            sampler.append(s_T.to(logp_T.dtype))
            advs.append(a_T.to(logp_T.dtype))
            masks.append(m_T.to(logp_T.dtype))
            for key, got in extra.items():
                t = optional_input(datum, key, i, logp_T.shape[0])
                got.append(None if t is None else t.to(logp_T.dtype))
        padded_extra = {}
        for key, got in extra.items():
            present = [t is not None for t in got]
            if any(present) and not all(present):
                raise ValueError(f"custom loss: {sum(present)} of {len(got)} datums carry loss_fn_inputs[{key!r}]; "
                                 "all or none must")
            padded_extra[key] = pad_sequence(got, batch_first=True, padding_value=0.0) if all(present) else None
        logp_BT = pad_sequence(list(logprobs_list), batch_first=True, padding_value=0.0)
        sampler_BT = pad_sequence(sampler, batch_first=True, padding_value=0.0)
        adv_BT = pad_sequence(advs, batch_first=True, padding_value=0.0)
        mask_BT = pad_sequence(masks, batch_first=True, padding_value=0.0)
        try:
            extras = {name: padded_extra[key] for name, key in (("anchor_logp", ANCHOR_KEY), ("ref_logp", REF_KEY))
                      if padded_extra[key] is not None}
            return loss(logp_BT, sampler_BT, adv_BT, mask_BT, **extras)
        except ValueError:
            raise  # already names the bad input
        except Exception as e:  # noqa: BLE001 - re-raised with its type named
            # a failure of the loss code itself (a torch RuntimeError, say) would otherwise look like a
            # backend failure to the trainer, which recovers from checkpoints and fails the same way again
            raise LossFunctionError(f"loss {custom_loss_fn.__name__} raised {type(e).__name__}: {e}") from e

    custom_loss_fn.__name__ = f"{getattr(loss, 'name', type(loss).__name__)}_custom_loss"
    return custom_loss_fn


def make_loss_handle(loss: Any, service_client: Any) -> Any:
    """Register the loss's one-pass per-datum form with `service_client.create_custom_loss`.

    Returns tinker's `LossHandle` for `forward_backward_custom(data, handle)`, or None when
    the client has no `create_custom_loss`. Raises ValueError unless `loss.aggregation == "sum"`
    (tinker sums per-datum losses). The datums passed with the handle must carry the keys
    the per-datum function reads: map them through
    `trainer.losses.per_datum.with_per_datum_inputs` (adds `sampler_logprobs`, and `mask`
    when absent); its metrics come back as `custom/...:sum` counts, which
    `trainer.losses.per_datum.finalize_per_datum_metrics` turns into the shared keys.
    """
    from trainer.losses.per_datum import make_per_datum_fn

    create = getattr(service_client, "create_custom_loss", None)
    if create is None:
        return None
    per_datum = make_per_datum_fn(loss)
    return create(per_datum.fn, per_datum.input_ranks).result()
