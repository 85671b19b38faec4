"""The allowed values of the config's choice keys, stated once.

The schema checks a config against these tuples and the runtime imports the same objects (the loss
plugins, the aggregation, the envs, eval's decision rules), so a new option is added in one place.
Plain Python only: the config package is imported by CLIs that must not pay for torch.
"""

from __future__ import annotations

# ----------------------------------------------------------------------------- model
#: how the client-side tokenizer is built (envs/tokenizers.py)
TOKENIZER_KINDS: tuple[str, ...] = ("local", "tml_qwen3_5", "hf")

# ----------------------------------------------------------------------------- loss
#: token-loss aggregations (trainer/losses/aggregate.py)
AGGREGATIONS: tuple[str, ...] = (
    "sum",
    "token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_mean",
    "seq_mean_token_sum_norm",
)
#: aggregations that need the constant normaliser `loss.norm_length` (Dr. GRPO's H)
NEEDS_NORM_LENGTH: tuple[str, ...] = ("seq_mean_token_sum_norm",)
#: trust-region anchors: the rollout logprobs, or the trainer's logprobs before the first update
ANCHORS: tuple[str, ...] = ("sampler", "recomputed")
#: divergences of DPPO's trust-region mask (trainer/losses/trust_region.py)
DPPO_MODES: tuple[str, ...] = ("binary_tv", "binary_kl")
#: DPPO's threshold per mode when `loss.delta` is null. Authors' defaults: verl-project/verl
#: examples/dppo_trainer (PR #5397 @ 182383bbb), run_qwen30b_dppo.sh: delta 0.15 for TV, 0.05 for KL.
DPPO_DEFAULT_DELTA: dict[str, float] = {"binary_tv": 0.15, "binary_kl": 0.05}

# ----------------------------------------------------------------------------- schedule, sampling, advantages
#: learning-rate schedules over optimizer steps (trainer/lr_schedule.py)
LR_SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine")
#: how a group's samples are requested (trainer/loop.py)
SAMPLING_REQUESTS: tuple[str, ...] = ("auto", "per_group", "per_sample")
#: how the local sampler turns a distribution into a token (backends/local/generate.py): inverse_cdf (one
#: uniform per row and step from the request's generator) | gumbel (Gumbel-max, noise keyed per token id)
SAMPLING_COUPLINGS: tuple[str, ...] = ("inverse_cdf", "gumbel")
#: advantage estimators (trainer/advantages.py)
ADVANTAGES: tuple[str, ...] = ("group_mean", "group_zscore", "none")

# ----------------------------------------------------------------------------- env, eval
#: few-shot conversation prefixes of the math envs (envs/gsm8k.py, envs/arithmetic.py)
CONVO_PREFIXES: tuple[str, ...] = ("standard", "none")

# ----------------------------------------------------------------------------- backend
#: how the loss is computed: one pass (a registered per-datum loss) or two (a client-side callable)
LOSS_PATHS: tuple[str, ...] = ("auto", "one_pass", "two_pass")
#: local-engine precisions (`auto` picks bf16 where the CPU has native bf16 arithmetic)
ENGINE_DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32")
#: what the local sampler's projection weights are rounded to (backends/local/quant.py; none = exact)
SAMPLER_QUANTS: tuple[str, ...] = ("none", "fp16", "fp8_e4m3", "int8", "int4")
#: the largest `backend.sampler_logit_noise` sigma (nats): far past any serving stack's mismatch already
MAX_SAMPLER_LOGIT_NOISE = 10.0

# ----------------------------------------------------------------------------- logger
#: logger kinds
LOGGERS: tuple[str, ...] = ("jsonl", "wandb")
#: wandb modes (`auto` = offline when WANDB_API_KEY is unset)
WANDB_MODES: tuple[str, ...] = ("online", "offline", "auto")

# ----------------------------------------------------------------------------- decision
#: the pre-registered tests of eval.compare: the deciding classes of eval/methods.py (DECIDING, equal to this)
DECISION_METHODS: tuple[str, ...] = ("paired_hoeffding", "mcnemar_exact", "paired_bootstrap", "seed_t",
                                     "sign_flip")
#: what decision.method may say: one of the tests, or `auto` (seed_t with >= 2 seeds per arm, else
#: paired_hoeffding; eval.methods.resolve_method, recorded in compare.json and the design gate's record)
DECISION_METHOD_CHOICES: tuple[str, ...] = ("auto", *DECISION_METHODS)
#: what eval.compare compares: the final accuracy, the accuracy at one step, the area under the eval curve
ENDPOINTS: tuple[str, ...] = ("final", "step", "auc")
