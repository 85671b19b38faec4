"""Tasks (GSM8K, arithmetic) on tinker-cookbook envs, plus the tokenizers and renderers they use.

`build_task(env_cfg, renderer) -> Task` (the class the env config's `_target_` names);
`Problem(index, question, answer)`; `problem_sha256(problem)`; `envs.tokenizers.get_tokenizer(model_cfg)`;
`envs.renderers.get_renderer(model_cfg, tokenizer)`.
"""

from envs.registry import build_task
from envs.types import Problem, Task, problem_sha256

__all__ = ["Problem", "Task", "build_task", "problem_sha256"]
