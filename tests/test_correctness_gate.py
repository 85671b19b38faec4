"""The correctness preflight gate and the shared GateReport / Check types."""

from __future__ import annotations

import io
import json
import math

import pytest

from trainer.losses import DPPOLoss, GRPOLoss
from trainer.losses.reference import ref_dppo, ref_grpo
from trainer.preflight.common import Check, GateReport
from trainer.preflight.correctness import Case, build_fixture, collect_checks, run


@pytest.fixture(scope="module")
def fixture():
    return build_fixture(seed=0)


def test_gate_passes_and_writes_json(tmp_path, capsys):
    report = run(tmp_path)
    assert report.passed, [c for c in report.checks if c.status != "pass"]
    names = {c.name for c in report.checks}
    for loss in ("grpo", "dppo_binary_tv", "dppo_binary_kl"):
        for agg in ("sum", "token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
            assert {
                f"f64/{loss}/{agg}/loss",
                f"f64/{loss}/{agg}/grad",
                f"custom_fn/{loss}/{agg}/grad_cosine",
            } <= names
        assert f"per_datum/{loss}/sum/trace" in names
    assert {"f64/cppo/sum/grad", "per_datum/cppo/sum/metrics", "fixture/cppo_budget_masked_frac"} <= names
    assert sum(n.startswith("negative/") for n in names) == 4
    on_disk = json.loads((tmp_path / "preflight" / "correctness.json").read_text())
    assert on_disk["gate"] == "correctness" and on_disk["passed"] is True
    assert on_disk["counts"]["fail"] == 0 and len(on_disk["checks"]) == len(report.checks)
    assert on_disk["meta"]["fixture"]["n_loss_tokens"] >= 1000
    out = capsys.readouterr().out
    assert "f64/dppo_binary_kl/sum/grad" in out and "PASSED" in out


def test_fixture_is_realistic_and_deterministic(fixture):
    s = fixture.stats()
    assert s["n_loss_tokens"] >= 1000 and s["n_non_loss_positions"] > 0
    assert s["n_zero_adv_loss_tokens"] > 0 and s["n_ratio_above_1e4"] >= 3
    assert build_fixture(seed=0).stats() == s
    assert build_fixture(seed=1).stats() != s


def _failures(checks):
    return [c.name for c in checks if c.status == "fail"]


def test_gate_catches_a_plugin_that_ignores_the_loss_mask(fixture):
    class MaskIgnoringGRPO(GRPOLoss):
        def __call__(self, logp, sampler_logp, advantages, mask):
            return super().__call__(logp, sampler_logp, advantages, mask.new_ones(mask.shape))

    case = Case(
        "grpo_wrong_mask",
        lambda agg: MaskIgnoringGRPO(aggregation=agg),
        lambda *rows, aggregation: ref_grpo(*rows, aggregation=aggregation),
        ("sum",),
    )
    failed = _failures(collect_checks(fixture, [case], controls=False))
    assert "f64/grpo_wrong_mask/sum/grad" in failed and "f64/grpo_wrong_mask/sum/loss" in failed


@pytest.mark.parametrize(
    "plugin, reference",
    [
        (
            lambda agg: GRPOLoss(clip_eps=0.25, aggregation=agg),
            lambda *rows, aggregation: ref_grpo(*rows, aggregation=aggregation),
        ),
        (
            lambda agg: DPPOLoss(mode="binary_tv", delta=0.2, aggregation=agg),
            lambda *rows, aggregation: ref_dppo(*rows, mode="binary_tv", aggregation=aggregation),
        ),
        (
            lambda agg: DPPOLoss(mode="binary_kl", is_cap=100.0, aggregation=agg),
            lambda *rows, aggregation: ref_dppo(
                *rows, mode="binary_kl", delta_low=0.05, delta_high=0.05, aggregation=aggregation
            ),
        ),
    ],
)
def test_gate_catches_a_wrong_parameter(fixture, plugin, reference):
    failed = _failures(
        collect_checks(fixture, [Case("wrong", plugin, reference, ("token_mean",))], controls=False)
    )
    assert "f64/wrong/token_mean/grad" in failed and "custom_fn/wrong/token_mean/grad" in failed


def test_gate_report_passed_logic_and_check_validation():
    ok = Check("a", 1.0, "<= 2", "pass")
    assert GateReport("g", [ok]).passed
    assert not GateReport("g", []).passed
    assert not GateReport("g", [ok, Check("b", 3.0, "<= 2", "fail")]).passed
    unverified = Check("c", None, "needs service", "unverified")
    assert GateReport("g", [ok, unverified]).passed
    assert not GateReport("g", [ok, unverified], require_verified=True).passed
    with pytest.raises(ValueError, match="status must be one of"):
        Check("d", 0, 0, "ok")


def test_gate_report_write_is_atomic_and_json_safe(tmp_path):
    report = GateReport("demo", [Check("x", math.inf, "finite", "fail", "overflow")], meta={"nan": math.nan})
    path = report.write(tmp_path)
    assert path == tmp_path / "preflight" / "demo.json"
    assert path.stat().st_mode & 0o777 == 0o644
    data = json.loads(path.read_text())  # strict JSON: inf/nan became strings
    assert data["checks"][0]["value"] == "inf" and data["meta"]["nan"] == "nan" and data["passed"] is False
    report.checks[0] = Check("x", 1.0, "finite", "pass")
    report.write(tmp_path)  # overwrite in place
    assert json.loads(path.read_text())["passed"] is True
    assert sorted(p.name for p in (tmp_path / "preflight").iterdir()) == ["demo.json"]  # no temp files left
    buf = io.StringIO()
    report.print_table(file=buf)
    assert "x" in buf.getvalue() and "PASSED: 1 pass, 0 fail, 0 unverified" in buf.getvalue()
