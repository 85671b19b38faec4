"""The Llama block's shared pieces, used by both the sampler and the training forward: weight names,
dimensions, the architecture check, RMSNorm, RoPE, the stacked (fused) projections, the unembedding
and its numerics (fp32 logits on both sides), and the oneDNN pre-packed GEMM.

Numerics follow transformers 5.5 `models/llama/modeling_llama.py` (`LlamaRMSNorm.forward`: the norm in
fp32, then cast to the input dtype and scaled; `rotate_half` / `apply_rotary_pos_emb`; the SiLU-gated
`LlamaMLP`), with cos/sin taken from the model's own rotary module (so any rope type it implements).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

# Projection names of one decoder layer, as in the HF state dict and peft's `target_modules`.
QKV_PROJ = ("q_proj", "k_proj", "v_proj")
GATE_UP_PROJ = ("gate_proj", "up_proj")
ATTN_PROJ = QKV_PROJ + ("o_proj",)
MLP_PROJ = GATE_UP_PROJ + ("down_proj",)
UNEMBED = "lm_head"

# Module names outside the decoder layers (a weight is `name + ".weight"`, see `weight`).
EMBED = "model.embed_tokens"
FINAL_NORM = "model.norm"


def weight(module: str) -> str:
    """The state-dict key of a module's weight."""
    return module + ".weight"


@dataclass(frozen=True)
class LayerNames:
    """HF module names of decoder layer i, plus the keys of its stacked weights in `fuse_base`."""

    input_norm: str
    qkv: tuple[str, ...]  # q, k, v projections, in the stacking order
    o: str
    post_norm: str
    gate_up: tuple[str, ...]  # gate, up projections, in the stacking order
    down: str
    stacked_qkv: str
    stacked_gate_up: str


def layer_names(i: int) -> LayerNames:
    p = f"model.layers.{i}"
    return LayerNames(
        input_norm=f"{p}.input_layernorm", qkv=tuple(f"{p}.self_attn.{n}" for n in QKV_PROJ),
        o=f"{p}.self_attn.o_proj", post_norm=f"{p}.post_attention_layernorm",
        gate_up=tuple(f"{p}.mlp.{n}" for n in GATE_UP_PROJ), down=f"{p}.mlp.down_proj",
        stacked_qkv=f"{p}.self_attn.qkv", stacked_gate_up=f"{p}.mlp.gate_up")


@dataclass(frozen=True)
class Dims:
    """The sizes and constants of a Llama config that the forward passes need."""

    n_layers: int
    hidden: int
    n_heads: int
    n_kv: int  # key/value heads (GQA: n_heads is a multiple)
    head_dim: int
    intermediate: int
    eps: float  # RMSNorm epsilon
    act: Callable[[torch.Tensor], torch.Tensor]  # the MLP gate's activation
    act_name: str  # its name in the config (`hidden_act`): native kernels implement "silu" only

    @property
    def qkv_outs(self) -> tuple[int, int, int]:
        """Output rows of q, k and v in the stacked q|k|v projection."""
        return (self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim)


def dims(config: Any) -> Dims:
    from transformers.activations import ACT2FN

    return Dims(n_layers=int(config.num_hidden_layers), hidden=int(config.hidden_size),
                n_heads=config.num_attention_heads, n_kv=config.num_key_value_heads,
                head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
                intermediate=config.intermediate_size, eps=float(config.rms_norm_eps),
                act=ACT2FN[config.hidden_act], act_name=str(config.hidden_act))


def check_architecture(config: Any) -> None:
    """The engine implements the Llama block only; anything else fails with a clear message."""
    if getattr(config, "model_type", None) != "llama":
        raise ValueError(f"local sampler supports Llama-architecture models, got model_type="
                         f"{getattr(config, 'model_type', None)!r}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("local sampler: attention/MLP biases are not supported")


def rotary_tables(model: Any, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos/sin `[max_context, head_dim]` from the model's own rotary module (any rope type)."""
    rot = model.model.rotary_emb if hasattr(model, "model") else model.base_model.model.model.rotary_emb
    pos = torch.arange(max_context).unsqueeze(0)
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0].float(), sin[0].float()


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalised in fp32, cast back, then scaled in the input dtype (torch's one-op
    `F.rms_norm` gives the same bits as the spelled-out mean/rsqrt/mul in fewer passes). On the engine's
    fp32 residual stream with fp32 weights there is no cast, and `F.rms_norm` scales by `w` itself (same
    bits, forward and backward, one pass fewer)."""
    if x.dtype == w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


@dataclass(frozen=True)
class Layer:
    """One decoder layer as `layer` runs it: the fp32 norm weights and the four products (each a callable
    from its input rows to its output rows: the sampler's row-blocked projections, the trainer's LoRA
    GEMMs)."""

    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]  # stacked q|k|v
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]  # stacked gate|up
    down: Callable[[torch.Tensor], torch.Tensor]


def layer(x: torch.Tensor, y: torch.Tensor | None, L: Layer, attend: Callable[[torch.Tensor], torch.Tensor],
          ops: Any, d: Dims, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama decoder layer, the same for prefill, decode and training: `x` is the fp32 residual
    stream and `y` the previous layer's down product not yet added to it (None before the first layer:
    each residual add is fused into the norm after it); `attend` maps the q|k|v output to the attention
    output in `dtype` (RoPE, the KV cache and the attention kernel are what differ between the three
    uses); `ops` the plan's element-wise steps (`ops.py`). Returns the stream after the attention's
    residual add and this layer's down product."""
    x, h = ops.add_norm(x, y, L.in_norm, d.eps, dtype)
    x, h = ops.add_norm(x, L.o(attend(L.qkv(h))), L.post_norm, d.eps, dtype)
    return x, L.down(ops.gate(L.gate_up(h), d.intermediate, d.act))


def fuse_base(config: Any, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer `LayerNames.stacked_qkv` and `.stacked_gate_up`: the projections of one input stacked
    into one weight (rows in q|k|v and gate|up order), so each runs as one GEMM with more columns; built
    once per base model and shared by the fp32 sampler and the training forward
    (`SharedBase.stacked_weights`)."""
    out = {}
    for i in range(config.num_hidden_layers):
        n = layer_names(i)
        out[n.stacked_qkv] = torch.cat([base[weight(m)] for m in n.qkv]).contiguous()
        out[n.stacked_gate_up] = torch.cat([base[weight(m)] for m in n.gate_up]).contiguous()
    return out


def unembed_weight(base: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output projection (the embedding matrix when they are tied)."""
    return base.get(weight(UNEMBED), base[weight(EMBED)])


# ----------------------------------------------------------------------------------- oneDNN packing
# oneDNN with a weight pre-packed for a given row count (the kernels torch inductor uses on CPU) runs
# small-row and wide, shallow fp32 products faster than MKL sgemm; `bench/gemm.py` measures both.
ONEDNN_PACKING = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def onednn_pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """`w [out, in]` reordered for oneDNN products of about `rows` rows (needs `ONEDNN_PACKING`)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """`x W^T` with `packed = onednn_pack(W, ...)`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


# ------------------------------------------------------------------------- unembedding numerics
# Both sides compute fp32 logits: rounding `[rows, vocab]` logits to bf16 costs up to ~0.04 at
# |logit| ~ 20, and a bf16 sampler's rounded logits against the trainer's fp32 ones were the largest
# part of the sampler/trainer logprob gap (`bench/drift.py`). In bf16 the inputs may be rounded to bf16
# (fp32 accumulation and output), where torch honours that and it is fast: `unembed_inputs`.


@contextlib.contextmanager
def matmul_inputs(dtype: torch.dtype) -> Iterator[None]:
    """fp32 matmuls inside run on `dtype` inputs (oneDNN: bf16 inputs, fp32 accumulation, fp32 output),
    so the unembedding keeps fp32 logits at bf16 speed. torch applies the setting only on some CPUs
    (AMX); elsewhere the products inside stay fp32 (`bf16_inputs_honoured`)."""
    if dtype == torch.float32:
        yield
        return
    m = torch.backends.mkldnn.matmul
    before = m.fp32_precision
    m.fp32_precision = {torch.bfloat16: "bf16"}[dtype]
    try:
        yield
    finally:
        m.fp32_precision = before


def _rounds_inputs_to_bf16(prepare: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
                           rows: int) -> bool:
    """Whether the product `prepare(W)(x)` (`x W^T`, fp32 tensors; the weight prepared outside, as the
    engine prepares it) rounds its inputs to bf16 under `matmul_inputs(torch.bfloat16)`: probed with an
    input bf16 cannot represent (1 + 2^-12 rounds to 1), at an unembedding-like shape."""
    x = torch.full((rows, 576), 1.0 + 2.0 ** -12)
    product = prepare(torch.ones(4096, 576))
    with matmul_inputs(torch.bfloat16):
        y = product(x)
    return bool(y[0, 0] != float(x[0].double().sum()))


@functools.cache
def bf16_inputs_honoured() -> bool:
    """Whether `matmul_inputs(torch.bfloat16)` really rounds fp32 matmul inputs to bf16 on this machine.
    torch hands fp32 matmuls to oneDNN's bf16 mode only where it deems that fast (AMX CPUs); elsewhere
    (e.g. AVX512_BF16 without AMX) the setting is silently ignored and the product runs as a plain fp32
    sgemm, several times slower than the oneDNN-packed fp32 kernel at the unembedding's shape."""
    return _rounds_inputs_to_bf16(lambda w: lambda x: F.linear(x, w), 128)


@functools.cache
def packed_bf16_inputs_honoured() -> bool:
    """Whether oneDNN's packed fp32 kernel (`onednn_pack` / `onednn_linear`, needs `ONEDNN_PACKING`) rounds
    its inputs to bf16 under `matmul_inputs(torch.bfloat16)` as the plain product does where
    `bf16_inputs_honoured`. Where it does, the packed weight serves bf16-input products too, without the
    per-call conversion of the fp32 weight that the plain product pays."""
    def prepare(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        packed = onednn_pack(w, 32)
        return lambda x: onednn_linear(x, packed)
    return _rounds_inputs_to_bf16(prepare, 32)


def unembed_inputs(dtype: torch.dtype) -> torch.dtype:
    """The dtype the unembedding's fp32 inputs are rounded to when the engine runs in `dtype` (sampler
    and trainer alike): bf16 where torch honours bf16 inputs for fp32 matmuls, else fp32 (then the
    product runs on oneDNN's packed fp32 kernel)."""
    return torch.bfloat16 if dtype == torch.bfloat16 and bf16_inputs_honoured() else torch.float32
