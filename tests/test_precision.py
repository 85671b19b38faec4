"""The engine's `auto` precision and training packing: timed once per machine and cached (`precision.py`),
decided by the engine plan (`plan.py`), overridable."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.backends.local import plan, precision
from trainer.backends.local.model import ONEDNN_PACKING


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(precision.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(plan.AUTO_PRECISION_ENV, raising=False)
    monkeypatch.delenv(plan.TRAIN_PACKING_ENV, raising=False)
    return tmp_path


@pytest.mark.parametrize(("bf16", "speedup", "choice"), [
    ({"decode": 0.5, "train": 2.0}, 2.0, "bfloat16"),
    # at the threshold, and each precision's faster training product (packed for fp32, plain here)
    ({"decode": 1.0, "train": 3.0, "train_packed": 3.5}, 1.25, "bfloat16"),
    # faster, but not by MIN_SPEEDUP (with fp32's slower plain product it would have been 7 / 4.25 = 1.65)
    ({"decode": 1.0, "train": 3.25}, 5.0 / 4.25, "float32"),
    ({"decode": 2.0, "train": 8.0}, 0.5, "float32"),
])
def test_choice_picks_bf16_only_where_it_is_clearly_faster(bf16, speedup, choice):
    """`plan.choose_dtype` on hand-made timings (seconds per sample, lower is faster): the decode product plus
    the faster training product of each precision, bf16 where fp32 takes MIN_SPEEDUP times as long or more.
    Checked here and not on a measurement, whose outcome is fixed by the CPU the suite runs on."""
    fp32 = {"decode": 1.0, "train": 6.0, "train_packed": 4.0}  # 1 + 4 = 5
    assert plan.MIN_SPEEDUP == 1.25
    got_choice, got_speedup = plan.choose_dtype({"float32": fp32, "bfloat16": bf16})
    assert got_choice == choice and got_speedup == pytest.approx(speedup, rel=1e-12)


def test_measured_choice_follows_the_cpus_bf16_instructions(cache_dir):
    """A real measurement: where the CPU has AMX, bf16 GEMMs are several times faster and `auto` must pick
    them; with AVX512_BF16 (its bf16 dot products do twice fp32's multiply-adds per instruction) bf16 is
    faster than fp32; with neither, torch's bf16 fallback is slower than fp32 and `auto` must not pick it."""
    seconds = precision.measure()
    choice, speedup = plan.choose_dtype(seconds)
    assert all(t > 0 for kinds in seconds.values() for t in kinds.values())
    flags = precision.cpu_flags()
    if "amx_bf16" in flags:
        assert (choice, speedup > 2) == ("bfloat16", True), seconds  # ~4.5-5x measured
    elif "avx512_bf16" in flags:
        assert speedup > 1, seconds  # ~1.9-2x measured (AMD Zen 4)
    else:
        assert (choice, speedup < 1) == ("float32", True), seconds


def _slower(entry: dict, name: str, factor: float) -> dict:
    """`entry` with every timing of precision `name` multiplied by `factor`."""
    seconds = {**entry["seconds"], name: {k: v * factor for k, v in entry["seconds"][name].items()}}
    return {**entry, "seconds": seconds}


def test_timing_is_cached_per_machine_and_a_bad_cache_is_remeasured(cache_dir):
    path = precision.cache_path()
    other = {"another cpu | avx512_bf16 | torch 0": {"choice": "bfloat16", "speedup": 9.0}}
    path.write_text(json.dumps(other))  # another machine's entry does not answer for this one
    dtype, why = plan.auto_dtype()
    assert path.parent == cache_dir and str(path) in why and why.startswith("measured")
    entries = json.loads(path.read_text())
    assert set(entries) == {*other, precision.machine_key()}  # kept beside the new one
    entry = entries[precision.machine_key()]
    assert "choice" not in entry  # the timing is cached; what it means is the plan's to decide
    assert plan.DTYPES[plan.choose_dtype(entry["seconds"])[0]] == dtype
    # a second call reads the file: an edited timing is what it decides from (no new measurement)
    flipped = "float32" if dtype == torch.bfloat16 else "bfloat16"
    edited = _slower(entry, "bfloat16", 100.0) if flipped == "float32" else _slower(entry, "float32", 100.0)
    path.write_text(json.dumps({precision.machine_key(): edited}))
    assert plan.auto_dtype()[0] == plan.DTYPES[flipped]
    # an entry without the timings the plan decides from is no answer (timed again), nor is a malformed file
    assert precision._valid(entry) and precision._valid(edited)
    for bad in ({**entry, "seconds": {"float32": entry["seconds"]["float32"]}}, {"choice": "bfloat16"},
                _slower(entry, "float32", -1.0)):
        assert not precision._valid(bad)
    path.write_text("{not json")
    assert plan.auto_dtype()[0] in (torch.float32, torch.bfloat16)
    assert precision._valid(json.loads(path.read_text())[precision.machine_key()])


def test_unwritable_cache_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(precision.CACHE_DIR_ENV, str(blocker / "sub"))  # a folder under a file: cannot exist
    monkeypatch.delenv(plan.AUTO_PRECISION_ENV, raising=False)
    dtype, why = plan.auto_dtype()
    assert dtype in plan.DTYPES.values() and "not cached" in why


def test_override_wins_and_a_bad_value_names_the_variable(cache_dir, monkeypatch):
    monkeypatch.setenv(plan.AUTO_PRECISION_ENV, "float32")
    assert plan.auto_dtype()[0] == plan.DTYPES["float32"]
    assert plan.resolve_dtypes("auto", "bfloat16") == (torch.float32, torch.bfloat16,
                                                      f"{plan.AUTO_PRECISION_ENV}=float32")
    assert plan.resolve_dtypes("float32", "float32") == (torch.float32, torch.float32, None)
    assert not precision.cache_path().exists()  # nothing measured
    with pytest.raises(ValueError, match="train_dtype must be one of"):
        plan.resolve_dtypes("auto", "float16")
    monkeypatch.setenv(plan.AUTO_PRECISION_ENV, "fp8")
    with pytest.raises(ValueError, match=plan.AUTO_PRECISION_ENV):
        plan.auto_dtype()


def test_training_packing_is_decided_from_the_same_timing_and_overridable(cache_dir, monkeypatch):
    """The packed-training choice comes from the same cached timing; an entry written before packing was
    timed is timed again; PAIREDRL_TRAIN_PACKING overrides it."""
    path = precision.cache_path()
    old = {precision.machine_key(): {"choice": "bfloat16", "speedup": 3.0}}  # as an older build wrote it
    path.write_text(json.dumps(old))
    on, why = plan.train_packing(torch.float32)
    entry = json.loads(path.read_text())[precision.machine_key()]
    if not ONEDNN_PACKING:
        assert (on, why) == (False, "no oneDNN packing on this torch build")
        return
    gains = entry["packing"]
    assert set(gains) == {"float32", "bfloat16"} and all(g > 0 for g in gains.values())
    assert on == (gains["float32"] >= plan.MIN_PACK_SPEEDUP) and why.startswith("measured")
    # the cached timing is what a second call decides from: packed fp32 9x as fast, packed bf16 no faster
    seconds = {name: {**entry["seconds"][name], "train_packed": entry["seconds"][name]["train"] / gain}
               for name, gain in (("float32", 9.0), ("bfloat16", 1.0))}
    path.write_text(json.dumps({precision.machine_key(): {**entry, "seconds": seconds}}))
    assert plan.train_packing(torch.float32)[0] is True
    assert plan.train_packing(torch.bfloat16)[0] is False
    monkeypatch.setenv(plan.TRAIN_PACKING_ENV, "0")
    assert plan.train_packing(torch.float32) == (False, f"{plan.TRAIN_PACKING_ENV}=0")
    monkeypatch.setenv(plan.TRAIN_PACKING_ENV, "yes")
    with pytest.raises(ValueError, match=plan.TRAIN_PACKING_ENV):
        plan.train_packing(torch.float32)
    with pytest.raises(ValueError, match=plan.TRAIN_PACKING_ENV):
        plan.check_environment()
