"""`LocalServiceClient`: tinker 0.38's `ServiceClient` surface served in-process on CPU.

LoRA alpha: Tinker does not expose it. `lora_alpha=None` uses 32 for every rank, the value a
third-party Tinker-compatible server assumes (NovaSky-AI/SkyRL `skyrl/tinker/api.py`: "alpha = 32
seems to be the tinker default"); pass `lora_alpha` (e.g. the model config's value) to override.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.lib.public_interfaces.custom_loss import trace_loss

from trainer.backends.local import ckpt
from trainer.backends.local.common import (
    Faults,
    done_future,
    failed_future,
    process_memory_mb,
    resolve_path,
    trim_heap,
)
from trainer.backends.local.engine import (
    BASE_SNAPSHOT,
    LoraSnapshot,
    loaded_bases,
    shared_base,
    target_modules,
)
from trainer.backends.local.plan import EnginePlan, check_environment, resolve_dtypes
from trainer.backends.local.precision import dtype_name
from trainer.backends.local.sampling import LocalSamplingClient, SampleScheduler
from trainer.backends.local.training import LocalTrainingClient
from trainer.config.enums import MAX_SAMPLER_LOGIT_NOISE, SAMPLER_QUANTS, SAMPLING_COUPLINGS
from trainer.config.schema import LocalBackendConfig, SamplingConfig
from trainer.model_registry import SUPPORTED_MODELS

log = logging.getLogger(__name__)

DEFAULT_LORA_ALPHA = 32.0
# the engine's defaults are `backend=local`'s, read from its schema: a client built in code (bench/, a
# notebook) runs as a run with the default config does, not with a second set of defaults
_CONFIG = LocalBackendConfig()
_SAMPLING = SamplingConfig()


def sampler_knobs(quant: Any, logit_noise: Any, coupling: Any) -> dict[str, Any]:
    """The sampler's mismatch knobs and its draw, checked (ValueError naming the option), as run_info.json's
    `engine` record states them: `sampler_quant`, `sampler_logit_noise`, `sampling_coupling`."""
    if quant not in SAMPLER_QUANTS:
        raise ValueError(f"sampler_quant must be one of {list(SAMPLER_QUANTS)}, got {quant!r}")
    if (isinstance(logit_noise, bool) or not isinstance(logit_noise, (int, float))
            or not 0 <= logit_noise <= MAX_SAMPLER_LOGIT_NOISE):  # NaN fails the comparison
        raise ValueError(f"sampler_logit_noise must be a number in [0, {MAX_SAMPLER_LOGIT_NOISE:g}] (nats), "
                         f"got {logit_noise!r}")
    if coupling not in SAMPLING_COUPLINGS:
        raise ValueError(f"sampling_coupling must be one of {list(SAMPLING_COUPLINGS)}, got {coupling!r}")
    return {"sampler_quant": quant, "sampler_logit_noise": float(logit_noise), "sampling_coupling": coupling}


class LocalServiceClient:
    def __init__(self, *, state_dir: str | Path, sampler_dtype: str = _CONFIG.sampler_dtype,
                 train_dtype: str = _CONFIG.train_dtype, micro_batch_size: int = _CONFIG.micro_batch_size,
                 micro_batch_tokens: int = _CONFIG.micro_batch_tokens,
                 max_sample_batch: int = _CONFIG.max_sample_batch,
                 sample_batch_wait_s: float = _CONFIG.sample_batch_wait_s, lora_alpha: float | None = None,
                 num_threads: int | None = None, model_cache_dir: str | Path | None = None,
                 faults: dict[str, Any] | None = None, sampler_quant: str = _CONFIG.sampler_quant,
                 sampler_logit_noise: float = _CONFIG.sampler_logit_noise,
                 sampling_coupling: str = _SAMPLING.coupling, **_tinker_kwargs: Any):
        self.state_dir = Path(state_dir).expanduser().resolve()
        # `auto` decided by the engine plan's rule (`plan.resolve_dtypes`); a bad PAIREDRL_* variable fails
        # here, before any model is loaded
        check_environment()
        self.sampler_dtype, self.train_dtype, self.auto = resolve_dtypes(sampler_dtype, train_dtype)
        # the resolved precision, what a resume checks and the gates' reports name (bf16 noise is ~1e3x
        # fp32's); run_info.json's `engine` record holds it with every other choice (`engine_record`)
        self.precision = {"sampler_dtype": dtype_name(self.sampler_dtype),
                          "train_dtype": dtype_name(self.train_dtype), "auto": self.auto}
        for name, v in (("micro_batch_size", micro_batch_size), ("micro_batch_tokens", micro_batch_tokens),
                        ("max_sample_batch", max_sample_batch)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if lora_alpha is not None and not lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {lora_alpha}")
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.max_sample_batch = max_sample_batch
        self.lora_alpha = lora_alpha
        self.model_cache_dir = model_cache_dir
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        self._faults = Faults(faults)
        self.session_id = f"local-{uuid.uuid4().hex[:12]}"
        if not sample_batch_wait_s >= 0:
            raise ValueError(f"sample_batch_wait_s must be >= 0, got {sample_batch_wait_s!r}")
        self.sampler_knobs = sampler_knobs(sampler_quant, sampler_logit_noise, sampling_coupling)
        self._scheduler = SampleScheduler(self.sampler_dtype, max_sample_batch, self._faults,
                                          batch_wait_s=float(sample_batch_wait_s), quant=sampler_quant,
                                          logit_noise=float(sampler_logit_noise), coupling=sampling_coupling)
        self._clients: weakref.WeakSet[LocalTrainingClient] = weakref.WeakSet()
        self._announced: set[str] = set()
        # checkpoint -> the snapshot its sampling clients share (one copy of its LoRA, one set of merged
        # weights, one batch), while any of them lives; keyed by the adapter file's mtime too, since a
        # sampler checkpoint saved again under its name is rewritten
        self._checkpoint_snaps: weakref.WeakValueDictionary[tuple, LoraSnapshot] = weakref.WeakValueDictionary()

    # ------------------------------------------------------------------ capabilities
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        return types.GetServerCapabilitiesResponse(supported_models=[
            types.SupportedModel(model_name=name, max_context_length=s.max_context_length, trainable=True,
                                 sampleable=True) for name, s in SUPPORTED_MODELS.items()])

    async def get_server_capabilities_async(self) -> types.GetServerCapabilitiesResponse:
        return self.get_server_capabilities()

    def plan(self, base_model: str) -> EnginePlan:
        """The engine plan for `base_model` in this client's dtypes (loads the model on first use): the
        model's sampler and training plans its ops are built from, and how `auto` was decided."""
        base = shared_base(base_model, self.model_cache_dir)
        plan = EnginePlan(base.sampler_plan(self.sampler_dtype), base.train_plan(self.train_dtype), self.auto)
        if base_model not in self._announced:  # said once per model, when a run or a server first uses it
            self._announced.add(base_model)
            log.info("%s: %s", base_model, plan.line())
        return plan

    def engine_record(self, base_model: str) -> dict[str, Any]:
        """run_info.json's `engine`: the resolved dtypes, how `auto` was decided and every implementation
        choice this client's engine runs `base_model` with (`EnginePlan.record`), then the sampler's mismatch
        knobs and its draw (`sampler_knobs`)."""
        return {**self.plan(base_model).record(), **self.sampler_knobs}

    # ------------------------------------------------------------------ training clients
    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: dict[str, str] | None = None,
                                    optimizer: Any = None, run_id: str | None = None) -> LocalTrainingClient:
        """A new LoRA adapter on `base_model` (returned client doubles as its own future); `run_id` names
        its checkpoints' folder and paths (default: the adapter's own name)."""
        if optimizer is not None and getattr(optimizer, "type", "adamw") != "adamw":
            raise ValueError(f"the local engine implements the AdamW optimizer only, got {optimizer!r}")
        targets = target_modules(train_attn, train_mlp, train_unembed)
        self.plan(base_model)
        base = shared_base(base_model, self.model_cache_dir)
        alpha = self.lora_alpha if self.lora_alpha is not None else DEFAULT_LORA_ALPHA
        tc = LocalTrainingClient(self, base, rank=rank, alpha=alpha, seed=seed, targets=targets,
                                 user_metadata=user_metadata, run_id=run_id)
        self._clients.add(tc)
        return tc

    def resolve(self, path: str, kinds: tuple[str, ...] = ("training", "sampler")) -> Path:
        """The folder of a checkpoint path, confined to the state dir (`common.resolve_path`)."""
        return resolve_path(path, self.state_dir, kinds)

    def _from_state(self, path: str, with_optimizer: bool, run_id: str | None = None,
                    user_metadata: dict[str, str] | None = None) -> LocalTrainingClient:
        import json

        folder = self.resolve(path)
        meta = json.loads((folder / "meta.json").read_text())
        self.plan(meta["base_model"])
        base = shared_base(meta["base_model"], self.model_cache_dir)
        tc = LocalTrainingClient(self, base, rank=int(meta["rank"]), alpha=float(meta["alpha"]), seed=meta["seed"],
                                 targets=list(meta["targets"]),
                                 user_metadata=user_metadata if user_metadata is not None else meta.get("user_metadata"),
                                 run_id=run_id)
        tc.load_weights_from(folder, with_optimizer)
        self._clients.add(tc)
        return tc

    def create_training_client_from_state(self, path: str, base_model: str | None = None,
                                          user_metadata: dict[str, str] | None = None,
                                          weights_access_token: str | None = None,
                                          optimizer: Any = None, run_id: str | None = None) -> LocalTrainingClient:
        """Weights from a checkpoint, fresh optimizer state."""
        return self._from_state(path, False, run_id, user_metadata)

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: dict[str, str] | None = None,
                                                         weights_access_token: str | None = None,
                                                         run_id: str | None = None) -> LocalTrainingClient:
        """Weights + AdamW moments + step count from a `save_state` checkpoint."""
        return self._from_state(path, True, run_id, user_metadata)

    async def create_lora_training_client_async(self, *args: Any, **kwargs: Any) -> LocalTrainingClient:
        return self.create_lora_training_client(*args, **kwargs)

    async def create_training_client_from_state_async(self, path: str, *args: Any, **kwargs: Any
                                                      ) -> LocalTrainingClient:
        return self.create_training_client_from_state(path, *args, **kwargs)

    async def create_training_client_from_state_with_optimizer_async(self, path: str, *args: Any, **kwargs: Any
                                                                     ) -> LocalTrainingClient:
        return self.create_training_client_from_state_with_optimizer(path, *args, **kwargs)

    # ------------------------------------------------------------------ sampling clients
    def _sampling_client(self, base: Any, snap: LoraSnapshot | Future, model_path: str | None = None
                         ) -> LocalSamplingClient:
        return LocalSamplingClient(base, snap, self._scheduler, self._faults, model_path)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False
                               ) -> LocalSamplingClient:
        """From a checkpoint path (`save_state` or `save_weights_for_sampler`) or a bare base model."""
        if model_path is None and base_model is None:
            raise ValueError("create_sampling_client needs model_path or base_model")
        if model_path is None:
            return self._sampling_client(shared_base(base_model, self.model_cache_dir), BASE_SNAPSHOT)
        folder = self.resolve(model_path)
        meta = json.loads((folder / "meta.json").read_text())
        key = (str(folder), os.stat(folder / ckpt.ADAPTER_FILE).st_mtime_ns, meta.get("created_at"))
        snap = self._checkpoint_snaps.get(key)
        base = shared_base(meta["base_model"], self.model_cache_dir)
        if snap is None:
            meta, tensors, _ = ckpt.read(folder, with_optimizer=False)
            snap = base.track(LoraSnapshot(id=f"ckpt-{uuid.uuid4().hex}", tensors=tensors,
                                           scale=float(meta["alpha"]) / int(meta["rank"])))
            self._checkpoint_snaps[key] = snap
        return self._sampling_client(base, snap, model_path)

    async def create_sampling_client_async(self, model_path: str | None = None, base_model: str | None = None,
                                           retry_config: Any = None, record_stability_info: bool = False
                                           ) -> LocalSamplingClient:
        return self.create_sampling_client(model_path, base_model)

    # ------------------------------------------------------------------ custom losses
    def create_custom_loss(self, fn: Any, input_ranks: Mapping[str, int]) -> AwaitableConcurrentFuture:
        """Trace a per-datum loss with tinker's own tracer; the handle runs in one pass per micro-batch."""
        try:
            return done_future(trace_loss(fn, input_ranks, self.session_id))
        except ValueError as e:
            return failed_future(e)

    async def create_custom_loss_async(self, fn: Any, input_ranks: Mapping[str, int]) -> Any:
        return await self.create_custom_loss(fn, input_ranks)

    # ------------------------------------------------------------------ lifecycle
    @property
    def faults_injected(self) -> dict[str, int]:
        return dict(self._faults.injected)

    @property
    def sample_batches_run(self) -> int:
        """How many batches the sampling scheduler has run (requests batched together count once)."""
        return self._scheduler.batches_run

    def memory_to_release(self) -> bool:
        """Whether sampling clients were dropped whose weights `release_memory` would free."""
        return any(base.has_dropped() for base in loaded_bases())

    def release_memory(self) -> None:
        """Return what dropped sampling clients held: collect them (a client waiting on its snapshot is in
        a reference cycle), drop their merged sampler weights, and hand the freed pages to the OS."""
        gc.collect()
        for base in loaded_bases():
            base.flush_dropped()
        trim_heap()

    def memory(self) -> dict[str, float]:
        """The process's RSS (now and peak, MiB) and the samplers' share: live snapshots, their LoRA
        tensors' MiB and the merged sampler weights cached (`SharedBase.sampler_memory`)."""
        out: dict[str, float] = dict(process_memory_mb())
        for base in loaded_bases():
            for k, v in base.sampler_memory().items():
                out[k] = out.get(k, 0) + v
        return out

    def sampler_load(self) -> dict[str, int]:
        """Requests (and rows) queued on the sampler and decoding now (`SampleScheduler.load`)."""
        return self._scheduler.load()

    def close(self, status: str = "success", detail: str | None = None) -> AwaitableConcurrentFuture:
        self._scheduler.close()
        for tc in list(self._clients):
            tc.close()
        return done_future(None)

    def __enter__(self) -> "LocalServiceClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
