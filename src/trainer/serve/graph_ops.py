"""What an uploaded custom-loss graph may call: explicit tables of function objects, never a name walk.

A graph arrives as data (`types.CustomLossGraph`) from a client the server does not trust, and it
runs inside the server process. Its targets are therefore looked up in three closed tables built
here from function objects, and anything not in them is refused before the loss is stored:

- `FUNCTIONS`: the wire name of each allowed function -> the function. Wire names are what the
  SDK's encoder writes (tinker 0.38, `lib/public_interfaces/custom_loss.py::encode_graph`:
  `torch.fx.node._get_qualified_name(target)`, with `_operator.` rewritten to `operator.`), so
  the table is keyed by computing that same name from each object; an alias such as
  `torch.special.expit` is found under the C name the tracer records for it.
- `METHODS`: the `torch.Tensor` methods a graph may call (`call_method` nodes).
- `ATTRIBUTES`: the tensor attributes `getattr` nodes may read (fx records `x.shape` that way).

What is left out, and why: anything touching files, processes or imports (`torch.save`,
`torch.load`, `torch.os`, `torch.utils`, `torch.hub`, `torch.ops`, `builtins.*`), attribute
getters that would walk objects (`operator.attrgetter`, `operator.methodcaller`), functions that
mutate shared state or allocate a size the client chooses (`torch.zeros(n)`, `torch.full`,
`torch.arange`, `torch.randn`, `Tensor.repeat`, `Tensor.expand`, `Tensor.new_*`, `resize_`), in-place
methods (they would write into the engine's tensors), and methods that leave torch (`item`,
`tolist`, `numpy`) or run autograd (`backward`), which the SDK's tracer refuses too
(`custom_loss.py::_check_graph`). How much work the allowed functions may add up to in one request is
bounded separately, before the graph runs (`graph_cost.py`, `--max-loss-cost`). A loss needing another
function is a one-line addition here, reviewed like any other change to what a client may run on the
server.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

_OPERATOR = (operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod,
             operator.pow, operator.neg, operator.pos, operator.abs, operator.matmul, operator.getitem,
             operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
             operator.and_, operator.or_, operator.xor, operator.invert, operator.not_, operator.truth)

_MATH = (math.log, math.log1p, math.log2, math.log10, math.exp, math.expm1, math.sqrt, math.pow, math.fabs,
         math.floor, math.ceil, math.trunc, math.tanh, math.sin, math.cos, math.isfinite, math.isnan,
         math.isinf, math.fmod, math.copysign)

_TORCH = (
    # element-wise arithmetic and comparisons
    torch.add, torch.sub, torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide,
    torch.true_divide, torch.floor_divide, torch.remainder, torch.fmod, torch.pow, torch.square, torch.sqrt,
    torch.rsqrt, torch.neg, torch.abs, torch.sign, torch.exp, torch.expm1, torch.log, torch.log1p,
    torch.log2, torch.log10, torch.reciprocal, torch.sigmoid, torch.tanh, torch.sin, torch.cos,
    torch.clamp, torch.clip, torch.minimum, torch.maximum, torch.fmin, torch.fmax, torch.where,
    torch.lerp, torch.floor, torch.ceil, torch.round, torch.trunc, torch.lt, torch.le, torch.gt,
    torch.ge, torch.eq, torch.ne, torch.logical_and, torch.logical_or, torch.logical_not,
    torch.logical_xor, torch.isfinite, torch.isnan, torch.isinf, torch.nan_to_num, torch.logaddexp,
    torch.xlogy, torch.masked_fill,
    # reductions and scans
    torch.sum, torch.mean, torch.prod, torch.amax, torch.amin, torch.max, torch.min, torch.argmax,
    torch.argmin, torch.any, torch.all, torch.logsumexp, torch.cumsum, torch.cumprod, torch.var,
    torch.std, torch.norm, torch.count_nonzero, torch.nansum, torch.nanmean,
    # a sort along a dim: its outputs have the input's size (CPPO's per-sequence P90 needs it)
    torch.sort,
    # shapes and selection bounded by the inputs' own sizes
    torch.cat, torch.concat, torch.stack, torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze,
    torch.transpose, torch.gather, torch.index_select, torch.masked_select, torch.narrow, torch.flip,
    torch.softmax, torch.log_softmax, torch.zeros_like, torch.ones_like, torch.full_like,
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.matmul, torch.dot, torch.einsum,
    torch.special.expit, torch.special.logit, torch.special.log1p, torch.special.entr,
    torch.special.xlogy, torch.special.logsumexp, torch.special.log_softmax, torch.special.softmax,
    # torch.nn.functional: stateless functions of their arguments
    F.relu, F.softplus, F.logsigmoid, F.log_softmax, F.softmax, F.mse_loss, F.l1_loss, F.smooth_l1_loss,
    F.huber_loss, F.kl_div, F.cross_entropy, F.nll_loss, F.binary_cross_entropy_with_logits, F.gelu,
    F.silu, F.normalize,
)

METHODS: frozenset[str] = frozenset({
    "abs", "add", "all", "amax", "amin", "any", "argmax", "argmin", "bool", "ceil", "clamp", "clamp_max",
    "clamp_min", "clip", "cumsum", "detach", "dim", "div", "double", "eq", "exp", "expand_as", "expm1", "flatten",
    "maximum", "minimum", "logaddexp", "masked_select",
    "flip", "float", "floor", "gather", "ge", "gt", "half", "bfloat16", "index_select", "int", "isfinite",
    "isnan", "le", "log", "log1p", "log_softmax", "logsumexp", "long", "lt", "masked_fill", "max", "mean",
    "min", "mul", "ne", "neg", "nelement", "numel", "permute", "pow", "prod", "reciprocal", "reshape",
    "round", "rsqrt", "sigmoid", "sign", "size", "softmax", "sqrt", "square", "squeeze", "std", "sub",
    "sum", "t", "tanh", "to", "transpose", "type_as", "unsqueeze", "var", "view", "view_as", "where",
    "nan_to_num", "logical_and", "logical_not", "logical_or", "count_nonzero", "contiguous", "narrow",
    "unbind", "split", "chunk", "norm",
    "__getitem__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__neg__", "__pow__", "__rpow__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__",
    "__ne__", "__and__", "__or__", "__invert__", "__matmul__",
})

ATTRIBUTES: frozenset[str] = frozenset({"shape", "dtype", "ndim", "T", "mT"})


def _wire_name(fn: Callable) -> str:
    from torch.fx.node import _get_qualified_name

    name = _get_qualified_name(fn)
    return "operator." + name.removeprefix("_operator.") if name.startswith("_operator.") else name


def tensor_attribute(obj: Any, name: str) -> Any:
    """`getattr` as a graph may use it: one of `ATTRIBUTES`, on a tensor or a size, nothing else."""
    if name not in ATTRIBUTES:
        raise ValueError(f"custom loss reads attribute {name!r}; only {sorted(ATTRIBUTES)} may be read")
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"custom loss reads {name!r} of a {type(obj).__name__}; only tensors' attributes may be read")
    return getattr(obj, name)


FUNCTIONS: dict[str, Callable] = {_wire_name(fn): fn for fn in (*_OPERATOR, *_MATH, *_TORCH)}
FUNCTIONS["getattr"] = tensor_attribute
FUNCTIONS["builtins.getattr"] = tensor_attribute
