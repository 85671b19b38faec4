"""The task contract shared by the trainer and the eval: `Problem`, `Task`, `problem_sha256`.

A `Task` owns a fixed train list (ordered by the env seed, identical across arms) and a fixed
test list, and turns a `Problem` into a single-use tinker-cookbook `Env` whose
`initial_observation()` gives the rendered prompt and stop condition and whose `step(tokens)`
gives the reward with metrics `format` and `correct`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tinker_cookbook import renderers
from tinker_cookbook.rl.types import Env


@dataclass(frozen=True)
class Problem:
    """One item: `index` is its stable id within its split (row number of the source data)."""

    index: int
    question: str
    answer: str


def problem_sha256(problem: Problem) -> str:
    """Hex SHA-256 of the question text (UTF-8): lets eval records be matched across runs."""
    return hashlib.sha256(problem.question.encode("utf-8")).hexdigest()


def conversation_prefix(fewshot: list[renderers.Message] | None,
                        system_prompt: str | None) -> list[renderers.Message] | None:
    """Messages rendered before the question: an optional system turn, then the few-shot turns."""
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"env.system_prompt must be a string or null, got {system_prompt!r}")
    msgs: list[renderers.Message] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs += list(fewshot or [])
    return msgs or None


class Task(ABC):
    """A train/test problem set plus the cookbook env that grades a completion."""

    name: str

    def __init__(self, renderer: renderers.Renderer, max_tokens: int | None = None) -> None:
        self.renderer = renderer
        # completion budget from the env config; informational for the trainer/eval
        self.max_tokens = max_tokens

    @abstractmethod
    def train_problems(self) -> list[Problem]:
        """All train problems in the seeded order (same list for every arm of one seed)."""

    @abstractmethod
    def _all_test_problems(self) -> list[Problem]:
        """The whole test split in its fixed order."""

    @abstractmethod
    def make_env(self, problem: Problem) -> Env:
        """A fresh single-use cookbook env for `problem`."""

    @abstractmethod
    def parse_answer(self, text: str) -> str | None:
        """The answer string the grader extracts from a completion's text, None if none."""

    def test_problems(self, n: int | None = None) -> list[Problem]:
        """The first `n` test problems in their fixed order (all of them when n is None)."""
        items = self._all_test_problems()
        if n is None:
            return list(items)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{self.name}: test_problems(n) needs an integer n >= 1 or None, got {n!r}")
        if n > len(items):
            raise ValueError(f"{self.name}: asked for {n} test problems, the test split has {len(items)}")
        return list(items[:n])

    def decode(self, tokens: Sequence[int]) -> str:
        """The completion text the grader sees: the renderer's parse of the sampled tokens
        (stop token removed, thinking parts dropped), as in cookbook `ProblemEnv.step`."""
        message, _ = self.renderer.parse_response(list(tokens))
        return renderers.get_text_content(message)
