"""envs.tokenizers and envs.renderers: the tml Qwen3.5 wrapper, hf/local loading, renderer fit."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
from tinker_cookbook import tokenizer_utils

from envs.renderers import get_renderer
from envs.tokenizers import TmlQwen35Tokenizer, get_tokenizer
from trainer.config.schema import ModelConfig

QWEN = ModelConfig(name="qwen3_5_2b", base_model="Qwen/Qwen3.5-2B", tokenizer="tml_qwen3_5",
                   renderer="qwen3_5_disable_thinking")
IM_START, IM_END, THINK, END_THINK = 248045, 248046, 248068, 248069


@pytest.fixture(scope="module")
def qwen_tok() -> TmlQwen35Tokenizer:
    return get_tokenizer(QWEN)  # ~5 s once per process (cached in envs.tokenizers)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small ChatML tokenizer saved as an HF folder (loaded back through the 'hf' kind)."""
    from trainer.model_registry import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_chatml_tok")
    build_tiny_tokenizer().save_pretrained(out)
    return str(out)


def test_tml_encode_splits_special_tokens(qwen_tok: TmlQwen35Tokenizer) -> None:
    text = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    ids = qwen_tok.encode(text, add_special_tokens=False)
    assert ids[0] == IM_START and ids.count(IM_START) == 2 and ids.count(IM_END) == 1
    assert ids.count(THINK) == 1 and ids.count(END_THINK) == 1
    # the raw tml tokenizer encodes the markers as plain text: the wrapper must differ from it
    assert IM_START not in qwen_tok._tml.encode_ordinary(text)
    assert qwen_tok.decode(ids) == text
    assert qwen_tok.decode(ids, skip_special_tokens=True) == "user\nWhat is 2+3?\nassistant\n\n\n\n\n"
    # ordinary text between specials is encoded exactly as encode_ordinary encodes it alone
    assert ids[1:ids.index(IM_END)] == qwen_tok._tml.encode_ordinary("user\nWhat is 2+3?")


def test_tml_attributes(qwen_tok: TmlQwen35Tokenizer) -> None:
    assert qwen_tok.name_or_path == "Qwen/Qwen3.5-2B"
    assert qwen_tok.eos_token == "<|im_end|>" and qwen_tok.eos_token_id == IM_END
    assert qwen_tok.convert_tokens_to_ids(["<|im_start|>", "<think>"]) == [IM_START, THINK]
    assert qwen_tok.decode(IM_END) == "<|im_end|>"
    with pytest.raises(ValueError, match="not a single token"):
        qwen_tok.convert_tokens_to_ids("not one token at all")


def test_cached_and_registered_with_cookbook(qwen_tok: TmlQwen35Tokenizer) -> None:
    assert get_tokenizer(ModelConfig(**vars(QWEN))) is qwen_tok  # an equal config, not the same object
    assert tokenizer_utils.get_tokenizer("Qwen/Qwen3.5-2B") is qwen_tok


def test_qwen35_renderer_prompt_and_stop(qwen_tok: TmlQwen35Tokenizer) -> None:
    renderer = get_renderer(QWEN, qwen_tok)
    assert renderer.get_stop_sequences() == [IM_END]
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "Hi"}]).to_ints()
    suffix = qwen_tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt[-len(suffix):] == suffix
    assert qwen_tok.decode(prompt) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # pickling re-creates the renderer through the tokenizer registered under base_model (offline)
    clone = pickle.loads(pickle.dumps(renderer))
    assert clone.tokenizer is qwen_tok and clone.get_stop_sequences() == [IM_END]


def test_hf_folder_chatml_with_qwen3_instruct(tiny_dir: str) -> None:
    cfg = ModelConfig(name="tiny", base_model=tiny_dir, tokenizer="hf", renderer="qwen3_instruct")
    tok = get_tokenizer(cfg)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [im_end]
    renderer = get_renderer(cfg, tok)
    assert renderer.get_stop_sequences() == [im_end]
    prompt = renderer.build_generation_prompt([{"role": "user", "content": "What is 1 + 2?"}])
    assert tok.decode(prompt.to_ints()) == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer_utils.get_tokenizer(tiny_dir) is tok


def test_thinking_renderer_refused_for_chatml_without_think(tiny_dir: str) -> None:
    cfg = ModelConfig(name="tiny", base_model=tiny_dir, tokenizer="hf", renderer="qwen3_5_disable_thinking")
    with pytest.raises(ValueError, match="qwen3_instruct"):
        get_renderer(cfg, get_tokenizer(cfg))


def test_local_kind_uses_local_engine_tokenizer(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    models = pytest.importorskip("trainer.model_registry")
    monkeypatch.setenv("PAIREDRL_CACHE", str(tmp_path))
    import envs.tokenizers

    # a fresh per-process cache: earlier in-process runs may have built TINY's tokenizer elsewhere
    monkeypatch.setattr(envs.tokenizers, "_cache", {})
    cfg = ModelConfig(name="tiny", base_model=models.TINY, tokenizer="local", renderer="qwen3_instruct")
    tok = get_tokenizer(cfg)
    assert tok is models.resolve_tokenizer(models.TINY)
    renderer = get_renderer(cfg, tok)
    assert renderer.get_stop_sequences() == tok.encode("<|im_end|>", add_special_tokens=False)


@pytest.mark.parametrize("fields, match", [
    ({"base_model": "x", "tokenizer": "sentencepiece"}, "unknown model.tokenizer"),
    ({"base_model": None, "tokenizer": "hf"}, "base_model"),
    ({"base_model": "", "tokenizer": "hf"}, "non-empty"),
])
def test_bad_tokenizer_config(fields: dict, match: str) -> None:
    """get_tokenizer's own checks, on a config that did not go through the schema's (a DictConfig that
    was never validated reads the same way)."""
    with pytest.raises(ValueError, match=match):
        get_tokenizer(SimpleNamespace(**fields))


def test_hf_missing_folder_is_clear(tmp_path) -> None:
    with pytest.raises(ValueError, match="AutoTokenizer"):
        get_tokenizer(ModelConfig(name="nope", base_model=str(tmp_path / "nope"), renderer="qwen3_instruct"))


def test_unknown_renderer_name(qwen_tok: TmlQwen35Tokenizer) -> None:
    with pytest.raises(ValueError, match="no_such_renderer"):
        get_renderer(ModelConfig(name="qwen", base_model="Qwen/Qwen3.5-2B", renderer="no_such_renderer"), qwen_tok)


def test_tiny_tokenizer_is_trained_on_the_vendored_gsm8k_corpus(monkeypatch, tmp_path) -> None:
    """The tiny tokenizer learns its merges from the repository's GSM8K rows: a GSM8K question takes about
    half a token per character (on the fixed fallback lines alone it takes ~1 per byte), and a missing
    corpus is an error naming the file, never a different tokenizer under the same cache name."""
    import envs.gsm8k_data as gsm8k_data
    from trainer import model_registry

    corpus = model_registry._tiny_corpus()
    assert len(corpus) >= 2 * model_registry._TINY_CORPUS_LINES
    tok = model_registry.build_tiny_tokenizer()
    q = corpus[0]
    assert len(tok.encode(q, add_special_tokens=False)) < 0.6 * len(q)
    monkeypatch.setattr(gsm8k_data, "VENDORED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        model_registry._tiny_corpus()
