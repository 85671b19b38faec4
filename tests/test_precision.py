"""The engine's `auto` precision: measured once per machine, cached, overridable."""

from __future__ import annotations

import json

import pytest

from trainer.backends.local import precision


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(precision.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(precision.AUTO_PRECISION_ENV, raising=False)
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
    """`choose` on hand-made timings (seconds per sample, lower is faster): the decode product plus the
    faster training product of each precision, bf16 where fp32 takes MIN_SPEEDUP times as long or more.
    Checked here and not on a measurement, whose outcome is fixed by the CPU the suite runs on."""
    fp32 = {"decode": 1.0, "train": 6.0, "train_packed": 4.0}  # 1 + 4 = 5
    assert precision.MIN_SPEEDUP == 1.25
    got_choice, got_speedup = precision.choose({"float32": fp32, "bfloat16": bf16})
    assert got_choice == choice and got_speedup == pytest.approx(speedup, rel=1e-12)


def test_measured_choice_follows_the_cpus_bf16_instructions(cache_dir):
    """A real measurement: where the CPU has AMX, bf16 GEMMs are several times faster and `auto` must pick
    them; with AVX512_BF16 (its bf16 dot products do twice fp32's multiply-adds per instruction) bf16 is
    faster than fp32; with neither, torch's bf16 fallback is slower than fp32 and `auto` must not pick it."""
    seconds = precision.measure()
    choice, speedup = precision.choose(seconds)
    assert all(t > 0 for kinds in seconds.values() for t in kinds.values())
    flags = precision.cpu_flags()
    if "amx_bf16" in flags:
        assert (choice, speedup > 2) == ("bfloat16", True), seconds  # ~4.5-5x measured
    elif "avx512_bf16" in flags:
        assert speedup > 1, seconds  # ~1.9-2x measured (AMD Zen 4)
    else:
        assert (choice, speedup < 1) == ("float32", True), seconds


def test_choice_is_cached_per_machine_and_a_bad_cache_is_remeasured(cache_dir):
    path = precision.cache_path()
    other = {"another cpu | avx512_bf16 | torch 0": {"choice": "bfloat16", "speedup": 9.0}}
    path.write_text(json.dumps(other))  # another machine's entry does not answer for this one
    dtype, why = precision.auto_precision()
    assert path.parent == cache_dir and str(path) in why and why.startswith("measured")
    entries = json.loads(path.read_text())
    assert set(entries) == {*other, precision.machine_key()}  # kept beside the new one
    entry = entries[precision.machine_key()]
    assert precision.DTYPES[entry["choice"]] == dtype
    # a second call reads the file: an edited entry is what it returns (no new measurement)
    flipped = "float32" if entry["choice"] == "bfloat16" else "bfloat16"
    path.write_text(json.dumps({precision.machine_key(): {**entry, "choice": flipped}}))
    assert precision.auto_precision()[0] == precision.DTYPES[flipped]
    # a malformed file is measured again and rewritten, not an error
    path.write_text("{not json")
    assert precision.auto_precision()[0] == dtype
    assert json.loads(path.read_text())[precision.machine_key()]["choice"] == entry["choice"]


def test_unwritable_cache_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(precision.CACHE_DIR_ENV, str(blocker / "sub"))  # a folder under a file: cannot exist
    monkeypatch.delenv(precision.AUTO_PRECISION_ENV, raising=False)
    dtype, why = precision.auto_precision()
    assert dtype in precision.DTYPES.values() and "not cached" in why


def test_override_wins_and_a_bad_value_names_the_variable(cache_dir, monkeypatch):
    monkeypatch.setenv(precision.AUTO_PRECISION_ENV, "float32")
    assert precision.auto_precision()[0] == precision.DTYPES["float32"]
    assert not precision.cache_path().exists()  # nothing measured
    monkeypatch.setenv(precision.AUTO_PRECISION_ENV, "fp8")
    with pytest.raises(ValueError, match=precision.AUTO_PRECISION_ENV):
        precision.auto_precision()


def test_training_packing_is_measured_with_the_precision_and_overridable(cache_dir, monkeypatch):
    """The packed-training choice comes from the same cached measurement; an entry written before it was
    measured (no `packing` field) is measured again; PAIREDRL_TRAIN_PACKING overrides it."""
    import torch

    monkeypatch.delenv(precision.TRAIN_PACKING_ENV, raising=False)
    path = precision.cache_path()
    old = {precision.machine_key(): {"choice": "bfloat16", "speedup": 3.0}}  # as an older build wrote it
    path.write_text(json.dumps(old))
    on, why = precision.training_packing(torch.float32)
    entry = json.loads(path.read_text())[precision.machine_key()]
    gains = entry["packing"]
    if torch.backends.mkldnn.is_available():
        assert set(gains) == {"float32", "bfloat16"} and all(g > 0 for g in gains.values())
        assert on == (gains["float32"] >= precision.MIN_PACK_SPEEDUP) and why.startswith("measured")
    # the cached answer is what a second call returns
    path.write_text(json.dumps({precision.machine_key(): {**entry, "packing": {"float32": 9.0, "bfloat16": 1.0}}}))
    assert precision.training_packing(torch.float32)[0] is True
    assert precision.training_packing(torch.bfloat16)[0] is False
    monkeypatch.setenv(precision.TRAIN_PACKING_ENV, "0")
    assert precision.training_packing(torch.float32)[0] is False
    monkeypatch.setenv(precision.TRAIN_PACKING_ENV, "yes")
    with pytest.raises(ValueError, match=precision.TRAIN_PACKING_ENV):
        precision.training_packing(torch.float32)
