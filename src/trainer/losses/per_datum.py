"""One-pass form of a loss plugin for tinker's `ServiceClient.create_custom_loss`.

tinker 0.38, tinker/lib/public_interfaces/custom_loss.py (`trace_loss`, `_inputs`,
`_check_graph`, `run_loss_handle`): the function runs once per datum and the losses are
summed; it takes `logprobs` (the datum's current target logprobs) first, then one
parameter per `loss_fn_inputs` key it reads; it is traced with torch.fx, so no Python
branching on tensor values, no `.item()`, no captured tensors, only torch/math calls; it
returns `(scalar, {"custom/<name>:sum|mean": scalar tensor})`.

The first parameter must be called `logprobs`, which is also the key tinker-cookbook uses
for the sampler logprobs; the per-datum function therefore reads the sampler logprobs
from `sampler_logprobs` (see `with_per_datum_inputs`). Because tinker sums per-datum
losses, only `aggregation="sum"` can be expressed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trainer.config.losses import PER_DATUM_RULE_NAMES as RULES
from trainer.losses.base import kl_k3
from trainer.losses.inputs import (
    ADVANTAGES_KEY,
    ANCHOR_KEY,
    MASK_KEY,
    REF_KEY,
    SAMPLER_LOGPROBS_KEY,
    default_mask,
)

PER_DATUM_SAMPLER_KEY = "sampler_logprobs"
PER_DATUM_INPUT_RANKS: dict[str, int] = {
    "logprobs": 1,
    PER_DATUM_SAMPLER_KEY: 1,
    ADVANTAGES_KEY: 1,
    MASK_KEY: 1,
    ANCHOR_KEY: 1,
}

# Per-datum metric sums (tinker metric-key rule custom/<name>:sum) and how
# `finalize_per_datum_metrics` turns them into the shared diagnostic keys.
_COUNT_KEYS = {
    "n_tokens": "custom/loss/n_tokens:sum",
    "nonzero_adv": "custom/loss/nonzero_adv_tokens:sum",
    "pos_adv": "custom/loss/pos_adv_tokens:sum",
    "neg_adv": "custom/loss/neg_adv_tokens:sum",
    "dppo_masked_nonzero_adv": "custom/loss/dppo_masked_nonzero_adv:sum",
    "ratio_sum": "custom/ratio/sum:sum",
    "cap_hits": "custom/ratio/cap_hits:sum",
    "kl_k3_sum": "custom/drift/kl_k3:sum",
    "nll_sum": "custom/entropy/sampled_nll:sum",
    **{f"{rule}{sfx}": f"custom/loss/{rule}{sfx}:sum" for rule in RULES for sfx in ("", "_adv_pos", "_adv_neg")},
}
_KL_REF_KEY = "custom/loss/kl_ref:sum"


@dataclass(frozen=True)
class PerDatumLoss:
    """`fn(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs[, ref_logprobs])` and its ranks."""

    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    input_ranks: Mapping[str, int]


def make_per_datum_fn(loss: Any) -> PerDatumLoss:
    """Build the traceable per-datum function of a `PolicyLoss` (aggregation must be "sum").

    Summed over datums it equals the padded batch loss in value and gradient. Its metrics
    are counts / sums (see `finalize_per_datum_metrics`); quantiles and maxima cannot be
    combined by tinker's sum/mean rule and are left to `loss.diagnostics` on the returned
    logprobs, as are the rules the rule table does not count per datum (`RuleSpec.per_datum`).
    The anchor input is always read (`with_per_datum_inputs` fills it with the sampler logprobs
    when there is no recomputed anchor); `ref_logprobs` only with kl_coef > 0.
    """
    if getattr(loss, "aggregation", None) != "sum":
        raise ValueError(
            f"per-datum loss needs aggregation='sum' (tinker sums per-datum losses), "
            f"got aggregation={getattr(loss, 'aggregation', None)!r}; use the two-pass "
            "make_custom_loss_fn path for other aggregations"
        )
    is_cap = float(loss.is_cap)
    kl_coef = float(getattr(loss, "kl_coef", 0.0))

    def metrics_and_loss(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs):
        sel = mask > 0
        token_loss = loss.token_loss(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs)
        value = torch.where(sel, token_loss, torch.zeros_like(token_loss)).sum()

        masks = loss.rules.masks(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs, names=RULES)
        log_ratio = logprobs.detach() - sampler_logprobs
        ratio = torch.exp(log_ratio)
        zeros = torch.zeros_like(ratio)
        nonzero = sel & (advantages != 0)
        pos = sel & (advantages > 0)
        neg = sel & (advantages < 0)
        metrics = {
            _COUNT_KEYS["n_tokens"]: sel.float().sum(),
            _COUNT_KEYS["nonzero_adv"]: nonzero.float().sum(),
            _COUNT_KEYS["pos_adv"]: pos.float().sum(),
            _COUNT_KEYS["neg_adv"]: neg.float().sum(),
            _COUNT_KEYS["dppo_masked_nonzero_adv"]: (nonzero & masks["dppo_masked"]).float().sum(),
            _COUNT_KEYS["ratio_sum"]: torch.where(sel, ratio, zeros).sum(),
            _COUNT_KEYS["cap_hits"]: (sel & (ratio > is_cap)).float().sum(),
            _COUNT_KEYS["kl_k3_sum"]: torch.where(sel, ratio - 1.0 - log_ratio, zeros).sum(),
            _COUNT_KEYS["nll_sum"]: torch.where(sel, -sampler_logprobs, zeros).sum(),
        }
        for rule in RULES:
            hit = masks[rule]
            metrics[_COUNT_KEYS[rule]] = (sel & hit).float().sum()
            metrics[_COUNT_KEYS[f"{rule}_adv_pos"]] = (pos & hit).float().sum()
            metrics[_COUNT_KEYS[f"{rule}_adv_neg"]] = (neg & hit).float().sum()
        return value, metrics

    ranks = dict(PER_DATUM_INPUT_RANKS)
    if kl_coef > 0:

        def per_datum_loss(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs, ref_logprobs):
            value, metrics = metrics_and_loss(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs)
            kl_t = kl_k3(logprobs, ref_logprobs)
            kl = torch.where(mask > 0, kl_t, torch.zeros_like(kl_t)).sum()
            metrics[_KL_REF_KEY] = kl.detach()
            return value + kl_coef * kl, metrics

        ranks[REF_KEY] = 1
    else:

        def per_datum_loss(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs):
            return metrics_and_loss(logprobs, sampler_logprobs, advantages, mask, anchor_logprobs)

    per_datum_loss.__name__ = f"{loss.name}_per_datum"
    return PerDatumLoss(fn=per_datum_loss, input_ranks=ranks)


def make_loss_handle(loss: Any, service_client: Any) -> Any:
    """Register the loss's one-pass per-datum form with `service_client.create_custom_loss`.

    Returns tinker's `LossHandle` for `forward_backward_custom(data, handle)`, or None when
    the client has no `create_custom_loss`. Raises ValueError unless `loss.aggregation == "sum"`
    (tinker sums per-datum losses). The datums passed with the handle must carry the keys
    the per-datum function reads: map them through `with_per_datum_inputs` (adds
    `sampler_logprobs`, and `mask` when absent); its metrics come back as `custom/...:sum`
    counts, which `finalize_per_datum_metrics` turns into the shared keys.
    """
    create = getattr(service_client, "create_custom_loss", None)
    if create is None:
        return None
    per_datum = make_per_datum_fn(loss)
    return create(per_datum.fn, per_datum.input_ranks).result()


def finalize_per_datum_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Turn summed per-datum metrics into the shared diagnostic keys derivable from sums.

    Returns loss/n_tokens, loss/<rule>_frac[_adv_pos|_adv_neg] of the rules counted per datum,
    loss/dppo_masked_frac_nonzero_adv, ratio/mean, ratio/cap_hits, drift/kl_sampler_current,
    entropy/sampled_token_estimate, and loss/kl_ref when the KL term ran.
    """
    missing = [k for k in _COUNT_KEYS.values() if k not in metrics]
    if missing:
        raise ValueError(f"finalize_per_datum_metrics: missing metric keys {missing}")
    get = {name: float(metrics[key]) for name, key in _COUNT_KEYS.items()}
    n = get["n_tokens"]
    if n <= 0:
        raise ValueError("finalize_per_datum_metrics: no loss tokens (custom/loss/n_tokens:sum is 0)")

    def frac(count: float, among: float) -> float:
        return count / among if among else 0.0

    out = {
        "loss/n_tokens": n,
        "loss/dppo_masked_frac_nonzero_adv": frac(get["dppo_masked_nonzero_adv"], get["nonzero_adv"]),
        "ratio/mean": get["ratio_sum"] / n,
        "ratio/cap_hits": get["cap_hits"],
        "drift/kl_sampler_current": get["kl_k3_sum"] / n,
        "entropy/sampled_token_estimate": get["nll_sum"] / n,
    }
    for rule in RULES:
        out[f"loss/{rule}_frac"] = get[rule] / n
        out[f"loss/{rule}_frac_adv_pos"] = frac(get[f"{rule}_adv_pos"], get["pos_adv"])
        out[f"loss/{rule}_frac_adv_neg"] = frac(get[f"{rule}_adv_neg"], get["neg_adv"])
    if _KL_REF_KEY in metrics:
        out["loss/kl_ref"] = float(metrics[_KL_REF_KEY]) / n
    return out


def with_per_datum_inputs(datum: Any) -> Any:
    """Copy of a tinker `Datum` with the keys the per-datum function reads.

    Adds `sampler_logprobs` (= its `logprobs`), `anchor_logprobs` (= its `logprobs`) when it
    carries no recomputed anchor, and, when absent, `mask` by the same rule as
    `make_custom_loss_fn` (advantages != 0 or logprobs != 0).
    """
    from tinker import types

    inputs = dict(datum.loss_fn_inputs)
    for key in (SAMPLER_LOGPROBS_KEY, ADVANTAGES_KEY):
        if key not in inputs:
            raise ValueError(f"with_per_datum_inputs: datum has no loss_fn_inputs[{key!r}]")
    sampler_T = inputs[SAMPLER_LOGPROBS_KEY].to_torch().to(torch.float32)
    inputs[PER_DATUM_SAMPLER_KEY] = types.TensorData.from_torch(sampler_T)
    if ANCHOR_KEY not in inputs:
        inputs[ANCHOR_KEY] = types.TensorData.from_torch(sampler_T)
    if MASK_KEY not in inputs:
        adv_T = inputs[ADVANTAGES_KEY].to_torch().to(torch.float32)
        inputs[MASK_KEY] = types.TensorData.from_torch(default_mask(sampler_T, adv_T))
    return dataclasses.replace(datum, loss_fn_inputs=inputs)
