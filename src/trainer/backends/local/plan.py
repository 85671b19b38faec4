"""The engine plan: every choice of the local engine that decides the bits a run produces, made in this module
once per model and dtype, said in one line at the start of a run (and of `python -m trainer.serve`), and
recorded in `run_info.json` as its `engine` record.

What it decides:
- the precision `auto` means on this machine (`resolve_dtypes`): bf16 where bf16 GEMMs are at least
  `MIN_SPEEDUP` times as fast as fp32, from the timing `precision.py` takes and caches;
- per sampler dtype (`SamplerPlan`): which ops run on the native kernels (`kernels.py`), the AMX tiles or
  oneDNN's packed products, and what the unembedding's inputs are rounded to;
- per training dtype (`TrainPlan`): the same for the training forward, and whether its layer products run on
  oneDNN-packed weights (where the timing finds them at least `MIN_PACK_SPEEDUP` times as fast).

Why one place: these implementations compute the same functions with different summation orders, so which
of them runs decides a run's bits. A choice probed again at every call could change inside a run (a library
that fails to load late) and could not be read anywhere as a whole; here each is probed once from what this
CPU, this torch build and this model's sizes allow, and the model code runs the op tables built from it
(`ops.py`) without asking again. `SharedBase` makes one plan per side and dtype, on the compute thread (its
probes run products); the plan a client logs and records (`EnginePlan`) is those two objects.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, fields, replace
from typing import ClassVar, TypeVar

import torch

from trainer.backends.local import kernels, precision
from trainer.backends.local.model import ONEDNN_PACKING, Dims, packed_bf16_inputs_honoured, unembed_inputs
from trainer.backends.local.precision import DTYPES, dtype_name

# `auto` as one precision for a whole process, subprocesses included (how `pytest --precision` runs a suite in
# the other precision); settings that name a precision keep it
AUTO_PRECISION_ENV = "PAIREDRL_AUTO_PRECISION"
# bf16 rounds activations and weights: it is chosen only when it is clearly faster, not within noise
MIN_SPEEDUP = 1.25
# packed training weights cost a copy of every projection weight and of its transpose: only when clearly
# faster
MIN_PACK_SPEEDUP = 1.2
TRAIN_PACKING_ENV = "PAIREDRL_TRAIN_PACKING"
# the plan's choices a process may put back on torch (`PAIREDRL_TORCH_OPS=a,b`): how `bench/` times what
# each native tier buys on one machine
TORCH_OPS_ENV = "PAIREDRL_TORCH_OPS"
NATIVE_CHOICES = ("decode_attention", "sampler_rows", "amx_projections", "amx_unembedding", "onednn_packing",
                  "train_rows")


@functools.cache
def cpu_flags() -> str:
    """The CPU features the native kernels look for (AVX2 / AVX-512 / AVX512_BF16 / AMX-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return "unknown"
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    return ",".join(x for x in wanted if x in flags) or "none of avx2/avx512f/avx512_bf16/amx_bf16"


# ------------------------------------------------------------------------------------------ precision
def choose_dtype(seconds: dict[str, dict[str, float]]) -> tuple[str, float]:
    """(`bfloat16` or `float32`, bf16's speedup over fp32) for a timing of the engine's GEMMs
    (`precision.measure`): bf16 where it is at least `MIN_SPEEDUP` times as fast."""
    speedup = precision.bf16_speedup(seconds)
    return ("bfloat16" if speedup >= MIN_SPEEDUP else "float32"), speedup


def measured_dtype() -> tuple[str, str]:
    """(`bfloat16` or `float32`, why): what the timing of this machine's GEMMs makes `auto` mean."""
    hit, where = precision.measured_entry()
    name, speedup = choose_dtype(hit["seconds"])
    return name, (f"measured: bf16 GEMMs {speedup:.2f}x as fast as fp32 on this CPU "
                  f"(threshold {MIN_SPEEDUP}x; {where})")


def auto_dtype() -> tuple[torch.dtype, str]:
    """What `sampler_dtype=auto` / `train_dtype=auto` mean in this process, and why."""
    forced = os.environ.get(AUTO_PRECISION_ENV, "").strip()
    if forced and forced != "auto":
        if forced not in DTYPES:
            raise ValueError(f"{AUTO_PRECISION_ENV}={forced!r}: expected one of auto, "
                             f"{', '.join(sorted(DTYPES))}")
        return DTYPES[forced], f"{AUTO_PRECISION_ENV}={forced}"
    name, why = measured_dtype()
    return DTYPES[name], why


def resolve_dtypes(sampler: str, train: str) -> tuple[torch.dtype, torch.dtype, str | None]:
    """(sampler dtype, training dtype, how `auto` was decided: None where neither setting is `auto`) for the
    backend's dtype settings (`float32`, `bfloat16` or `auto`); ValueError for another name."""
    auto = auto_dtype() if "auto" in (sampler, train) else None

    def one(name: str, what: str) -> torch.dtype:
        if name == "auto" and auto is not None:
            return auto[0]
        if name not in DTYPES:
            raise ValueError(f"{what} must be one of {sorted(DTYPES) + ['auto']}, got {name!r}")
        return DTYPES[name]
    return one(sampler, "sampler_dtype"), one(train, "train_dtype"), auto[1] if auto else None


def train_packing(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the training forward runs its layer GEMMs on oneDNN-packed weights in `dtype`, and why: which
    of MKL's sgemm and oneDNN's packed kernel is faster at the training shapes differs between CPUs and
    precisions (`bench/gemm.py`), so it is timed (`precision.measured_entry`); PAIREDRL_TRAIN_PACKING=0|1
    overrides the timing."""
    forced = _train_packing_forced()
    if not ONEDNN_PACKING:
        return False, "no oneDNN packing on this torch build"
    if forced:
        return forced == "1", f"{TRAIN_PACKING_ENV}={forced}"
    hit, where = precision.measured_entry()
    name = dtype_name(dtype)
    gain = precision.packing_gains(hit["seconds"]).get(name)
    if gain is None:  # `dtype` is neither float32 nor bfloat16: not timed
        return False, f"no packed measurement for {name} ({where})"
    return gain >= MIN_PACK_SPEEDUP, (f"measured: packed {name} training GEMMs {gain:.2f}x as fast as "
                                      f"F.linear (threshold {MIN_PACK_SPEEDUP}x; {where})")


def _train_packing_forced() -> str:
    forced = os.environ.get(TRAIN_PACKING_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{TRAIN_PACKING_ENV}={forced!r}: expected 0 or 1")
    return forced


def forced_to_torch() -> set[str]:
    """The choices `PAIREDRL_TORCH_OPS` names; ValueError naming the valid ones for any other name."""
    raw = os.environ.get(TORCH_OPS_ENV, "")
    names = {x.strip() for x in raw.split(",") if x.strip()}
    unknown = sorted(names - set(NATIVE_CHOICES))
    if unknown:
        raise ValueError(f"{TORCH_OPS_ENV}={raw!r}: unknown choice(s) {unknown}; choose from "
                         f"{', '.join(NATIVE_CHOICES)}")
    if "decode_attention" in names:  # the row kernels pair with the decode kernel's cache layout
        names.add("sampler_rows")
    return names


def check_environment() -> None:
    """ValueError naming the variable for a bad PAIREDRL_TORCH_OPS or PAIREDRL_TRAIN_PACKING: a client checks
    them when it is made, before any model is loaded (the plans that read them are made at the first load)."""
    forced_to_torch()
    _train_packing_forced()


# ------------------------------------------------------------------------------------------ the plans
@dataclass(frozen=True)
class SamplerPlan:
    """What the sampler runs where, for one model (`Dims`) in one dtype. Each bool names one implementation
    choice; True is the native (or AMX, or oneDNN-packed) variant."""

    sampler_dtype: torch.dtype
    kernels: str  # the native library's state and why (`kernels.describe`)
    cpu: str  # `cpu_flags()`
    decode_attention: bool  # decode attention on the native kernel (a KV cache of keys before RoPE)
    sampler_rows: bool  # residual add + RMSNorm + cast and the SiLU gate on the native row kernels
    amx_projections: bool  # bf16 layer products on the AMX tiles
    amx_unembedding: bool  # the unembedding on the AMX tiles from bf16 inputs
    onednn_packing: bool  # products on oneDNN weights pre-packed for their row count
    head_inputs: torch.dtype  # what the fp32 unembedding's inputs are rounded to (`model.unembed_inputs`)
    packed_head: bool  # the unembedding on the packed weight (`packed_bf16_inputs_honoured`)

    # the `NATIVE_CHOICES` this side makes, and the field each one sets
    CHOICES: ClassVar[dict[str, str]] = {c: c for c in ("decode_attention", "sampler_rows", "amx_projections",
                                                        "amx_unembedding", "onednn_packing")}

    def on_torch(self) -> SamplerPlan:
        """This plan with every op on torch, what a machine without the native kernels runs: tests and
        `bench/` compare the two paths on one machine with it."""
        return _on_torch(self)


@dataclass(frozen=True)
class TrainPlan:
    """What the training forward runs where, for one model in one dtype (fields named for run_info.json's
    `engine` record, where they sit beside the sampler's)."""

    train_dtype: torch.dtype
    kernels: str
    cpu: str
    train_rows: bool  # norm-cast, RoPE and SiLU gate (forward and backward) on the native row kernels
    train_amx_unembedding: bool  # the logprobs' unembedding on the AMX tiles from bf16 inputs
    onednn_packing: bool  # the logprobs' unembedding and its gradient product on oneDNN-packed weights
    train_head_inputs: torch.dtype  # what the fp32 unembedding's inputs are rounded to
    train_packed_weights: bool  # the layer products and their input gradients on oneDNN-packed weights
    train_packing: str  # why (`train_packing`)

    CHOICES: ClassVar[dict[str, str]] = {"train_rows": "train_rows", "amx_unembedding": "train_amx_unembedding",
                                         "onednn_packing": "onednn_packing"}

    def on_torch(self) -> TrainPlan:
        """This plan with every op on torch (see `SamplerPlan.on_torch`)."""
        return _on_torch(self)


Plan = TypeVar("Plan", SamplerPlan, TrainPlan)


def _on_torch(plan: Plan) -> Plan:
    return replace(plan, kernels="torch path (asked for)",
                   **{f: False for c, f in plan.CHOICES.items() if c != "onednn_packing"})


def _off(plan: Plan, names: set[str]) -> Plan:
    """`plan` less the choices `names` puts back on torch."""
    off = {f: False for c, f in plan.CHOICES.items() if c in names}
    return replace(plan, **off) if off else plan


def sampler_plan_for(d: Dims, dtype: torch.dtype) -> SamplerPlan:
    """The sampler plan for a model of sizes `d` in `dtype` (every capability it needs probed here, once),
    less the choices `PAIREDRL_TORCH_OPS` puts back on torch."""
    decode = kernels.native_decode(d.n_heads, d.n_kv, d.head_dim)
    head_inputs = unembed_inputs(dtype)
    plan = SamplerPlan(
        sampler_dtype=dtype, kernels=kernels.describe(), cpu=cpu_flags(), decode_attention=decode,
        # the row kernels pair with the decode kernel's cache layout: both or neither
        sampler_rows=decode and kernels.row_kernels(d.act_name, dtype, d.hidden, d.intermediate),
        amx_projections=kernels.amx_head() and dtype == torch.bfloat16,
        amx_unembedding=kernels.amx_head() and head_inputs == torch.bfloat16,
        onednn_packing=ONEDNN_PACKING, head_inputs=head_inputs,
        packed_head=ONEDNN_PACKING and (head_inputs == torch.float32 or packed_bf16_inputs_honoured()))
    return _off(plan, forced_to_torch())


def train_plan_for(d: Dims, dtype: torch.dtype) -> TrainPlan:
    """The training plan for a model of sizes `d` in `dtype`, less the choices `PAIREDRL_TORCH_OPS` puts back
    on torch (the packed layer weights are no such choice: `PAIREDRL_TRAIN_PACKING` sets them)."""
    head_inputs = unembed_inputs(dtype)
    packed, why = train_packing(dtype)
    plan = TrainPlan(
        train_dtype=dtype, kernels=kernels.describe(), cpu=cpu_flags(),
        train_rows=kernels.row_kernels(d.act_name, dtype, d.hidden, d.intermediate),
        train_amx_unembedding=kernels.amx_head() and head_inputs == torch.bfloat16,
        onednn_packing=ONEDNN_PACKING, train_head_inputs=head_inputs, train_packed_weights=packed,
        train_packing=why)
    return _off(plan, forced_to_torch())


@dataclass(frozen=True)
class EnginePlan:
    """The plan a client runs a model with: the sampler plan and the training plan its ops are built from
    (the very objects), and how its `auto` dtypes were decided (None: neither was `auto`)."""

    sampler: SamplerPlan
    train: TrainPlan
    auto: str | None

    def native(self) -> list[str]:
        """The `NATIVE_CHOICES` that run native on either side."""
        return [c for c in NATIVE_CHOICES
                if any(getattr(p, p.CHOICES[c]) for p in (self.sampler, self.train) if c in p.CHOICES)]

    def record(self) -> dict[str, object]:
        """run_info.json's `engine`: the resolved dtypes and how `auto` was decided (what a resume and
        `eval.compare` check), then every choice of both sides as JSON values."""
        out: dict[str, object] = {"sampler_dtype": dtype_name(self.sampler.sampler_dtype),
                                  "train_dtype": dtype_name(self.train.train_dtype), "auto": self.auto}
        for plan in (self.sampler, self.train):
            for f in fields(plan):
                v = getattr(plan, f.name)
                out.setdefault(f.name, dtype_name(v) if isinstance(v, torch.dtype) else v)
        return out

    def line(self) -> str:
        """One line: the dtypes, then which ops are native, then the library's state."""
        s, t = self.sampler, self.train
        return (f"engine plan: sampler {dtype_name(s.sampler_dtype)}, train {dtype_name(t.train_dtype)}, "
                f"head inputs {dtype_name(s.head_inputs)}; native: {', '.join(self.native()) or 'none'}; "
                f"packed training weights: {'yes' if t.train_packed_weights else 'no'}; cpu {s.cpu}; "
                f"{s.kernels}")
