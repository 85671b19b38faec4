"""The local `TrainingClient`: tinker 0.38's training-client surface (futures, argument checks,
checkpoints, sampling snapshots, the deprecated async forms) over `training_compute.LoraCompute`,
which runs the forward/backward passes and the AdamW step. Requests run in submission order on one
worker thread per client.

Differences from the service (documented, deliberate):
- a request that fails validation (bad Datum, unknown loss, ...) raises ValueError from its future
  and the client stays usable; the service poisons the client after any failed request.
- `forward_backward_custom(data, callable)` runs Tinker's two passes in-process
  (`LoraCompute.run_custom`); a `LossHandle` runs in ONE pass per micro-batch (`LoraCompute.run_handle`).
- the model forward is the engine's own (`train_forward.py`: packed rows, datums of one group
  computing their shared prompt once, LoRA inside the GEMMs); the service's internals are unknown.
- metrics carry `engine/forward_passes:sum` (model forward passes the call ran) and
  `engine/micro_batches:sum`, so a benchmark can report passes per update.
"""

from __future__ import annotations

import random
import time
import weakref
from typing import Any, Callable, Mapping

import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle

from trainer.backends.local import ckpt
from trainer.backends.local.common import (COMPUTE, Faults, OrderedWorker, RequestCancelled, SelfFuture,
                                           check_id, checkpoint_folder, failed_future, tinker_path)
from trainer.backends.local.engine import LoraSnapshot, SharedBase
from trainer.backends.local.training_compute import LoraCompute, LossRun

OUTPUT_TYPE = "TorchLossReturn"


class LocalTrainingClient(SelfFuture):
    def __init__(self, service: Any, base: SharedBase, *, rank: int, alpha: float, seed: int | None,
                 targets: list[str], user_metadata: dict[str, str] | None = None, run_id: str | None = None):
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRA rank must be a positive int, got {rank!r}")
        self._service = service
        self._base = base
        self.rank = rank
        self.alpha = float(alpha)
        self.scale = self.alpha / rank
        self.targets = list(targets)
        self.seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        self.user_metadata = dict(user_metadata or {})
        if run_id is not None:
            check_id(run_id, "run id")
        self.model_id = base.add_adapter(rank, self.alpha, self.targets, self.seed)
        # the folder under the state dir and the first segment of this client's checkpoint paths: a server
        # passes its own model id (the SDK's training_run_id), in-process clients use the adapter's name
        self.run_id = run_id or self.model_id
        weakref.finalize(self, base.release, self.model_id)
        self.compute = LoraCompute(base, self.model_id, self.scale, train_dtype=service.train_dtype,
                                   micro_batch_size=service.micro_batch_size,
                                   micro_batch_tokens=service.micro_batch_tokens)
        self.optim_steps = 0
        self._worker = OrderedWorker(f"local-train-{self.model_id}")
        self._faults: Faults = service._faults

    # ------------------------------------------------------------------ info
    @property
    def base_model(self) -> str:
        return self._base.base_model

    def trains(self, part: str) -> bool:
        """Whether the adapter covers `attn`, `mlp` or `unembed` (the SDK's LoraConfig switches)."""
        from trainer.backends.local.engine import ATTN_PROJ, MLP_PROJ, UNEMBED

        mods = {"attn": set(ATTN_PROJ), "mlp": set(MLP_PROJ), "unembed": {UNEMBED}}[part]
        return bool(mods & set(self.targets))

    def get_info(self) -> types.GetInfoResponse:
        return types.GetInfoResponse(
            model_data=types.ModelData(arch=str(self._base.config.model_type), model_name=self.base_model,
                                       tokenizer_id=self.base_model),
            model_id=self.model_id, optimizer_config=types.AdamOptimizerConfig(), is_lora=True,
            lora_rank=self.rank, model_name=self.base_model)

    def get_tokenizer(self) -> Any:
        return self._base.tokenizer

    def _submit(self, fn: Callable[[], Any], fault_kind: str | None = None, chunked: bool = False
                ) -> AwaitableConcurrentFuture:
        """`fn` on this client's ordered worker, on the compute thread; `chunked`: `fn` hands its pieces to
        the compute thread itself (a loss runner, one micro-batch at a time: `training_compute`)."""
        if self.compute.cancelled.is_set():
            return failed_future(RequestCancelled("the training client was cancelled (its session ended)"))
        fail = self._faults.draw(fault_kind) if fault_kind else False

        def run() -> Any:
            if fault_kind:
                self._faults.apply(fault_kind, fail)
            return fn() if chunked else COMPUTE.run(fn)

        return self._worker.submit(run)

    # ------------------------------------------------------------------ built-in losses
    @staticmethod
    def _output(run: LossRun) -> types.ForwardBackwardOutput:
        outs = [{"logprobs": types.TensorData.from_torch(lp.detach().to(torch.float32).contiguous())}
                for lp in run.logprobs]
        for o, ent in zip(outs, run.entropy or []):  # `forward` only: the exact next-token entropy per position
            o["entropy"] = types.TensorData.from_torch(ent.to(torch.float32).contiguous())
        return types.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE, loss_fn_outputs=outs, metrics=run.metrics)

    def _run_builtin(self, data: Any, loss_fn: str, loss_fn_config: Any, backward: bool) -> types.ForwardBackwardOutput:
        run = self.compute.run_builtin(data, loss_fn, loss_fn_config, backward)
        return COMPUTE.run(lambda: self._output(run))

    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None
                ) -> AwaitableConcurrentFuture:
        """Loss, target logprobs and (local engine only) the exact per-position entropy, without gradients."""
        return self._submit(lambda: self._run_builtin(data, loss_fn, loss_fn_config, backward=False),
                            chunked=True)

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, Any] | None = None) -> AwaitableConcurrentFuture:
        """Gradients of the summed loss accumulate until the next `optim_step`."""
        return self._submit(lambda: self._run_builtin(data, loss_fn, loss_fn_config, backward=True),
                            "forward_backward", chunked=True)

    # ------------------------------------------------------------------ custom losses
    def forward_backward_custom(self, data: list[types.Datum], loss_fn: Any, *, loss_type_input: Any = None
                                ) -> AwaitableConcurrentFuture:
        if loss_type_input not in (None, "logprobs"):
            return self._submit(lambda: _raise(
                ValueError(f"loss_type_input must be 'logprobs' or None, got {loss_type_input!r}")))
        if isinstance(loss_fn, LossHandle):
            return self._submit(lambda: self._run_handle(data, loss_fn), "forward_backward", chunked=True)
        return self._submit(lambda: self._run_callable(data, loss_fn), "forward_backward", chunked=True)

    def _run_callable(self, data: Any, loss_fn: Callable) -> types.ForwardBackwardOutput:
        run = self.compute.run_custom(data, loss_fn)
        return COMPUTE.run(lambda: self._output(run))

    def _run_handle(self, data: Any, handle: LossHandle) -> types.ForwardBackwardOutput:
        if handle.session_id != self._service.session_id:
            raise ValueError(f"LossHandle {handle.name!r} was created in session {handle.session_id}; it can only "
                             "be used by clients of that session")
        run = self.compute.run_handle(data, handle)
        return COMPUTE.run(lambda: self._output(run))

    # ------------------------------------------------------------------ optimizer
    def optim_step(self, optim_params: types.AdamParams | None = None, *, adam_params: types.AdamParams | None = None
                   ) -> AwaitableConcurrentFuture:
        """AdamW (torch.optim.AdamW semantics, decoupled weight decay) over this client's LoRA params."""
        params = optim_params if optim_params is not None else adam_params
        return self._submit(lambda: self._optim_step(params), "optim_step")

    def _optim_step(self, params: Any) -> types.OptimStepResponse:
        if params is None:
            raise ValueError("optim_step needs tinker.AdamParams")
        if not isinstance(params, types.AdamParams):
            raise ValueError(f"the local engine implements AdamW only; got {type(params).__name__}")
        if params.learning_rate < 0 or not 0 <= params.beta1 < 1 or not 0 <= params.beta2 < 1 or params.eps <= 0:
            raise ValueError(f"invalid AdamParams: {params}")
        norm = self.compute.adamw_step(params)
        self.optim_steps += 1
        return types.OptimStepResponse(metrics={"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate,
                                                "optim_steps:max": float(self.optim_steps)})

    # ------------------------------------------------------------------ state
    def _meta(self, kind: str, name: str, ttl_seconds: int | None,
              user_metadata: dict[str, str] | None) -> dict[str, Any]:
        now = time.time()
        return {"kind": kind, "name": name, "base_model": self.base_model, "rank": self.rank, "alpha": self.alpha,
                "targets": self.targets, "seed": self.seed, "optim_steps": self.optim_steps,
                "model_id": self.model_id, "run_id": self.run_id, "user_metadata": self.user_metadata,
                "checkpoint_user_metadata": dict(user_metadata or {}), "created_at": now,
                # a server's sweeper deletes the checkpoint after this (SaveWeightsRequest.ttl_seconds)
                "expires_at": now + ttl_seconds if ttl_seconds is not None else None}

    def _save(self, name: str, kind: str, overwrite: bool, ttl_seconds: int | None = None,
              user_metadata: dict[str, str] | None = None) -> str:
        if ttl_seconds is not None and (not isinstance(ttl_seconds, int) or ttl_seconds < 1):
            raise ValueError(f"ttl_seconds must be a positive int or None, got {ttl_seconds!r}")
        folder = checkpoint_folder(self._service.state_dir, self.run_id, kind, name)
        opt = ({"adamw": self.compute.optimizer.state_dict(), "optim_steps": self.optim_steps}
               if kind == "training" else None)
        meta = self._meta(kind, name, ttl_seconds, user_metadata)
        if kind == "external":
            ckpt.write_peft(folder, meta, self.compute.adapter_tensors(), overwrite)
        else:
            ckpt.write(folder, meta, self.compute.adapter_tensors(), opt, overwrite)
        return tinker_path(self.run_id, kind, name)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> AwaitableConcurrentFuture:
        """Weights + AdamW moments + step count -> `tinker://<run_id>/weights/<name>`
        (the folder `<state_dir>/<run_id>/weights/<name>`)."""
        return self._submit(lambda: types.SaveWeightsResponse(
            path=self._save(name, "training", overwrite, ttl_seconds, user_metadata)), "save_state")

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None) -> AwaitableConcurrentFuture:
        """Weights only -> `tinker://<run_id>/sampler_weights/<name>` (overwrites, as the service does)."""
        return self._submit(lambda: types.SaveWeightsForSamplerResponse(
            path=self._save(name, "sampler", True, ttl_seconds, user_metadata)))

    def save_weights_external(self, name: str, ttl_seconds: int | None = None,
                              age_encryption_recipients: Any = None) -> AwaitableConcurrentFuture:
        """The adapter as a PEFT LoRA folder -> `tinker://<run_id>/external_weights/<name>` (`ckpt.write_peft`);
        overwrites, as `tinker checkpoint download` reuses the name `download`. No age encryption offline."""
        if age_encryption_recipients:
            raise ValueError("the local engine does not encrypt external weights (age_encryption_recipients)")
        return self._submit(lambda: types.SaveWeightsExternalResponse(
            path=self._save(name, "external", True, ttl_seconds)))

    def load_weights_from(self, folder: Any, with_optimizer: bool) -> None:
        """Copy a checkpoint's adapter (and optimizer state) into this client (runs on the caller's thread)."""
        meta, tensors, opt = ckpt.read(folder, with_optimizer)
        mine = {m for m, _, _ in self.compute.modules}
        if set(tensors) != mine or meta["rank"] != self.rank or float(meta["alpha"]) != self.alpha:
            # alpha too: the copied factors would otherwise run at another scale (alpha / rank)
            raise ValueError(f"checkpoint {folder} (rank {meta['rank']}, alpha {meta['alpha']}, {len(tensors)} "
                             f"modules) does not match this client (rank {self.rank}, alpha {self.alpha}, "
                             f"{len(mine)} modules)")
        self.compute.load_adapter(tensors, opt["adamw"] if opt is not None else None)
        if opt is not None:
            self.optim_steps = int(opt["optim_steps"])

    def load_state(self, path: str, weights_access_token: str | None = None) -> AwaitableConcurrentFuture:
        """Deprecated in tinker; loads weights only (fresh optimizer moments are kept as they are)."""
        return self._submit(lambda: (self.load_weights_from(self._service.resolve(path), False),
                                     types.LoadWeightsResponse(path=path))[1])

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> AwaitableConcurrentFuture:
        return self._submit(lambda: (self.load_weights_from(self._service.resolve(path), True),
                                     types.LoadWeightsResponse(path=path))[1])

    # ------------------------------------------------------------------ sampling
    def snapshot(self) -> LoraSnapshot:
        return self._base.snapshot(self.model_id, self.scale)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None,
                                             record_stability_info: bool = False, kind: str = "snapshot") -> Any:
        """A sampling client on a snapshot taken after every request submitted before this call."""
        fut = self._worker.submit(self.snapshot).future()
        return self._service._sampling_client(self._base, fut)

    def create_sampling_client(self, model_path: str, retry_config: Any = None,
                               record_stability_info: bool = False) -> Any:
        return self._service.create_sampling_client(model_path=model_path)

    # ------------------------------------------------------------------ deprecated async forms
    async def forward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward(data, loss_fn, loss_fn_config)

    async def forward_backward_async(self, data, loss_fn, loss_fn_config=None):
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def forward_backward_custom_async(self, data, loss_fn, *, loss_type_input=None):
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    async def optim_step_async(self, optim_params=None, *, adam_params=None):
        return self.optim_step(optim_params, adam_params=adam_params)

    async def save_state_async(self, name, ttl_seconds=None, overwrite=False, user_metadata=None):
        return self.save_state(name, ttl_seconds, overwrite, user_metadata)

    async def save_weights_for_sampler_async(self, name, ttl_seconds=None, user_metadata=None):
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata)

    async def load_state_async(self, path, weights_access_token=None):
        return self.load_state(path, weights_access_token)

    async def save_weights_and_get_sampling_client_async(self, name=None, retry_config=None,
                                                         record_stability_info=False, kind="snapshot"):
        return await self.save_weights_and_get_sampling_client(name, retry_config, record_stability_info, kind)

    async def create_sampling_client_async(self, model_path, retry_config=None, record_stability_info=False):
        return await self.create_sampling_client(model_path)

    def close(self) -> None:
        self._worker.shutdown()

    def cancel(self) -> None:
        """Stop this client's work (a server ended its session): queued requests are cancelled before they
        start, a running one stops before its next micro-batch (`RequestCancelled`); no request is taken
        after. The adapter itself is freed with the client."""
        self.compute.cancelled.set()
        self._worker.shutdown(cancel_queued=True)


def _raise(exc: BaseException) -> Any:
    raise exc
