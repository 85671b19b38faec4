"""The engine plan: every implementation choice of the local engine for one model and the client's dtypes,
made once, said in one line at the start of a run (and of `python -m trainer.serve`), and recorded in
`run_info.json`.

Why one place: the native kernels (`kernels.py`), the AMX tiles, oneDNN's packed products and torch's own
ops compute the same functions with different summation orders, so which of them runs decides the bits a
run produces. A choice probed again at every call could change inside a run (a library that fails to load
late) and could not be read anywhere as a whole; here each is probed once from what this CPU, this torch
build and this model's sizes allow, and the model code runs the op tables built from it (`ops.py`)
without asking again.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from trainer.backends.local import kernels
from trainer.backends.local.model import ONEDNN_PACKING, Dims, packed_bf16_inputs_honoured, unembed_inputs
from trainer.backends.local.precision import dtype_name


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


@dataclass(frozen=True)
class EnginePlan:
    """What runs where, for one model (`Dims`) in the sampler and training dtypes. Each flag names one
    implementation choice; True is the native (or AMX, or oneDNN-packed) variant."""

    sampler_dtype: torch.dtype
    train_dtype: torch.dtype
    kernels: str  # the native library's state and why (`kernels.describe`)
    cpu: str  # `cpu_flags()`
    # the sampler
    decode_attention: bool  # decode attention on the native kernel (a KV cache of keys before RoPE)
    sampler_rows: bool  # residual add + RMSNorm + cast and the SiLU gate on the native row kernels
    amx_projections: bool  # bf16 layer products on the AMX tiles
    amx_unembedding: bool  # the unembedding on the AMX tiles from bf16 inputs
    onednn_packing: bool  # products on oneDNN weights pre-packed for their row count
    head_inputs: torch.dtype  # what the fp32 unembedding's inputs are rounded to (`model.unembed_inputs`)
    packed_head: bool  # the sampler's unembedding on the packed weight (`packed_bf16_inputs_honoured`)
    # the training forward
    train_rows: bool  # norm-cast, RoPE and SiLU gate (forward and backward) on the native row kernels

    def with_training(self, train: EnginePlan) -> EnginePlan:
        """This plan's sampler choices with `train`'s training choices (`TRAIN_FIELDS`)."""
        return replace(self, **{k: getattr(train, k) for k in TRAIN_FIELDS})

    def on_torch(self) -> EnginePlan:
        """This plan with every op on torch, what a machine without the native kernels runs: tests and
        `bench/` compare the two paths on one machine with it."""
        return replace(self, kernels="torch path (asked for)",
                       **{k: False for k in NATIVE_CHOICES if k != "onednn_packing"})

    def record(self) -> dict[str, object]:
        """The plan as JSON values (run_info.json's `engine`)."""
        out: dict[str, object] = {}
        for k, v in self.__dict__.items():
            out[k] = dtype_name(v) if isinstance(v, torch.dtype) else v
        return out

    def line(self) -> str:
        """One line: the dtypes, then which ops are native, then the library's state."""
        on = [name for name in NATIVE_CHOICES if getattr(self, name)]
        return (f"engine plan: sampler {dtype_name(self.sampler_dtype)}, train {dtype_name(self.train_dtype)}, "
                f"head inputs {dtype_name(self.head_inputs)}; native: {', '.join(on) or 'none'}; "
                f"cpu {self.cpu}; {self.kernels}")


# the fields of the training side (the others are the sampler's, or the same on both sides)
TRAIN_FIELDS = ("train_dtype", "train_rows")
# the plan's choices a process may put back on torch (`PAIREDRL_TORCH_OPS=a,b`): how `bench/` times what
# each native tier buys on one machine
TORCH_OPS_ENV = "PAIREDRL_TORCH_OPS"
NATIVE_CHOICES = ("decode_attention", "sampler_rows", "amx_projections", "amx_unembedding", "onednn_packing",
                  "train_rows")


def forced_to_torch() -> set[str]:
    """The choices `PAIREDRL_TORCH_OPS` names; ValueError naming the valid ones for any other name."""
    raw = os.environ.get(TORCH_OPS_ENV, "")
    names = {x.strip() for x in raw.split(",") if x.strip()}
    unknown = sorted(names - set(NATIVE_CHOICES))
    if unknown:
        raise ValueError(f"{TORCH_OPS_ENV}={raw!r}: unknown choice(s) {unknown}; choose from "
                         f"{', '.join(NATIVE_CHOICES)}")
    return names


def plan_for(d: Dims, sampler_dtype: torch.dtype, train_dtype: torch.dtype) -> EnginePlan:
    """The plan for a model of sizes `d` (every capability of the engine is probed here, once), less the
    choices `PAIREDRL_TORCH_OPS` puts back on torch."""
    sampler_rows = kernels.row_kernels(d.act_name, sampler_dtype, d.hidden, d.intermediate)
    decode = kernels.native_decode(d.n_heads, d.n_kv, d.head_dim)
    head_inputs = unembed_inputs(sampler_dtype)
    packing = ONEDNN_PACKING
    plan = EnginePlan(
        sampler_dtype=sampler_dtype, train_dtype=train_dtype, kernels=kernels.describe(), cpu=cpu_flags(),
        decode_attention=decode,
        # the row kernels pair with the decode kernel's cache layout: both or neither
        sampler_rows=decode and sampler_rows,
        amx_projections=kernels.amx_head() and sampler_dtype == torch.bfloat16,
        amx_unembedding=kernels.amx_head() and head_inputs == torch.bfloat16,
        onednn_packing=packing, head_inputs=head_inputs,
        packed_head=packing and (head_inputs == torch.float32 or packed_bf16_inputs_honoured()),
        train_rows=kernels.row_kernels(d.act_name, train_dtype, d.hidden, d.intermediate))
    off = forced_to_torch()
    if "decode_attention" in off:  # the row kernels pair with the decode kernel's cache layout
        off.add("sampler_rows")
    return replace(plan, **{k: False for k in off}) if off else plan
