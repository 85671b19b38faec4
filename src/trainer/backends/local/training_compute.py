"""The compute behind a local training client: datum preparation, micro-batching, target logprobs
with prompt sharing, the three loss runners (built-in, custom callable, registered `LossHandle`) and
the AdamW step over one LoRA adapter. `training.LocalTrainingClient` wraps it in Tinker's API (futures,
argument checks, checkpoints); tests and benches call it directly through `client.compute`.

Every method that touches the model expects to run on the engine's compute thread; `logprobs` also
expects `base.lock` held (the runners take it themselves). The loss runners are the exception: they hand
each piece of torch work (preparing the data, one micro-batch's pass, a custom loss's own call) to the
compute thread separately (`COMPUTE.run`, inline when called on it), so called from another thread they
let the sampler take a slice between two micro-batches: a sampling request waits for at most one
micro-batch of a training request, not for all of it. A cancelled compute (`cancelled` set: a server
ended its session) stops its runner before the next micro-batch with `RequestCancelled`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from tinker import types
from tinker.lib.public_interfaces.custom_loss import LossHandle, check_loss_inputs, run_loss_handle

from trainer.backends.local import train_forward
from trainer.backends.local.common import COMPUTE, RequestCancelled
from trainer.backends.local.engine import SharedBase
from trainer.backends.local.losses import REQUIRED_INPUTS, datum_loss, resolve_config
from trainer.backends.local.model import matmul_inputs, unembed_weight

# A registered (one-pass) loss that takes a `mask` input must weight every token term by it, as the
# project's per-datum losses do (trainer/losses/per_datum.py); the engine then skips the unembedding
# gradient before the first masked-in position. A handle without a `mask` input gets full gradients.
MASK_KEY = "mask"


@dataclass
class PreparedDatum:
    """A validated `tinker.Datum` as the forward reads it."""

    ids: list[int]
    targets: torch.Tensor  # long [T] or [T, K]
    inputs: dict[str, torch.Tensor]  # float32 tensors of the other loss_fn_inputs
    # first position with a non-zero `mask` (else `weights`) input: the rows before it are the prompt,
    # shared with neighbouring datums that start with the same tokens (0: share nothing)
    share: int = 0
    # first position with a non-zero `mask` input (0 without one): where a registered loss's gradient starts
    mask_from: int = 0


@dataclass
class LossRun:
    """What a loss runner returns: every datum's target logprobs, the metrics and (no-grad built-in
    forwards only) every datum's exact per-position entropy."""

    logprobs: list[torch.Tensor]
    metrics: dict[str, float]
    entropy: list[torch.Tensor] | None = None


def prepare_data(data: Any, vocab_size: int, max_context: int, loss_keys: tuple[str, ...] = ()
                 ) -> list[PreparedDatum]:
    """Check every datum (token chunks only, within the context and vocabulary, `target_tokens` and the
    `loss_keys` inputs present with matching shapes) and convert it; a bad one is a ValueError naming it."""
    if not isinstance(data, (list, tuple)) or not data:
        raise ValueError("data must be a non-empty list of tinker.Datum")
    out = []
    V, ctx = vocab_size, max_context
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
        mask = d.loss_fn_inputs.get(MASK_KEY)
        mask_from = _first_nonzero(None if mask is None else mask.to_torch())
        share = mask_from if mask is not None else _first_nonzero(inputs.get("weights"))
        out.append(PreparedDatum(ids, tt, inputs, share, mask_from))
    return out


def micro_batches(preps: Sequence[PreparedDatum], max_datums: int, max_tokens: int) -> list[range]:
    """Consecutive datums, at most `max_datums` of them and `max_tokens` padded tokens per micro-batch
    (a single longer datum still gets its own): short RL sequences share one large matmul (more rows,
    better GEMM efficiency), long ones stay within memory."""
    m, budget = max_datums, max_tokens
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


class LoraCompute:
    """One LoRA adapter on a `SharedBase` and its AdamW state: the forward/backward passes and the step.

    `modules`: `(HF module name, A, B)` of the adapter, sorted by name; `params`: the A and B tensors in
    that order (what the optimizer updates and the gradients accumulate in)."""

    def __init__(self, base: SharedBase, model_id: str, scale: float, *, train_dtype: torch.dtype,
                 micro_batch_size: int, micro_batch_tokens: int):
        self.base = base
        self.model_id = model_id
        self.scale = scale
        self.train_dtype = train_dtype
        self.ops = base.train_ops(train_dtype)  # the engine plan's choices for the training forward
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        with base.lock:
            self.modules = base.adapter_params(model_id)
        self.params = [p for _, A, B in self.modules for p in (A, B)]
        # placeholder hyperparameters: every `adamw_step` sets the request's own before stepping. fused: one
        # kernel over all ~400 LoRA tensors (torch's CPU default loops over them in Python, several times slower
        # at this count; the same update up to fp32 rounding)
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                                           fused=True)
        self.cancelled = threading.Event()

    def check_cancelled(self) -> None:
        """Between micro-batches: a cancelled client's request stops here (its gradients so far stay
        accumulated, but the client is never used again)."""
        if self.cancelled.is_set():
            raise RequestCancelled("the training client was cancelled (its session ended)")

    # ------------------------------------------------------------------ data
    def prepare(self, data: Any, loss_keys: tuple[str, ...] = ()) -> list[PreparedDatum]:
        return prepare_data(data, self.base.vocab_size, self.base.max_context, loss_keys)

    def micro_batches(self, preps: Sequence[PreparedDatum]) -> list[range]:
        return micro_batches(preps, self.micro_batch_size, self.micro_batch_tokens)

    # ------------------------------------------------------------------ forward
    def logprobs(self, preps: list[PreparedDatum], grad_from: list[int] | None = None,
                 entropy: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Target logprobs of a micro-batch (graph kept when grad is enabled). Call with the lock held.

        The forward is `train_forward.forward` over packed rows, datums of one group sharing their
        prompt rows. `grad_from[i]`: datum i's positions before this index cannot affect its loss (mask
        0 there), so their unembedding runs without a graph: no [positions, vocab] softmax gradient and
        no backward matmul through lm_head for the prompt (TRL's `logits_to_keep` idea, with the prompt
        logprobs still returned, computed once per distinct (row, target)). `entropy` (no-grad calls with
        rank-1 targets): a list that receives each datum's exact per-position entropy."""
        b = self.base
        b.activate(self.model_id)  # flushes deleted adapters
        for prm in self.params:  # peft marks only its active adapter trainable; these are ours
            prm.requires_grad_(True)
        lora = {m: (A, B) for m, A, B in self.modules}
        pk = train_forward.pack([p.ids for p in preps], [p.share for p in preps])
        base, fused = b.compute_weights(self.train_dtype)
        plan = self.ops.plan
        packed = b.packed_projections(self.train_dtype) if plan.train_packed_weights else None
        hidden = train_forward.forward(b.config, base, b.cos, b.sin, lora, self.scale, pk, fused, self.train_dtype,
                                       packed, ops=self.ops)
        # the unembedding's fp32 logits on the plan's head inputs (`model.unembed_inputs`), on every path
        # below alike and as the sampler computes them (a recomputed anchor and the training logprobs come
        # from the same numbers)
        with matmul_inputs(plan.train_head_inputs):
            return self._unembed(hidden, pk, preps, lora.get("lm_head"), fused.get("unembed"), grad_from, entropy)

    def _unembed(self, hidden: torch.Tensor, pk: train_forward.Packing, preps: list[PreparedDatum],
                 head_lora: tuple[torch.Tensor, torch.Tensor] | None, grad_weight: torch.Tensor | None,
                 grad_from: list[int] | None, entropy: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Each datum's target logprobs from the final hidden states (see `logprobs`)."""
        b = self.base
        W = unembed_weight(b.base_state)

        def logits(h: torch.Tensor) -> torch.Tensor:  # the unembedding in fp32 for accurate logprobs
            return train_forward.linear(h.float(), W, head_lora, self.scale)

        if any(p.targets.dim() != 1 for p in preps):
            out = []
            for p, rows in zip(preps, pk.rows):
                lg = logits(hidden.index_select(0, rows))
                t = p.targets if p.targets.dim() == 2 else p.targets.unsqueeze(-1)
                lp = lg.gather(-1, t) - torch.logsumexp(lg, -1, keepdim=True)
                out.append(lp if p.targets.dim() == 2 else lp.squeeze(-1))
            return out
        # fp32 inputs run on oneDNN's packed fp32 kernel (see `model.unembed_inputs`), bf16 ones on the AMX
        # head kernel where it runs (the same logits as the plain product, from bf16 weights); every path
        # below computes its logits the same way
        plan = self.ops.plan
        packed = (b.packed_unembed(plan) if plan.train_head_inputs == torch.float32
                  else b.blocked_unembed(plan))
        if entropy is not None:
            idx = torch.cat(list(pk.rows))
            lp, ent = train_forward.target_logprobs_and_entropy(hidden.index_select(0, idx), W, head_lora,
                                                                self.scale, torch.cat([p.targets for p in preps]),
                                                                packed)
            sizes = [len(p.ids) for p in preps]
            entropy += list(ent.split(sizes))
            return list(lp.split(sizes))
        cuts = [min(max(0, int(s)), len(p.ids)) for s, p in zip(grad_from or [0] * len(preps), preps)]
        idx_g = torch.cat([rows[c:] for c, rows in zip(cuts, pk.rows)])
        tgt_g = torch.cat([p.targets[c:] for c, p in zip(cuts, preps)])
        grad_packed = b.packed_unembed_grad(self.train_dtype) if torch.is_grad_enabled() else None
        lp_g = train_forward.target_logprobs(hidden.index_select(0, idx_g), W, head_lora, self.scale, tgt_g, packed,
                                             grad_weight, grad_packed)
        idx_n = torch.cat([rows[:c] for c, rows in zip(cuts, pk.rows)])
        tgt_n = torch.cat([p.targets[:c] for c, p in zip(cuts, preps)])
        with torch.no_grad():  # shared prompt rows with the same target: one unembedding each
            key, inv = torch.unique(idx_n * b.vocab_size + tgt_n, return_inverse=True)
            lp_n = train_forward.target_logprobs(hidden.detach().index_select(0, key // b.vocab_size), W,
                                                 head_lora, self.scale, key % b.vocab_size, packed)[inv]
        out, og, on = [], 0, 0
        for c, p in zip(cuts, preps):
            g = len(p.ids) - c
            out.append(torch.cat([lp_n[on: on + c], lp_g[og: og + g]]))
            og, on = og + g, on + c
        return out

    # ------------------------------------------------------------------ loss runners
    def run_builtin(self, data: Any, loss_fn: str, loss_fn_config: Any, backward: bool) -> LossRun:
        """One of Tinker's built-in losses (`losses.py`), summed over datums, per micro-batch."""
        fn_config = resolve_config(loss_fn, loss_fn_config)
        preps = COMPUTE.run(lambda: self.prepare(data, REQUIRED_INPUTS[loss_fn]))
        total, lps_all, passes = 0.0, [], 0
        # a no-grad forward also returns the exact entropy (the logits are at hand; the training passes skip it)
        entropy: list[torch.Tensor] | None = None if backward or any(p.targets.dim() != 1 for p in preps) else []

        def one(chunk: list[PreparedDatum]) -> tuple[list[torch.Tensor], float]:
            with self.base.lock, torch.set_grad_enabled(backward):
                lps = self.logprobs(chunk, entropy=entropy)
                loss = sum(datum_loss(loss_fn, lp, p.inputs, fn_config) for lp, p in zip(lps, chunk))
                if backward:
                    loss.backward()
            return lps, float(loss.detach())

        for mb in self.micro_batches(preps):
            self.check_cancelled()
            lps, loss_v = COMPUTE.run(lambda mb=mb: one([preps[i] for i in mb]))
            passes += 1
            total += loss_v
            lps_all += lps
        metrics = {"loss:sum": total, "engine/forward_passes:sum": float(passes),
                   "engine/micro_batches:sum": float(passes)}
        return LossRun(lps_all, metrics, entropy)

    def run_custom(self, data: Any, loss_fn: Callable) -> LossRun:
        """Tinker's two passes in-process (tinker 0.38 `training_client.py::forward_backward_custom` /
        `_compute_custom_loss`): a no-grad forward gives float32 logprob leaves, `loss_fn(data, logprobs)`
        is differentiated w.r.t. them, and a second forward+backward per micro-batch backpropagates the
        surrogate `sum(logp * dC/dlogp)`, whose parameter gradient equals that of the custom loss."""
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be a callable (data, logprobs_list) -> (loss, metrics) or a LossHandle, "
                             f"got {type(loss_fn).__name__}")
        preps = COMPUTE.run(lambda: self.prepare(data))
        mbs = self.micro_batches(preps)
        passes = 0
        # pass 1: no-grad logprobs of every datum -> float32 leaves, as the SDK builds them
        leaves: list[torch.Tensor] = []

        def first(mb: range) -> list[torch.Tensor]:
            with self.base.lock, torch.no_grad():
                return [lp.detach().to(torch.float32).clone().requires_grad_(True)
                        for lp in self.logprobs([preps[i] for i in mb])]

        for mb in mbs:
            self.check_cancelled()
            leaves += COMPUTE.run(lambda mb=mb: first(mb))
            passes += 1

        def differentiate() -> tuple[float, Any, list[torch.Tensor]]:
            loss, metrics = loss_fn(list(data), leaves)
            if not isinstance(loss, torch.Tensor):
                raise ValueError(f"custom loss_fn must return (torch.Tensor, dict), got {type(loss).__name__}")
            loss_sum = float(loss.detach().sum())
            loss.backward()
            grads = []
            for i, leaf in enumerate(leaves):
                if leaf.grad is None:
                    raise ValueError(f"No gradient computed for logprob tensor of datum[{i}]: the custom loss "
                                     "must depend on every datum's logprobs")
                grads.append(leaf.grad)
            return loss_sum, metrics, grads

        loss_sum, metrics, grads = COMPUTE.run(differentiate)

        # pass 2: forward+backward of the linear surrogate sum(logp * dC/dlogp) per micro-batch
        def second(mb: range) -> tuple[list[torch.Tensor], float]:
            with self.base.lock:
                lps = self.logprobs([preps[i] for i in mb])
                s = sum((lp * grads[i]).sum() for lp, i in zip(lps, mb))
                s.backward()
            return lps, float(s.detach())

        surrogate, lps_all = 0.0, []
        for mb in mbs:
            self.check_cancelled()
            lps, s_v = COMPUTE.run(lambda mb=mb: second(mb))
            passes += 1
            surrogate += s_v
            lps_all += lps
        out_metrics = {k: float(v) for k, v in dict(metrics or {}).items()}
        out_metrics.update({"loss:sum": loss_sum, "surrogate_loss:sum": surrogate,
                            "engine/forward_passes:sum": float(passes), "engine/micro_batches:sum": float(len(mbs))})
        return LossRun(lps_all, out_metrics)

    def run_handle(self, data: Any, handle: LossHandle) -> LossRun:
        """A registered per-datum loss in ONE pass per micro-batch (its per-datum losses summed, as tinker's
        `custom_loss.py::run_loss_handle` does)."""
        preps = COMPUTE.run(lambda: self.prepare(data))
        check_loss_inputs(handle, list(data))
        mbs = self.micro_batches(preps)
        total, lps_all, sums = 0.0, [], {}

        def one(mb: range) -> tuple[list[torch.Tensor], float, dict[str, float]]:
            with self.base.lock:
                # the registered losses weight every token by `mask`: positions before the first
                # masked-in one (the prompt) need no gradient
                lps = self.logprobs([preps[i] for i in mb], [preps[i].mask_from for i in mb])
                loss, metrics = run_loss_handle(handle, [data[i] for i in mb], lps)
                loss.backward()
            return lps, float(loss.detach()), metrics

        for mb in mbs:
            self.check_cancelled()
            lps, loss_v, metrics = COMPUTE.run(lambda mb=mb: one(mb))
            total += loss_v
            lps_all += lps
            for k, v in metrics.items():  # means come back per micro-batch: re-weight by its size
                sums[k] = sums.get(k, 0.0) + (v * len(mb) if k.endswith(":mean") else v)
        out = {k: (v / len(preps) if k.endswith(":mean") else v) for k, v in sums.items()}
        out.update({"loss:sum": total, "engine/forward_passes:sum": float(len(mbs)),
                    "engine/micro_batches:sum": float(len(mbs))})
        return LossRun(lps_all, out)

    # ------------------------------------------------------------------ optimizer and state
    def adamw_step(self, params: types.AdamParams) -> float:
        """Clip the accumulated gradients to `grad_clip_norm` (global norm, torch `clip_grad_norm_`
        convention), step AdamW with `params` and clear the gradients; returns the norm before clipping."""
        self.check_cancelled()
        with self.base.lock:
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
            if params.grad_clip_norm > 0 and norm > params.grad_clip_norm:
                torch._foreach_mul_(grads, params.grad_clip_norm / (norm + 1e-6))
            for group in self.optimizer.param_groups:
                group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                             weight_decay=params.weight_decay)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return norm

    def adapter_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """A copy of the adapter: `HF module name -> (A, B)`."""
        with self.base.lock:
            return {m: (A.detach().clone(), B.detach().clone()) for m, A, B in self.modules}

    def load_adapter(self, tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     optimizer_state: dict[str, Any] | None = None) -> None:
        """Copy `tensors` (the same modules as this adapter) into it, drop pending gradients and, when
        given, load the AdamW state."""
        mine = {m: (A, B) for m, A, B in self.modules}
        with self.base.lock, torch.no_grad():
            for m, (A, B) in tensors.items():
                mine[m][0].copy_(A)
                mine[m][1].copy_(B)
            for p in self.params:
                p.grad = None
            if optimizer_state is not None:
                self.optimizer.load_state_dict(optimizer_state)


def _first_nonzero(v: torch.Tensor | None) -> int:
    """Index of the first position with a non-zero entry of a per-position loss input (0 when absent or
    all zero)."""
    if v is None:
        return 0
    nz = torch.nonzero((v != 0).reshape(v.shape[0], -1).any(-1))
    return int(nz[0, 0]) if len(nz) else 0
