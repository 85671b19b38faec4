"""GSM8K with the cookbook's `MathEnv`: prompt, `\\boxed{}` answer, numeric grader and reward.

Reused from tinker-cookbook 0.5.8, `recipes/math_rl/math_env.py`:
- `MathEnv(problem, answer, renderer, convo_prefix, grader="sympy", timeout=1.0, format_coef=0.1)`:
  user turn = question + " Write your answer in \\boxed{} format."; reward (`rl/problem_env.py::
  ProblemEnv.step`) = format_coef * (format - 1) + correct, format = stopped at the stop token
  and has a `\\boxed{}`; correct = `safe_grade(extract_boxed(text), gold)` (`math_grading.grade_answer`).
- `MathEnv.standard_fewshot_prefix()` for convo_prefix "standard" (the cookbook's default).
"""

from __future__ import annotations

import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

from tinker_cookbook import renderers
from tinker_cookbook.recipes.math_rl.math_env import MathEnv
from tinker_cookbook.recipes.math_rl.math_grading import extract_boxed, grade_answer, grade_answer_math_verify

from envs import gsm8k_data
from envs.types import Problem, Task, conversation_prefix
from trainer.config.enums import CONVO_PREFIXES

log = logging.getLogger("pairedrl")

_GRADERS = {"sympy": grade_answer, "math_verify": grade_answer_math_verify}
_grade_pool: ThreadPoolExecutor | None = None
_grade_lock = threading.Lock()


def graded(given: str, gold: str, grader: str = "sympy", timeout: float = 1.0) -> bool:
    """The cookbook's `safe_grade` on one long-lived worker thread: same grader function, same
    "False after ceil(timeout) seconds" rule. `safe_grade` opens a new ThreadPoolExecutor per call
    (a thread start-up per call, 256 calls per flagship step); a grade that times out here abandons
    the worker (its thread finishes on its own) and later calls get a fresh one."""
    global _grade_pool
    with _grade_lock:
        if _grade_pool is None:
            _grade_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grader")
        pool = _grade_pool
    fut = pool.submit(_GRADERS[grader], given, gold)
    try:
        return bool(fut.result(timeout=math.ceil(timeout)))
    except FuturesTimeout:
        log.warning("grading %r against %r timed out after %ss; counted as wrong", given, gold, timeout)
        with _grade_lock:
            if _grade_pool is pool:
                _grade_pool = None
                pool.shutdown(wait=False)
        return False
    except Exception as e:  # noqa: BLE001 - the cookbook also counts a grader error as wrong
        log.warning("grading %r against %r raised %s; counted as wrong", given, gold, e)
        return False


class GSM8KEnv(MathEnv):
    """The cookbook's MathEnv (prompt, reward, `extract_boxed`, `grade_answer` unchanged) with its
    client-side cost cut: the boxed answer is extracted once per response (`check_format` and
    `check_answer` each extracted it) and grading runs on a persistent worker (see `graded`)."""

    _last: tuple[str, str | None] | None = None

    def _boxed(self, text: str) -> str | None:
        if self._last is not None and self._last[0] is text:
            return self._last[1]
        try:
            ans: str | None = extract_boxed(text)
        except ValueError:
            ans = None
        self._last = (text, ans)
        return ans

    def check_format(self, sample_str: str) -> bool:
        return self._boxed(sample_str) is not None

    def check_answer(self, sample_str: str) -> bool:
        ans = self._boxed(sample_str)
        return ans is not None and graded(ans, self.answer, self.grader, self.timeout)


class GSM8KTask(Task):
    name = "gsm8k"

    def __init__(self, renderer: renderers.Renderer, *, source: str = "vendored", seed: int = 0,
                 n_examples: int | None = None, convo_prefix: str = "standard", format_coef: float = 0.1,
                 system_prompt: str | None = None, max_tokens: int | None = None) -> None:
        super().__init__(renderer, max_tokens)
        if convo_prefix not in CONVO_PREFIXES:
            raise ValueError(f"env.convo_prefix must be one of {list(CONVO_PREFIXES)}, got {convo_prefix!r}")
        if n_examples is not None and (not isinstance(n_examples, int) or n_examples < 1):
            raise ValueError(f"env.n_examples must be an integer >= 1 or null, got {n_examples!r}")
        if not isinstance(seed, int):
            raise TypeError(f"env.seed must be an integer, got {seed!r}")
        if format_coef < 0:
            raise ValueError(f"env.format_coef must be >= 0, got {format_coef!r}")
        self.source, self.seed, self.n_examples = source, seed, n_examples
        self.format_coef = float(format_coef)
        self.convo_prefix = conversation_prefix(
            MathEnv.standard_fewshot_prefix() if convo_prefix == "standard" else None, system_prompt)
        # load both splits now so a bad source or a corrupted file fails at build time
        train = gsm8k_data.load_split(source, "train")
        self._test = gsm8k_data.load_split(source, "test")
        order = gsm8k_data.seeded_permutation(len(train), seed)
        if n_examples is not None:
            order = order[:n_examples]
        self._train = [train[i] for i in order]

    def train_problems(self) -> list[Problem]:
        return list(self._train)

    def _all_test_problems(self) -> list[Problem]:
        return self._test

    def make_env(self, problem: Problem) -> GSM8KEnv:
        return GSM8KEnv(problem.question, problem.answer, self.renderer, convo_prefix=self.convo_prefix,
                       format_coef=self.format_coef)

    def parse_answer(self, text: str) -> str | None:
        """The last `\\boxed{...}` content (cookbook `extract_boxed`), None if there is none."""
        try:
            return extract_boxed(text)
        except ValueError:
            return None

