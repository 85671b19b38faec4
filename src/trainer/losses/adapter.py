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

from trainer.losses.inputs import ANCHOR_KEY, REF_KEY, datum_inputs, optional_input

CustomLossFn = Callable[[list[Any], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


class LossFunctionError(ValueError):
    """The client-side loss code raised: a bug or bad inputs, which no retry or recovery can fix."""


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

