"""Seeded addition problems with the cookbook's `ArithmeticEnv` (offline demo task).

Reused from tinker-cookbook 0.5.8, `recipes/math_rl/arithmetic_env.py`:
- `ArithmeticEnv(x, y, renderer, convo_prefix, format_coef)`: question "What is {x} + {y}?";
  correct = the last integer in the reply (commas removed) equals x + y (`_extract_final_int`);
  format is always true, so reward = correct - format_coef when the reply did not stop at the
  stop token; `ArithmeticEnv.standard_fewshot_prefix()` ("What is 4 + 5?" -> "9") for
  convo_prefix "standard".
The cookbook's `ArithmeticDataset` draws x, y in [0, 100] from `RandomState(batch index)`; here the
operand sizes are configurable and the problem lists are fixed by `seed`, so the test split can be
held out. Default mix (1- and 2-digit operands, plain prompt): the setting in which SmolLM2-135M
gets a reward signal (50 GRPO steps raise its greedy accuracy from 31% to 81.5%).

Generation: each operand independently gets d digits, d uniform in [min_digits, max_digits]
(1 digit = 0-9, d >= 2 digits = 10^(d-1) .. 10^d - 1). The test split (stream [seed, 1]) holds
`n_test` distinct (x, y) pairs; no digit class gives more than half of its pairs to it. The train
split (stream [seed, 2]) draws `n_examples` problems from the same distribution with repeats
allowed (as in the cookbook) but never a test pair.
"""

from __future__ import annotations

import re

import numpy as np
from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv, _extract_final_int

from envs.types import Problem, Task, conversation_prefix
from trainer.config.enums import CONVO_PREFIXES

_QUESTION_RE = re.compile(r"What is (\d+) \+ (\d+)\?")
# share of a digit class's distinct pairs the test split may take (the rest stays for train)
_MAX_TEST_SHARE = 0.5


def _digit_range(d: int) -> tuple[int, int]:
    """[lo, hi) of the d-digit numbers, 0 counted as 1-digit."""
    return (0 if d == 1 else 10 ** (d - 1)), 10 ** d


def _class_size(dx: int, dy: int) -> int:
    (lx, hx), (ly, hy) = _digit_range(dx), _digit_range(dy)
    return (hx - lx) * (hy - ly)


def _draw(rng: np.random.Generator, min_digits: int, max_digits: int) -> tuple[int, int, tuple[int, int]]:
    dx, dy = (int(d) for d in rng.integers(min_digits, max_digits + 1, size=2))
    x = int(rng.integers(*_digit_range(dx)))
    y = int(rng.integers(*_digit_range(dy)))
    return x, y, (dx, dy)


def generate_splits(seed: int, n_examples: int, n_test: int, min_digits: int = 1,
                    max_digits: int = 2) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pairs, test pairs); test pairs are distinct and never appear in train."""
    classes = [(a, b) for a in range(min_digits, max_digits + 1) for b in range(min_digits, max_digits + 1)]
    caps = {c: int(_class_size(*c) * _MAX_TEST_SHARE) for c in classes}
    if n_test > sum(caps.values()):
        raise ValueError(f"env.n_test={n_test} needs more than half of the "
                         f"{sum(_class_size(*c) for c in classes)} distinct problems with "
                         f"min_digits={min_digits}, max_digits={max_digits}; lower n_test or raise max_digits")
    rng = np.random.default_rng([seed, 1])
    test: list[tuple[int, int]] = []
    seen: set[tuple[int, int]] = set()
    used = {c: 0 for c in classes}
    while len(test) < n_test:
        x, y, c = _draw(rng, min_digits, max_digits)
        if (x, y) in seen or used[c] >= caps[c]:
            continue  # rejection keeps the draw distribution within the unsaturated classes
        seen.add((x, y))
        used[c] += 1
        test.append((x, y))
    rng = np.random.default_rng([seed, 2])
    train: list[tuple[int, int]] = []
    while len(train) < n_examples:
        x, y, _ = _draw(rng, min_digits, max_digits)
        if (x, y) not in seen:  # every class keeps >= half its pairs, so this terminates
            train.append((x, y))
    return train, test


class ArithmeticTask(Task):
    name = "arithmetic"

    def __init__(self, renderer: renderers.Renderer, *, seed: int = 0, n_examples: int = 2000, n_test: int = 200,
                 max_digits: int = 2, min_digits: int = 1, convo_prefix: str = "none", format_coef: float = 0.1,
                 system_prompt: str | None = None, max_tokens: int | None = None) -> None:
        super().__init__(renderer, max_tokens)
        for key, v in (("seed", seed), ("n_examples", n_examples), ("n_test", n_test),
                       ("max_digits", max_digits), ("min_digits", min_digits)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"env.{key} must be an integer, got {v!r}")
        if n_examples < 1 or n_test < 1:
            raise ValueError(f"env.n_examples and env.n_test must be >= 1, got {n_examples}, {n_test}")
        if not 1 <= min_digits <= max_digits <= 9:
            raise ValueError(f"need 1 <= env.min_digits <= env.max_digits <= 9, got {min_digits}, {max_digits}")
        if convo_prefix not in CONVO_PREFIXES:
            raise ValueError(f"env.convo_prefix must be one of {list(CONVO_PREFIXES)}, got {convo_prefix!r}")
        if format_coef < 0:
            raise ValueError(f"env.format_coef must be >= 0, got {format_coef!r}")
        self.seed, self.min_digits, self.max_digits = seed, min_digits, max_digits
        self.format_coef = float(format_coef)
        self.convo_prefix = conversation_prefix(
            ArithmeticEnv.standard_fewshot_prefix() if convo_prefix == "standard" else None, system_prompt)
        train, test = generate_splits(seed, n_examples, n_test, min_digits, max_digits)
        self._train = [self._problem(i, x, y) for i, (x, y) in enumerate(train)]
        self._test = [self._problem(i, x, y) for i, (x, y) in enumerate(test)]

    @staticmethod
    def _problem(index: int, x: int, y: int) -> Problem:
        # same wording as ArithmeticEnv.get_question
        return Problem(index=index, question=f"What is {x} + {y}?", answer=str(x + y))

    def train_problems(self) -> list[Problem]:
        return list(self._train)

    def _all_test_problems(self) -> list[Problem]:
        return self._test

    def make_env(self, problem: Problem) -> ArithmeticEnv:
        m = _QUESTION_RE.fullmatch(problem.question)
        if m is None:
            raise ValueError(f"not an arithmetic question: {problem.question!r}")
        x, y = int(m.group(1)), int(m.group(2))
        if str(x + y) != problem.answer:
            raise ValueError(f"problem {problem.index}: answer {problem.answer!r} is not {x} + {y}")
        return ArithmeticEnv(x, y, self.renderer, convo_prefix=self.convo_prefix, format_coef=self.format_coef)

    def parse_answer(self, text: str) -> str | None:
        """The last integer in the text (cookbook `_extract_final_int`), None if there is none."""
        value = _extract_final_int(text)
        return None if value is None else str(value)

