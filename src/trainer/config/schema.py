"""Structured-config schemas: one dataclass per Hydra group option, registered in the ConfigStore.

Hydra composes `conf/` against these schemas, so an unknown key or a value of the wrong type
fails at composition with the full key in the message. Range checks live in `__post_init__`;
`validate()` converts each group to its dataclass (which runs them) and prefixes the group name,
so `loss.clip_eps=-1` fails with "loss.clip_eps must be > 0 ...". Mapping groups 1:1 onto
dataclasses follows verl's config layout (verl/workers/config/actor.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from trainer.config.checks import ConfigError
from trainer.config.checks import in_set as _in_set
from trainer.config.checks import nonneg_int as _nonneg_int
from trainer.config.checks import number as _number
from trainer.config.checks import positive_int as _positive_int
from trainer.config.checks import require as _require
from trainer.config.enums import (
    ADVANTAGES,
    DECISION_METHOD_CHOICES,
    DECISION_METHODS,  # noqa: F401 - re-exported: the tests check every module shares one list
    DPPO_DEFAULT_DELTA,
    ENDPOINTS,
    ENGINE_DTYPES,
    LOGGERS,
    LOSS_PATHS,
    LR_SCHEDULES,
    MAX_SAMPLER_LOGIT_NOISE,
    SAMPLER_QUANTS,
    SAMPLING_COUPLINGS,
    SAMPLING_REQUESTS,
    TOKENIZER_KINDS,
    WANDB_MODES,
)
from trainer.config.enums import CONVO_PREFIXES as _CONVO_PREFIXES
from trainer.config.losses import (  # noqa: F401 - the loss configs are re-exported beside the other groups'
    LOSS_SCHEMAS,
    CISPOLossConfig,
    DPPOLossConfig,
    GRPOLossConfig,
    GSPOLossConfig,
    ImportanceSamplingLossConfig,
    LossCommonConfig,
)


# ----------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    # short name of this model option (used in run names and reports)
    name: str = MISSING
    # model id sent to create_lora_training_client (Tinker model name or local-engine model)
    base_model: str = MISSING
    # cookbook renderer name used to build prompts and parse completions
    renderer: str = MISSING
    # how the client-side tokenizer is built: local | tml_qwen3_5 | hf
    tokenizer: str = "hf"
    # LoRA rank (adapter dimension)
    lora_rank: int = 32
    # LoRA alpha (scale = alpha / rank); the local engine only, Tinker fixes its own
    lora_alpha: float = 32.0
    # train LoRA adapters on the MLP projections
    train_mlp: bool = True
    # train LoRA adapters on the attention projections
    train_attn: bool = True
    # train a LoRA adapter on the unembedding (lm_head)
    train_unembed: bool = False
    # maximum total sequence length, prompt + completion (tokens)
    max_seq_len: int = 1024

    def __post_init__(self) -> None:
        _positive_int("lora_rank", self.lora_rank)
        _require(self.lora_alpha > 0, "lora_alpha", "must be > 0", self.lora_alpha)
        _in_set("tokenizer", self.tokenizer, TOKENIZER_KINDS)
        _require(self.max_seq_len >= 16, "max_seq_len", "must be >= 16", self.max_seq_len)
        _require(self.train_mlp or self.train_attn or self.train_unembed, "train_mlp",
                 "(or train_attn / train_unembed) must be true: no LoRA target", False)


# ----------------------------------------------------------------------------- optimizer
@dataclass
class AdamWConfig:
    # optimizer family (Tinker's AdamParams)
    name: str = "adamw"
    # peak learning rate
    lr: float = 2e-5
    # Adam first-moment decay
    beta1: float = 0.9
    # Adam second-moment decay
    beta2: float = 0.95
    # Adam denominator epsilon
    eps: float = 1e-8
    # decoupled weight decay (per step, multiplied by lr)
    weight_decay: float = 0.0
    # global gradient-norm clip; 0 = off
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        _require(0 < self.lr < 1, "lr", "must be in (0, 1)", self.lr)
        _require(0 <= self.beta1 < 1, "beta1", "must be in [0, 1)", self.beta1)
        _require(0 <= self.beta2 < 1, "beta2", "must be in [0, 1)", self.beta2)
        _require(self.eps > 0, "eps", "must be > 0", self.eps)
        _require(self.weight_decay >= 0, "weight_decay", "must be >= 0", self.weight_decay)
        _require(self.grad_clip_norm >= 0, "grad_clip_norm", "must be >= 0 (0 = off)", self.grad_clip_norm)


# ----------------------------------------------------------------------------- schedule
@dataclass
class ScheduleConfig:
    # short name of this schedule option
    name: str = MISSING
    # number of rollout steps (each: sample a batch, then updates_per_batch optimizer steps)
    num_steps: int = 10
    # prompts (groups) per rollout step
    groups_per_batch: int = 8
    # samples per prompt (group size)
    group_size: int = 4
    # minibatches per rollout batch = optimizer steps per rollout step
    updates_per_batch: int = 1
    # save_state every this many rollout steps (0 = only at the end)
    save_every: int = 5
    # learning-rate schedule over optimizer steps: constant | linear | cosine
    lr_schedule: str = "constant"
    # linear warmup length (optimizer steps)
    warmup_steps: int = 0
    # final lr as a fraction of the peak lr (linear and cosine)
    min_lr_ratio: float = 0.0
    # skip training on groups whose rewards are all equal (zero advantage: zero gradient under the
    # sum aggregation, as cookbook remove_constant_reward_groups); at least one datum per update stays
    drop_constant_groups: bool = False

    def __post_init__(self) -> None:
        for key in ("num_steps", "groups_per_batch", "group_size", "updates_per_batch"):
            _positive_int(key, getattr(self, key))
        _nonneg_int("save_every", self.save_every)
        _nonneg_int("warmup_steps", self.warmup_steps)
        _in_set("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        _require(self.updates_per_batch <= self.groups_per_batch * self.group_size, "updates_per_batch",
                 f"must be <= rollouts per step ({self.groups_per_batch * self.group_size})",
                 self.updates_per_batch)


# ----------------------------------------------------------------------------- env
#: items in GSM8K's test split (openai/gsm8k `main`, the vendored test.jsonl; tests/test_envs.py counts them)
GSM8K_TEST_ITEMS = 1319


@dataclass
class EnvCommonConfig:
    """What every env config has: the Task class it builds and its name; each env's config subclasses it."""

    # the Task class built from the other fields (envs.build_task), as a loss's `_target_`
    _target_: str = MISSING
    # task name (the env's label; `eval.task` names an env by it)
    name: str = MISSING

    def test_items(self) -> int:
        """The size of the test split a whole-split eval scores."""
        raise NotImplementedError

    def data_source(self) -> str:
        """Where the train set comes from (said when it turns out empty)."""
        raise NotImplementedError


@dataclass
class GSM8KEnvConfig(EnvCommonConfig):
    # the Task class built from the other fields (envs.build_task), as a loss's `_target_`
    _target_: str = "envs.gsm8k.GSM8KTask"
    # task name (the env's label; `eval.task` names an env by it)
    name: str = "gsm8k"
    # data source: vendored | openai/gsm8k (HF hub id) | a folder holding train.jsonl and test.jsonl
    source: str = "vendored"
    # seed of the train-set shuffle (fixes the data order, identical across arms)
    seed: int = 0
    # cap on train examples after the shuffle (null = all 7473)
    n_examples: Optional[int] = None
    # few-shot conversation prefix: standard (cookbook) | none
    convo_prefix: str = "standard"
    # reward penalty for a missing \\boxed{} or stop token (cookbook format_coef)
    format_coef: float = 0.1
    # optional system message prepended to every prompt
    system_prompt: Optional[str] = None
    # completion budget per sample (tokens)
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if self.n_examples is not None:
            _positive_int("n_examples", self.n_examples)
        _in_set("convo_prefix", self.convo_prefix, _CONVO_PREFIXES)
        _require(self.format_coef >= 0, "format_coef", "must be >= 0", self.format_coef)
        _positive_int("max_tokens", self.max_tokens)

    def test_items(self) -> int:
        """The size of the test split a whole-split eval scores."""
        return GSM8K_TEST_ITEMS

    def data_source(self) -> str:
        """Where the train set comes from (said when it turns out empty)."""
        return f"env.source={self.source!r}"


@dataclass
class ArithmeticEnvConfig(EnvCommonConfig):
    # the Task class built from the other fields (envs.build_task), as a loss's `_target_`
    _target_: str = "envs.arithmetic.ArithmeticTask"
    # task name (the env's label; `eval.task` names an env by it)
    name: str = "arithmetic"
    # seed of the problem generator (fixes the data, identical across arms)
    seed: int = 0
    # number of generated train problems
    n_examples: int = 2000
    # number of generated held-out test problems (disjoint from train)
    n_test: int = 200
    # largest number of digits of an operand (1 = 0-9, 2 = 0-99)
    max_digits: int = 2
    # smallest number of digits of an operand
    min_digits: int = 1
    # few-shot conversation prefix: none (plain prompt) | standard (cookbook)
    convo_prefix: str = "none"
    # reward penalty for a missing stop token (cookbook format_coef)
    format_coef: float = 0.1
    # optional system message prepended to every prompt
    system_prompt: Optional[str] = None
    # completion budget per sample (tokens)
    max_tokens: int = 64

    def __post_init__(self) -> None:
        _positive_int("n_examples", self.n_examples)
        _positive_int("n_test", self.n_test)
        _require(1 <= self.max_digits <= 6, "max_digits", "must be in [1, 6]", self.max_digits)
        _require(1 <= self.min_digits <= self.max_digits, "min_digits", "must be in [1, max_digits]",
                 self.min_digits)
        _in_set("convo_prefix", self.convo_prefix, _CONVO_PREFIXES)
        _require(self.format_coef >= 0, "format_coef", "must be >= 0", self.format_coef)
        _positive_int("max_tokens", self.max_tokens)

    def test_items(self) -> int:
        """The size of the test split a whole-split eval scores."""
        return self.n_test

    def data_source(self) -> str:
        """Where the train set comes from (said when it turns out empty)."""
        return f"generated from env.seed={self.seed}"


# ----------------------------------------------------------------------------- eval
@dataclass
class EvalConfig:
    # eval name; the per-item file is eval/<name>.jsonl ('none' disables eval)
    name: str = "none"
    # which env's test split to evaluate: an env name (gsm8k | arithmetic; null = no eval)
    task: Optional[str] = None
    # number of test items (null = all)
    n_examples: Optional[int] = None
    # evaluate every this many rollout steps (0 = only at the end)
    every: int = 0
    # also evaluate the initial weights before the first step, and compare the final eval with it
    at_start: bool = False
    # completion budget per item (tokens)
    max_tokens: int = 512
    # maximum eval requests in flight at once
    concurrency: int = 512
    # samples per item: 1 = one greedy completion (correct 0/1); K > 1 = K samples at eval.temperature, the
    # item's score being its fraction correct (less eval noise per item, K times the sampling)
    samples_per_item: int = 1
    # sampling temperature of the K samples (used only when samples_per_item > 1)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _positive_int("samples_per_item", self.samples_per_item)
        _require(self.samples_per_item <= 64, "samples_per_item", "must be <= 64", self.samples_per_item)
        _require(self.temperature > 0, "temperature", "must be > 0", self.temperature)
        if self.n_examples is not None:
            _positive_int("n_examples", self.n_examples)
        _nonneg_int("every", self.every)
        _positive_int("max_tokens", self.max_tokens)
        _positive_int("concurrency", self.concurrency)
        if self.task is not None:
            _in_set("task", self.task, env_names())


# ----------------------------------------------------------------------------- backend
@dataclass
class FaultsConfig:
    # probability that a call fails before doing any work, per call type
    p_sample: float = 0.0
    p_forward_backward: float = 0.0
    p_optim_step: float = 0.0
    p_save_state: float = 0.0
    # added latency per call (seconds)
    latency_s: float = 0.0
    # seed of the fault generator
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("p_sample", "p_forward_backward", "p_optim_step", "p_save_state"):
            v = getattr(self, key)
            _require(0 <= v < 1, key, "must be in [0, 1)", v)
        _require(self.latency_s >= 0, "latency_s", "must be >= 0", self.latency_s)


@dataclass
class BackendCommonConfig:
    """The fields the trainer reads from every backend (the loop, main, setup), stated once here; a
    backend's config subclasses it and may change a default (trainer.backends.Backend declares the rest)."""

    # backend kind (trainer.backends.BACKENDS)
    name: str = MISSING
    # how the loss is computed: auto (one pass where the loss and backend allow it, else two passes with a
    # warning) | one_pass (fail if unavailable) | two_pass (client-side callable)
    loss_path: str = "auto"
    # restoration gate: max |logprob diff| between fresh clients and across save -> restore
    restore_tolerance: float = 1e-6
    # send optim_step right behind forward_backward instead of after its result (no resend in place then:
    # a failure of either redoes the step from the last checkpoint)
    pipeline_optim_step: bool = True
    # seconds a call may wait while no call of the run gets a successful reply; past it the step is redone
    # from the last checkpoint with a new client (null = none: the local engine's calls return or raise)
    call_deadline_s: Optional[float] = None
    # seconds to wait for the backend to answer (the connect check, finishing the session at the end)
    connect_timeout_s: float = 10.0

    def _check_common(self) -> None:
        _in_set("loss_path", self.loss_path, LOSS_PATHS)
        _require(self.restore_tolerance > 0, "restore_tolerance", "must be > 0", self.restore_tolerance)
        if self.call_deadline_s is not None:
            _require(1 <= self.call_deadline_s <= 86400, "call_deadline_s", "must be in [1, 86400] seconds",
                     self.call_deadline_s)
        _require(0 < self.connect_timeout_s <= 25, "connect_timeout_s", "must be in (0, 25]",
                 self.connect_timeout_s)


@dataclass
class LocalBackendConfig(BackendCommonConfig):
    # backend kind
    name: str = "local"
    # where the engine persists checkpoints (null = <run dir>/engine)
    state_dir: Optional[str] = None
    # sampler weight precision: auto (bf16 where it measures faster than fp32 on this CPU, cached per machine) | bfloat16 | float32
    sampler_dtype: str = "auto"
    # training precision: auto | float32 | bfloat16 (bf16 projections, fp32 residual stream and attention)
    train_dtype: str = "auto"
    # sequences per forward/backward micro-batch at most
    micro_batch_size: int = 16
    # padded tokens per micro-batch at most (a longer single sequence still runs alone)
    micro_batch_tokens: int = 2048
    # sequences decoded together by the sampler
    max_sample_batch: int = 128
    # seconds of quiet the sampler waits for more requests before decoding a batch (0 = decode at once;
    # speed only: results do not depend on how requests are batched)
    sample_batch_wait_s: float = 0.01
    # the sampler's projection weights rounded to a serving format and back, training keeping the exact
    # ones (a train-inference mismatch, docs/engine.md): none | fp16 | fp8_e4m3 | int8 | int4
    sampler_quant: str = "none"
    # sd (nats) of seeded Gaussian noise added to the sampler's logits at every sampled token, in [0, 10]
    # (0 = none)
    sampler_logit_noise: float = 0.0
    # torch CPU threads (null = torch default)
    num_threads: Optional[int] = None
    # injected faults (testing the trainer's retry and resume paths)
    faults: FaultsConfig = field(default_factory=FaultsConfig)

    def __post_init__(self) -> None:
        self._check_common()
        _in_set("sampler_dtype", self.sampler_dtype, ENGINE_DTYPES)
        _in_set("train_dtype", self.train_dtype, ENGINE_DTYPES)
        _positive_int("micro_batch_size", self.micro_batch_size)
        _positive_int("micro_batch_tokens", self.micro_batch_tokens)
        _positive_int("max_sample_batch", self.max_sample_batch)
        _require(self.sample_batch_wait_s >= 0, "sample_batch_wait_s", "must be >= 0", self.sample_batch_wait_s)
        _in_set("sampler_quant", self.sampler_quant, SAMPLER_QUANTS)
        _number("sampler_logit_noise", self.sampler_logit_noise)
        _require(0 <= self.sampler_logit_noise <= MAX_SAMPLER_LOGIT_NOISE, "sampler_logit_noise",
                 f"must be in [0, {MAX_SAMPLER_LOGIT_NOISE:g}] (nats)", self.sampler_logit_noise)
        if self.num_threads is not None:
            _positive_int("num_threads", self.num_threads)


@dataclass
class TinkerBackendConfig(BackendCommonConfig):
    # backend kind
    name: str = "tinker"
    # service URL; null = $TINKER_BASE_URL or the SDK default
    base_url: Optional[str] = None
    # environment variable holding the API key (the key itself is never stored in configs)
    api_key_env: str = "TINKER_API_KEY"
    # a service's calls can hang: at most retry.max_attempts redone steps in a row, then the run ends with an
    # error. Keep it above the longest single call (a queued forward_backward)
    call_deadline_s: Optional[float] = 600.0
    # bf16 GPUs serving separate clients agree to ~1e-2, not to the embedded engine's 1e-6
    restore_tolerance: float = 0.02

    def __post_init__(self) -> None:
        _require(self.call_deadline_s is not None, "call_deadline_s",
                 "must be set for a service (in [1, 86400] seconds)", self.call_deadline_s)
        self._check_common()


# ----------------------------------------------------------------------------- logger
@dataclass
class LoggerConfig:
    # logger kind: jsonl (metrics.jsonl only) | wandb (metrics.jsonl + Weights & Biases)
    name: str = "jsonl"
    # wandb project
    project: str = "pairedrl"
    # wandb entity (null = the account default)
    entity: Optional[str] = None
    # wandb group; runs of one sweep share it (null = the sweep folder name)
    group: Optional[str] = None
    # wandb mode: online | offline | auto (WANDB_MODE if set, else offline when WANDB_API_KEY is unset);
    # WANDB_MODE=offline|disabled in the environment wins over any mode
    mode: str = "auto"
    # rollouts written to rollouts.jsonl per step
    rollouts_per_step: int = 4

    def __post_init__(self) -> None:
        _in_set("name", self.name, LOGGERS)
        _in_set("mode", self.mode, WANDB_MODES)
        _nonneg_int("rollouts_per_step", self.rollouts_per_step)


# ----------------------------------------------------------------------------- top level
@dataclass
class SamplingConfig:
    # sampling temperature for rollouts
    temperature: float = 1.0
    # completion budget per rollout (tokens)
    max_tokens: int = 512
    # nucleus sampling mass (1 = off)
    top_p: float = 1.0
    # top-k sampling (-1 = off)
    top_k: int = -1
    # maximum sample requests in flight at once
    concurrency: int = 256
    # how a group is requested: per_group (one request, num_samples = group_size) | per_sample (one request
    # per sample, each with its own derived seed) | auto (per_sample on backend=tinker, where a seeded
    # request with num_samples > 1 may return identical samples; per_group on the local engine, whose
    # seeded request draws each sample independently)
    requests: str = "auto"
    # how the local engine draws a token: inverse_cdf (one uniform per row and step) | gumbel (Gumbel-max over
    # the tempered vocabulary with noise keyed by seed, sample, position and token id, so two arms at one
    # seed draw the same token wherever their distributions allow; backend=local only)
    coupling: str = "inverse_cdf"

    def __post_init__(self) -> None:
        _in_set("requests", self.requests, SAMPLING_REQUESTS)
        _in_set("coupling", self.coupling, SAMPLING_COUPLINGS)
        _require(self.temperature > 0, "temperature", "must be > 0 for RL rollouts", self.temperature)
        _positive_int("max_tokens", self.max_tokens)
        _require(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _require(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1", self.top_k)
        _positive_int("concurrency", self.concurrency)


@dataclass
class RetryConfig:
    # attempts per client call before giving up (1 = no retry)
    max_attempts: int = 5
    # first backoff delay (seconds), doubled each attempt
    backoff_s: float = 0.5
    # longest backoff delay (seconds)
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        _positive_int("max_attempts", self.max_attempts)
        _require(self.backoff_s >= 0, "backoff_s", "must be >= 0", self.backoff_s)
        _require(self.max_backoff_s >= self.backoff_s, "max_backoff_s", "must be >= backoff_s",
                 self.max_backoff_s)


@dataclass
class PreflightConfig:
    # skip the check that all preflight gates passed before a sweep
    skip: bool = True
    # folder holding preflight/<gate>.json (null = ./preflight_runs/<experiment>)
    dir: Optional[str] = None
    # wall-clock budget of the full plan (minutes), checked by the feasibility gate
    budget_minutes: float = 120.0
    # model names the service may serve for this plan (null = model.base_model)
    planned_models: Optional[list[str]] = None
    # rollout steps of the activation/feasibility pilot
    pilot_steps: int = 5
    # eval items timed by the pilot
    pilot_eval_items: int = 8

    def __post_init__(self) -> None:
        _require(self.budget_minutes > 0, "budget_minutes", "must be > 0", self.budget_minutes)
        _positive_int("pilot_steps", self.pilot_steps)
        _positive_int("pilot_eval_items", self.pilot_eval_items)


@dataclass
class DecisionConfig:
    # the pre-registered test: auto | paired_hoeffding | mcnemar_exact | paired_bootstrap | seed_t (over seeds)
    # | sign_flip (exact, over seeds);
    # auto = seed_t with >= 2 seeds per arm (a verdict about the training procedure), paired_hoeffding with one
    method: str = "auto"
    # two-sided error rate of the rule's interval / test (Holm-adjusted over several treatments)
    alpha: float = 0.05
    # `validated` needs the interval's lower bound above this gain (accuracy points as a fraction)
    margin: float = 0.0
    # what is compared: final (accuracy at the end) | step (accuracy at decision.step) | auc (per-item
    # area under the eval curve over the eval.every evals)
    endpoint: str = "final"
    # the eval step of endpoint=step (a multiple of eval.every, or schedule.num_steps)
    step: Optional[int] = None
    # the smallest gain the plan must be able to detect (the design gate fails if it cannot); null = none
    target_effect: Optional[float] = None
    # power at which the design step reports minimum detectable effects
    power: float = 0.8
    # loss of the baseline arm; every other loss of a sweep is a treatment compared against it
    baseline: str = "grpo"
    # accuracy the steps-to-threshold endpoint waits for (null = the baseline's final accuracy)
    threshold: Optional[float] = None
    # design assumption: share of items on which the two arms disagree (null = 0.3, stated as assumed)
    discordance: Optional[float] = None
    # design assumption: between-seed sd of one arm's accuracy, as an A/A sweep measures it (null = 0)
    seed_sd: Optional[float] = None
    # what target_effect is a gain of: procedure (the loss, across training runs; needs a seed-level method)
    # | checkpoints (the trained checkpoints) | null (the decision method's own scope)
    target_scope: Optional[str] = None
    # `equivalent` (two one-sided tests) when the rule's two-sided interval lies inside +-this gain (0.02 = 2
    # accuracy points); null = off (eval.compare then never says `equivalent`)
    equivalence_margin: Optional[float] = None
    # seeds per arm at which compare may decide, increasing (e.g. [3, 6, 10]): alpha is spent over them
    # (O'Brien-Fleming-like), and a look before the last says `inconclusive` and names the next; null = one look
    looks: Optional[list[int]] = None
    # what the design gate does with a plan whose rule is miscalibrated (false positives above alpha under the
    # stated seed sd, an item-level method for a procedure-level target, seed sd left at 0 with several seeds):
    # fail | warn
    design_problems: str = "fail"

    def __post_init__(self) -> None:
        _in_set("method", self.method, DECISION_METHOD_CHOICES)
        _require(0 < self.alpha < 1, "alpha", "must be in (0, 1)", self.alpha)
        _require(0 <= self.margin < 1, "margin", "must be in [0, 1)", self.margin)
        _in_set("endpoint", self.endpoint, ENDPOINTS)
        if self.endpoint == "step":
            _require(self.step is not None, "step", "must be set when endpoint=step", self.step)
        if self.step is not None:
            _nonneg_int("step", self.step)
        if self.target_effect is not None:
            _require(0 < self.target_effect <= 1, "target_effect", "must be in (0, 1] or null",
                     self.target_effect)
        _require(0 < self.power < 1, "power", "must be in (0, 1)", self.power)
        # the exact test has no shift parameter: a margin needs an interval method
        _require(self.method != "mcnemar_exact" or self.margin == 0, "margin",
                 "must be 0 with method=mcnemar_exact (use paired_hoeffding, paired_bootstrap or seed_t "
                 "for a margin)", self.margin)
        if self.threshold is not None:
            _require(0 < self.threshold <= 1, "threshold", "must be in (0, 1] or null", self.threshold)
        if self.discordance is not None:
            _require(0 < self.discordance <= 1, "discordance", "must be in (0, 1] or null", self.discordance)
        if self.seed_sd is not None:
            _require(0 <= self.seed_sd < 1, "seed_sd", "must be in [0, 1) or null", self.seed_sd)
        if self.target_scope is not None:
            _in_set("target_scope", self.target_scope, ("procedure", "checkpoints"))
        _in_set("design_problems", self.design_problems, ("fail", "warn"))
        if self.equivalence_margin is not None:
            _require(0 < self.equivalence_margin < 1, "equivalence_margin", "must be in (0, 1) or null",
                     self.equivalence_margin)
        if self.looks is not None:
            looks = list(self.looks)
            _require(len(looks) >= 1 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 2
                                             for x in looks) and looks == sorted(set(looks)), "looks",
                     "must be null or increasing seeds per arm, each >= 2 (e.g. [3, 6, 10])", self.looks)
            _require(self.method not in ("paired_hoeffding", "mcnemar_exact", "paired_bootstrap"), "looks",
                     "needs a seed-level method (auto, seed_t or sign_flip): looks add seeds", self.method)
@dataclass
class ReportConfig:
    # write report.md with PNG plots into the run folder at the end of a run (python -m eval.report)
    enabled: bool = True


def arm_name(config: Config) -> str:
    """The arm label: one loss x one seed, unless run_name overrides it."""
    return config.run_name or f"{config.loss.name}_seed{config.seed}"


GROUPS = ("model", "loss", "optimizer", "schedule", "env", "eval", "backend", "logger")


@dataclass
class Config:
    # group options (selected in conf/config.yaml's defaults list)
    model: ModelConfig = MISSING
    loss: LossCommonConfig = MISSING
    optimizer: AdamWConfig = MISSING
    schedule: ScheduleConfig = MISSING
    env: EnvCommonConfig = MISSING
    eval: EvalConfig = MISSING
    backend: BackendCommonConfig = MISSING
    logger: LoggerConfig = MISSING
    # experiment name (recorded in run_info.json; compare refuses runs of different experiments)
    experiment: str = "default"
    # arm name shown in logs and wandb (null = <loss>_seed<seed>)
    run_name: Optional[str] = None
    # seed of LoRA init and sampling (the data order comes from env.seed: the same for every seed)
    seed: int = 0
    # advantage estimator: group_mean (cookbook) | group_zscore | none
    advantage: str = "group_mean"
    # require a checkpoint.json in the run folder (resuming from it is automatic either way)
    resume: bool = False
    # rollout sampling parameters
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # retry policy for transient backend errors
    retry: RetryConfig = field(default_factory=RetryConfig)
    # preflight gate settings
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    # the pre-registered decision rule of eval.compare (part of the plan hash)
    decision: DecisionConfig = field(default_factory=DecisionConfig)
    # the per-run report written at the end
    report: ReportConfig = field(default_factory=ReportConfig)
    # checkpoint to evaluate (python -m eval.run checkpoint=<path>)
    checkpoint: Optional[str] = None

    def __post_init__(self) -> None:
        _check_top_level(self.advantage, self.seed)


def _check_top_level(advantage: str, seed: int) -> None:
    """The top-level scalars' checks (validate() runs them without building a whole Config)."""
    _in_set("advantage", advantage, ADVANTAGES)
    _nonneg_int("seed", seed)


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "model": {"model_schema": ModelConfig},
    "loss": dict(LOSS_SCHEMAS),
    "optimizer": {"adamw_schema": AdamWConfig},
    "schedule": {"schedule_schema": ScheduleConfig},
    "env": {"gsm8k_schema": GSM8KEnvConfig, "arithmetic_schema": ArithmeticEnvConfig},
    "eval": {"eval_schema": EvalConfig},
    "backend": {"local_schema": LocalBackendConfig, "tinker_schema": TinkerBackendConfig},
    "logger": {"logger_schema": LoggerConfig},
}


def env_names() -> tuple[str, ...]:
    """The env names the config knows: one per schema in `GROUP_SCHEMAS["env"]`."""
    return tuple(cls.name for cls in GROUP_SCHEMAS["env"].values())


def env_schema(name: str) -> type:
    """The typed config class of the env called `name`."""
    for cls in GROUP_SCHEMAS["env"].values():
        if cls.name == name:
            return cls
    raise ConfigError(f"env: unknown env name {name!r}; available: {sorted(env_names())}")


def eval_items(config: Config) -> int:
    """How many items one eval scores: `eval.n_examples`, else the whole test split of the eval's env
    (the train env's own config when the eval names it, else that env's schema defaults, as
    `trainer.setup.eval_task` builds it)."""
    if config.eval.n_examples:
        return int(config.eval.n_examples)
    name = config.eval.task or config.env.name
    env = config.env if name == config.env.name else env_schema(name)()
    return int(env.test_items())


def _dppo_default_delta(mode: str) -> float | None:
    return DPPO_DEFAULT_DELTA.get(mode)  # an unknown mode is reported by DPPOLossConfig's own check


def register_configs() -> None:
    """Register every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    # conf/loss/dppo.yaml: `delta: ${dppo_default_delta:${.mode}}`, so the resolved config (and its
    # hash) states the threshold the loss uses, and switching `loss.mode` switches the default with it
    OmegaConf.register_new_resolver("dppo_default_delta", _dppo_default_delta, replace=True)
    for group, options in GROUP_SCHEMAS.items():
        for name, node in options.items():
            cs.store(group=group, name=name, node=node)


def validate(cfg: DictConfig) -> Config:
    """The run's typed config: every group converted to its dataclass (which runs its range checks), the
    top-level checks, the cross-group ones; a failure is a ConfigError naming `<group>.<key>`.

    The entry points (train.py, the preflight, eval.run, eval.design) call it once on the composed config
    and pass the result down; nothing outside `trainer.config` reads the composed DictConfig."""
    objects: dict[str, Any] = {}
    for group in GROUPS:
        node = cfg.get(group)
        if node is None:
            raise ConfigError(f"{group}: missing config group (add '{group}=<option>' to the defaults)")
        try:
            objects[group] = OmegaConf.to_object(node)
        except ConfigError as e:
            raise ConfigError(f"{group}.{e}") from None
    for key in ("sampling", "retry", "preflight", "decision"):
        try:
            objects[key] = OmegaConf.to_object(cfg[key])
        except ConfigError as e:
            raise ConfigError(f"{key}.{e}") from None
    _check_top_level(cfg.advantage, cfg.seed)
    _check_group_advantage(cfg.advantage, objects["schedule"].group_size)
    _check_coupling_backend(objects["sampling"].coupling, objects["backend"].name)
    names = [f.name for f in dataclasses.fields(Config)]
    for key in names + [k for k in cfg if k not in names and k != "hydra"]:
        if key not in objects:
            node = cfg[key]
            try:
                objects[key] = OmegaConf.to_object(node) if OmegaConf.is_config(node) else node
            except ConfigError as e:
                raise ConfigError(f"{key}.{e}") from None
    config = Config(**{k: objects[k] for k in names})
    # a key added on the command line (`+key=...`), kept as OmegaConf.to_object keeps one inside a group:
    # an attribute beside the fields, so that config.yaml and the hashes still state it
    for key in [k for k in objects if k not in names]:
        setattr(config, key, objects[key])
    return config


def config_dict(config: Config) -> dict[str, Any]:
    """The typed config as plain dicts and lists, in the schema's key order: what config.yaml, the config
    and plan hashes, run_info.json and wandb are written from. It is the composed config's own resolved
    container, key for key and in the same order (tests/test_config.py checks every option), so that runs
    written before the typed config reached the runtime still resume and compare."""
    return _plain(config)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        # then the keys a `+group.key=...` override added, which OmegaConf.to_object sets as attributes
        names += [k for k in vars(value) if k not in names]
        return {k: _plain(getattr(value, k)) for k in names}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def config_yaml(d: dict[str, Any]) -> str:
    """config.yaml's text of a config dict (`config_dict`, secrets replaced)."""
    return OmegaConf.to_yaml(OmegaConf.create(d))


def composed_dict(cfg: DictConfig) -> dict[str, Any]:
    """A composed config before validation as plain dicts (interpolations resolved where they resolve,
    Hydra's own node dropped): the secrets a run must not write are read from it before anything can
    fail, and the preflight diffs the arms' composed configs with it."""
    try:
        d = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - a broken interpolation is reported by validate(); read it as written
        d = OmegaConf.to_container(cfg, resolve=False)
    d.pop("hydra", None)  # type: ignore[union-attr]
    return d  # type: ignore[return-value]


def _check_coupling_backend(coupling: str, backend: str) -> None:
    """Gumbel coupling is the local engine's own draw: the Tinker protocol cannot ask a service for it."""
    if coupling != "inverse_cdf" and backend != "local":
        raise ConfigError(f"sampling.coupling={coupling} needs backend=local (a service draws tokens its own "
                          f"way and the Tinker protocol cannot ask for another), got backend={backend}")


def _check_group_advantage(advantage: str, group_size: int) -> None:
    """A group-relative advantage subtracts the group's mean: a group of one sample gets advantage 0 on
    every rollout, and the run would train nothing."""
    if advantage != "none" and group_size < 2:
        raise ConfigError(f"schedule.group_size={group_size} with advantage={advantage}: every advantage is the "
                          "reward minus its group's mean, 0 for a group of one, so the run would train nothing; "
                          "use schedule.group_size >= 2 (or advantage=none)")
