"""The timing behind the local engine's `auto` precision and its training packing: taken once, cached per
machine.

CPU flags alone do not settle which precision is faster: without AVX512_BF16/AMX torch runs bf16 matmuls on a
fallback several times slower than fp32, with AMX they run ~5x faster, and CPUs with AVX512_BF16 but no AMX
(e.g. Zen 5) sit in between. So this module times the engine's own GEMM kinds in both precisions (a decode
projection on oneDNN-packed weights, a training layer's products plain and on packed weights) in a one-thread
child process, and caches the seconds in a small JSON file keyed by CPU model, bf16 flags and torch version,
so every run on one machine decides from the same numbers. What they decide (which dtype `auto` means,
whether training packs its weights) is the engine plan's (`plan.py`), as is every other choice of the engine.
`python -m trainer.backends.local.precision` prints a fresh timing.
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

# where the timing is kept (default: $XDG_CACHE_HOME/pairedrl or ~/.cache/pairedrl)
CACHE_DIR_ENV = "PAIREDRL_CACHE_DIR"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
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
        raise RuntimeError(f"timing the local engine's GEMMs (what `auto` precision and training packing "
                           f"are decided from) failed ({detail}); set PAIREDRL_AUTO_PRECISION=float32 or "
                           "bfloat16 and PAIREDRL_TRAIN_PACKING=0 or 1 to decide without it") from e


def bf16_speedup(seconds: dict[str, dict[str, float]]) -> float:
    """How many times as fast bf16 runs the engine's GEMMs as fp32: each precision's decode product plus its
    faster training product (plain or packed, as the training plan would run it)."""
    def total(ks: dict[str, float]) -> float:
        return ks["decode"] + min(ks["train"], ks.get("train_packed", ks["train"]))
    return total(seconds["float32"]) / total(seconds["bfloat16"])


def packing_gains(seconds: dict[str, dict[str, float]]) -> dict[str, float]:
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


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0


def _valid(hit: object) -> bool:
    """An entry with every timing the plan decides from: both precisions' products, packed ones included
    where this torch build packs."""
    kinds = ("decode", "train", "train_packed") if ONEDNN_PACKING else ("decode", "train")
    seconds = hit.get("seconds") if isinstance(hit, dict) else None
    return isinstance(seconds, dict) and all(
        isinstance(seconds.get(name), dict) and all(_number(seconds[name].get(k)) for k in kinds)
        for name in DTYPES)


def measured_entry() -> tuple[dict, str]:
    """This machine's timing (`seconds`; `speedup` and `packing` summarise it for a reader of the file) and
    where it is kept: from the cache when this machine was timed before (an entry missing a timing is timed
    again)."""
    key, path = machine_key(), cache_path()
    entries = _read_cache(path)
    hit = entries.get(key)
    if _valid(hit):
        return hit, f"cached in {path}"
    seconds = measure()
    entries[key] = hit = {"speedup": round(bf16_speedup(seconds), 3), "packing": packing_gains(seconds),
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


if __name__ == "__main__":  # the child process of `measure`
    print(json.dumps(_measure_here()))
