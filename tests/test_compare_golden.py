"""compare.json and compare.md of six representative comparisons, byte for byte against files in
tests/golden/: a seed-level rule, an item-level rule the bootstrap decides, a planned look, an A/B sweep
calibrated by an A/A sweep (`--aa`), lm-eval per-item files (`--items`) and three arms under Holm. The
sweeps are built by the fixtures of tests/test_compare.py / tests/test_verdict.py, so their numbers are
fixed; what varies is where they live (replaced by `<TMP>` / `<CWD>` / `<ROOT>` before comparing) and the
checkout's git state each run records (pinned to one clean revision here, so an uncommitted edit does not
add a note). A refactor of eval.compare must leave these files as they are; a change in what compare writes
regenerates them (`PAIREDRL_REGEN_GOLDEN=1 python -m pytest tests/test_compare_golden.py`) in a commit that
says why."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from test_verdict import _sweep, _with_gap

from eval.compare import compare, main

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
LM = ROOT / "tests" / "data" / "items" / "lm_eval"
N_ITEMS = 200


def _gap_sweep(root: Path, gaps_items: list[int], overrides=(), name="sweep") -> Path:
    """One seed pair per entry: the treatment right on gaps_items[s] more items than the baseline."""
    rng = np.random.default_rng(42)
    arms = {}
    for s, g in enumerate(gaps_items):
        arms["dppo", s], arms["grpo", s] = _with_gap(N_ITEMS, 80, g, rng)
    return _sweep(root, arms, overrides=overrides, name=name)


def _seed_level(tmp: Path) -> list[Path]:
    """decision.method auto at 4 seeds (seed t), the default bootstrap settings."""
    sweep = _gap_sweep(tmp, [10, 14, 6, 12])
    compare([sweep], make_plots=False)
    return [sweep]


def _item_level(tmp: Path) -> list[Path]:
    """One seed per arm, the paired bootstrap decides (its default resamples and seed are the rule's)."""
    sweep = _gap_sweep(tmp, [16], overrides=("decision.method=paired_bootstrap",))
    compare([sweep], make_plots=False)
    return [sweep]


def _looks(tmp: Path) -> list[Path]:
    """The first of the looks [3, 6]: decided at its share of alpha, the next look named."""
    sweep = _gap_sweep(tmp, [8, 12, 4], overrides=("decision.looks=[3,6]",))
    compare([sweep], n_bootstrap=0, make_plots=False)
    return [sweep]


def _aa(tmp: Path) -> list[Path]:
    """An A/A sweep of grpo at 3 seeds, then an A/B sweep of the same experiment calibrated by it."""
    rng = np.random.default_rng(2)
    n = 400
    aa_runs = {}
    for s, a in {0: 0.30, 1: 0.42, 2: 0.36}.items():
        c = np.zeros(n, bool)
        c[rng.choice(n, int(a * n), replace=False)] = True
        aa_runs["grpo", s] = c
    aa = _sweep(tmp, aa_runs, name="aa")
    compare([aa], n_bootstrap=0, make_plots=False)
    ab_runs = {}
    for s, g in {0: 20, 1: 32, 2: 8}.items():
        ab_runs["dppo", s], ab_runs["grpo", s] = _with_gap(n, 140, g, rng)
    ab = _sweep(tmp, ab_runs, name="ab")
    compare([ab], aa=aa, make_plots=False)
    return [aa, ab]


def _items_lm_eval(tmp: Path) -> list[Path]:
    """lm-evaluation-harness 0.4.13 `--log_samples` folders, two arms at two seeds, two tasks."""
    arm = {a: ",".join(str(LM / f"{a}_seed{s}") for s in (0, 1)) for a in ("a", "b")}
    out = tmp / "items"
    assert main(["--items", f"a={arm['a']}", f"b={arm['b']}", "--out", str(out)]) == 0
    return [out]


def _holm(tmp: Path) -> list[Path]:
    """Three arms on one seed under paired Hoeffding: Holm decides the better treatment at alpha / 2."""
    rng = np.random.default_rng(3)
    n = 1000
    t1, b = _with_gap(n, 300, 92, rng)
    t2 = b.copy()
    t2[np.flatnonzero(~b)[:89]] = True
    sweep = _sweep(tmp, {("grpo", 0): b, ("dppo", 0): t1, ("cispo", 0): t2},
                   overrides=("decision.method=paired_hoeffding",))
    compare([sweep], n_bootstrap=0, make_plots=False)
    return [sweep]


CASES = {"seed_level": _seed_level, "item_level": _item_level, "looks": _looks, "aa": _aa,
         "items_lm_eval": _items_lm_eval, "holm": _holm}


def _normalized(text: str, tmp: Path) -> str:
    """The report with the folders that differ from one run of the test to the next named by placeholder
    (longest first: the temporary folder may lie under the working directory or the checkout)."""
    for path, name in sorted(((str(tmp), "<TMP>"), (str(ROOT), "<ROOT>"), (os.getcwd(), "<CWD>")),
                             key=lambda x: -len(x[0])):
        text = text.replace(path, name)
    return text


@pytest.mark.parametrize("case", sorted(CASES))
def test_compare_writes_the_golden_report(tmp_path, monkeypatch, case):
    import trainer.run_info

    monkeypatch.setattr(trainer.run_info, "git_revision", lambda repo=None: {"rev": "0" * 40, "dirty": False})
    tmp = tmp_path.resolve()
    folders = CASES[case](tmp)
    regen = os.environ.get("PAIREDRL_REGEN_GOLDEN") == "1"
    for folder in folders:
        for name in ("compare.json", "compare.md"):
            got = _normalized((folder / name).read_text(), tmp)
            golden = GOLDEN / case / f"{folder.name}.{name}"
            if regen:
                golden.parent.mkdir(parents=True, exist_ok=True)
                golden.write_text(got)
            assert golden.is_file(), f"{golden} missing: PAIREDRL_REGEN_GOLDEN=1 writes it"
            assert got == golden.read_text(), f"{case}: {folder.name}/{name} differs from {golden}"


def test_descriptive_bootstraps_run_only_where_they_decide_or_are_asked_for(tmp_path):
    """Issue #51: 98% of a 10-arm `--items` comparison's CPU went to bootstraps whose result decides nothing.
    Under seed t the item and two-level bootstraps are skipped by default (and compare.md says so); asked
    for (--bootstrap N) they run at N resamples; as the rule the item bootstrap runs at its pre-registered
    resamples whatever the default."""
    from eval.compare import CompareRequest, compare_paths

    sweep = _gap_sweep(tmp_path, [10, 14, 6, 12])
    c = compare_paths([sweep], CompareRequest(make_plots=False))
    (row,) = c.rows
    assert row.bootstrap_skipped == ["paired_bootstrap", "two_level_bootstrap"]
    assert "paired_bootstrap" not in row.methods and "two_level_bootstrap" not in row.methods
    assert all(s.get("bootstrap_low") is None for s in row.per_seed)
    md = (sweep / "compare.md").read_text()
    assert "Bootstrap: skipped (paired bootstrap (items), two-level bootstrap (seeds, then items))" in md
    asked = compare_paths([sweep], CompareRequest(make_plots=False, n_bootstrap=200, out=tmp_path / "asked"))
    (row,) = asked.rows
    assert row.bootstrap_skipped == [] and row.methods["two_level_bootstrap"]["ci_low"] is not None
    assert row.methods["paired_bootstrap"]["ci_low"] is not None and row.bootstrap_resamples == 200
    assert all(s["bootstrap_low"] is not None for s in row.per_seed)
    assert "Bootstrap: 200 percentile resamples" in (tmp_path / "asked" / "compare.md").read_text()
    rule = _gap_sweep(tmp_path, [16], overrides=("decision.method=paired_bootstrap",), name="rule")
    (row,) = compare_paths([rule], CompareRequest(make_plots=False)).rows
    assert row.bootstrap_skipped == [] and row.decision.method == "paired_bootstrap"
    assert row.methods["paired_bootstrap"]["p_resolution"] == 1 / 10000 and row.decision.rule_ci is not None
