"""Client-side tokenizers for the cookbook renderers, chosen by `model_cfg.tokenizer`.

- `tml_qwen3_5`: tml-renderers' offline `Qwen35Tokenizer` (vocab inside the wheel, no network),
  wrapped so `encode` splits special tokens like an HF tokenizer does.
- `local`: the local engine's tokenizer, `trainer.model_registry.resolve_tokenizer(base_model)`.
- `hf`: `transformers.AutoTokenizer.from_pretrained(base_model)` (hub id or local folder).

Each tokenizer is also registered with `tinker_cookbook.tokenizer_utils.register_tokenizer` under
`base_model`, so cookbook code that calls `get_tokenizer(base_model)` (e.g. unpickling a renderer,
`renderers/base.py::_unpickle_renderer` in tinker-cookbook 0.5.8) resolves it offline.
The cookbook renderers only call `encode(text, add_special_tokens=False)`, `decode(ids)` and
`name_or_path` on a tokenizer (tinker-cookbook 0.5.8, `renderers/*.py`).
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tinker_cookbook.tokenizer_utils import register_tokenizer

from trainer.config.enums import TOKENIZER_KINDS

if TYPE_CHECKING:
    from trainer.config.schema import ModelConfig

_lock = threading.Lock()
_cache: dict[tuple[str, str], Any] = {}


@functools.lru_cache(maxsize=1)
def _load_qwen35() -> Any:
    # slow (the vocab is unpacked from the extension module): once per process
    from tml_renderers.tokenizers import Qwen35Tokenizer

    return Qwen35Tokenizer()


def _ids(token_ids: Any) -> list[int]:
    if isinstance(token_ids, int):
        return [token_ids]
    if hasattr(token_ids, "tolist"):  # torch / numpy
        token_ids = token_ids.tolist()
    return [int(t) for t in token_ids]


class TmlQwen35Tokenizer:
    """HF-tokenizer-like facade over `tml_renderers.tokenizers.Qwen35Tokenizer`.

    `Qwen35Tokenizer.encode_ordinary` encodes "<|im_end|>" as plain text (7 tokens), while the
    HF tokenizer and the cookbook's Qwen3/3.5 renderers expect it as one token (248046); so
    `encode` splits the text at the literal special tokens and encodes those with
    `encode_special`. eos is "<|im_end|>" (the chat turn end, the renderers' stop token).
    """

    def __init__(self, name_or_path: str, tml: Any | None = None) -> None:
        self._tml = tml if tml is not None else _load_qwen35()
        self.name_or_path = name_or_path
        self.all_special_tokens: list[str] = list(self._tml.all_special_tokens)
        self._special_to_id = {s: int(self._tml.encode_special(s)) for s in self.all_special_tokens}
        self.all_special_ids: list[int] = list(self._special_to_id.values())
        # longest first so that no special token is split by a shorter one that prefixes it
        alternatives = sorted(self.all_special_tokens, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(re.escape(s) for s in alternatives) + ")")
        self.eos_token = "<|im_end|>"
        self.eos_token_id = self._special_to_id[self.eos_token]
        self.pad_token = "<|endoftext|>"
        self.pad_token_id = self._special_to_id[self.pad_token]
        self.bos_token = None  # Qwen tokenizers add no BOS
        self.bos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False, **_: Any) -> list[int]:
        # add_special_tokens adds nothing for Qwen (no BOS), as in the HF tokenizer
        out: list[int] = []
        for piece in self._split_re.split(text):
            if not piece:
                continue
            special = self._special_to_id.get(piece)
            if special is not None:
                out.append(special)
            else:
                out.extend(self._tml.encode_ordinary(piece))
        return out

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **_: Any) -> str:
        ids = _ids(token_ids)
        if skip_special_tokens:
            ids = [t for t in ids if not self._tml.is_special_token(t)]
        return str(self._tml.decode(ids))

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | list[int]:
        if isinstance(tokens, str):
            return self._token_to_id(tokens)
        return [self._token_to_id(t) for t in tokens]

    def _token_to_id(self, token: str) -> int:
        if token in self._special_to_id:
            return self._special_to_id[token]
        ids = self._tml.encode_ordinary(token)
        if len(ids) != 1:
            raise ValueError(f"{token!r} is not a single token of the Qwen3.5 vocabulary (encodes to {ids})")
        return int(ids[0])

    def __repr__(self) -> str:
        return f"TmlQwen35Tokenizer(name_or_path={self.name_or_path!r})"


def _build(kind: str, base_model: str) -> Any:
    if kind == "tml_qwen3_5":
        return TmlQwen35Tokenizer(base_model)
    if kind == "local":
        try:
            from trainer.model_registry import resolve_tokenizer
        except ImportError as e:
            raise ValueError(
                f"tokenizer 'local' for {base_model!r} needs trainer.model_registry.resolve_tokenizer, "
                f"which could not be imported: {e}") from e
        return resolve_tokenizer(base_model)
    if kind == "hf":
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(base_model)
        except Exception as e:  # OSError offline, ValueError for a bad folder, ...
            raise ValueError(
                f"tokenizer 'hf' could not load {base_model!r} with AutoTokenizer.from_pretrained "
                f"(a hub id needs network or a populated HF cache; a folder needs tokenizer files): {e}") from e
    raise ValueError(f"unknown model.tokenizer {kind!r}; expected one of {list(TOKENIZER_KINDS)}")


def get_tokenizer(model_cfg: ModelConfig) -> Any:
    """The tokenizer for the model config `model_cfg` (a Config's `model`; any object with `base_model` and
    `tokenizer` does), cached per process and registered with the cookbook under `base_model`."""
    base_model, kind = model_cfg.base_model, model_cfg.tokenizer
    if not isinstance(base_model, str) or not base_model:
        raise ValueError(f"model.base_model must be a non-empty string, got {base_model!r}")
    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"unknown model.tokenizer {kind!r}; expected one of {list(TOKENIZER_KINDS)}")
    key = (kind, base_model)
    with _lock:
        tok = _cache.get(key)
        if tok is None:
            tok = _build(kind, base_model)
            _cache[key] = tok
        register_tokenizer(base_model, lambda: tok)
    return tok
