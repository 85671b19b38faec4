"""envs tasks: prompts, rewards of hand-written completions, data order, data errors."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from envs import Problem, build_task, gsm8k_data, problem_sha256
from envs.renderers import get_renderer
from envs.tokenizers import get_tokenizer
from trainer.config.schema import ModelConfig

QWEN = ModelConfig(name="qwen3_5_2b", base_model="Qwen/Qwen3.5-2B", tokenizer="tml_qwen3_5",
                   renderer="qwen3_5_disable_thinking")
QWEN_SUFFIX = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
GSM8K = {"name": "gsm8k", "source": "vendored", "seed": 0, "n_examples": None, "convo_prefix": "standard",
         "max_tokens": 512}
ARITH = {"name": "arithmetic", "seed": 0, "n_examples": 300, "n_test": 100, "max_digits": 2, "max_tokens": 64}
VENDORED = gsm8k_data.VENDORED_DIR


@pytest.fixture(scope="module")
def tiny():
    """(tokenizer, renderer) for a small ChatML tokenizer with the qwen3_instruct renderer."""
    from trainer.model_registry import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return tok, get_renderer(ModelConfig(name="tiny", base_model="pairedrl/tiny-chatml-test",
                                         renderer="qwen3_instruct"), tok)


@pytest.fixture(scope="module")
def qwen():
    tok = get_tokenizer(QWEN)  # one ~5 s load per process
    return tok, get_renderer(QWEN, tok)


@pytest.fixture(scope="module")
def gsm8k_tiny(tiny):
    return build_task(GSM8K, tiny[1])


def run(coro):
    return asyncio.run(coro)


def prompt_and_reward(task, problem: Problem, completion_tokens: list[int]):
    env = task.make_env(problem)
    ob, stop = run(env.initial_observation())
    res = run(env.step(completion_tokens))
    return ob.to_ints(), stop, res


def im_end(tok) -> int:
    return tok.encode("<|im_end|>", add_special_tokens=False)[0]


# ------------------------------------------------------------------ gsm8k: prompts and rewards
def test_gsm8k_prompt_tiny_chatml(gsm8k_tiny, tiny) -> None:
    tok, _ = tiny
    first = gsm8k_tiny.test_problems(1)[0]
    ids, stop, _ = prompt_and_reward(gsm8k_tiny, first, tok.encode("x<|im_end|>"))
    text = tok.decode(ids)
    assert stop == [im_end(tok)]
    # few-shot strawberry turn first, then the question with MathEnv's suffix, then the assistant header
    assert text.startswith("<|im_start|>user\nHow many r's are in strawberry? Write your answer in \\boxed{} format.")
    assert text.endswith(first.question + " Write your answer in \\boxed{} format.<|im_end|>\n"
                         "<|im_start|>assistant\n")
    assert text.count("<|im_start|>") == 4


def test_gsm8k_convo_prefix_none(tiny) -> None:
    tok, renderer = tiny
    task = build_task({**GSM8K, "convo_prefix": "none", "n_examples": 5}, renderer)
    p = task.test_problems(1)[0]
    ids, _, _ = prompt_and_reward(task, p, tok.encode("x<|im_end|>"))
    assert tok.decode(ids) == (f"<|im_start|>user\n{p.question} Write your answer in \\boxed{{}} format.<|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_gsm8k_prompt_and_rewards_qwen35(qwen) -> None:
    tok, renderer = qwen
    task = build_task({**GSM8K, "n_examples": 8}, renderer)
    p = task.test_problems(1)[0]  # Janet's ducks, gold 18
    assert p.answer == "18"
    ids, stop, res = prompt_and_reward(task, p, tok.encode("16 - 3 - 4 = 9; 9 * 2 = 18. \\boxed{18}<|im_end|>"))
    assert stop == [248046]
    assert ids[-len(tok.encode(QWEN_SUFFIX)):] == tok.encode(QWEN_SUFFIX)
    assert tok.decode(ids).endswith(p.question + " Write your answer in \\boxed{} format.<|im_end|>\n" + QWEN_SUFFIX)
    assert res.reward == pytest.approx(1.0) and res.metrics == {"format": 1.0, "correct": 1.0}
    cases = {
        "\\boxed{17}<|im_end|>": (0.0, 1.0, 0.0),     # wrong
        "The answer is 18.<|im_end|>": (-0.1, 0.0, 0.0),  # no \boxed{}
        "\\boxed{18}": (0.9, 0.0, 1.0),              # correct but cut off before the stop token
        "\\boxed{18.0}<|im_end|>": (1.0, 1.0, 1.0),  # numeric grader
    }
    for text, (reward, fmt, correct) in cases.items():
        _, _, res = prompt_and_reward(task, p, tok.encode(text))
        assert (res.reward, res.metrics["format"], res.metrics["correct"]) == pytest.approx((reward, fmt, correct)), text


def test_gsm8k_rewards_tiny_and_parse(gsm8k_tiny, tiny) -> None:
    tok, _ = tiny
    p = gsm8k_tiny.test_problems(1)[0]
    for text, reward in [("so \\boxed{18}<|im_end|>", 1.0), ("\\boxed{19}<|im_end|>", 0.0), ("18<|im_end|>", -0.1)]:
        _, _, res = prompt_and_reward(gsm8k_tiny, p, tok.encode(text))
        assert res.reward == pytest.approx(reward), text
    tokens = tok.encode("a \\boxed{3} then \\boxed{18}<|im_end|>")
    assert gsm8k_tiny.decode(tokens) == "a \\boxed{3} then \\boxed{18}"
    assert gsm8k_tiny.parse_answer(gsm8k_tiny.decode(tokens)) == "18"
    assert gsm8k_tiny.parse_answer("no box here 18") is None


def test_gsm8k_env_matches_cookbook_mathenv_rewards(gsm8k_tiny, tiny) -> None:
    """Our GSM8KEnv (one extraction per response, persistent grading worker) gives the cookbook
    MathEnv's reward and metrics on every kind of response."""
    from tinker_cookbook.recipes.math_rl.math_env import MathEnv

    from envs.gsm8k import GSM8KEnv

    tok, renderer = tiny
    p = gsm8k_tiny.test_problems(1)[0]
    texts = ["so \\boxed{18}<|im_end|>", "\\boxed{18.0}<|im_end|>", "\\boxed{19}<|im_end|>", "18<|im_end|>",
             "\\boxed{18}", "a \\boxed{3} then \\boxed{18}<|im_end|>", "\\boxed{}<|im_end|>", "<|im_end|>"]
    for text in texts:
        results = []
        for cls in (GSM8KEnv, MathEnv):
            env = cls(p.question, p.answer, renderer, convo_prefix=gsm8k_tiny.convo_prefix, format_coef=0.1)
            results.append(asyncio.run(env.step(tok.encode(text))))
        assert isinstance(gsm8k_tiny.make_env(p), GSM8KEnv)
        assert (results[0].reward, results[0].metrics) == (results[1].reward, results[1].metrics), text


def test_graded_times_out_and_recovers(monkeypatch) -> None:
    import time

    from envs import gsm8k

    monkeypatch.setitem(gsm8k._GRADERS, "slow", lambda a, b: time.sleep(3) or True)
    t0 = time.time()
    assert gsm8k.graded("1", "1", "slow", timeout=0.5) is False  # ceil(0.5) = 1 s, as the cookbook rounds
    assert time.time() - t0 < 2.5
    assert gsm8k.graded("18", "18.0") is True and gsm8k.graded("17", "18") is False  # a fresh worker


# ------------------------------------------------------------------ gsm8k: data
def test_gsm8k_vendored_sizes_order_and_gold(gsm8k_tiny) -> None:
    train, test = gsm8k_tiny.train_problems(), gsm8k_tiny.test_problems()
    assert (len(train), len(test)) == (7473, 1319)
    lines = (VENDORED / "test.jsonl").read_text().splitlines()
    rows = [json.loads(lines[i]) for i in range(3)]
    assert [p.question for p in test[:3]] == [r["question"] for r in rows]  # test split unshuffled
    assert [p.index for p in test[:3]] == [0, 1, 2]
    assert test[0].answer == "18"
    # train order = HF datasets' Dataset.shuffle(seed=0) permutation (the cookbook's Gsm8kDataset order)
    from datasets import Dataset

    hf_order = Dataset.from_dict({"i": list(range(7473))}).shuffle(seed=0)["i"]
    assert [p.index for p in train] == list(hf_order)
    assert sorted(p.index for p in train) == list(range(7473))


def test_gsm8k_seed_determinism_and_cap(tiny) -> None:
    renderer = tiny[1]
    a = build_task({**GSM8K, "n_examples": 100}, renderer).train_problems()
    b = build_task({**GSM8K, "n_examples": 100}, renderer).train_problems()
    c = build_task({**GSM8K, "n_examples": 100, "seed": 1}, renderer).train_problems()
    full = build_task(GSM8K, renderer).train_problems()
    assert a == b and len(a) == 100
    assert a == full[:100]  # the cap applies after the shuffle
    assert [p.index for p in a] != [p.index for p in c]


def test_gold_answer_removes_commas() -> None:
    assert gsm8k_data.gold_answer("12 * 100 = 1200\n#### 1,200") == "1200"
    assert gsm8k_data.gold_answer("a\n#### 5\nmore\n#### 7") == "7"


def _write_split_folder(tmp_path: Path, train_lines: list[str]) -> Path:
    good = json.dumps({"question": "What is 2 + 2?", "answer": "2 + 2 = 4\n#### 4"})
    (tmp_path / "train.jsonl").write_text("\n".join(train_lines) + "\n")
    (tmp_path / "test.jsonl").write_text(good + "\n")
    return tmp_path


@pytest.mark.parametrize("bad, match", [
    ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
    ('{"question": "q"}', "missing key 'answer'"),
    ('{"question": "q", "answer": ""}', "'answer' must be a non-empty string"),
    ('{"question": "q", "answer": "the answer is 4"}', "no '####'"),
    ('{"question": "q", "answer": "4\\n####   "}', "empty final answer"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_line_names_file_and_line(tmp_path: Path, tiny, bad: str, match: str) -> None:
    good = json.dumps({"question": "What is 1 + 1?", "answer": "#### 2"})
    folder = _write_split_folder(tmp_path, [good, good, bad, good])
    with pytest.raises(ValueError, match=match) as e:
        build_task({**GSM8K, "source": str(folder)}, tiny[1])
    assert f"{folder / 'train.jsonl'}:3:" in str(e.value)


def test_local_folder_source(tmp_path: Path, tiny) -> None:
    rows = [json.dumps({"question": f"q{i}", "answer": f"#### {i},000"}) for i in range(6)]
    folder = _write_split_folder(tmp_path, rows)
    task = build_task({**GSM8K, "source": str(folder), "seed": 3}, tiny[1])
    train = task.train_problems()
    assert sorted((p.index, p.answer) for p in train) == [(i, f"{i}000") for i in range(6)]
    assert [p.index for p in train] == gsm8k_data.seeded_permutation(6, 3)
    assert task.test_problems() == [Problem(0, "What is 2 + 2?", "4")]


def test_sha_mismatch_detected(tmp_path: Path, tiny) -> None:
    data = (VENDORED / "test.jsonl").read_bytes()
    tampered = tmp_path / "test.jsonl"
    tampered.write_bytes(data.replace(b"#### 18", b"#### 19", 1))
    with pytest.raises(gsm8k_data.DataIntegrityError, match="SHA-256 mismatch.*test.jsonl"):
        gsm8k_data.verify_sha256(tampered, VENDORED / "SHA256SUMS")
    # a folder source with a SHA256SUMS is checked the same way at build time
    shutil.copy(VENDORED / "train.jsonl", tmp_path / "train.jsonl")
    shutil.copy(VENDORED / "SHA256SUMS", tmp_path / "SHA256SUMS")
    with pytest.raises(gsm8k_data.DataIntegrityError, match="test.jsonl"):
        build_task({**GSM8K, "source": str(tmp_path)}, tiny[1])
    gsm8k_data.verify_sha256(VENDORED / "test.jsonl", VENDORED / "SHA256SUMS")  # the shipped copy is intact


def test_hf_hub_source_offline_error_is_clear() -> None:
    import datasets

    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("HF hub reachable in principle: this test checks the offline message only")
    with pytest.raises(ValueError, match="could not load openai/gsm8k.*env.source=vendored"):
        gsm8k_data.load_split("openai/gsm8k", "test")


def test_bad_source(tiny) -> None:
    with pytest.raises(ValueError, match="neither 'vendored'"):
        build_task({**GSM8K, "source": "/no/such/folder"}, tiny[1])


# ------------------------------------------------------------------ arithmetic
def test_arithmetic_prompt_and_rewards_tiny(tiny) -> None:
    tok, renderer = tiny
    task = build_task(ARITH, renderer)
    p = task.test_problems(1)[0]
    x, y = (int(v) for v in p.question.removeprefix("What is ").removesuffix("?").split(" + "))
    assert p.answer == str(x + y)
    ids, stop, res = prompt_and_reward(task, p, tok.encode(f"{x} + {y} = {x + y}<|im_end|>"))
    assert tok.decode(ids) == f"<|im_start|>user\nWhat is {x} + {y}?<|im_end|>\n<|im_start|>assistant\n"
    assert stop == [im_end(tok)]
    assert res.reward == pytest.approx(1.0) and res.metrics == {"format": 1.0, "correct": 1.0}
    for text, reward, correct in [(f"{x + y + 1}<|im_end|>", 0.0, 0.0),
                                  (f"The sum is {x + y}, I think it is {x + y - 1}.<|im_end|>", 0.0, 0.0),
                                  (f"{x + y}", 0.9, 1.0)]:
        _, _, res = prompt_and_reward(task, p, tok.encode(text))
        assert (res.reward, res.metrics["correct"]) == pytest.approx((reward, correct)), text
    assert task.parse_answer(f"so it is {x + y}") == str(x + y)
    assert task.parse_answer("no number") is None


def test_arithmetic_prompt_qwen35_and_fewshot(qwen) -> None:
    tok, renderer = qwen
    task = build_task({**ARITH, "convo_prefix": "standard", "n_examples": 10, "n_test": 5}, renderer)
    p = task.train_problems()[0]
    ids, stop, res = prompt_and_reward(task, p, tok.encode(p.answer + "<|im_end|>"))
    assert stop == [248046]
    assert tok.decode(ids) == ("<|im_start|>user\nWhat is 4 + 5?<|im_end|>\n<|im_start|>assistant\n9<|im_end|>\n"
                               f"<|im_start|>user\n{p.question}<|im_end|>\n" + QWEN_SUFFIX)
    assert res.reward == pytest.approx(1.0)


def test_arithmetic_splits(tiny) -> None:
    renderer = tiny[1]
    task = build_task({**ARITH, "n_examples": 2000, "n_test": 200}, renderer)
    train, test = task.train_problems(), task.test_problems()
    assert (len(train), len(test)) == (2000, 200)
    assert len({p.question for p in test}) == 200  # distinct test items
    assert not {p.question for p in train} & {p.question for p in test}  # held out
    operands = [int(v) for p in train for v in p.question[8:-1].split(" + ")]
    assert min(operands) >= 0 and max(operands) <= 99
    one_digit = sum(v < 10 for v in operands) / len(operands)
    assert 0.4 < one_digit < 0.6  # mixed 1- and 2-digit operands
    again = build_task({**ARITH, "n_examples": 2000, "n_test": 200}, renderer)
    assert again.train_problems() == train and again.test_problems() == test
    other = build_task({**ARITH, "n_examples": 2000, "n_test": 200, "seed": 1}, renderer)
    assert other.train_problems() != train and other.test_problems() != test
    assert task.test_problems(10) == test[:10]
    one = build_task({**ARITH, "max_digits": 1, "n_test": 40}, renderer)
    assert max(int(v) for p in one.train_problems() for v in p.question[8:-1].split(" + ")) <= 9


def test_arithmetic_too_many_test_items(tiny) -> None:
    with pytest.raises(ValueError, match="n_test=60"):
        build_task({**ARITH, "max_digits": 1, "n_test": 60}, tiny[1])


# ------------------------------------------------------------------ registry and records
def test_unknown_env_name_and_field(tiny) -> None:
    with pytest.raises(ValueError, match="unknown env name 'mnist'.*arithmetic.*gsm8k"):
        build_task({"name": "mnist"}, tiny[1])
    with pytest.raises(ValueError, match="does not take field.*'digits'"):
        build_task({**ARITH, "digits": 3}, tiny[1])
    # a key added on the command line reaches the task through the typed config, and is refused there too
    from trainer.config.compose import run_config

    with pytest.raises(ValueError, match="does not take field.*'digits'"):
        build_task(run_config(["env=arithmetic", "+env.digits=3"]).env, tiny[1])


def test_the_target_selects_the_task_class(tiny) -> None:
    """`_target_` is the one selector (as for losses); a mapping without it takes its named env's."""
    from envs.arithmetic import ArithmeticTask

    task = build_task({**ARITH, "name": "my_sums", "_target_": "envs.arithmetic.ArithmeticTask"}, tiny[1])
    assert type(task) is ArithmeticTask
    with pytest.raises(ValueError, match="names no importable class"):
        build_task({**ARITH, "_target_": "envs.arithmetic.NoSuchTask"}, tiny[1])
    with pytest.raises(TypeError, match="not an envs.types.Task subclass"):
        build_task({**ARITH, "_target_": "envs.types.Problem"}, tiny[1])


def test_eval_items_come_from_the_eval_envs_test_split() -> None:
    """One source for an eval's size: eval.n_examples, else the eval env's whole test split (GSM8K's
    1319 items, the vendored file's count; arithmetic's n_test)."""
    from trainer.config.compose import run_config
    from trainer.config.schema import GSM8K_TEST_ITEMS, eval_items

    lines = (gsm8k_data.VENDORED_DIR / "test.jsonl").read_text().splitlines()
    assert GSM8K_TEST_ITEMS == len([x for x in lines if x.strip()]) == 1319
    assert eval_items(run_config(["env=gsm8k", "eval=gsm8k_test"])) == 1319
    assert eval_items(run_config(["env=arithmetic", "env.n_test=37", "eval=arithmetic"])) == 37
    assert eval_items(run_config(["env=arithmetic", "eval=gsm8k_test"])) == 1319
    assert eval_items(run_config(["env=gsm8k", "eval=arithmetic"])) == 200  # arithmetic's default
    assert eval_items(run_config(["env=gsm8k", "eval=gsm8k_test", "eval.n_examples=12"])) == 12


def test_test_problems_bounds(tiny) -> None:
    task = build_task(ARITH, tiny[1])
    with pytest.raises(ValueError, match="has 100"):
        task.test_problems(101)
    with pytest.raises(ValueError, match="n >= 1"):
        task.test_problems(0)


def test_structured_config_objects(tiny) -> None:
    """The typed env configs (the trainer passes a Config's `env`), and a mapping (here an OmegaConf node)."""
    from omegaconf import OmegaConf

    from trainer.config.schema import ArithmeticEnvConfig, GSM8KEnvConfig

    a = build_task(ArithmeticEnvConfig(n_examples=20, n_test=10), tiny[1])
    assert len(a.train_problems()) == 20 and a.max_tokens == 64
    g = build_task(GSM8KEnvConfig(n_examples=3), tiny[1])
    assert len(g.train_problems()) == 3 and g.max_tokens == 512
    node = OmegaConf.merge(OmegaConf.structured(ArithmeticEnvConfig), {"n_examples": 20, "n_test": "${.n_examples}"})
    assert len(build_task(node, tiny[1]).test_problems(20)) == 20
    with pytest.raises(TypeError, match="dataclass or a mapping"):
        build_task("arithmetic", tiny[1])


def test_problem_sha256() -> None:
    p = Problem(0, "What is 1 + 2?", "3")
    assert problem_sha256(p) == hashlib.sha256(b"What is 1 + 2?").hexdigest()
    assert problem_sha256(Problem(5, "What is 1 + 2?", "4")) == problem_sha256(p)
    assert problem_sha256(Problem(0, "What is 1 + 3?", "4")) != problem_sha256(p)
