"""The cookbook renderer named by `model_cfg.renderer`, checked against the tokenizer.

`tinker_cookbook.renderers.get_renderer(name, tokenizer, model_name=...)` (tinker-cookbook 0.5.8,
`renderers/__init__.py`) builds it; `model_name=base_model` is the pickle metadata, resolved again
through the tokenizer registered by `envs.tokenizers.get_tokenizer`.

Which names fit which tokenizer:
- Qwen3.5 (`tml_qwen3_5`): `qwen3_5_disable_thinking` (generation suffix
  `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`, stop `[<|im_end|>]` = [248046]).
- ChatML tokenizers without `<think>` (SmolLM2, the tiny test tokenizer): `qwen3_instruct`
  (the Qwen3-2507 template, which never writes `<think>`; stop `[<|im_end|>]`).
  The `qwen3`, `qwen3_disable_thinking` and `qwen3_5*` renderers write `<think>` into prompts,
  which such a tokenizer would split into plain-text pieces, so that pairing is refused here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tinker_cookbook import renderers as cookbook_renderers
from tinker_cookbook.renderers.base import RendererError

if TYPE_CHECKING:
    from trainer.config.schema import ModelConfig

# renderers whose prompts or parsing use the ChatML turn tokens / the <think> tags as single tokens
_CHATML_PREFIX = "qwen3"
_THINK_TAG_RENDERERS = ("qwen3", "qwen3_disable_thinking", "qwen3_vl", "qwen3_5", "qwen3_5_disable_thinking",
                        "qwen3_5_preserve_thinking")


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def check_tokenizer_fits(name: str, tokenizer: Any) -> None:
    """ValueError when `tokenizer` lacks a special token that renderer `name` relies on."""
    needed: list[str] = []
    if name.startswith(_CHATML_PREFIX):
        needed += ["<|im_start|>", "<|im_end|>"]
    if name in _THINK_TAG_RENDERERS:
        needed += ["<think>", "</think>"]
    missing = [t for t in needed if _single_token(tokenizer, t) is None]
    if missing:
        hint = " (for a ChatML tokenizer without <think>, use renderer qwen3_instruct)" \
            if "<think>" in missing and "<|im_end|>" not in missing else ""
        raise ValueError(f"renderer {name!r} needs {missing} as single tokens, but tokenizer "
                         f"{getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} splits them{hint}")


def get_renderer(model_cfg: ModelConfig, tokenizer: Any) -> cookbook_renderers.Renderer:
    """The cookbook renderer `model_cfg.renderer` over `tokenizer` (special tokens checked first); `model_cfg`
    is a Config's `model` (any object with `renderer` and `base_model` does)."""
    name, base_model = model_cfg.renderer, model_cfg.base_model
    if not isinstance(name, str) or not name:
        raise ValueError(f"model.renderer must be a non-empty string, got {name!r}")
    check_tokenizer_fits(name, tokenizer)
    try:
        renderer = cookbook_renderers.get_renderer(name, tokenizer, model_name=base_model)
    except RendererError as e:
        raise ValueError(f"model.renderer {name!r}: {e}") from e
    stop = renderer.get_stop_sequences()
    if not stop:
        raise ValueError(f"renderer {name!r} has an empty stop condition")
    return renderer
