"""The config's translations into Tinker requests, each written once: the LoRA training client
(`cfg.model`), an optimizer step's Adam parameters (`cfg.optimizer`), the rollouts' sampling
parameters (`cfg.sampling`), and the model a training client says it serves. The loop and the
preflight gates both build their clients and steps from these, so an arm and its gate cannot drift."""

from __future__ import annotations

from typing import Any

import tinker

from trainer.config.schema import AdamWConfig, ModelConfig, SamplingConfig


def create_lora_training_client(service_client: Any, model: ModelConfig, seed: int) -> Any:
    """A fresh LoRA training client for `model` (the config's model group), LoRA init drawn from `seed`;
    blocks until the service has made it."""
    return service_client.create_lora_training_client(
        base_model=model.base_model, rank=model.lora_rank, seed=seed, train_mlp=model.train_mlp,
        train_attn=model.train_attn, train_unembed=model.train_unembed).result()


def adam_params(optimizer: AdamWConfig, learning_rate: float) -> tinker.AdamParams:
    """The Adam parameters of one `optim_step`: the optimizer group's, at `learning_rate` (the run's LR
    schedule picks it per update; the service keeps no schedule, so every step sends its own)."""
    o = optimizer
    return tinker.AdamParams(learning_rate=learning_rate, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                             weight_decay=o.weight_decay, grad_clip_norm=o.grad_clip_norm)


def sampling_params(sampling: SamplingConfig) -> tinker.SamplingParams:
    """The rollouts' sampling parameters from the sampling group; each request adds its own seed, and each
    group its stop sequences and its completion budget under `model.max_seq_len` (rollouts.py)."""
    return tinker.SamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k)


def served_model(info: Any) -> str | None:
    """The model a training client's `get_info()` names: tinker's GetInfoResponse carries it at the top
    level and in `model_data`, either of which may be unset."""
    return getattr(info, "model_name", None) or getattr(getattr(info, "model_data", None), "model_name", None)
