"""`python -m eval.ladder`: the gap of each treatment at each level of a knob, beside the mismatch the runs
measured there, read from the levels' own compare.json and run folders."""

from __future__ import annotations

import json

import pytest
from test_compare import PNG_MAGIC, make_sweep

from eval.compare import compare
from eval.ladder import main

KNOB = "backend.sampler_logit_noise"


def _level(root, sigma: float, q90_by_step: list[float], p_t: float):
    """A compared sweep at one knob level whose runs logged `q90_by_step[step]` at each batch's first update
    (and something else at the second, which the ladder must not read)."""
    root.mkdir()
    sweep, _ = make_sweep(root, seeds=(0, 1, 2), p_t=p_t, overrides=(f"{KNOB}={sigma}",))
    for run in (p for p in sweep.iterdir() if p.is_dir()):
        with (run / "metrics.jsonl").open("w") as f:
            for step, q in enumerate(q90_by_step):
                for u in range(2):
                    f.write(json.dumps({"step": step, "update": u, "mismatch/abs_p_q90": q if u == 0 else 9.0,
                                        "loss/grpo_clip_frac": 0.1 * u, "loss/dppo_masked_frac": 0.0,
                                        "ratio/max": 1.5}) + "\n")
    compare([sweep], n_bootstrap=0, make_plots=False)
    return sweep


def test_the_ladder_reads_each_level_s_gap_and_measured_mismatch(tmp_path, capsys):
    high = _level(tmp_path / "high", 0.5, [0.12, 0.2, 0.1], p_t=0.6)
    low = _level(tmp_path / "low", 0.1, [0.02, 0.04, 0.03], p_t=0.8)
    out = tmp_path / "ladder"
    assert main([str(high), str(low / "compare.json"), "--out", str(out)]) == 0
    res = json.loads((out / "ladder.json").read_text())
    assert res["knob"] == KNOB
    levels = res["levels"]
    assert [lv["knob_value"] for lv in levels] == [0.1, 0.5]  # ordered by measured mismatch
    assert levels[0]["mismatch_q90"] == pytest.approx(0.03) and levels[0]["mismatch_q90_step0"] == 0.02
    assert levels[1]["mismatch_q90"] == pytest.approx(0.14) and levels[1]["mismatch_q90_step0"] == 0.12
    assert levels[0]["rules"]["grpo_clip_frac"] == 0.0  # first updates only
    for lv, sweep in zip(levels, (low, high)):
        verdicts = json.loads((sweep / "compare.json").read_text())["verdicts"]
        assert [(g["treatment"], g["estimate"], g["verdict"]) for g in lv["gaps"]] == [
            (v["treatment"], v["estimate"], v["verdict"]) for v in verdicts]
        assert lv["n_runs"] == 6 and lv["n_seeds"] == 3
    assert (out / "ladder.png").read_bytes()[:8] == PNG_MAGIC
    assert "| 0.1 | 0.0300 (0.0200)" in (out / "ladder.md").read_text()


def test_bad_ladders_are_refused_in_one_line(tmp_path, capsys):
    a = _level(tmp_path / "a", 0.1, [0.02], p_t=0.8)
    b = _level(tmp_path / "b", 0.1, [0.03], p_t=0.7)
    for args, what in (([str(a)], "at least two"),
                       ([str(a), str(b)], "exactly one config key"),
                       ([str(a), str(b), "--knob", KNOB], "same level"),
                       ([str(a), str(tmp_path / "nowhere")], "no compare.json")):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert what in err and err.count("\n") == 1, err


def test_a_level_whose_runs_are_gone_is_named(tmp_path, capsys):
    a = _level(tmp_path / "a", 0.1, [0.02], p_t=0.8)
    b = _level(tmp_path / "b", 0.5, [0.1], p_t=0.7)
    (next(p for p in b.iterdir() if p.is_dir()) / "metrics.jsonl").unlink()
    assert main([str(a), str(b)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    assert (a / "compare.json").is_file() and not (a.parent / "ladder").exists()  # nothing written
