"""The local `TrainingClient`: LoRA forward/backward with Tinker's losses, custom losses, AdamW,
checkpoints and sampling snapshots. Requests run in submission order on one worker thread per client.

Differences from the service (documented, deliberate):
- a request that fails validation (bad Datum, unknown loss, ...) raises ValueError from its future
  and the client stays usable; the service poisons the client after any failed request.
- `forward_backward_custom(data, callable)` runs Tinker's two passes in-process
  (tinker 0.38 `training_client.py::forward_backward_custom` / `_compute_custom_loss`): a no-grad
  forward gives float32 logprob leaves, `loss_fn(data, logprobs)` is differentiated w.r.t. them, and a
  second forward+backward per micro-batch backpropagates the surrogate `sum(logp * dC/dlogp)`, whose
  parameter gradient equals that of the custom loss. A `LossHandle` runs in ONE pass per micro-batch
  (its per-datum losses are summed, as `custom_loss.py::run_loss_handle` does).
- the model forward is the engine's own (`train_forward.py`: packed rows, datums of one group
  computing their shared prompt once, LoRA inside the GEMMs); the service's internals are unknown.
- metrics carry `engine/forward_passes:sum` (model forward passes the call ran) and
  `engine/micro_batches:sum`, so a benchmark can report passes per update.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs, run_loss_handle

from trainer.backends.local import ckpt
from trainer.backends.local import train_forward as TF
from trainer.backends.local.common import (COMPUTE, Faults, OrderedWorker, SelfFuture, check_name, parse_path,
                                           tinker_path)
from trainer.backends.local.engine import LoraSnapshot, SharedBase
from trainer.backends.local.losses import REQUIRED_INPUTS, datum_loss, resolve_config

OUTPUT_TYPE = "TorchLossReturn"


@dataclass
class _Prepared:
    ids: list[int]
    targets: torch.Tensor  # long [T] or [T, K]
    inputs: dict[str, torch.Tensor]  # float32 tensors of the other loss_fn_inputs
    # first position with a non-zero `mask` (else `weights`) input: the rows before it are the prompt,
    # shared with neighbouring datums that start with the same tokens (0: share nothing)
    share: int = 0
    # first position with a non-zero `mask` input (0 without one): where a registered loss's gradient starts
    mask_from: int = 0


class LocalTrainingClient(SelfFuture):
    def __init__(self, service: Any, base: SharedBase, *, rank: int, alpha: float, seed: int | None,
                 targets: list[str], user_metadata: dict[str, str] | None = None):
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
        self.model_id = base.add_adapter(rank, self.alpha, self.targets, self.seed)
        weakref.finalize(self, base.release, self.model_id)
        with base.lock:
            self._modules = base.adapter_params(self.model_id)
        self._params = [p for _, A, B in self._modules for p in (A, B)]
        self._opt = torch.optim.AdamW(self._params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        self.optim_steps = 0
        self._worker = OrderedWorker(f"local-train-{self.model_id}")
        self._faults: Faults = service._faults

    # ------------------------------------------------------------------ info
    @property
    def base_model(self) -> str:
        return self._base.base_model

    def get_info(self) -> types.GetInfoResponse:
        return types.GetInfoResponse(
            model_data=types.ModelData(arch=str(self._base.config.model_type), model_name=self.base_model,
                                       tokenizer_id=self.base_model),
            model_id=self.model_id, optimizer_config=types.AdamOptimizerConfig(), is_lora=True,
            lora_rank=self.rank, model_name=self.base_model)

    def get_tokenizer(self) -> Any:
        return self._base.tokenizer

    def _submit(self, fn: Callable[[], Any], fault_kind: str | None = None) -> AwaitableConcurrentFuture:
        fail = self._faults.draw(fault_kind) if fault_kind else False

        def run() -> Any:
            if fault_kind:
                self._faults.apply(fault_kind, fail)
            return COMPUTE.run(fn)

        return self._worker.submit(run)

    # ------------------------------------------------------------------ data
    def _prepare(self, data: Any, loss_keys: tuple[str, ...] = ()) -> list[_Prepared]:
        if not isinstance(data, (list, tuple)) or not data:
            raise ValueError("data must be a non-empty list of tinker.Datum")
        out = []
        V, ctx = self._base.vocab_size, self._base.max_context
        for i, d in enumerate(data):
            if not isinstance(d, types.Datum):
                raise ValueError(f"datum[{i}] is a {type(d).__name__}, not a tinker.Datum")
            try:
                ids = [int(t) for t in d.model_input.to_ints()]
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"datum[{i}]: the local engine takes token chunks only ({e})") from e
            if not ids:
                raise ValueError(f"datum[{i}] has an empty model_input")
            if len(ids) > ctx:
                raise ValueError(f"datum[{i}] has {len(ids)} tokens, more than the model context of {ctx}")
            if "target_tokens" not in d.loss_fn_inputs:
                raise ValueError(f"datum[{i}] has no loss_fn_inputs['target_tokens']")
            tt = d.loss_fn_inputs["target_tokens"].to_torch().long()
            if tt.dim() not in (1, 2) or tt.shape[0] != len(ids):
                raise ValueError(f"datum[{i}]: target_tokens has shape {tuple(tt.shape)} but model_input has "
                                 f"{len(ids)} tokens (expected [{len(ids)}] or [{len(ids)}, K]; "
                                 "model_input = s[:-1], target_tokens = s[1:])")
            bad = [t for t in ids if not 0 <= t < V] + [t for t in tt.flatten().tolist() if not 0 <= t < V]
            if bad:
                raise ValueError(f"datum[{i}] holds token ids outside the vocabulary [0, {V}): {bad[:5]}")
            inputs = {}
            for key in ("weights",) + loss_keys:
                if key not in d.loss_fn_inputs:
                    if key != "weights":
                        raise ValueError(f"datum[{i}] has no loss_fn_inputs[{key!r}]")
                    continue
                t = d.loss_fn_inputs[key].to_torch().to(torch.float32)
                if tuple(t.shape) != tuple(tt.shape):
                    raise ValueError(f"datum[{i}]: loss_fn_inputs[{key!r}] has shape {tuple(t.shape)}, "
                                     f"target_tokens has {tuple(tt.shape)}")
                inputs[key] = t
            mask = d.loss_fn_inputs.get(_MASK_KEY)
            mask_from = _first_nonzero(None if mask is None else mask.to_torch())
            share = mask_from if mask is not None else _first_nonzero(inputs.get("weights"))
            out.append(_Prepared(ids, tt, inputs, share, mask_from))
        return out

    def _micro_batches(self, preps: list[_Prepared]) -> list[range]:
        """Consecutive datums, at most `micro_batch_size` of them and `micro_batch_tokens` padded tokens
        per micro-batch (a single longer datum still gets its own): short RL sequences share one large
        matmul (more rows, better GEMM efficiency), long ones stay within memory."""
        m, budget = self._service.micro_batch_size, self._service.micro_batch_tokens
        out, start, longest = [], 0, 0
        for i, p in enumerate(preps):
            longest_i = max(longest, len(p.ids))
            if i > start and (i - start >= m or (i - start + 1) * longest_i > budget):
                out.append(range(start, i))
                start, longest_i = i, len(p.ids)
            longest = longest_i
        if preps:
            out.append(range(start, len(preps)))
        return out

    def _logprobs(self, preps: list[_Prepared], grad_from: list[int] | None = None,
                  entropy: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Target logprobs of a micro-batch (graph kept when grad is enabled). Call with the lock held.

        The forward is `train_forward.forward` over packed rows, datums of one group sharing their
        prompt rows. `grad_from[i]`: datum i's positions before this index cannot affect its loss (mask
        0 there), so their unembedding runs without a graph: no [positions, vocab] softmax gradient and
        no backward matmul through lm_head for the prompt (TRL's `logits_to_keep` idea, with the prompt
        logprobs still returned, computed once per distinct (row, target)). `entropy` (no-grad calls with
        rank-1 targets): a list that receives each datum's exact per-position entropy."""
        b = self._base
        b.activate(self.model_id)  # flushes deleted adapters
        for prm in self._params:  # peft marks only its active adapter trainable; these are ours
            prm.requires_grad_(True)
        lora = {m: (A, B) for m, A, B in self._modules}
        pk = TF.pack([p.ids for p in preps], [p.share for p in preps])
        dtype = self._service.train_dtype
        base, fused = b.compute_weights(dtype)
        hidden = TF.forward(b.config, base, b.cos, b.sin, lora, self.scale, pk, fused, dtype)
        W, head_lora = TF.unembed_weight(b.base_state), lora.get("lm_head")

        def unembed() -> list[torch.Tensor]:
            def logits(h: torch.Tensor) -> torch.Tensor:  # the unembedding in fp32 for accurate logprobs
                return TF.linear(h.float(), W, head_lora, self.scale)

            if any(p.targets.dim() != 1 for p in preps):
                out = []
                for p, rows in zip(preps, pk.rows):
                    lg = logits(hidden.index_select(0, rows))
                    t = p.targets if p.targets.dim() == 2 else p.targets.unsqueeze(-1)
                    lp = lg.gather(-1, t) - torch.logsumexp(lg, -1, keepdim=True)
                    out.append(lp if p.targets.dim() == 2 else lp.squeeze(-1))
                return out
            if entropy is not None:
                idx = torch.cat(list(pk.rows))
                lp, ent = TF.target_logprobs_and_entropy(hidden.index_select(0, idx), W, head_lora, self.scale,
                                                         torch.cat([p.targets for p in preps]))
                sizes = [len(p.ids) for p in preps]
                entropy.extend(ent.split(sizes))
                return list(lp.split(sizes))
            cuts = [min(max(0, int(s)), len(p.ids)) for s, p in zip(grad_from or [0] * len(preps), preps)]
            idx_g = torch.cat([rows[c:] for c, rows in zip(cuts, pk.rows)])
            tgt_g = torch.cat([p.targets[c:] for c, p in zip(cuts, preps)])
            packed = b.packed_unembed() if head_lora is None and dtype == torch.float32 else None
            lp_g = TF.target_logprobs(hidden.index_select(0, idx_g), W, head_lora, self.scale, tgt_g, packed,
                                      fused.get("unembed"))
            idx_n = torch.cat([rows[:c] for c, rows in zip(cuts, pk.rows)])
            tgt_n = torch.cat([p.targets[:c] for c, p in zip(cuts, preps)])
            with torch.no_grad():  # shared prompt rows with the same target: one unembedding each
                key, inv = torch.unique(idx_n * b.vocab_size + tgt_n, return_inverse=True)
                lp_n = TF.target_logprobs(hidden.detach().index_select(0, key // b.vocab_size), W, head_lora,
                                          self.scale, key % b.vocab_size, packed)[inv]
            out, og, on = [], 0, 0
            for c, p in zip(cuts, preps):
                g = len(p.ids) - c
                out.append(torch.cat([lp_n[on: on + c], lp_g[og: og + g]]))
                og, on = og + g, on + c
            return out

        # bf16 training: the unembedding runs on bf16 inputs with fp32 accumulation and fp32 logits, as every
        # path below must (a recomputed anchor and the training logprobs come from the same numbers)
        with TF.matmul_inputs(dtype):
            return unembed()

    @staticmethod
    def _outputs(lps: list[torch.Tensor], entropy: list[torch.Tensor] | None = None
                 ) -> list[dict[str, types.TensorData]]:
        out = [{"logprobs": types.TensorData.from_torch(lp.detach().to(torch.float32).contiguous())} for lp in lps]
        for o, ent in zip(out, entropy or []):  # `forward` only: the exact next-token entropy per position
            o["entropy"] = types.TensorData.from_torch(ent.to(torch.float32).contiguous())
        return out

    # ------------------------------------------------------------------ built-in losses
    def _run_builtin(self, data: Any, loss_fn: str, loss_fn_config: Any, backward: bool) -> types.ForwardBackwardOutput:
        cfg = resolve_config(loss_fn, loss_fn_config)
        preps = self._prepare(data, REQUIRED_INPUTS[loss_fn])
        total, lps_all, passes = 0.0, [], 0
        # a no-grad forward also returns the exact entropy (the logits are at hand; the training passes skip it)
        entropy: list[torch.Tensor] | None = None if backward or any(p.targets.dim() != 1 for p in preps) else []
        for mb in self._micro_batches(preps):
            chunk = [preps[i] for i in mb]
            with self._base.lock, torch.set_grad_enabled(backward):
                lps = self._logprobs(chunk, entropy=entropy)
                passes += 1
                loss = sum(datum_loss(loss_fn, lp, p.inputs, cfg) for lp, p in zip(lps, chunk))
                if backward:
                    loss.backward()
            total += float(loss.detach())
            lps_all += lps
        metrics = {"loss:sum": total, "engine/forward_passes:sum": float(passes),
                   "engine/micro_batches:sum": float(passes)}
        return types.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE,
                                           loss_fn_outputs=self._outputs(lps_all, entropy), metrics=metrics)

    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None
                ) -> AwaitableConcurrentFuture:
        """Loss, target logprobs and (local engine only) the exact per-position entropy, without gradients."""
        return self._submit(lambda: self._run_builtin(data, loss_fn, loss_fn_config, backward=False))

    def forward_backward(self, data: list[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, Any] | None = None) -> AwaitableConcurrentFuture:
        """Gradients of the summed loss accumulate until the next `optim_step`."""
        return self._submit(lambda: self._run_builtin(data, loss_fn, loss_fn_config, backward=True),
                            "forward_backward")

    # ------------------------------------------------------------------ custom losses
    def forward_backward_custom(self, data: list[types.Datum], loss_fn: Any, *, loss_type_input: Any = None
                                ) -> AwaitableConcurrentFuture:
        if loss_type_input not in (None, "logprobs"):
            return self._submit(lambda: _raise(
                ValueError(f"loss_type_input must be 'logprobs' or None, got {loss_type_input!r}")))
        if isinstance(loss_fn, LossHandle):
            return self._submit(lambda: self._run_handle(data, loss_fn), "forward_backward")
        return self._submit(lambda: self._run_callable(data, loss_fn), "forward_backward")

    def _run_callable(self, data: Any, loss_fn: Callable) -> types.ForwardBackwardOutput:
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be a callable (data, logprobs_list) -> (loss, metrics) or a LossHandle, "
                             f"got {type(loss_fn).__name__}")
        preps = self._prepare(data)
        mbs = self._micro_batches(preps)
        passes = 0
        # pass 1: no-grad logprobs of every datum -> float32 leaves, as the SDK builds them
        leaves: list[torch.Tensor] = []
        for mb in mbs:
            with self._base.lock, torch.no_grad():
                leaves += [lp.detach().to(torch.float32).clone().requires_grad_(True)
                           for lp in self._logprobs([preps[i] for i in mb])]
            passes += 1
        loss, metrics = loss_fn(list(data), leaves)
        if not isinstance(loss, torch.Tensor):
            raise ValueError(f"custom loss_fn must return (torch.Tensor, dict), got {type(loss).__name__}")
        loss_sum = float(loss.detach().sum())
        loss.backward()
        grads = []
        for i, leaf in enumerate(leaves):
            if leaf.grad is None:
                raise ValueError(f"No gradient computed for logprob tensor of datum[{i}]: the custom loss must "
                                 "depend on every datum's logprobs")
            grads.append(leaf.grad)
        # pass 2: forward+backward of the linear surrogate sum(logp * dC/dlogp) per micro-batch
        surrogate, lps_all = 0.0, []
        for mb in mbs:
            with self._base.lock:
                lps = self._logprobs([preps[i] for i in mb])
                s = sum((lp * grads[i]).sum() for lp, i in zip(lps, mb))
                s.backward()
            passes += 1
            surrogate += float(s.detach())
            lps_all += lps
        out_metrics = {k: float(v) for k, v in dict(metrics or {}).items()}
        out_metrics.update({"loss:sum": loss_sum, "surrogate_loss:sum": surrogate,
                            "engine/forward_passes:sum": float(passes), "engine/micro_batches:sum": float(len(mbs))})
        return types.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE, loss_fn_outputs=self._outputs(lps_all),
                                           metrics=out_metrics)

    def _run_handle(self, data: Any, handle: LossHandle) -> types.ForwardBackwardOutput:
        if handle.session_id != self._service.session_id:
            raise ValueError(f"LossHandle {handle.name!r} was created in session {handle.session_id}; it can only "
                             "be used by clients of that session")
        preps = self._prepare(data)
        check_loss_inputs(handle, list(data))
        mbs = self._micro_batches(preps)
        total, lps_all, sums = 0.0, [], {}
        for mb in mbs:
            chunk_data = [data[i] for i in mb]
            with self._base.lock:
                # the registered losses weight every token by `mask`: positions before the first
                # masked-in one (the prompt) need no gradient
                lps = self._logprobs([preps[i] for i in mb], [preps[i].mask_from for i in mb])
                loss, metrics = run_loss_handle(handle, chunk_data, lps)
                loss.backward()
            total += float(loss.detach())
            lps_all += lps
            for k, v in metrics.items():  # means come back per micro-batch: re-weight by its size
                sums[k] = sums.get(k, 0.0) + (v * len(mb) if k.endswith(":mean") else v)
        out = {k: (v / len(preps) if k.endswith(":mean") else v) for k, v in sums.items()}
        out.update({"loss:sum": total, "engine/forward_passes:sum": float(len(mbs)),
                    "engine/micro_batches:sum": float(len(mbs))})
        return types.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE, loss_fn_outputs=self._outputs(lps_all),
                                           metrics=out)

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
        with self._base.lock:
            grads = [p.grad for p in self._params if p.grad is not None]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) \
                if grads else 0.0
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                for g in grads:
                    g.mul_(params.grad_clip_norm / (norm + 1e-6))
            for group in self._opt.param_groups:
                group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                             weight_decay=params.weight_decay)
            self._opt.step()
            self._opt.zero_grad(set_to_none=True)
        self.optim_steps += 1
        return types.OptimStepResponse(metrics={"grad_norm:mean": norm, "learning_rate:mean": params.learning_rate,
                                                "optim_steps:max": float(self.optim_steps)})

    # ------------------------------------------------------------------ state
    def _meta(self, kind: str, name: str) -> dict[str, Any]:
        return {"kind": kind, "name": name, "base_model": self.base_model, "rank": self.rank, "alpha": self.alpha,
                "targets": self.targets, "seed": self.seed, "optim_steps": self.optim_steps,
                "model_id": self.model_id, "user_metadata": self.user_metadata}

    def _tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        with self._base.lock:
            return {m: (A.detach().clone(), B.detach().clone()) for m, A, B in self._modules}

    def _save(self, name: str, kind: str, overwrite: bool) -> str:
        check_name(name)
        sub = "weights" if kind == "state" else "sampler_weights"
        folder = self._service.state_dir / self.model_id / sub / name
        opt = {"adamw": self._opt.state_dict(), "optim_steps": self.optim_steps} if kind == "state" else None
        ckpt.write(folder, self._meta(kind, name), self._tensors(), opt, overwrite)
        return tinker_path(folder)

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False,
                   user_metadata: dict[str, str] | None = None) -> AwaitableConcurrentFuture:
        """Weights + AdamW moments + step count -> `tinker://local/<state_dir>/<model_id>/weights/<name>`."""
        return self._submit(lambda: types.SaveWeightsResponse(path=self._save(name, "state", overwrite)),
                            "save_state")

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None,
                                 user_metadata: dict[str, str] | None = None) -> AwaitableConcurrentFuture:
        return self._submit(lambda: types.SaveWeightsForSamplerResponse(
            path=self._save(name, "sampler", overwrite=True)))

    def load_weights_from(self, folder: Any, with_optimizer: bool) -> None:
        """Copy a checkpoint's adapter (and optimizer state) into this client (runs on the caller's thread)."""
        meta, tensors, opt = ckpt.read(folder, with_optimizer)
        mine = {m: (A, B) for m, A, B in self._modules}
        if set(tensors) != set(mine) or meta["rank"] != self.rank or float(meta["alpha"]) != self.alpha:
            # alpha too: the copied factors would otherwise run at another scale (alpha / rank)
            raise ValueError(f"checkpoint {folder} (rank {meta['rank']}, alpha {meta['alpha']}, {len(tensors)} "
                             f"modules) does not match this client (rank {self.rank}, alpha {self.alpha}, "
                             f"{len(mine)} modules)")
        with self._base.lock, torch.no_grad():
            for m, (A, B) in tensors.items():
                mine[m][0].copy_(A)
                mine[m][1].copy_(B)
            for p in self._params:
                p.grad = None
            if opt is not None:
                self._opt.load_state_dict(opt["adamw"])
                self.optim_steps = int(opt["optim_steps"])

    def load_state(self, path: str, weights_access_token: str | None = None) -> AwaitableConcurrentFuture:
        """Deprecated in tinker; loads weights only (fresh optimizer moments are kept as they are)."""
        return self._submit(lambda: (self.load_weights_from(parse_path(path), False),
                                     types.LoadWeightsResponse(path=path))[1])

    def load_state_with_optimizer(self, path: str, weights_access_token: str | None = None
                                  ) -> AwaitableConcurrentFuture:
        return self._submit(lambda: (self.load_weights_from(parse_path(path), True),
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


def _raise(exc: BaseException) -> Any:
    raise exc


# A registered (one-pass) loss that takes a `mask` input must weight every token term by it, as the
# project's per-datum losses do (trainer/losses/per_datum.py); the engine then skips the unembedding
# gradient before the first masked-in position. A handle without a `mask` input gets full gradients.
_MASK_KEY = "mask"


def _first_nonzero(v: torch.Tensor | None) -> int:
    """Index of the first position with a non-zero entry of a per-position loss input (0 when absent or
    all zero)."""
    if v is None:
        return 0
    nz = torch.nonzero((v != 0).reshape(v.shape[0], -1).any(-1))
    return int(nz[0, 0]) if len(nz) else 0
