"""What the local engine's `auto` precision means on this machine: measured once, cached per machine.

CPU flags alone do not settle it: without AVX512_BF16/AMX torch runs bf16 matmuls on a fallback several
times slower than fp32, with AMX they run ~5x faster, and CPUs with AVX512_BF16 but no AMX (e.g. Zen 5)
sit in between. So `auto` times the engine's own GEMM kinds in both precisions (a decode projection on
oneDNN-packed weights and a training-sized `F.linear`) in a one-thread child process, and picks bf16 when
it is at least `MIN_SPEEDUP` times faster over both. The result is cached in a small JSON file keyed by CPU
model, bf16 flags and torch version, so every run on one machine makes the same choice (a run records the
precision it used in `run_info.json`).

`PAIREDRL_AUTO_PRECISION=float32|bfloat16` overrides the measurement (a whole test suite, subprocesses
included, can then run the other precision); settings that name a precision keep it.

The same measurement decides, per precision, whether the training forward runs its layer GEMMs on
oneDNN-packed weights (`training_packing`): which of MKL's sgemm and oneDNN's packed kernel is faster at
the training shapes differs between CPUs and precisions (`bench/gemm.py` measures both), so packing is
chosen where the packed product is at least `MIN_PACK_SPEEDUP` times as fast as `F.linear`;
`PAIREDRL_TRAIN_PACKING=0|1` overrides it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from trainer.backends.local.model import ONEDNN_PACKING, onednn_linear, onednn_pack
from trainer.utils.machine import cpu_model

AUTO_PRECISION_ENV = "PAIREDRL_AUTO_PRECISION"
# where the measured choice is kept (default: $XDG_CACHE_HOME/pairedrl or ~/.cache/pairedrl)
CACHE_DIR_ENV = "PAIREDRL_CACHE_DIR"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# bf16 rounds activations and weights: it is chosen only when it is clearly faster, not within noise
MIN_SPEEDUP = 1.25
# packed training weights cost a copy of every projection weight and of its transpose: only when clearly faster
MIN_PACK_SPEEDUP = 1.2
TRAIN_PACKING_ENV = "PAIREDRL_TRAIN_PACKING"
# SmolLM2-135M's widest layer projection (gate|up, 576 -> 3072): 32 decode rows, 512 training rows
_IN, _OUT, _DECODE_ROWS, _TRAIN_ROWS = 576, 3072, 32, 512
# calls per timed sample: ~5 ms of bf16 work each on an AMX CPU (fp32 and bf16 alike run the same count)
_DECODE_REPS, _TRAIN_REPS = 40, 4
# distinct weights the training products cycle over: 8 x 3.5 MB (bf16) is more than a core's L2
_TRAIN_WEIGHTS = 8


def cpu_flags() -> set[str]:
    """The bf16 matmul flags of this CPU (`avx512_bf16`, `amx_bf16`), empty when unknown."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {f for f in ("avx512_bf16", "amx_bf16") if f in text.split()}


# bumped when what `_kernels` times changes, so that a cached result of the old measurement is not reused
MEASUREMENT = 2


def machine_key() -> str:
    """What the measurement depends on: CPU model and bf16 flags, torch version, the measurement itself."""
    return (f"{cpu_model() or platform.machine()} | {','.join(sorted(cpu_flags())) or 'no bf16 flags'} | "
            f"torch {torch.__version__} | measurement {MEASUREMENT}")


def cache_path() -> Path:
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "pairedrl")
    return Path(root) / "auto_precision.json"


def _kernels(dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The two GEMM kinds, each repeated enough to take a few milliseconds (a sample shorter than a
    scheduler tick is mostly noise on a busy machine)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(_OUT, _IN, generator=gen).to(dtype)
    xd = torch.randn(_DECODE_ROWS, _IN, generator=gen).to(dtype)
    xt = torch.randn(_TRAIN_ROWS, _IN, generator=gen).to(dtype)
    if ONEDNN_PACKING:
        packed = onednn_pack(w, _DECODE_ROWS)  # how the sampler runs decode

        def one_decode() -> object:
            return onednn_linear(xd, packed)
    else:
        def one_decode() -> object:
            return F.linear(xd, w)

    def decode() -> None:
        for _ in range(_DECODE_REPS):
            one_decode()

    # training products cycle over distinct weights, as the training forward's layers do: each product finds
    # its weight out of the core's caches (plain bf16 weights are then reordered for AMX from memory on
    # every call, which a weight kept hot would hide)
    ws = [w] + [torch.randn(_OUT, _IN, generator=gen).to(dtype) for _ in range(_TRAIN_WEIGHTS - 1)]

    dyt = torch.randn(_TRAIN_ROWS, _OUT, generator=gen).to(dtype)

    def train() -> None:  # the forward product and the backward's input gradient, as a layer runs them
        for i in range(_TRAIN_REPS):
            F.linear(xt, ws[i % _TRAIN_WEIGHTS])
            torch.mm(dyt, ws[i % _TRAIN_WEIGHTS])
    kinds = {"decode": decode, "train": train}
    if ONEDNN_PACKING:  # how packed training runs: the weight and its transpose packed (`train_forward.pack_weight`)
        packed_t = [(onednn_pack(wi, _TRAIN_ROWS), onednn_pack(wi.t().contiguous(), _TRAIN_ROWS)) for wi in ws]

        def train_packed() -> None:
            for i in range(_TRAIN_REPS):
                fwd, bwd = packed_t[i % _TRAIN_WEIGHTS]
                onednn_linear(xt, fwd)
                onednn_linear(dyt, bwd)
        kinds["train_packed"] = train_packed
    return kinds


def _measure_here(rounds: int = 5) -> dict[str, dict[str, float]]:
    """Best CPU seconds per sample of each kind, on one thread; the precisions alternate within every
    round, so a burst of load elsewhere touches both rather than one."""
    torch.set_num_threads(1)
    kernels = {name: _kernels(dt) for name, dt in DTYPES.items()}
    best = {name: {kind: float("inf") for kind in ks} for name, ks in kernels.items()}
    for ks in kernels.values():  # warm-up: oneDNN builds its kernels on the first call
        for fn in ks.values():
            fn()
    for _ in range(rounds):
        for name, ks in kernels.items():
            for kind, fn in ks.items():
                t0 = time.thread_time()
                fn()
                best[name][kind] = min(best[name][kind], time.thread_time() - t0)
    return best


def measure() -> dict[str, dict[str, float]]:
    """CPU seconds per sample, by precision and GEMM kind. Timed in a one-thread child process on its
    thread's CPU clock: wall-clock GEMM timings on a busy machine mostly measure the scheduler (an
    OpenMP team waits for its slowest thread), and the child opens no second OpenMP pool in the engine's
    process (see `common.ComputeThread`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[3])] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    try:
        out = subprocess.run([sys.executable, "-m", "trainer.backends.local.precision"], env=env,
                             capture_output=True, text=True, timeout=300, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        detail = getattr(e, "stderr", None) or e
        raise RuntimeError(f"measuring the local engine's `auto` precision failed ({detail}); set "
                           f"{AUTO_PRECISION_ENV}=float32 or bfloat16 to skip the measurement") from e


def choose(seconds: dict[str, dict[str, float]]) -> tuple[str, float]:
    """(`bfloat16` or `float32`, bf16's speedup over fp32): each precision's decode product plus its faster
    training product (plain or packed, as `training_packing` would run it)."""
    def total(ks: dict[str, float]) -> float:
        return ks["decode"] + min(ks["train"], ks.get("train_packed", ks["train"]))
    speedup = total(seconds["float32"]) / total(seconds["bfloat16"])
    return ("bfloat16" if speedup >= MIN_SPEEDUP else "float32"), speedup


def choose_packing(seconds: dict[str, dict[str, float]]) -> dict[str, float]:
    """Per precision, the packed training product's speedup over `F.linear` (absent without oneDNN)."""
    return {name: round(ks["train"] / ks["train_packed"], 3) for name, ks in seconds.items() if "train_packed" in ks}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or unreadable: measure again (and rewrite it)
    return data if isinstance(data, dict) else {}


def _valid(hit: object) -> bool:
    return (isinstance(hit, dict) and hit.get("choice") in DTYPES and isinstance(hit.get("speedup"), (int, float))
            and isinstance(hit.get("packing"), dict)
            and all(isinstance(v, (int, float)) for v in hit["packing"].values()))


def measured_entry() -> tuple[dict, str]:
    """This machine's measurement (`choice`, `speedup`, `packing`, `seconds`) and where it is kept: from
    the cache when this machine was measured before (an entry missing a field is measured again)."""
    key, path = machine_key(), cache_path()
    entries = _read_cache(path)
    hit = entries.get(key)
    if _valid(hit):
        return hit, f"cached in {path}"
    seconds = measure()
    choice, speedup = choose(seconds)
    entries[key] = hit = {"choice": choice, "speedup": round(speedup, 3), "packing": choose_packing(seconds),
                          "seconds": seconds, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    where = "not cached: the cache folder is not writable"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
        where = f"cached in {path}"
    except OSError:
        pass
    return hit, where


def measured_precision() -> tuple[str, str]:
    """(`bfloat16` or `float32`, why)."""
    hit, where = measured_entry()
    return hit["choice"], (f"measured: bf16 GEMMs {hit['speedup']:.2f}x as fast as fp32 on this CPU "
                           f"(threshold {MIN_SPEEDUP}x; {where})")


def training_packing(dtype: torch.dtype) -> tuple[bool, str]:
    """Whether the training forward runs its layer GEMMs on oneDNN-packed weights in `dtype`, and why."""
    forced = os.environ.get(TRAIN_PACKING_ENV, "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"{TRAIN_PACKING_ENV}={forced!r}: expected 0 or 1")
    if not ONEDNN_PACKING:
        return False, "no oneDNN packing on this torch build"
    if forced:
        return forced == "1", f"{TRAIN_PACKING_ENV}={forced}"
    hit, where = measured_entry()
    name = dtype_name(dtype)
    gain = hit["packing"].get(name)
    if gain is None:  # measured where packing was absent: the same torch build, so not expected
        return False, f"no packed measurement for {name} ({where})"
    return gain >= MIN_PACK_SPEEDUP, (f"measured: packed {name} training GEMMs {gain:.2f}x as fast as F.linear "
                                      f"(threshold {MIN_PACK_SPEEDUP}x; {where})")


def auto_precision() -> tuple[torch.dtype, str]:
    """What `sampler_dtype=auto` / `train_dtype=auto` mean on this machine, and why."""
    forced = os.environ.get(AUTO_PRECISION_ENV, "").strip()
    if forced and forced != "auto":
        if forced not in DTYPES:
            raise ValueError(f"{AUTO_PRECISION_ENV}={forced!r}: expected one of auto, {', '.join(sorted(DTYPES))}")
        return DTYPES[forced], f"{AUTO_PRECISION_ENV}={forced}"
    choice, why = measured_precision()
    return DTYPES[choice], why


if __name__ == "__main__":  # the child process of `measure`
    print(json.dumps(_measure_here()))
