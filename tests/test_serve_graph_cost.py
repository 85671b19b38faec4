"""The custom-loss cost bound (`trainer.serve.graph_cost`) as a request meets it: the cost of a
forward_backward is that of its largest datum times the number of datums, within `--max-loss-cost`.

Unit-level: `check_request` is what the server's `forward_backward` handler calls (with the shapes it reads
from the request) before anything is queued, and a refusal there is the 400 the client sees."""

from __future__ import annotations

import pytest
import torch
from test_serve_sessions import _call, _graph

from trainer.serve import graph_cost, wire
from trainer.serve.limits import Limits

# an outer product: its cost grows with the square of the datum's length, so short and long datums
# cost very differently
OUTER = [
    _call("u", "torch.unsqueeze", {"ref": "logprobs"}, 1),
    _call("v", "torch.unsqueeze", {"ref": "logprobs"}, 0),
    _call("o", "torch.matmul", {"ref": "u"}, {"ref": "v"}),
    _call("loss", "torch.sum", {"ref": "o"}),
]


def _datum(tokens: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [((tokens,), torch.float32)]


def test_a_long_datum_after_a_short_one_is_costed_at_its_own_length():
    """The request's cost is taken at each axis's maximum over its datums, not at the first datum's: a
    short first datum does not let a long second one through (tests-audit S8)."""
    gm = wire.rebuild_graph(_graph(OUTER))
    big = Limits(loss_cost=2**50)
    short, long = 4, 2048
    c_short = graph_cost.check_request(gm, [_datum(short)], big)
    c_long = graph_cost.check_request(gm, [_datum(long)], big)
    assert c_long > 100 * c_short
    bound = Limits(loss_cost=int((2 * c_short * 2 * c_long) ** 0.5))  # between two short and two long
    assert graph_cost.check_request(gm, [_datum(short), _datum(short)], bound) <= bound.loss_cost
    with pytest.raises(graph_cost.CostExceeded, match="--max-loss-cost"):
        graph_cost.check_request(gm, [_datum(short), _datum(long)], bound)


def test_a_request_of_many_datums_may_not_cost_many_times_the_bound():
    """The bound is per request: a datum that fits alone does not fit 64 times over (tests-audit S7)."""
    gm = wire.rebuild_graph(_graph(OUTER))
    one = graph_cost.check_request(gm, [_datum(256)], Limits(loss_cost=2**50))
    bound = Limits(loss_cost=8 * one)  # one datum fits, 64 cost 64x that
    assert graph_cost.check_request(gm, [_datum(256)], bound) == one
    with pytest.raises(graph_cost.CostExceeded, match="64 datum"):
        graph_cost.check_request(gm, [_datum(256)] * 64, bound)
