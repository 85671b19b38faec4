"""Correctness preflight: each loss plugin against the independent reference.

On a fixed seeded fixture (>= 1000 loss tokens, variable lengths, prompt and padding
positions filled with garbage, all-zero-advantage groups, realistic sampler/current
drift, a few r > c spikes) every loss (GRPO, DPPO binary_tv, DPPO binary_kl, each
aggregation; plus clip-higher GRPO, asymmetric-delta DPPO, CPPO, importance sampling, CISPO and GSPO,
the last four at the aggregations they are run with) is compared with
`trainer.losses.reference` three ways:
- float64 tensors through the plugin (value, gradient, diagnostics);
- float32 tinker `Datum`s through `make_custom_loss_fn` (the two-pass forward_backward_custom path);
- the per-datum function traced by tinker's own `trace_loss` and run by `run_loss_handle`
  (the one-pass `create_custom_loss` path; sum aggregation only).
Tolerances (docs/architecture.md): loss atol 1e-5 / rtol 1e-4; gradient atol 1e-5 /
rtol 1e-3 and cosine >= 0.9999. Negative controls (wrong loss mask, trust region off,
delta_low/high swapped, CPPO's prefix budget off) must *differ* from the plugin, showing the
comparison can fail.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.config.enums import AGGREGATIONS
from trainer.losses.adapter import make_custom_loss_fn
from trainer.losses.diagnostics import DIAGNOSTIC_KEYS
from trainer.losses.cispo import CISPOLoss
from trainer.losses.cppo import CPPOLoss
from trainer.losses.dppo import DPPOLoss
from trainer.losses.grpo import GRPOLoss
from trainer.losses.gspo import GSPOLoss
from trainer.losses.importance_sampling import ImportanceSamplingLoss
from trainer.losses.per_datum import finalize_per_datum_metrics, make_per_datum_fn, with_per_datum_inputs
from trainer.losses.reference import RefResult, ref_dppo, ref_grpo, ref_loss
from trainer.preflight.common import Check, GateReport

GATE = "correctness"
LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-4
GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-3
MIN_COSINE = 0.9999
METRIC_RTOL_F64 = 1e-6
METRIC_RTOL_F32 = 1e-4
# the constant H of seq_mean_token_sum_norm on the fixture (its longest response is 64 tokens)
NORM_LENGTH = 64.0


def _agg(agg: str) -> dict[str, Any]:
    """Loss / reference kwargs selecting aggregation `agg` (with H where it needs one)."""
    return {"aggregation": agg, "norm_length": NORM_LENGTH if agg == "seq_mean_token_sum_norm" else None}


# ----------------------------------------------------------------------------- fixture
@dataclass
class Fixture:
    """Padded `[B, T]` float64 tensors; `prompt_len_B` / `resp_len_B` locate the loss tokens."""

    logp_BT: torch.Tensor
    sampler_logp_BT: torch.Tensor
    adv_BT: torch.Tensor
    mask_BT: torch.Tensor
    prompt_len_B: list[int]
    resp_len_B: list[int]
    seed: int

    def rows(self, dtype: torch.dtype = torch.float64) -> tuple[list, list, list, list]:
        """Nested float lists (after rounding through `dtype`) for the reference."""

        def conv(t: torch.Tensor) -> list:
            return t.to(dtype).to(torch.float64).tolist()

        return conv(self.logp_BT), conv(self.sampler_logp_BT), conv(self.adv_BT), self.mask_BT.tolist()

    def stats(self) -> dict[str, Any]:
        m = self.mask_BT > 0
        r = torch.exp(self.logp_BT - self.sampler_logp_BT)[m]
        return {
            "seed": self.seed,
            "n_sequences": int(self.mask_BT.shape[0]),
            "padded_length": int(self.mask_BT.shape[1]),
            "n_loss_tokens": int(m.sum()),
            "n_non_loss_positions": int((~m).sum()),
            "n_zero_adv_loss_tokens": int((self.adv_BT[m] == 0).sum()),
            "n_ratio_above_1e4": int((r > 1e4).sum()),
            "ratio_max": float(r.max()),
        }


def build_fixture(seed: int = 0, n_groups: int = 8, group_size: int = 6) -> Fixture:
    """The fixed correctness fixture (deterministic for a given seed)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=g, dtype=torch.float64)

    B = n_groups * group_size
    resp_len = torch.randint(8, 65, (B,), generator=g).tolist()
    prompt_len = torch.randint(2, 7, (B,), generator=g).tolist()
    T = max(p + r for p, r in zip(prompt_len, resp_len)) + 3  # every row has some padding

    # Sampler probabilities: mostly confident tokens, a band of mid ones, a low-probability tail.
    u = rand(B, T)
    p_s = torch.where(
        u < 0.55,
        1.0 - 0.08 * rand(B, T) ** 2,
        torch.where(u < 0.9, 0.05 + 0.9 * rand(B, T), 10.0 ** (-4.0 + 2.7 * rand(B, T))),
    )
    sampler_logp = torch.log(p_s)
    # Current policy: log-space drift, exactly on-policy for ~10% of tokens.
    noise = 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    noise = torch.where(rand(B, T) < 0.1, torch.zeros_like(noise), noise)
    logp = torch.clamp(sampler_logp + noise, max=-1e-6)
    # Rare spikes: a token the sampler almost never picks that the current policy likes (r >> c).
    spike = rand(B, T) < 0.015
    sampler_logp = torch.where(spike, torch.log(10.0 ** (-7.0 + 1.5 * rand(B, T))), sampler_logp)
    logp = torch.where(spike, torch.log(0.02 + 0.28 * rand(B, T)), logp)

    # Group-centred advantages of rewards in {0, 0.5, 1}; two groups are all-equal (A = 0).
    rewards = torch.randint(0, 3, (n_groups, group_size), generator=g).double() / 2.0
    rewards[1] = 1.0
    rewards[5] = 0.0
    adv_seq = (rewards - rewards.mean(dim=1, keepdim=True)).reshape(B)

    mask = torch.zeros(B, T, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)  # garbage outside the loss tokens
    for i, (p, r) in enumerate(zip(prompt_len, resp_len)):
        mask[i, p : p + r] = 1.0
        adv[i, p : p + r] = adv_seq[i]
    return Fixture(logp, sampler_logp, adv, mask, prompt_len, resp_len, seed)


# ----------------------------------------------------------------------------- comparisons
@dataclass
class Case:
    name: str
    make_loss: Callable[[str], Any]
    reference: Callable[..., RefResult]  # (logp, slp, adv, mask, aggregation) -> RefResult
    aggregations: tuple[str, ...]


def default_cases() -> list[Case]:
    def case(name: str, make: Callable[..., Any], ref_name: str, aggs: tuple[str, ...] = AGGREGATIONS,
             **params: Any) -> Case:
        return Case(name, lambda agg: make(**_agg(agg)),
                    lambda *rows, aggregation: ref_loss(ref_name, *rows, **_agg(aggregation), **params), aggs)

    return [
        case("grpo", GRPOLoss, "grpo"),
        case("dppo_binary_tv", lambda **kw: DPPOLoss(mode="binary_tv", **kw), "dppo", mode="binary_tv",
             delta_low=0.15, delta_high=0.15),
        case("dppo_binary_kl", lambda **kw: DPPOLoss(mode="binary_kl", **kw), "dppo", mode="binary_kl",
             delta_low=0.05, delta_high=0.05),
        case("grpo_clip_higher", lambda **kw: GRPOLoss(clip_eps_low=0.2, clip_eps_high=0.28, **kw), "grpo",
             ("sum",), eps_low=0.2, eps_high=0.28),
        case("dppo_tv_asym_c3", lambda **kw: DPPOLoss(mode="binary_tv", delta_low=0.1, delta_high=0.2, is_cap=3.0, **kw),
             "dppo", ("sum",), mode="binary_tv", delta_low=0.1, delta_high=0.2, cap=3.0),
        case("cppo", CPPOLoss, "cppo", ("sum", "seq_mean_token_sum_norm")),
        case("importance_sampling", ImportanceSamplingLoss, "importance_sampling", ("sum", "token_mean")),
        case("cispo", CISPOLoss, "cispo", ("sum", "seq_mean_token_sum_norm")),
        case("gspo", GSPOLoss, "gspo", ("sum", "seq_mean_token_mean")),
    ]


def _loss_check(name: str, value: float, ref: float) -> Check:
    err = abs(value - ref)
    tol = LOSS_ATOL + LOSS_RTOL * abs(ref)
    return Check(
        f"{name}/loss",
        err,
        f"<= {tol:.3g}",
        "pass" if err <= tol else "fail",
        f"plugin {value:.10g} ref {ref:.10g}",
    )


def _grad_stats(grad: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(max |g - g_ref| / (atol + rtol |g_ref|), max abs error, cosine)."""
    err = (grad - ref).abs()
    ratio = float((err / (GRAD_ATOL + GRAD_RTOL * ref.abs())).max())
    denom = float(grad.norm() * ref.norm())
    cosine = float((grad * ref).sum()) / denom if denom > 0 else (1.0 if float(err.max()) == 0 else 0.0)
    return ratio, float(err.max()), cosine


def _grad_checks(name: str, grad: torch.Tensor, ref: torch.Tensor) -> list[Check]:
    ratio, max_err, cosine = _grad_stats(grad, ref)
    return [
        Check(
            f"{name}/grad",
            ratio,
            "<= 1 (err / (atol + rtol*|ref|))",
            "pass" if ratio <= 1.0 else "fail",
            f"max abs err {max_err:.3g}",
        ),
        Check(f"{name}/grad_cosine", cosine, f">= {MIN_COSINE}", "pass" if cosine >= MIN_COSINE else "fail"),
    ]


def _metric_check(name: str, metrics: dict[str, float], ref: dict[str, float], rtol: float) -> Check:
    keys = sorted(ref)
    if set(metrics) < set(keys):
        missing = sorted(set(keys) - set(metrics))
        return Check(f"{name}/metrics", len(missing), "0 missing keys", "fail", f"missing {missing}")
    worst_key, worst = "", 0.0
    for k in keys:
        rel = abs(metrics[k] - ref[k]) / max(abs(ref[k]), 1e-12) if metrics[k] != ref[k] else 0.0
        if rel > worst:
            worst_key, worst = k, rel
    return Check(
        f"{name}/metrics",
        worst,
        f"<= {rtol:g} rel",
        "pass" if worst <= rtol else "fail",
        f"worst {worst_key}" if worst_key else "all equal",
    )


def _plugin_f64(loss: Any, fx: Fixture) -> tuple[float, torch.Tensor, dict[str, float]]:
    logp = fx.logp_BT.clone().requires_grad_(True)
    value, metrics = loss(logp, fx.sampler_logp_BT, fx.adv_BT, fx.mask_BT)
    value.backward()
    return float(value.detach()), logp.grad.detach(), metrics


def _spike_free_loss_check(name: str, case: Case, loss: Any, agg: str, fx: Fixture) -> Check:
    """Loss value with the r > 100 tokens taken out of the mask.

    The spikes' -r*A terms dominate the full GRPO sum, so its relative tolerance would hide
    value-only errors on ordinary tokens (e.g. a wrong clipped constant, whose gradient is 0).
    """
    ratio = torch.exp(fx.logp_BT - fx.sampler_logp_BT)
    mask = torch.where(ratio > 100.0, torch.zeros_like(fx.mask_BT), fx.mask_BT)
    logp, slp, adv, _ = fx.rows()
    ref = case.reference(logp, slp, adv, mask.tolist(), aggregation=agg)
    value, _ = loss(fx.logp_BT, fx.sampler_logp_BT, fx.adv_BT, mask)
    return _loss_check(f"{name}/no_spikes", float(value.detach()), ref.value)


def _datums(fx: Fixture, with_mask: bool = True) -> tuple[list, list[torch.Tensor]]:
    """Cookbook-style float32 Datums (prompt positions: A = 0, logprobs = 0) + current logprobs."""
    from tinker import types

    data, logprobs = [], []
    for i, (p, r) in enumerate(zip(fx.prompt_len_B, fx.resp_len_B)):
        n = p + r
        sel = slice(0, n)
        m = fx.mask_BT[i, sel].float()
        inputs = {
            "target_tokens": types.TensorData.from_torch(torch.arange(n, dtype=torch.int64)),
            "logprobs": types.TensorData.from_torch(fx.sampler_logp_BT[i, sel].float() * m),
            "advantages": types.TensorData.from_torch(fx.adv_BT[i, sel].float() * m),
        }
        if with_mask:
            inputs["mask"] = types.TensorData.from_torch(m)
        data.append(
            types.Datum(model_input=types.ModelInput.from_ints(list(range(n))), loss_fn_inputs=inputs)
        )
        logprobs.append(fx.logp_BT[i, sel].float())
    return data, logprobs


def _ref_rows_f32(fx: Fixture) -> tuple[list, list, list, list]:
    """Reference inputs as the float32 datums carry them (non-loss positions zeroed)."""
    m = fx.mask_BT
    rows = []
    for t, zero_outside in ((fx.logp_BT, False), (fx.sampler_logp_BT, True), (fx.adv_BT, True)):
        t32 = t.float().double()
        rows.append((t32 * m if zero_outside else t32).tolist())
    rows.append(m.tolist())
    return tuple(rows)


def _unpad(fx: Fixture, grad_rows: list[list[float]]) -> torch.Tensor:
    return torch.cat(
        [
            torch.tensor(grad_rows[i][: p + r], dtype=torch.float64)
            for i, (p, r) in enumerate(zip(fx.prompt_len_B, fx.resp_len_B))
        ]
    )


def _run_custom(fn: Callable, data: list, logprobs: list[torch.Tensor]) -> tuple[float, torch.Tensor, dict]:
    leaves = [lp.clone().requires_grad_(True) for lp in logprobs]
    value, metrics = fn(data, leaves)
    value.backward()
    return float(value.detach()), torch.cat([lp.grad.double() for lp in leaves]), metrics


def _tinker_tracer() -> tuple[Callable, Callable] | None:
    try:
        from tinker.lib.public_interfaces.custom_loss import run_loss_handle, trace_loss
    except ImportError:
        return None
    return trace_loss, run_loss_handle


def _fixture_checks(fx: Fixture) -> list[Check]:
    s = fx.stats()
    tv = DPPOLoss(mode="binary_tv").diagnostics(fx.logp_BT, fx.sampler_logp_BT, fx.adv_BT, fx.mask_BT)
    kl = DPPOLoss(mode="binary_kl").diagnostics(fx.logp_BT, fx.sampler_logp_BT, fx.adv_BT, fx.mask_BT)

    def at_least(name: str, value: float, bound: float) -> Check:
        return Check(f"fixture/{name}", value, f">= {bound:g}", "pass" if value >= bound else "fail")

    return [
        at_least("n_loss_tokens", s["n_loss_tokens"], 1000),
        at_least("n_non_loss_positions", s["n_non_loss_positions"], 1),
        at_least("n_zero_adv_loss_tokens", s["n_zero_adv_loss_tokens"], 1),
        at_least("n_ratio_above_1e4", s["n_ratio_above_1e4"], 3),
        at_least("dppo_tv_masked_frac", tv["loss/dppo_masked_frac"], 0.01),
        at_least("dppo_kl_masked_frac", kl["loss/dppo_masked_frac"], 0.01),
        at_least("grpo_clip_frac", tv["loss/grpo_clip_frac"], 0.01),
        at_least("cispo_clip_frac", tv["loss/cispo_clip_frac"], 0.005),
        at_least("gspo_clip_frac", tv["loss/gspo_clip_frac"], 0.01),
        at_least("cppo_token_masked_frac", tv["loss/cppo_token_masked_frac"], 0.01),
        at_least("cppo_budget_masked_frac", tv["loss/cppo_budget_masked_frac"], 0.01),
    ]


def _negative_control(name: str, grad: torch.Tensor, wrong_ref: RefResult, detail: str) -> Check:
    ratio, max_err, _ = _grad_stats(grad, torch.tensor(wrong_ref.grad, dtype=torch.float64))
    return Check(
        f"negative/{name}",
        ratio,
        "> 1 (must differ)",
        "pass" if ratio > 1.0 else "fail",
        f"{detail}; max abs grad diff {max_err:.3g}",
    )


def collect_checks(fx: Fixture, cases: list[Case] | None = None, *, controls: bool = True) -> list[Check]:
    """All checks of the gate on fixture `fx` (`cases` defaults to the built-in losses)."""
    checks = _fixture_checks(fx)
    rows64 = fx.rows()
    rows32 = _ref_rows_f32(fx)
    data, logprobs32 = _datums(fx)
    tracer = _tinker_tracer()

    for case in default_cases() if cases is None else cases:
        for agg in case.aggregations:
            name = f"{case.name}/{agg}"
            loss = case.make_loss(agg)
            # float64 tensors straight into the plugin
            ref = case.reference(*rows64, aggregation=agg)
            value, grad, metrics = _plugin_f64(loss, fx)
            checks.append(_loss_check(f"f64/{name}", value, ref.value))
            checks += _grad_checks(f"f64/{name}", grad, torch.tensor(ref.grad, dtype=torch.float64))
            checks.append(_spike_free_loss_check(f"f64/{name}", case, loss, agg, fx))
            if agg == "sum":
                checks.append(_metric_check(f"f64/{name}", metrics, ref.metrics, METRIC_RTOL_F64))
                if set(metrics) != set(DIAGNOSTIC_KEYS):
                    checks.append(
                        Check(f"f64/{name}/metric_keys", sorted(metrics), "DIAGNOSTIC_KEYS", "fail")
                    )
            # float32 datums through the forward_backward_custom adapter
            ref32 = case.reference(*rows32, aggregation=agg)
            v32, g32, _ = _run_custom(make_custom_loss_fn(loss), data, logprobs32)
            checks.append(_loss_check(f"custom_fn/{name}", v32, ref32.value))
            checks += _grad_checks(f"custom_fn/{name}", g32, _unpad(fx, ref32.grad))
            # one-pass per-datum function, traced and run by tinker itself
            if agg == "sum":
                checks += _per_datum_checks(f"per_datum/{name}", loss, data, logprobs32, ref32, fx, tracer)
    if controls:
        checks += _negative_controls(fx, rows64)
    return checks


def _per_datum_checks(
    name: str,
    loss: Any,
    data: list,
    logprobs: list,
    ref: RefResult,
    fx: Fixture,
    tracer: tuple[Callable, Callable] | None,
) -> list[Check]:
    if tracer is None:
        return [Check(f"{name}/trace", "tinker custom_loss not importable", "traces", "unverified")]
    trace_loss, run_loss_handle = tracer
    pd = make_per_datum_fn(loss)
    try:
        handle = trace_loss(pd.fn, pd.input_ranks, "preflight")
    except ValueError as e:
        return [Check(f"{name}/trace", str(e), "traces", "fail")]
    pd_data = [with_per_datum_inputs(d) for d in data]
    value, grad, metrics = _run_custom(lambda d, lp: run_loss_handle(handle, d, lp), pd_data, logprobs)
    ref_subset = {k: ref.metrics[k] for k in finalize_per_datum_metrics(metrics)}
    return [
        Check(f"{name}/trace", "ok", "traces", "pass", f"{len(handle.graph.graph.nodes)} fx nodes"),
        _loss_check(name, value, ref.value),
        *_grad_checks(name, grad, _unpad(fx, ref.grad)),
        _metric_check(name, finalize_per_datum_metrics(metrics), ref_subset, METRIC_RTOL_F32),
    ]


def _negative_controls(fx: Fixture, rows64: tuple) -> list[Check]:
    logp, slp, adv, mask = rows64
    _, grad_grpo, _ = _plugin_f64(GRPOLoss(), fx)
    _, grad_tv, _ = _plugin_f64(DPPOLoss(mode="binary_tv"), fx)
    _, grad_asym, _ = _plugin_f64(DPPOLoss(mode="binary_tv", delta_low=0.1, delta_high=0.2), fx)
    _, grad_cppo, _ = _plugin_f64(CPPOLoss(), fx)
    all_ones = [[1.0] * len(row) for row in mask]
    return [
        _negative_control(
            "grpo_mask_includes_padding",
            grad_grpo,
            ref_grpo(logp, slp, adv, all_ones),
            "reference fed an all-ones loss mask",
        ),
        _negative_control(
            "dppo_trust_region_off",
            grad_tv,
            ref_dppo(logp, slp, adv, mask, delta_low=math.inf, delta_high=math.inf),
            "reference DPPO with delta = inf (no tokens dropped)",
        ),
        _negative_control(
            "dppo_delta_low_high_swapped",
            grad_asym,
            ref_dppo(logp, slp, adv, mask, delta_low=0.2, delta_high=0.1),
            "reference with delta_low/delta_high swapped",
        ),
        _negative_control(
            "cppo_prefix_budget_off",
            grad_cppo,
            ref_loss("cppo", logp, slp, adv, mask, delta_b=1.0),
            "reference CPPO with delta_b = 1 (the prefix budget never binds)",
        ),
    ]


def run(out_dir: Path | None = None, *, seed: int = 0, quiet: bool = False) -> GateReport:
    """Run the gate; print the table (unless quiet) and write `<out_dir>/preflight/correctness.json`."""
    import tinker

    from trainer.run_info import git_revision

    fx = build_fixture(seed)
    report = GateReport(
        gate=GATE,
        checks=collect_checks(fx),
        meta={
            "fixture": fx.stats(),
            "tolerances": {
                "loss_atol": LOSS_ATOL,
                "loss_rtol": LOSS_RTOL,
                "grad_atol": GRAD_ATOL,
                "grad_rtol": GRAD_RTOL,
                "min_cosine": MIN_COSINE,
            },
            "torch": torch.__version__,
            "tinker": getattr(tinker, "__version__", "unknown"),
            # the code the losses were checked at (require_passed compares it with the sweep's)
            "git": git_revision(),
        },
    )
    if not quiet:
        report.print_table()
    if out_dir is not None:
        path = report.write(out_dir)
        if not quiet:
            print(f"wrote {path}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="directory; writes <out>/preflight/correctness.json"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return 0 if run(args.out, seed=args.seed).passed else 1


if __name__ == "__main__":
    sys.exit(main())
