"""One base model per process, shared by every client of it: fp32 weights loaded once, one peft
model carrying one LoRA adapter per training client, a compute lock, and the sampler weight cache.

Each training client owns only its adapter (`lora_A`/`lora_B` of the targeted projections) and its
optimizer state; its forward (`train_forward.py`) reads the shared base weights and its own factors
directly, under the lock (the peft model holds the factors and serves as the reference in tests).
LoRA follows peft (`y = W x + (alpha / r) * B A x`, no dropout); the init is peft's (A kaiming-uniform with a = sqrt(5),
B = 0) but drawn from a `torch.Generator` seeded by the client's seed, so equal seeds give
bit-identical adapters whatever the global RNG state.
"""

from __future__ import annotations

import math
import threading
import uuid
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.backends.local import kernels
from trainer.backends.local.common import COMPUTE
from trainer.backends.local.model import (ATTN_PROJ, MLP_PROJ, UNEMBED, check_architecture, dims, fuse_base,
                                          layer_names, rotary_tables, unembed_weight, weight)
from trainer.backends.local.ops import SamplerOps, TrainOps, sampler_ops, train_ops
from trainer.backends.local.plan import SamplerPlan, TrainPlan, sampler_plan_for, train_plan_for
from trainer.backends.local.sampler_weights import SamplerWeights, build_weights, with_lora
from trainer.backends.local.train_forward import Packed, pack_unembed, pack_unembed_grad, pack_weight
from trainer.model_registry import resolve_base_model, spec_for

_PEFT_PREFIX = "base_model.model."


def target_modules(train_attn: bool, train_mlp: bool, train_unembed: bool) -> list[str]:
    t = (list(ATTN_PROJ) if train_attn else []) + (list(MLP_PROJ) if train_mlp else []) + (
        [UNEMBED] if train_unembed else [])
    if not t:
        raise ValueError("LoRA needs at least one of train_attn, train_mlp, train_unembed")
    return t


@dataclass(frozen=True)
class LoraSnapshot:
    """Immutable copy of one adapter: `module name (HF) -> (A [r, in], B [out, r])` and its scale."""

    id: str
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    scale: float


BASE_SNAPSHOT = LoraSnapshot(id="base", tensors={}, scale=0.0)


class SharedBase:
    def __init__(self, base_model: str, cache_dir: str | Path | None):
        spec = spec_for(base_model)
        self.base_model = spec.base_model
        factory, self.tokenizer = resolve_base_model(spec.base_model, cache_dir)
        model = factory(torch.float32)
        model.requires_grad_(False)
        self.config = model.config
        check_architecture(self.config)
        self.max_context = min(spec.max_context_length, int(self.config.max_position_embeddings))
        self.vocab_size = int(self.config.vocab_size)
        # fp32 base tensors under HF names; they share storage with the model (and later with the
        # peft base layers), so the sampler never holds a second fp32 copy
        self.base_state = {k: v.detach() for k, v in model.state_dict(keep_vars=True).items()}
        self.cos, self.sin = rotary_tables(model, self.max_context)
        self.hf_model = model
        self.peft: Any = None
        self.lock = threading.RLock()
        self._to_delete: list[str] = []
        self._sampler_cache: OrderedDict[tuple[str, ...], SamplerWeights] = OrderedDict()
        self.sampler_cache_size = 2
        # snapshots some sampling client still holds (`track`), and the ids of those dropped since the
        # last flush: their merged sampler weights leave the cache then, not when the LRU gets to them
        self._live_snapshots: weakref.WeakValueDictionary[str, LoraSnapshot] = weakref.WeakValueDictionary()
        self._dropped_snapshots: list[str] = []
        self._sampler_base: dict[torch.dtype, SamplerWeights] = {}
        self._compute_weights: dict[torch.dtype, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}
        self._stacked: dict[str, torch.Tensor] | None = None
        self._packed_unembed: torch.Tensor | None = None
        # (side, dtype): `_plan_once`
        self._plans: dict[tuple[str, torch.dtype], SamplerPlan | TrainPlan] = {}
        self._blocked_unembed: kernels.BlockedHead | None = None
        self._blocked_unembed_built = False
        self._packed_unembed_grad: dict[torch.dtype, torch.Tensor | None] = {}
        self._packed_projections: dict[torch.dtype, dict[str, Packed]] = {}

    # ------------------------------------------------------------------ adapters
    def add_adapter(self, rank: int, alpha: float, targets: list[str], seed: int) -> str:
        """A new adapter with a seeded init; returns its name (used as the client's model id)."""
        from peft import LoraConfig, get_peft_model

        name = "m" + uuid.uuid4().hex[:12]
        cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                         init_lora_weights=True)
        with self.lock, warnings.catch_warnings():
            # LoRA on lm_head of a tied model changes the output projection only (peft warns about it)
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            self._flush_deletes()
            if self.peft is None:
                self.peft = get_peft_model(self.hf_model, cfg, adapter_name=name)
            else:
                self.peft.add_adapter(name, cfg)
            gen = torch.Generator().manual_seed(int(seed))
            with torch.no_grad():
                for mod_name, A, B in self.adapter_params(name):
                    torch.nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=gen)
                    B.zero_()
        return name

    def adapter_params(self, name: str) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]]:
        """`(HF module name, A weight, B weight)` of adapter `name`, in a fixed (sorted) order."""
        out = []
        for mod_name, mod in self.peft.named_modules():
            lora_A = getattr(mod, "lora_A", None)
            if isinstance(lora_A, torch.nn.ModuleDict) and name in lora_A:
                hf = mod_name[len(_PEFT_PREFIX):] if mod_name.startswith(_PEFT_PREFIX) else mod_name
                out.append((hf, lora_A[name].weight, mod.lora_B[name].weight))
        return sorted(out, key=lambda t: t[0])

    def activate(self, name: str) -> None:
        """Make `name` the adapter of the next forward (call with the lock held)."""
        self._flush_deletes()
        if list(self.peft.active_adapters) != [name]:
            self.peft.base_model.set_adapter(name)

    def release(self, name: str) -> None:
        """Drop an adapter at the next safe point (finalizers may run in any thread)."""
        self._to_delete.append(name)

    def _flush_deletes(self) -> None:
        while self._to_delete:
            name = self._to_delete.pop()
            if self.peft is not None and name in self.peft.peft_config and len(self.peft.peft_config) > 1:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self.peft.delete_adapter(name)

    def _plan_once(self, key: tuple[str, torch.dtype], make: Callable[[], Any]) -> Any:
        """The plan under `key`, made on first use and kept. Made on the compute thread: its probes run
        products, and a parallel region opened on the caller's thread would start a second OpenMP pool that
        slows every later kernel (`common.ComputeThread`). Made without the lock held: a caller waiting on the
        compute thread while that thread waits for the lock (a sampler batch) would never return. Two callers
        that race make the same plan; the first one kept wins."""
        with self.lock:
            plan = self._plans.get(key)
        if plan is None:
            made = COMPUTE.run(make)
            with self.lock:
                plan = self._plans.setdefault(key, made)
        return plan

    def sampler_plan(self, dtype: torch.dtype) -> SamplerPlan:
        """The one plan of every `dtype` sampler of this model (`plan.sampler_plan_for`)."""
        return self._plan_once(("sampler", dtype), lambda: sampler_plan_for(dims(self.config), dtype))

    def train_plan(self, dtype: torch.dtype) -> TrainPlan:
        """The one plan of every `dtype` training forward of this model (`plan.train_plan_for`)."""
        return self._plan_once(("train", dtype), lambda: train_plan_for(dims(self.config), dtype))

    def sampler_ops(self, dtype: torch.dtype) -> SamplerOps:
        """The sampler's ops in `dtype`."""
        return sampler_ops(self.sampler_plan(dtype))

    def train_ops(self, dtype: torch.dtype) -> TrainOps:
        """The training forward's ops in `dtype`."""
        return train_ops(self.train_plan(dtype))

    def packed_unembed(self, plan: TrainPlan) -> torch.Tensor | None:
        """The fp32 unembedding pre-packed for the logprobs of a training forward under `plan` (built on first
        use; None where the plan packs nothing)."""
        if not plan.onednn_packing:
            return None
        with self.lock:
            if self._packed_unembed is None:
                self._packed_unembed = pack_unembed(unembed_weight(self.base_state))
            return self._packed_unembed

    def blocked_unembed(self, plan: TrainPlan) -> kernels.BlockedHead | None:
        """The unembedding in bf16 for the AMX head kernel (`kernels.blocked_head`) where the training forward
        under `plan` runs its logprobs on it, else None."""
        if not plan.train_amx_unembedding:
            return None
        with self.lock:
            return self._blocked_head()

    def _blocked_head_for(self, dtype: torch.dtype) -> kernels.BlockedHead | None:
        """The blocked bf16 unembedding where the plan runs a `dtype` sampler's head on the AMX kernel (its
        inputs rounded to bf16: the same logits; `model.unembed_inputs`), else None. Called with the lock
        held."""
        return self._blocked_head() if self.sampler_plan(dtype).amx_unembedding else None

    def _blocked_head(self) -> kernels.BlockedHead | None:
        """The blocked bf16 unembedding, built on first use (called with the lock held)."""
        if not self._blocked_unembed_built:
            self._blocked_unembed = kernels.blocked_head(unembed_weight(self.base_state).float())
            self._blocked_unembed_built = True
        return self._blocked_unembed

    def packed_unembed_grad(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The unembedding's transpose in `dtype`, packed for the logprob gradient's product (built on
        first use; None without oneDNN)."""
        with self.lock:
            if dtype not in self._packed_unembed_grad:
                w = unembed_weight(self.base_state) if dtype == torch.float32 else self.compute_weights(dtype)[1]["unembed"]
                self._packed_unembed_grad[dtype] = (pack_unembed_grad(w) if self.train_plan(dtype)
                                                    .onednn_packing else None)
            return self._packed_unembed_grad[dtype]

    def stacked_weights(self) -> dict[str, torch.Tensor]:
        """fp32 q|k|v and gate|up weights of every layer (`model.fuse_base`), built once and
        shared by the training forward and the fp32 sampler."""
        with self.lock:
            if self._stacked is None:
                self._stacked = fuse_base(self.config, self.base_state)
            return self._stacked

    def compute_weights(self, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """`(base, fused)` for `train_forward.forward` in `dtype`: the projection weights (o, down and the
        stacked q|k|v, gate|up) converted once per dtype; norms and the embedding stay fp32. Below dtype
        fp32, `fused["unembed"]` is the unembedding in `dtype` for `train_forward.target_logprobs`."""
        if dtype == torch.float32:
            return self.base_state, self.stacked_weights()
        stacked = self.stacked_weights()
        with self.lock:
            got = self._compute_weights.get(dtype)
            if got is None:
                base = dict(self.base_state)
                for n in map(layer_names, range(self.config.num_hidden_layers)):
                    for key in (weight(n.o), weight(n.down)):
                        base[key] = base[key].to(dtype)
                fused = {k: v.to(dtype) for k, v in stacked.items()}
                fused["unembed"] = unembed_weight(self.base_state).to(dtype)  # the logprob gradient's product
                got = self._compute_weights[dtype] = (base, fused)
            return got

    def packed_projections(self, dtype: torch.dtype) -> dict[str, Packed]:
        """Every projection weight of `compute_weights(dtype)` (o, down, stacked q|k|v and gate|up) packed
        for the training forward's products and their input gradients (`train_forward.pack_weight`),
        built on first use: a copy of each weight and of its transpose."""
        base, fused = self.compute_weights(dtype)
        with self.lock:
            got = self._packed_projections.get(dtype)
            if got is None:
                got = {}
                for n in map(layer_names, range(self.config.num_hidden_layers)):
                    for key, w in ((weight(n.o), base[weight(n.o)]), (weight(n.down), base[weight(n.down)]),
                                   (n.stacked_qkv, fused[n.stacked_qkv]), (n.stacked_gate_up, fused[n.stacked_gate_up])):
                        got[key] = pack_weight(w)
                self._packed_projections[dtype] = got
            return got

    def causal_lm(self) -> Any:
        """The HF LlamaForCausalLM inside the peft wrapper (its Linear layers carry the adapters)."""
        return self.peft.base_model.model

    # ------------------------------------------------------------------ snapshots / sampler
    def snapshot(self, name: str, scale: float) -> LoraSnapshot:
        with self.lock:
            tensors = {m: (A.detach().clone(), B.detach().clone()) for m, A, B in self.adapter_params(name)}
        return self.track(LoraSnapshot(id=uuid.uuid4().hex, tensors=tensors, scale=scale))

    def track(self, snap: LoraSnapshot) -> LoraSnapshot:
        """Count `snap` as live until the last sampling client (or queued request) holding it is gone; its
        merged weights are then dropped at the next flush (`flush_dropped`). A finalizer may run on any
        thread, so it only appends the id."""
        self._live_snapshots[snap.id] = snap
        weakref.finalize(snap, self._dropped_snapshots.append, snap.id)
        return snap

    def has_dropped(self) -> bool:
        """Whether snapshots were dropped since the last flush (their cached weights still held)."""
        return bool(self._dropped_snapshots)

    def flush_dropped(self) -> None:
        """Drop the cached sampler weights of snapshots no sampling client holds any more."""
        with self.lock:
            while self._dropped_snapshots:
                sid = self._dropped_snapshots.pop()
                for key in [k for k in self._sampler_cache if k[0] == sid]:
                    del self._sampler_cache[key]

    def sampler_memory(self) -> dict[str, float]:
        """Live snapshots, their LoRA tensors' size and the merged sampler weights cached."""
        snaps = list(self._live_snapshots.values())
        size = sum(t.numel() * t.element_size() for s in snaps for pair in s.tensors.values() for t in pair)
        return {"snapshots": len(snaps), "snapshot_mb": round(size / 2**20, 1),
                "merged_cached": len(self._sampler_cache)}

    def sampler_weights(self, snap: LoraSnapshot, dtype: torch.dtype, quant: str = "none") -> SamplerWeights:
        """Sampler weights of a snapshot: the base, fused and packed once per dtype, plus the snapshot's
        LoRA (merged into re-packed copies of the projections where oneDNN packs, one model's worth of
        memory per snapshot; unmerged factors otherwise). The LRU cache keeps the last
        `sampler_cache_size` weight sets, so every generate of one snapshot reuses its weights.

        `quant` (`backend.sampler_quant`) other than `none`: the layer projections, LoRA merged,
        fake-quantised once per snapshot (`sampler_weights.with_lora`); the key then names it, since clients
        of one process may differ in it (`none` keeps the key it always had)."""
        key: tuple[str, ...] = (snap.id, str(dtype)) if quant == "none" else (snap.id, str(dtype), quant)
        self.flush_dropped()
        with self.lock:
            w = self._sampler_cache.get(key)
            if w is not None:
                self._sampler_cache.move_to_end(key)
                return w
            base = self._sampler_base.get(dtype)
            if base is None:
                base = self._sampler_base[dtype] = build_weights(
                    self.config, self.base_state, self.cos, self.sin, dtype,
                    stacked=self.stacked_weights() if dtype == torch.float32 else None,
                    head_tiles=self._blocked_head_for(dtype), ops=self.sampler_ops(dtype))
            w = with_lora(base, snap.tensors, snap.scale, quant)
            self._sampler_cache[key] = w
            while len(self._sampler_cache) > self.sampler_cache_size:
                self._sampler_cache.popitem(last=False)
            return w


_bases: dict[tuple[str, str], SharedBase] = {}
_bases_lock = threading.Lock()


def loaded_bases() -> list[SharedBase]:
    """Every `SharedBase` this process has loaded."""
    with _bases_lock:
        return list(_bases.values())


def shared_base(base_model: str, cache_dir: str | Path | None = None) -> SharedBase:
    """The process-wide `SharedBase` of a model (loaded on first use)."""
    from trainer.model_registry import cache_root

    key = (spec_for(base_model).base_model, str(cache_root(cache_dir)))
    with _bases_lock:
        if key not in _bases:
            # loaded on the compute thread: a torch parallel region run from the caller's thread would
            # start a second OpenMP pool, which slows the compute thread's kernels (see ComputeThread)
            _bases[key] = COMPUTE.run(lambda: SharedBase(base_model, cache_dir))
        return _bases[key]
