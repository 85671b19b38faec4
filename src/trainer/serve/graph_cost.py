"""What an uploaded custom-loss graph costs, found before it runs: refused above `--max-loss-cost`.

`graph_ops` decides which functions a graph may call; this module bounds how much work those calls
may add up to, because allowed functions still freeze or exhaust a shared server when their operands
are chosen by the client: `operator.pow(7, 2 * 10**7)` holds the GIL for tens of seconds, a chain of
`torch.cat` over thousands of references grows a tensor geometrically, an outer product of a long
datum allocates gigabytes, and hundreds of cheap nodes run once per datum add up to minutes.

The cost model: the engine runs the graph once per datum (tinker 0.38
`lib/public_interfaces/custom_loss.py::run_loss_handle`), forward and backward, so one run of one node
costs a fixed overhead (in element operations: Python, fx, dispatch and autograd for one
call, whatever the tensor sizes, `NODE_COST`), a fixed overhead per reference it makes to another node's
output (`REF_COST`), plus its element work: the elements it reads and writes (a reduction reads far more
than it returns) and, for contractions, its multiply-adds (`torch.utils.flop_counter`) at `FLOP_COST` each.
A request costs its datums times the cost of its largest datum (each input's axis at its maximum over
the datums); above `Limits.loss_cost` (`--max-loss-cost`) it is refused (400) before anything is queued.
Besides the total, the elements one datum's nodes return (what autograd keeps for backward) are bounded
by `MAX_KEPT_ELEMENTS`, a memory bound independent of the time bound.

The check itself is bounded and runs once per graph and shape class, never per request:

- at upload, the graph's size is capped (`--max-loss-nodes` nodes, `MAX_GRAPH_REFS` references to
  other nodes in all), and it is run once on small nominal shapes, which refuses a graph whose cost
  does not depend on the data (the `pow` above) in milliseconds;
- a run of the meter (the graph on fake tensors: `torch._subclasses.FakeTensorMode`, shapes and dtypes,
  no data, no allocation) is O(nodes + references) and stops past `CHECK_S` seconds;
- a request's datum cost is read from the graph's table, keyed by its input shapes with each axis rounded
  up to a power of two; a class not yet in the table is metered once, on the rounded shapes, and kept.
  Rounding up is an upper bound because every allowed op's work grows with its inputs' sizes; for that
  to hold, a Python number computed from a tensor's size may only be added to, multiplied by or divided
  by a non-negative number (`size - 512` as a divisor would cost little at 1024 and a lot at 513).

Python-level work is checked before it is computed: a Python integer may have at most `MAX_INT_BITS`
bits and a sequence `MAX_SEQ_ITEMS` items. An op whose output size depends on tensor values is costed at
its upper bound (`masked_select`: its input's size); any other data-dependent op is refused.
"""

from __future__ import annotations

import math
import operator
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from trainer.serve.limits import LimitExceeded, Limits

# The cost model's constants, in element operations (one element read or written by a node on one datum),
# fitted by `bench/graph_cost.py` on this engine (forward and backward, per datum, as a registered loss
# runs): one node run's fixed overhead (Python, fx, dispatch and autograd for one call, whatever the
# sizes), the overhead of each reference a node makes to another node's output (`cat` over 511 references
# costs far more than its elements: every argument is unpacked, checked and kept for backward), and the
# weight of one multiply-add of a contraction (vectorised, far cheaper than an element-wise read/write).
# Refit there when the engine changes; `--max-loss-cost`'s default is sized in these units.
NODE_COST = 16_000
REF_COST = 1_800
FLOP_COST = 0.17
# what autograd may keep for one datum: the elements its nodes return (2**24 float32 = 64 MiB; the engine
# holds a micro-batch of up to 16 datums at once)
MAX_KEPT_ELEMENTS = 2**24
MAX_INT_BITS = 4096
MAX_SEQ_ITEMS = 4096
# references from nodes to other nodes in one graph: the meter's work per node grows with them (fake
# tensors hash every argument, about 0.1 ms each), and a `cat` of 4096 references took 0.5 s to meter
MAX_GRAPH_REFS = 2048
# a run of the meter past this is refused (it is O(nodes + references), so only a loaded machine or a
# graph built to be slow to meter gets near it)
CHECK_S = 10.0
# shape classes kept per graph (each axis a power of two: ~19 lengths up to --max-batch-tokens)
MAX_CLASSES = 64
# nominal sizes of the upload-time check: rank-1 inputs are [T], rank-2 [T, K]
UPLOAD_T, UPLOAD_K = 8, 4
# Python-level ops through which a number computed from a tensor's size keeps growing with it
_MONOTONE = frozenset({operator.add, operator.mul, operator.getitem, operator.floordiv, operator.truediv,
                       operator.pos, math.floor, math.ceil, math.sqrt, math.log, math.log2, math.log1p,
                       math.log10, math.exp})
_SIZE_METHODS = frozenset({"size", "numel", "nelement"})


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


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    return False


def _graph_refs(gm: torch.fx.GraphModule) -> int:
    """References from nodes to other nodes, counted with repeats (`cat([x] * 4096)` is 4096)."""
    refs: list[torch.fx.Node] = []
    for n in gm.graph.nodes:
        torch.fx.node.map_arg((n.args, n.kwargs), refs.append)
    return len(refs)


class _Meter(torch.fx.Interpreter):
    """Runs the graph on fake tensors, adding up each node's cost and stopping past `budget`, past the
    memory bound or past `CHECK_S` seconds."""

    def __init__(self, gm: torch.fx.GraphModule, budget: float, flops: FlopCounterMode):
        super().__init__(gm, garbage_collect_values=True)
        self.budget = budget
        self.flops = flops
        self.cost = 0
        self.kept = 0
        self.deadline = time.monotonic() + CHECK_S
        self.sized: set[torch.fx.Node] = set()  # Python numbers computed from a tensor's size

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

    def _track_sizes(self, n: torch.fx.Node, out: Any) -> None:
        """Keep the costs monotone in the inputs' sizes (what rounding shapes up relies on): a Python
        number computed from a size may only grow with it."""
        from trainer.serve.graph_ops import tensor_attribute

        if (n.op == "call_function" and n.target is tensor_attribute and n.args[1:] == ("shape",)) or (
                n.op == "call_method" and n.target in _SIZE_METHODS):
            self.sized.add(n)
            return
        if not any(a in self.sized for a in n.all_input_nodes) or _has_tensor(out):
            return
        others = [a for a in (*n.args, *n.kwargs.values()) if not isinstance(a, torch.fx.Node)]
        divisor_sized = n.target in (operator.floordiv, operator.truediv) and n.args[1:2] and (
            n.args[1] in self.sized)
        if (n.op != "call_function" or n.target not in _MONOTONE or divisor_sized
                or any(isinstance(a, (int, float)) and a < 0 for a in others)):
            what = getattr(n.target, "__name__", str(n.target))
            raise CostExceeded(
                f"custom loss node {n.name!r} computes {what} on a number derived from a tensor's size; "
                "a size may only be added to, multiplied by or divided by a non-negative number here "
                "(the cost check relies on costs that grow with the inputs)"
            )
        self.sized.add(n)

    def run_node(self, n: torch.fx.Node) -> Any:
        if time.monotonic() > self.deadline:
            raise CostExceeded(
                f"the cost check of this custom loss ran past {CHECK_S:g} s (fixed bound); send a graph "
                "with fewer nodes or references"
            )
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
            self._track_sizes(n, out)
            # what it reads and what it writes (a reduction reads far more than it returns), plus the
            # fixed cost of one call
            refs: list[torch.fx.Node] = []  # with repeats: cat([x] * 512) reads x 512 times
            torch.fx.node.map_arg((n.args, n.kwargs), refs.append)
            read = sum(_numel(self.env[a]) for a in refs if a in self.env)
            written = _numel(out)
            self.kept += written
            if self.kept > MAX_KEPT_ELEMENTS:
                raise CostExceeded(
                    f"custom loss keeps {self.kept} elements per datum for its backward pass by node "
                    f"{n.name!r}, past this server's fixed bound of {MAX_KEPT_ELEMENTS} (memory)"
                )
            self.cost += NODE_COST + REF_COST * len(refs) + read + written
            if self.cost + FLOP_COST * self.flops.get_total_flops() > self.budget:
                raise _OverBudget("over budget")
        return out


def datum_cost(
    gm: torch.fx.GraphModule, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype], budget: float
) -> int:
    """The cost of one run of `gm` on inputs of these shapes (logprobs first); `_OverBudget` as soon as it
    passes `budget` (the caller names the bound). Every call is counted in the graph's table."""
    _table(gm).runs += 1
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
        with FlopCounterMode(display=False) as flops:
            meter = _Meter(gm, budget, flops)
            meter.run(*inputs)
        return math.ceil(meter.cost + FLOP_COST * flops.get_total_flops())


class _Table:
    """One graph's datum cost per shape class: an int, or ("over", budget) when it passed `budget`,
    ("refused", detail) for a refusal that does not depend on the bound, or ("fails", exception) when the
    graph itself fails on those shapes."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: dict[tuple, Any] = {}
        self.runs = 0  # meter runs on this graph (what a test counts)


_TABLES: weakref.WeakKeyDictionary[torch.fx.GraphModule, _Table] = weakref.WeakKeyDictionary()
_TABLES_LOCK = threading.Lock()


def _table(gm: torch.fx.GraphModule) -> _Table:
    with _TABLES_LOCK:
        table = _TABLES.get(gm)
        if table is None:
            table = _TABLES[gm] = _Table()
        return table


def meter_runs(gm: torch.fx.GraphModule) -> int:
    """How often the cost of `gm` has been metered (at upload and per new shape class)."""
    return _table(gm).runs


def _rung(x: int) -> int:
    """`x` rounded up to a power of two (0 stays 0)."""
    return 0 if x <= 0 else 1 << (x - 1).bit_length()


def _class_cost(gm: torch.fx.GraphModule, shapes: list[tuple[int, ...]], dtypes: list[torch.dtype],
                budget: float) -> int:
    """The datum cost of `gm` at these shapes, from its table or metered once and kept; `_OverBudget`
    past `budget`, `CostExceeded` for a refusal, the graph's own error when it fails on them."""
    table = _table(gm)
    key = (tuple(shapes), tuple(dtypes))
    with table.lock:  # two requests of one new class meter it once
        row = table.rows.get(key)
        if row is None or (isinstance(row, tuple) and row[0] == "over" and row[1] < budget):
            try:
                row = datum_cost(gm, shapes, dtypes, budget)
            except _OverBudget:
                row = ("over", budget)
            except CostExceeded as e:
                row = ("refused", e.detail)
            except Exception as e:  # noqa: BLE001 - the graph fails on these shapes: kept, raised again
                row = ("fails", e.with_traceback(None))
            if len(table.rows) >= MAX_CLASSES:
                del table.rows[next(iter(table.rows))]
            table.rows[key] = row
    if isinstance(row, int):
        if row > budget:
            raise _OverBudget("over budget")
        return row
    if row[0] == "over":
        raise _OverBudget("over budget")
    if row[0] == "fails":
        raise row[1]
    raise CostExceeded(row[1])


def _refuse(what: str, limits: Limits) -> CostExceeded:
    return CostExceeded(
        f"custom loss costs more than this server's bound of {limits.loss_cost} element operations "
        f"per forward_backward ({_flag()}) {what}"
    )


def check_at_upload(gm: torch.fx.GraphModule, ranks: Sequence[int], limits: Limits) -> None:
    """Refuse a graph over the size caps, whose cost on one small datum already passes the bound, or that
    grows Python numbers or sequences past their fixed bounds; `ranks` are its inputs'
    (`CustomLossInput.rank`), logprobs first. Other failures on the nominal shapes are left to the
    check with the real inputs."""
    nodes = len(gm.graph.nodes)
    if nodes > limits.loss_nodes:
        raise LimitExceeded(f"custom loss graph has {nodes} nodes, past this server's limit "
                            f"{limits.loss_nodes} ({Limits.flag('loss_nodes')})")
    refs = _graph_refs(gm)
    if refs > MAX_GRAPH_REFS:
        raise CostExceeded(f"custom loss graph has {refs} references between its nodes, past this server's "
                           f"fixed bound of {MAX_GRAPH_REFS}")
    shapes = [(UPLOAD_T, UPLOAD_K)[:r] for r in ranks]
    try:
        _class_cost(gm, shapes, [torch.float32] * len(shapes), limits.loss_cost)
    except _OverBudget:
        raise _refuse(f"on a single datum of {UPLOAD_T} tokens", limits) from None
    except CostExceeded as e:
        raise CostExceeded(e.detail) from None
    except Exception:  # noqa: BLE001, S110 - it may need other shapes; checked again with the real ones
        pass


def check_request(
    gm: torch.fx.GraphModule, inputs: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]], limits: Limits
) -> int:
    """The cost of one forward_backward: the graph's datum cost at the largest datum's shapes (each axis
    the maximum over the datums, rounded up to a power of two), times the datums.

    `inputs[i]` holds (shape, dtype) of datum i's logprobs (shaped like its target tokens) and then of
    each of the loss's inputs, in the graph's order. The datum cost comes from the graph's table; only a
    shape class the graph has not met before is metered."""
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
    rounded = [tuple(_rung(x) for x in s) for s in shapes]
    try:
        try:
            cost = _class_cost(gm, rounded, dtypes, budget)
        except (_OverBudget, CostExceeded):
            raise
        except Exception:  # noqa: BLE001 - e.g. a reshape that fits the real length only: the real shapes
            cost = _class_cost(gm, shapes, dtypes, budget)
    except _OverBudget:
        tokens = shapes[0][0] if shapes[0] else 1
        raise _refuse(f"on {len(inputs)} datum(s) of up to {tokens} tokens (costed at "
                      f"{rounded[0][0] if rounded[0] else 1})", limits) from None
    except CostExceeded as e:
        raise CostExceeded(e.detail) from None
    return cost * len(inputs)
