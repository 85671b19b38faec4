"""Unit tests for the small core modules: advantages, the lr schedule, rollout -> Datum and
minibatch splitting. Every expected value is computed by hand in the test."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.advantages import compute_advantages
from trainer.datums import Rollout, rollout_to_datum, split_minibatches
from trainer.lr_schedule import lr_at

# --- advantages ---------------------------------------------------------------------------

def test_group_mean_subtracts_the_group_mean():
    # mean of [1, 0, 0, 1, 1] is 0.6
    adv = compute_advantages(np.array([1.0, 0.0, 0.0, 1.0, 1.0]), "group_mean")
    assert adv == pytest.approx([0.4, -0.6, -0.6, 0.4, 0.4], abs=1e-12)


def test_group_zscore_divides_by_population_std():
    # rewards [0, 2]: mean 1, population std 1 -> (-1, 1) / (1 + 1e-6)
    adv = compute_advantages(np.array([0.0, 2.0]), "group_zscore")
    assert adv == pytest.approx([-1 / (1 + 1e-6), 1 / (1 + 1e-6)], abs=1e-12)
    # [1, 2, 3, 6]: mean 3, variance (4+1+0+9)/4 = 3.5
    adv = compute_advantages(np.array([1.0, 2.0, 3.0, 6.0]), "group_zscore")
    s = math.sqrt(3.5) + 1e-6
    assert adv == pytest.approx([-2 / s, -1 / s, 0.0, 3 / s], abs=1e-12)


def test_constant_group_gives_zero_advantage():
    for mode in ("group_mean", "group_zscore"):
        assert compute_advantages(np.array([0.7, 0.7, 0.7]), mode) == pytest.approx([0, 0, 0], abs=1e-9)


def test_none_returns_a_copy_of_the_rewards():
    r = np.array([0.5, -1.0, 2.0])
    adv = compute_advantages(r, "none")
    assert adv.tolist() == [0.5, -1.0, 2.0]
    adv[0] = 99.0
    assert r[0] == 0.5


def test_unknown_advantage_mode_is_rejected():
    with pytest.raises(ValueError, match="unknown estimator 'bogus'"):
        compute_advantages(np.array([1.0, 0.0]), "bogus")


# --- learning-rate schedule ---------------------------------------------------------------

def test_warmup_is_linear_from_peak_over_warmup():
    # warmup 4: steps 0..3 get 1/4, 2/4, 3/4, 4/4 of the peak
    got = [lr_at(u, 10, 1e-3, "constant", warmup_steps=4) for u in range(6)]
    assert got == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3], rel=1e-12)


def test_linear_decay_to_floor():
    # total 10, warmup 2 -> span 8; floor = 0.1 * peak
    peak = 2.0
    assert lr_at(2, 10, peak, "linear", 2, 0.1) == pytest.approx(2.0)
    assert lr_at(6, 10, peak, "linear", 2, 0.1) == pytest.approx(0.2 + 1.8 * 0.5)
    assert lr_at(9, 10, peak, "linear", 2, 0.1) == pytest.approx(0.2 + 1.8 * (1 - 7 / 8))
    # progress is clipped at 1: past the end stays at the floor
    assert lr_at(50, 10, peak, "linear", 2, 0.1) == pytest.approx(0.2)


def test_cosine_decay_hand_values():
    # no warmup, total 4: progress 0, 1/4, 1/2, 3/4; no floor
    got = [lr_at(u, 4, 1.0, "cosine") for u in range(4)]
    want = [1.0, 0.5 * (1 + math.sqrt(0.5)), 0.5, 0.5 * (1 - math.sqrt(0.5))]
    assert got == pytest.approx(want, abs=1e-12)
    # with floor 0.2: floor + 0.8 * half-cosine at progress 1/2
    assert lr_at(2, 4, 1.0, "cosine", min_lr_ratio=0.2) == pytest.approx(0.6)


def test_constant_schedule_ignores_progress():
    assert {lr_at(u, 5, 3e-4, "constant") for u in range(5)} == {3e-4}


def test_unknown_schedule_is_rejected():
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_at(0, 10, 1.0, "step")


# --- rollout -> Datum ---------------------------------------------------------------------

def _rollout(**kw):
    base = {"group": 0, "prompt_tokens": [11, 12, 13], "tokens": [21, 22], "logprobs": [-0.5, -1.25],
            "reward": 1.0, "metrics": {}, "stop_reason": "stop", "advantage": 0.75}
    base.update(kw)
    return Rollout(**base)


def test_rollout_to_datum_alignment():
    d = rollout_to_datum(_rollout())
    # full sequence 11 12 13 21 22: input drops the last, targets drop the first
    assert d.model_input.to_ints() == [11, 12, 13, 21]
    inp = d.loss_fn_inputs
    assert inp["target_tokens"].to_numpy().tolist() == [12, 13, 21, 22]
    # positions 0-1 predict prompt tokens; positions 2-3 predict the completion
    assert inp["logprobs"].to_numpy().tolist() == [0.0, 0.0, -0.5, -1.25]
    assert inp["advantages"].to_numpy().tolist() == [0.0, 0.0, 0.75, 0.75]
    assert inp["mask"].to_numpy().tolist() == [0.0, 0.0, 1.0, 1.0]


def test_rollout_to_datum_one_token_prompt():
    d = rollout_to_datum(_rollout(prompt_tokens=[5], tokens=[6, 7, 8], logprobs=[-1.0, -2.0, -3.0],
                                  advantage=-0.5))
    assert d.model_input.to_ints() == [5, 6, 7]
    assert d.loss_fn_inputs["target_tokens"].to_numpy().tolist() == [6, 7, 8]
    assert d.loss_fn_inputs["logprobs"].to_numpy().tolist() == [-1.0, -2.0, -3.0]
    assert d.loss_fn_inputs["mask"].to_numpy().tolist() == [1.0, 1.0, 1.0]
    assert d.loss_fn_inputs["advantages"].to_numpy().tolist() == [-0.5, -0.5, -0.5]


def test_rollout_to_datum_rejects_bad_rollouts():
    with pytest.raises(ValueError, match="no completion tokens"):
        rollout_to_datum(_rollout(tokens=[], logprobs=[]))
    with pytest.raises(ValueError, match="2 tokens but 1 sampler logprobs"):
        rollout_to_datum(_rollout(logprobs=[-0.5]))


# --- minibatches --------------------------------------------------------------------------

def test_split_minibatches_first_chunks_one_longer():
    assert split_minibatches(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_minibatches(list(range(6)), 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_minibatches([1, 2, 3], 1) == [[1, 2, 3]]
    assert split_minibatches([1, 2, 3], 3) == [[1], [2], [3]]


def test_split_minibatches_rejects_bad_counts():
    for n in (0, 4):
        with pytest.raises(ValueError, match=f"cannot split 3 datums into {n} minibatches"):
            split_minibatches([1, 2, 3], n)


# --- selecting the rollouts a step trains on -------------------------------------------------

def test_drop_constant_groups_keeps_mixed_rollouts_first_when_topping_up():
    from trainer.datums import Rollout
    from trainer.loop import select_for_training

    def ro(group: int, i: int) -> Rollout:
        return Rollout(group=group, prompt_tokens=[1], tokens=[2, 3], logprobs=[-1.0, -1.0], reward=float(i),
                       metrics={}, stop_reason="stop")

    rollouts = [ro(g, i) for g in range(3) for i in range(2)]  # group_size 2; only group 2 is mixed
    mixed_G = [False, False, True]
    assert select_for_training(rollouts, mixed_G, False, 4) == rollouts
    assert select_for_training(rollouts, mixed_G, True, 2) == rollouts[4:]
    # 4 updates need 4 rollouts: both mixed ones, then the first constant ones (not the constant ones only)
    assert select_for_training(rollouts, mixed_G, True, 4) == rollouts[4:] + rollouts[:2]
    assert select_for_training(rollouts, [False] * 3, True, 2) == rollouts[:2]
