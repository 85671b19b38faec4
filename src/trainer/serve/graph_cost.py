"""What an uploaded custom-loss graph costs, found before it runs: refused above `--max-loss-cost`.

`graph_ops` decides which functions a graph may call; this module bounds how much work those calls
may add up to, because allowed functions still freeze or exhaust a shared server when their operands
are chosen by the client: `operator.pow(7, 2 * 10**7)` holds the GIL for tens of seconds, a chain of
`torch.cat` over thousands of references grows a tensor geometrically, an outer product of a long
datum allocates gigabytes, and 400 products of it hold the base model's lock for half a minute.

The graph is run once on fake tensors (`torch._subclasses.FakeTensorMode`: shapes and dtypes, no data,
no allocation) shaped like the request's largest datum (each axis the maximum over the datums), under
an interpreter that checks every node *before* it runs where the work is outside torch (plain Python
numbers and sequences) and adds up, after each node, what its real run would cost:

- each node costs at least `NODE_COST` (the interpreter's per-call overhead, in element operations);
- a node costs the elements of the tensors it reads plus those it returns (a reduction reads far more
  than it returns; the outputs bound the memory autograd keeps);
- contractions (matmul, einsum, dot, ...) cost their multiply-adds (`torch.utils.flop_counter`);
- a Python integer may have at most `MAX_INT_BITS` bits and a Python sequence `MAX_SEQ_ITEMS` items,
  checked from the operands before `pow`, `mul`, `lshift`-like growth is computed.

The cost of one datum times the number of datums is the request's cost; above `Limits.loss_cost`
(`--max-loss-cost`) the request is refused (400) before anything is queued. The same check runs at
upload on small nominal shapes, so a graph whose cost does not depend on the data (the `pow` above) is
refused when it is registered. An op whose output size depends on tensor values is costed at its
upper bound (`masked_select`: its input's size); any other data-dependent op is refused.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from trainer.serve.limits import Limits

NODE_COST = 64  # element operations one node's call costs at least (fx + torch dispatch overhead)
MAX_INT_BITS = 4096
MAX_SEQ_ITEMS = 4096
# nominal sizes of the upload-time check: rank-1 inputs are [T], rank-2 [T, K]
UPLOAD_T, UPLOAD_K = 8, 4


class CostExceeded(ValueError):
    """A custom loss whose cost is above the bound (or cannot be bounded): answered 400. `detail` is the
    message as raised (fx's interpreter appends the node's source to the exception's text)."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


class _OverBudget(CostExceeded):
    """The running cost passed the budget; the caller words the refusal."""


def _flag() -> str:
    return Limits.flag("loss_cost")


def _check_scalar_op(target: Any, args: Sequence[Any]) -> None:
    """Refuse a Python-level operation whose result would be too large, before computing it."""
    if len(args) != 2 or any(isinstance(a, torch.Tensor) for a in args):
        return
    a, b = args
    ints = all(isinstance(x, int) for x in (a, b))
    seq = next((x for x in (a, b) if isinstance(x, (str, bytes, tuple, list))), None)
    if target in (operator.pow, math.pow) and ints:
        if b > 0 and abs(a) > 1 and b * abs(a).bit_length() > MAX_INT_BITS:
            raise CostExceeded(
                f"custom loss computes {a} ** {b} on Python integers, past {MAX_INT_BITS} bits "
                "(fixed bound: integer work runs outside torch and holds the server's lock)"
            )
    elif target is operator.mul and ints:
        if a.bit_length() + b.bit_length() > MAX_INT_BITS:
            raise CostExceeded(
                f"custom loss multiplies Python integers past {MAX_INT_BITS} bits (fixed bound)"
            )
    elif target is operator.mul and seq is not None:
        n = b if seq is a else a
        if not isinstance(n, int) or len(seq) * max(n, 0) > MAX_SEQ_ITEMS:
            raise CostExceeded(
                f"custom loss repeats a {type(seq).__name__} past {MAX_SEQ_ITEMS} items (fixed bound)"
            )
    elif (target is operator.add and seq is not None and isinstance(a, type(seq)) and isinstance(b, type(seq))
          and len(a) + len(b) > MAX_SEQ_ITEMS):
        raise CostExceeded(f"custom loss joins sequences past {MAX_SEQ_ITEMS} items (fixed bound)")
    elif target in (operator.mod, math.fmod) and isinstance(a, (str, bytes)):
        # `"%0999999999d" % 1` formats a string of any width the client picks
        raise CostExceeded("custom loss formats a string with %; only numbers and tensors may be computed")


def _numel(out: Any) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel()
    if isinstance(out, (tuple, list)):
        return sum(_numel(o) for o in out)
    if isinstance(out, int) and not isinstance(out, bool) and out.bit_length() > MAX_INT_BITS:
        raise CostExceeded(
            f"custom loss makes a Python integer of {out.bit_length()} bits (fixed bound {MAX_INT_BITS})"
        )
    if isinstance(out, (str, bytes)) and len(out) > MAX_SEQ_ITEMS:
        raise CostExceeded(f"custom loss makes a sequence of {len(out)} items (fixed bound {MAX_SEQ_ITEMS})")
    return 0


class _Meter(torch.fx.Interpreter):
    """Runs the graph on fake tensors, adding up each node's cost and stopping past `budget`."""

    def __init__(self, gm: torch.fx.GraphModule, budget: float, flops: FlopCounterMode):
        super().__init__(gm, garbage_collect_values=True)
        self.budget = budget
        self.flops = flops
        self.cost = 0

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        _check_scalar_op(target, args)
        if target is torch.masked_select:  # its size depends on the mask's values: the upper bound
            return torch.empty(
                torch.broadcast_shapes(args[0].shape, args[1].shape).numel(), dtype=args[0].dtype
            )
        return super().call_function(target, args, kwargs)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):  # e.g. (7).__pow__(10**7) as a method call
            raise CostExceeded(
                f"custom loss calls method {target!r} on a {type(args[0]).__name__ if args else 'nothing'}"
                "; methods may be called on tensors only"
            )
        if target == "masked_select":
            return torch.empty(
                torch.broadcast_shapes(args[0].shape, args[1].shape).numel(), dtype=args[0].dtype
            )
        return super().call_method(target, args, kwargs)

    def run_node(self, n: torch.fx.Node) -> Any:
        try:
            out = super().run_node(n)
        except DynamicOutputShapeException:
            raise CostExceeded(
                f"custom loss node {n.name!r} ({n.target}) has an output whose size depends on "
                "tensor values; its cost cannot be bounded before it runs"
            ) from None
        except RuntimeError as e:
            if "data-dependent" in str(e) or "Data dependent" in str(e):
                raise CostExceeded(
                    f"custom loss node {n.name!r} ({n.target}) depends on tensor values; its cost "
                    "cannot be bounded before it runs"
                ) from None
            raise
        if n.op in ("call_function", "call_method"):
            # what it reads and what it writes: a reduction reads far more than it returns
            read = sum(_numel(self.env[a]) for a in n.all_input_nodes if a in self.env)
            self.cost += max(NODE_COST, read + _numel(out))
            if self.cost + self.flops.get_total_flops() > self.budget:
                raise _OverBudget("over budget")
        return out


def datum_cost(
    gm: torch.fx.GraphModule, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype], budget: float
) -> int:
    """The cost of one run of `gm` on inputs of these shapes (logprobs first); `_OverBudget` as soon as it
    passes `budget` (the caller names the bound)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
        with FlopCounterMode(display=False) as flops:
            meter = _Meter(gm, budget, flops)
            meter.run(*inputs)
        return meter.cost + flops.get_total_flops()


def _refuse(what: str, limits: Limits) -> CostExceeded:
    return CostExceeded(
        f"custom loss costs more than this server's bound of {limits.loss_cost} element operations "
        f"per forward_backward ({_flag()}) {what}"
    )


def check_at_upload(gm: torch.fx.GraphModule, ranks: Sequence[int], limits: Limits) -> None:
    """Refuse a graph whose cost on one small datum already passes the bound, or that grows Python numbers
    or sequences past their fixed bounds; `ranks` are its inputs' (`CustomLossInput.rank`), logprobs first.
    Other failures on the nominal shapes are left to the check with the real inputs."""
    shapes = [(UPLOAD_T, UPLOAD_K)[:r] for r in ranks]
    try:
        datum_cost(gm, shapes, [torch.float32] * len(shapes), limits.loss_cost)
    except _OverBudget:
        raise _refuse(f"on a single datum of {UPLOAD_T} tokens", limits) from None
    except CostExceeded as e:
        raise CostExceeded(e.detail) from None
    except Exception:  # noqa: BLE001, S110 - it may need other shapes; checked again with the real ones
        pass


def check_request(
    gm: torch.fx.GraphModule, inputs: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]], limits: Limits
) -> int:
    """The cost of one forward_backward: the graph on the largest datum's shapes, times the datums.

    `inputs[i]` holds (shape, dtype) of datum i's logprobs (shaped like its target tokens) and then of
    each of the loss's inputs, in the graph's order."""
    if not inputs:
        return 0
    shapes = []
    for j in range(len(inputs[0])):
        dims = [tuple(d[j][0]) for d in inputs]
        rank = len(dims[0])
        if any(len(s) != rank for s in dims):
            raise ValueError(f"custom loss input {j} has different ranks across datums")
        shapes.append(tuple(max(s[k] for s in dims) for k in range(rank)))
    dtypes = [dt for _, dt in inputs[0]]
    budget = limits.loss_cost / len(inputs)
    try:
        cost = datum_cost(gm, shapes, dtypes, budget)
    except _OverBudget:
        raise _refuse(
            f"on {len(inputs)} datum(s) of up to {shapes[0][0] if shapes[0] else 1} tokens", limits
        ) from None
    except CostExceeded as e:
        raise CostExceeded(e.detail) from None
    return cost * len(inputs)
