"""Backend factory: a Tinker-style ServiceClient, real or embedded. Nothing above knows which."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


class BackendConfigError(RuntimeError):
    pass


def build_service_client(cfg: DictConfig, run_dir: Path) -> Any:
    b = cfg.backend
    if b.name == "tinker":
        return _tinker_client(b)
    if b.name == "local":
        from trainer.backends.local import LocalServiceClient

        f = b.faults
        faults = {k: float(v) for k, v in f.items()} if any(
            float(f[k]) > 0 for k in ("p_sample", "p_forward_backward", "p_optim_step", "p_save_state",
                                      "latency_s")) else None
        try:
            return LocalServiceClient(
                state_dir=Path(b.state_dir) if b.state_dir else Path(run_dir) / "engine",
                sampler_dtype=b.sampler_dtype, train_dtype=b.train_dtype, micro_batch_size=b.micro_batch_size,
                micro_batch_tokens=b.micro_batch_tokens,
                max_sample_batch=b.max_sample_batch, lora_alpha=cfg.model.lora_alpha, num_threads=b.num_threads,
                sample_batch_wait_s=b.sample_batch_wait_s, faults=faults)
        except ValueError as e:  # a bad setting or environment variable, before any model is loaded
            raise BackendConfigError(f"backend=local: {e}") from None
    raise BackendConfigError(f"backend.name: unknown backend {b.name!r} (local | tinker)")


def _tinker_client(b: DictConfig) -> Any:
    key = os.environ.get(b.api_key_env)
    if not key:
        raise BackendConfigError(
            f"backend=tinker needs an API key: set the environment variable {b.api_key_env} "
            "(and TINKER_BASE_URL for a non-default deployment), or run with backend=local")
    import tinker

    kwargs: dict[str, Any] = {"api_key": key}
    base_url = b.base_url or os.environ.get("TINKER_BASE_URL")
    if base_url:
        kwargs["base_url"] = base_url
    return tinker.ServiceClient(**kwargs)
