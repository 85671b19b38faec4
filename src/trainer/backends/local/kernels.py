"""Native CPU kernels of the local engine (`kernels.c`), built with the machine's C compiler on first use and
loaded with ctypes; the engine runs torch ops where none can be built.

Why: at decode shapes (one query per row, a few hundred cached positions, head size 64) attention is 96
tiny matrix products per layer, which torch's batched GEMM runs at a few percent of the CPU's speed;
one pass per (row, key/value head) that computes the scores, the softmax and the weighted sum of values,
with the query heads of a group sharing their cache reads, does the same arithmetic in a fraction of the
time. The same holds, less extremely, for the element-wise steps between a layer's products (norms,
casts, residual adds, RoPE, the SiLU gate): each torch op is a pass over memory and a dispatch, and at
decode's few rows the dispatch alone costs more than the arithmetic; here each step is one pass per row.
On AMX CPUs the unembedding runs on the tiles from bf16 weights (`BlockedHead`): the fp32 product in
oneDNN's bf16 mode gives the same logits but converts the fp32 weight on every call.

Build: `cc -O3 -march=native -fopenmp -shared -fPIC`, once per (source, compiler, CPU), into
`<cache>/kernels/` (`PAIREDRL_CACHE_DIR` or ~/.cache/pairedrl, as for `auto` precision), written
atomically. The library is opened after torch, so its OpenMP symbols resolve to the runtime torch
already loaded (same soname): the kernel's threads are torch's own, not a second pool competing for
the cores. Without a compiler, when the build fails, or with `PAIREDRL_NATIVE_KERNELS=0`, `library()`
is None and `describe()` says why; the run records which path it used (`run_info.json`,
`engine.kernels`). The first two also print one warning line on stderr per process: the torch
path is slower and sums in another order, so the same command follows another trajectory, which a user
should not learn from a run's numbers alone. `PAIREDRL_NATIVE_KERNELS=0` is a choice and prints nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.backends.local.precision import cache_path
from trainer.utils.machine import cpu_flags_line

NATIVE_ENV = "PAIREDRL_NATIVE_KERNELS"
# a library built from kernels.c elsewhere, loaded instead of the cached build: the sanitizer test
# (tests/test_sanitizer.py) points the kernel tests at an -fsanitize=address,undefined build this way
LIBRARY_ENV = "PAIREDRL_KERNELS_LIBRARY"
SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: no fused multiply-adds where the source writes a product and a sum (RoPE must
# round as torch does)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-lm"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(cc: str) -> Path:
    """The library for this source, compiler and CPU: built into the cache folder unless already there."""
    src = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
    key = hashlib.sha256(b"\0".join([src, cc.encode(), version.encode(), " ".join(FLAGS).encode(),
                                      cpu_flags_line().encode()])).hexdigest()[:16]
    out = cache_path().parent / "kernels" / f"pairedrl_kernels_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=300,
                           check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(r.stderr or r.stdout).strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
# each kernel's C parameters (kernels.c), in order
_SIGNATURES = {
    "decode_layer_attention": [_ptr, _i64, _int, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                               _i64, _float, _int, _int],
    "residual_rms_norm": [_ptr, _ptr, _i64, _int, _ptr, _float, _ptr, _int, _ptr, _ptr, _i64, _i64, _int],
    "silu_mul": [_ptr, _i64, _int, _ptr, _i64, _i64, _int],
    "rms_norm_backward": [_ptr, _ptr, _ptr, _ptr, _i64, _int, _ptr, _ptr, _i64, _i64, _int],
    "rope_qkv": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int],
    "rope_qkv_backward": [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _int],
    "silu_mul_backward": [_ptr, _i64, _ptr, _i64, _int, _ptr, _i64, _i64, _int],
    "head_pack": [_ptr, _int, _i64, _i64, _ptr, _int],
    "amx_linear": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _int],
    "head_logits": [_ptr, _i64, _i64, _ptr, _i64, _ptr, _int],
    "avx512_available": [],
    "amx_available": [],
}


_warned = False


def _fall_back(why: str) -> None:
    """The torch path for this process, and (once per process) one warning line saying why and how to fix it."""
    global _warned
    _state.update(lib=None, why=f"torch path ({why})")
    if not _warned:
        _warned = True
        reason = " ".join(why.split())  # a compiler's message spans lines: the warning stays one
        if len(reason) > 300:
            reason = reason[:300] + "..."
        print(f"pairedrl: warning: native CPU kernels unavailable ({reason}); running the torch path (slower, and "
              f"it sums in another order, so results differ from a native build's). Fix: install gcc or clang, or "
              f"set CC to a working C compiler; {NATIVE_ENV}=0 chooses the torch path without this warning",
              file=sys.stderr, flush=True)


def _load() -> None:
    if os.environ.get(NATIVE_ENV, "").strip() == "0":
        _state.update(lib=None, why=f"torch path ({NATIVE_ENV}=0)")
        return
    prebuilt = os.environ.get(LIBRARY_ENV, "").strip()
    if prebuilt:  # named on purpose: a library that does not load is an error, not the torch path
        _bind(ctypes.CDLL(prebuilt), Path(prebuilt))
        return
    cc = _compiler()
    if cc is None:
        _fall_back("no C compiler found: CC unset, no cc, gcc or clang on PATH")
        return
    if shutil.which(cc) is None:
        _fall_back(f"CC={cc} is not an executable")
        return
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _fall_back(f"native kernels did not build: {e}")
        return
    _bind(lib, path)


def _bind(lib: ctypes.CDLL, path: Path) -> None:
    for name, argtypes in _SIGNATURES.items():  # every kernel returns an int status
        f = getattr(lib, name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
    _state.update(lib=lib, why=f"native ({path.name})")


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it cannot be built here (see `describe`)."""
    with _lock:
        if "lib" not in _state:
            _load()
        return _state["lib"]  # type: ignore[return-value]


def describe() -> str:
    """Which path this process runs (the native kernels or torch ops), and why."""
    library()
    return str(_state["why"])


# what `decode_layer_attention` takes (kernels.c: MAX_G, MAX_D)
MAX_GROUP, MAX_HEAD_DIM = 16, 256


def native_decode(n_heads: int, n_kv: int, head_dim: int) -> bool:
    """Whether the decode step of a model with these attention sizes runs on the native kernel here."""
    return (library() is not None and n_heads % n_kv == 0 and 1 <= n_heads // n_kv <= MAX_GROUP
            and 2 <= head_dim <= MAX_HEAD_DIM and head_dim % 2 == 0)


def _rope_tables(cos: torch.Tensor, sin: torch.Tensor, D: int) -> bool:
    """Whether `cos`, `sin` are the fp32 `[max_ctx, D]` RoPE tables the decode kernels read."""
    return (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == D)


def decode_layer_attention(qkv_BC: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, pos_B: torch.Tensor, n_heads: int, portable: bool = False
                           ) -> torch.Tensor:
    """One decode layer's attention from its stacked q|k|v output `qkv_BC` (`[B, (n_heads + 2 KV) D]`, in
    the caches' dtype): RoPE of q at `pos_B`, the new k (before RoPE) and v written into the caches at
    index `pos_B[b]`, and softmax attention over indices `[0, pos_B[b]]` with keys rotated as read.
    Returns `[B, n_heads * D]` in the caches' dtype (computed in fp32). Caches: `[B, KV, L, D]`,
    contiguous, fp32 or bf16; `cos`, `sin`: fp32 `[max_ctx, D]` RoPE tables. Only where
    `native_decode(n_heads, KV, D)`. `portable`: the kernel's portable loop even where a vectorized variant
    runs (the same bits; tests compare them)."""
    lib = library()
    B, KV, L, D = k_cache.shape
    dt = k_cache.dtype
    if lib is None or not native_decode(n_heads, KV, D):
        raise RuntimeError(f"the native decode kernel does not run here: {describe()}")
    if (dt not in (torch.float32, torch.bfloat16) or qkv_BC.dtype != dt or v_cache.dtype != dt
            or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or qkv_BC.stride(-1) != 1 or qkv_BC.shape != (B, (n_heads + 2 * KV) * D)
            or not _rope_tables(cos, sin, D) or pos_B.shape != (B,)):
        raise ValueError(f"decode_layer_attention: unexpected inputs (qkv {tuple(qkv_BC.shape)} {qkv_BC.dtype}, "
                         f"caches {tuple(k_cache.shape)} {dt}/{v_cache.dtype}, tables {tuple(cos.shape)}, "
                         f"positions {tuple(pos_B.shape)})")
    pos_B = pos_B.to(torch.int64).contiguous()
    out = torch.empty(B, n_heads * D, dtype=dt)
    if B == 0:
        return out
    rc = lib.decode_layer_attention(qkv_BC.data_ptr(), qkv_BC.stride(0), int(dt == torch.bfloat16), cos.data_ptr(),
                                    sin.data_ptr(), cos.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
                                    pos_B.data_ptr(), out.data_ptr(), B, KV, n_heads // KV, D, L, float(D) ** -0.5,
                                    int(portable), torch.get_num_threads())
    if rc == -1:  # the kernel checks every position before it writes anything
        raise ValueError(f"decode_layer_attention: a position outside [0, {min(L, cos.shape[0])}): "
                         f"{pos_B.tolist()}")
    if rc != 0:
        raise MemoryError("decode_layer_attention: out of memory for the attention scores")
    return out


# what the row kernels take (kernels.c: MAX_H, MAX_I)
MAX_HIDDEN, MAX_INTERMEDIATE = 16384, 16384
# `hidden_act` names of SiLU in transformers' ACT2FN, the activation `silu_mul` implements
SILU_NAMES = ("silu", "swish")


def row_kernels(act_name: str, dtype: torch.dtype, hidden: int, intermediate: int) -> bool:
    """Whether a model's element-wise steps between its layer products run on the row kernels here: the
    library is built, the activation is SiLU, the dtype fp32 or bf16, and the widths within the bounds."""
    return (library() is not None and act_name in SILU_NAMES and dtype in (torch.float32, torch.bfloat16)
            and hidden <= MAX_HIDDEN and intermediate <= MAX_INTERMEDIATE)


def _lib_or_raise(what: str) -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"the native {what} kernel does not run here: {describe()}")
    return lib


def residual_rms_norm(x_BH: torch.Tensor, y_BH: torch.Tensor | None, w_H: torch.Tensor, eps: float,
                      out_dtype: torch.dtype, rstd_B: torch.Tensor | None = None,
                      x_sum: torch.Tensor | None = None) -> torch.Tensor:
    """`x += y` in place on the fp32 residual stream `x_BH` (contiguous; `y_BH` bf16 or fp32, rows
    contiguous, or None), then `rms_norm(x, w, eps)` (`model.rms_norm` on fp32 `x` and `w`) in `out_dtype`
    (bf16 or fp32): the residual add and the norm between two layer products in one pass per row.
    `rstd_B` (fp32 `[B]`, contiguous): receives each row's `rsqrt(mean(x^2) + eps)`. `x_sum` (fp32, contiguous,
    `x_BH`'s shape): receives `x + y` instead, `x` left as it is (autograd saves it)."""
    lib = _lib_or_raise("row")
    B, H = x_BH.shape
    if (x_BH.dtype != torch.float32 or not x_BH.is_contiguous() or w_H.dtype != torch.float32
            or w_H.shape != (H,) or not w_H.is_contiguous() or out_dtype not in (torch.float32, torch.bfloat16)
            or (y_BH is not None and (y_BH.shape != (B, H) or y_BH.stride(-1) != 1
                                      or y_BH.dtype not in (torch.float32, torch.bfloat16)))
            or not 1 <= H <= MAX_HIDDEN
            or (rstd_B is not None and (rstd_B.shape != (B,) or rstd_B.dtype != torch.float32
                                        or not rstd_B.is_contiguous()))
            or (x_sum is not None and (x_sum.shape != x_BH.shape or x_sum.dtype != torch.float32
                                       or not x_sum.is_contiguous()))):
        raise ValueError(f"residual_rms_norm: unexpected inputs (x {tuple(x_BH.shape)} {x_BH.dtype}, y "
                         f"{None if y_BH is None else (tuple(y_BH.shape), y_BH.dtype)}, w {tuple(w_H.shape)} "
                         f"{w_H.dtype}, out {out_dtype})")
    out = torch.empty(B, H, dtype=out_dtype)
    if B:
        lib.residual_rms_norm(x_BH.data_ptr(), None if y_BH is None else y_BH.data_ptr(),
                              0 if y_BH is None else y_BH.stride(0), int(y_BH is not None and y_BH.dtype == torch.bfloat16),
                              w_H.data_ptr(), float(eps), out.data_ptr(), int(out_dtype == torch.bfloat16),
                              None if rstd_B is None else rstd_B.data_ptr(), None if x_sum is None else x_sum.data_ptr(),
                              B, H, torch.get_num_threads())
    return out


def silu_mul(gu_BC: torch.Tensor) -> torch.Tensor:
    """`F.silu(g) * u` of a stacked gate|up product `gu_BC = [g | u]` (`[B, 2 I]`, bf16 or fp32, rows
    contiguous), with the roundings of those two torch ops in its dtype; `[B, I]` in that dtype."""
    lib = _lib_or_raise("row")
    B, C = gu_BC.shape
    if (gu_BC.dtype not in (torch.float32, torch.bfloat16) or gu_BC.stride(-1) != 1 or C % 2
            or not 1 <= C // 2 <= MAX_INTERMEDIATE):
        raise ValueError(f"silu_mul: unexpected input {tuple(gu_BC.shape)} {gu_BC.dtype}")
    out = torch.empty(B, C // 2, dtype=gu_BC.dtype)
    if B:
        lib.silu_mul(gu_BC.data_ptr(), gu_BC.stride(0), int(gu_BC.dtype == torch.bfloat16), out.data_ptr(), B, C // 2,
                     torch.get_num_threads())
    return out


def rms_norm_backward(x_NH: torch.Tensor, w_H: torch.Tensor, rstd_N: torch.Tensor, dy_NH: torch.Tensor,
                      add: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `dx` of `rms_norm(x, w)` (fp32 `x`, frozen fp32 `w`, the forward's `rstd`) from `dy` (bf16 or
    fp32, rows contiguous), plus `add` (fp32 `[N, H]`) where given, in the same pass."""
    lib = _lib_or_raise("row")
    N, H = x_NH.shape
    if dy_NH.shape != (N, H) or dy_NH.stride(-1) != 1 or dy_NH.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"rms_norm_backward: unexpected gradient {tuple(dy_NH.shape)} {dy_NH.dtype}")
    if add is not None:
        add = add.float().contiguous()
        if add.shape != (N, H):
            raise ValueError(f"rms_norm_backward: unexpected residual gradient {tuple(add.shape)}")
    dx = torch.empty(N, H)
    if N:
        lib.rms_norm_backward(x_NH.data_ptr(), w_H.data_ptr(), rstd_N.data_ptr(), dy_NH.data_ptr(), dy_NH.stride(0),
                              int(dy_NH.dtype == torch.bfloat16), None if add is None else add.data_ptr(),
                              dx.data_ptr(), N, H, torch.get_num_threads())
    return dx


def rope_qkv(qkv_NC: torch.Tensor, pos_N: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
             n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 `(rope(q), rope(k), v)` (`[N, heads, D]` each) of a stacked q|k|v output `qkv_NC` (bf16 or fp32,
    rows contiguous) at positions `pos_N` (long), as `model.rope` on fp32 tables `cos`, `sin` `[ctx, D]`."""
    lib = _lib_or_raise("RoPE")
    N, C = qkv_NC.shape
    D = cos.shape[1]
    if (qkv_NC.dtype not in (torch.float32, torch.bfloat16) or qkv_NC.stride(-1) != 1
            or C != (n_heads + 2 * n_kv) * D or pos_N.shape != (N,) or not 2 <= D <= MAX_HEAD_DIM or D % 2
            or not (cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
                    and cos.shape == sin.shape)):
        raise ValueError(f"rope_qkv: unexpected inputs (qkv {tuple(qkv_NC.shape)} {qkv_NC.dtype}, heads "
                         f"{n_heads}/{n_kv}, tables {tuple(cos.shape)})")
    pos_N = pos_N.to(torch.int64).contiguous()
    q, k, v = torch.empty(N, n_heads, D), torch.empty(N, n_kv, D), torch.empty(N, n_kv, D)
    if N and lib.rope_qkv(qkv_NC.data_ptr(), qkv_NC.stride(0), int(qkv_NC.dtype == torch.bfloat16), pos_N.data_ptr(),
                          cos.data_ptr(), sin.data_ptr(), cos.shape[0], q.data_ptr(), k.data_ptr(), v.data_ptr(),
                          N, n_heads, n_kv, D, torch.get_num_threads()):
        raise ValueError(f"rope_qkv: a position outside [0, {cos.shape[0]})")
    return q, k, v


def rope_qkv_backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, pos_N: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`d qkv` (`[N, (nh + 2 kv) D]` in `dtype`) of `rope_qkv` from the fp32 gradients of its three outputs."""
    lib = _lib_or_raise("RoPE")
    N, nh, D = dq.shape
    kv = dk.shape[1]
    dq, dk, dv = dq.float().contiguous(), dk.float().contiguous(), dv.float().contiguous()
    out = torch.empty(N, (nh + 2 * kv) * D, dtype=dtype)
    if N:
        lib.rope_qkv_backward(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), pos_N.to(torch.int64).contiguous().data_ptr(),
                              cos.data_ptr(), sin.data_ptr(), out.data_ptr(), int(dtype == torch.bfloat16), N, nh, kv, D,
                              torch.get_num_threads())
    return out


def silu_mul_backward(gu_NC: torch.Tensor, dm_NI: torch.Tensor) -> torch.Tensor:
    """`d gu` (`[N, 2 I]`, contiguous, `gu`'s dtype) of `silu_mul(gu)` from `dm` (same dtype, rows contiguous)."""
    lib = _lib_or_raise("row")
    N, C = gu_NC.shape
    if dm_NI.shape != (N, C // 2) or dm_NI.dtype != gu_NC.dtype or dm_NI.stride(-1) != 1:
        raise ValueError(f"silu_mul_backward: unexpected gradient {tuple(dm_NI.shape)} {dm_NI.dtype}")
    out = torch.empty(N, C, dtype=gu_NC.dtype)
    if N:
        lib.silu_mul_backward(gu_NC.data_ptr(), gu_NC.stride(0), dm_NI.data_ptr(), dm_NI.stride(0),
                              int(gu_NC.dtype == torch.bfloat16), out.data_ptr(), N, C // 2, torch.get_num_threads())
    return out


def avx512() -> bool:
    """Whether the native library here was built with AVX-512 (the decode kernel's vectorized variant)."""
    lib = library()
    return lib is not None and bool(lib.avx512_available())


@dataclass(frozen=True)
class BlockedHead:
    """An unembedding `[V, K]` rounded to bf16 in the blocked layout of the AMX head kernel (`head_pack`):
    `logits(h)` gives fp32 logits of bf16-rounded fp32 inputs, what `model.matmul_inputs(torch.bfloat16)`
    gives for the fp32 product, reading half its weight bytes."""

    packed: torch.Tensor  # bf16, V * K elements
    vocab: int
    width: int
    lib: ctypes.CDLL  # the library that packed it (AMX available)

    def logits(self, h_MK: torch.Tensor) -> torch.Tensor:
        lib = self.lib
        M, K = h_MK.shape
        if K != self.width or h_MK.dtype != torch.float32:
            raise ValueError(f"BlockedHead: inputs {tuple(h_MK.shape)} {h_MK.dtype}, expected [rows, {self.width}] fp32")
        x = _rows16(h_MK.contiguous())
        Mp = x.shape[0]
        out = torch.empty(Mp, self.vocab)
        if M:
            rc = lib.head_logits(x.data_ptr(), Mp, K, self.packed.data_ptr(), self.vocab, out.data_ptr(),
                                 torch.get_num_threads())
            if rc == -2:
                raise MemoryError("head_logits: out of memory for the bf16 inputs")
            if rc:
                raise RuntimeError(f"head_logits failed ({rc})")
        return out[:M]


@dataclass
class BlockedLinear:
    """A bf16 layer projection `[out, in]` in the blocked layout of the AMX tiles (`head_pack`): `x W^T` of
    bf16 rows on `amx_linear`, bf16 out. At the sampler's decode rows this is the same bits as oneDNN's
    product on a weight packed for 32 rows, at a fraction of its per-call cost (`bench/decode.py`)."""

    packed: torch.Tensor  # bf16, out * in elements
    out_features: int
    in_features: int
    lib: ctypes.CDLL

    def __call__(self, x_MK: torch.Tensor) -> torch.Tensor:
        M, K = x_MK.shape
        if K != self.in_features or x_MK.dtype != torch.bfloat16 or x_MK.stride(-1) != 1:
            raise ValueError(f"BlockedLinear: inputs {tuple(x_MK.shape)} {x_MK.dtype}, expected [rows, "
                             f"{self.in_features}] bf16 with unit column stride")
        x = _rows16(x_MK)
        Mp = x.shape[0]
        out = torch.empty(Mp, self.out_features, dtype=torch.bfloat16)
        if M:
            rc = self.lib.amx_linear(x.data_ptr(), Mp, K, x.stride(0), self.packed.data_ptr(), self.out_features,
                                     out.data_ptr(), torch.get_num_threads())
            if rc:
                raise RuntimeError(f"amx_linear failed ({rc})")
        return out[:M]


def _rows16(x_MK: torch.Tensor) -> torch.Tensor:
    """`x_MK` with zero rows appended up to a multiple of 16 (the tiles' row count)."""
    M, K = x_MK.shape
    pad = -M % 16
    return x_MK if not pad else torch.cat([x_MK, x_MK.new_zeros(pad, K)])


def _tile_pack(W: torch.Tensor) -> torch.Tensor | None:
    """`W [out, in]` (fp32 or bf16) rounded to bf16 in the tiles' blocked layout (`head_pack`), or None where
    the AMX kernels do not run here or a size is not a multiple of 32."""
    O, I = W.shape
    if O % 32 or I % 32 or not amx_head():
        return None
    packed = torch.empty(O * I, dtype=torch.bfloat16)
    if library().head_pack(W.contiguous().data_ptr(), int(W.dtype == torch.bfloat16), O, I, packed.data_ptr(),
                           torch.get_num_threads()):
        return None
    return packed


def blocked_linear(w_OI: torch.Tensor) -> BlockedLinear | None:
    """A bf16 projection weight for `amx_linear`, or None where the AMX kernel does not run here or the
    shape does not fit its tiles (both sizes multiples of 32)."""
    packed = _tile_pack(w_OI) if w_OI.dtype == torch.bfloat16 else None
    return None if packed is None else BlockedLinear(packed, *w_OI.shape, library())


def amx_head() -> bool:
    """Whether the AMX head kernel runs here: built for a CPU with AMX-BF16 and the OS grants the tiles."""
    lib = library()
    return lib is not None and bool(lib.amx_available())


def blocked_head(W_VK: torch.Tensor) -> BlockedHead | None:
    """`W_VK` (fp32) for the AMX head kernel, or None where it does not run here or the shape does not
    fit its tiles (vocabulary a multiple of 32, width of 32)."""
    packed = _tile_pack(W_VK) if W_VK.dtype == torch.float32 else None
    return None if packed is None else BlockedHead(packed, *W_VK.shape, library())
