"""Tasks (GSM8K, arithmetic) on tinker-cookbook envs, plus the tokenizers and renderers they use.

`build_task(env_cfg, renderer) -> Task`; `Problem(index, question, answer)`;
`problem_sha256(problem)`; `envs.tokenizers.get_tokenizer(model_cfg)`;
`envs.renderers.get_renderer(model_cfg, tokenizer)`.
"""

from envs.registry import available_tasks, build_task, register_task
from envs.types import Problem, Task, problem_sha256

__all__ = ["Problem", "Task", "available_tasks", "build_task", "problem_sha256", "register_task"]
