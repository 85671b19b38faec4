"""The custom-loss cost bound (`trainer.serve.graph_cost`) as a request meets it: the cost of a
forward_backward is that of its largest datum times the number of datums, within `--max-loss-cost`.

Unit-level: `check_request` is what the server's `forward_backward` handler calls (with the shapes it reads
from the request) before anything is queued, and a refusal there is the 400 the client sees."""

from __future__ import annotations

import os
import time

import pytest
import torch
from test_serve_sessions import _call, _graph

from trainer.serve import graph_cost, wire
from trainer.serve.limits import LimitExceeded, Limits

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


def _neg_chain(n: int) -> list[dict]:
    """`n` cheap nodes: each costs little element work and one node run (the review's C6 graph)."""
    nodes, prev = [], "logprobs"
    for i in range(n - 1):
        nodes.append(_call(f"n{i}", "torch.neg", {"ref": prev}))
        prev = f"n{i}"
    return [*nodes, _call("loss", "torch.sum", {"ref": prev})]


def test_many_cheap_nodes_cost_more_than_a_few_long_ones():
    """The per-node overhead is charged: 31 cheap nodes on 128 datums of 3 tokens (3968 node runs, the
    review's 62.5 s request) cost more than 2 nodes on one datum of 262,144 tokens (a few milliseconds of
    element work); with a per-node cost of 64 element operations it was the other way round."""
    big = Limits(loss_cost=2**50)
    many = graph_cost.check_request(wire.rebuild_graph(_graph(_neg_chain(31))), [_datum(3)] * 128, big)
    few = graph_cost.check_request(wire.rebuild_graph(_graph(_neg_chain(2))), [_datum(262_144)], big)
    assert many > 10 * few, (many, few)
    # and the review's accepted graph (512 nodes x 4096 datums) is far over the default bound
    assert 512 * 4096 * graph_cost.NODE_COST > 5 * Limits().loss_cost


def test_references_are_charged_beside_the_elements_they_carry():
    """`cat` over 511 references to an 8-token input moves as many elements as `cat` of two 2044-token
    inputs, but unpacks, checks and keeps 511 arguments for backward: about 60x the time on this engine
    (bench/graph_cost.py). The model charges each reference, so the many-reference graph costs more."""
    big = Limits(loss_cost=2**50)
    many = [_call("c", "torch.cat", [{"ref": "logprobs"}] * 511), _call("loss", "torch.sum", {"ref": "c"})]
    two = [_call("c", "torch.cat", [{"ref": "logprobs"}] * 2), _call("loss", "torch.sum", {"ref": "c"})]
    c_many = graph_cost.check_request(wire.rebuild_graph(_graph(many)), [_datum(8)] * 64, big)
    c_two = graph_cost.check_request(wire.rebuild_graph(_graph(two)), [_datum(2044)] * 64, big)
    assert c_many > 4 * c_two, (c_many, c_two)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["cheap_nodes", "contractions"])
def test_a_graph_at_the_default_bound_runs_in_bounded_time(shape):
    """What the default bound means in time: a request costed at about 0.7 of it, run as the engine runs
    a registered loss (the graph once per datum, then one backward), finishes within 60 s (printed with
    the load; bench/graph_cost.py fits the constants this relies on)."""
    limits = Limits()
    if shape == "cheap_nodes":
        gm, tokens = wire.rebuild_graph(_graph(_neg_chain(500))), 3
    else:  # o @ o on the outer product of a 1024-token datum: 2 * 1024**3 multiply-adds per node
        nodes = [*OUTER[:3], _call("m", "torch.matmul", {"ref": "o"}, {"ref": "o"}),
                 _call("loss", "torch.sum", {"ref": "m"})]
        gm, tokens = wire.rebuild_graph(_graph(nodes)), 1024
    one = graph_cost.check_request(gm, [_datum(tokens)], limits)
    n = max(1, int(0.7 * limits.loss_cost // one))
    cost = graph_cost.check_request(gm, [_datum(tokens)] * n, limits)
    assert 0.5 * limits.loss_cost < cost <= limits.loss_cost
    lps = [torch.randn(tokens, requires_grad=True) for _ in range(n)]
    t = time.perf_counter()
    sum(gm(lp)[0] for lp in lps).backward()
    took = time.perf_counter() - t
    print(f"{shape}: {n} datums, cost {cost} ({cost / limits.loss_cost:.2f} of the bound) ran in "
          f"{took:.2f} s, load {os.getloadavg()}")
    assert took < 60


def test_a_graph_over_the_node_cap_is_refused_at_upload_naming_the_flag():
    limits = Limits(loss_nodes=64)
    graph_cost.check_at_upload(wire.rebuild_graph(_graph(_neg_chain(62))), [1], limits)  # 64 with in/out
    with pytest.raises(LimitExceeded, match="65 nodes.*--max-loss-nodes"):
        graph_cost.check_at_upload(wire.rebuild_graph(_graph(_neg_chain(63))), [1], limits)


def test_metering_a_cat_heavy_graph_is_bounded():
    """The review's C7: 16 `cat` nodes over 4096 references each took 37 s of server CPU to meter (and
    again per forward_backward). Now the references are capped before anything is metered, and a graph
    at the cap is metered well within the check's own time bound."""
    warm = wire.rebuild_graph(_graph(_neg_chain(2)))
    graph_cost.check_at_upload(warm, [1], Limits())  # imports and caches warm
    cats = [_call(f"c{i}", "torch.cat", [{"ref": "logprobs"}] * 4096) for i in range(16)]
    gm = wire.rebuild_graph(_graph([*cats, _call("loss", "torch.sum", {"ref": "c15"})]))
    t = time.perf_counter()
    with pytest.raises(graph_cost.CostExceeded, match="65538 references"):
        graph_cost.check_at_upload(gm, [1], Limits())
    assert time.perf_counter() - t < 2.0
    assert graph_cost.meter_runs(gm) == 0
    per = (graph_cost.MAX_GRAPH_REFS - 2) // 4  # and the output's two
    cats = [_call(f"c{i}", "torch.cat", [{"ref": "logprobs"}] * per) for i in range(4)]
    gm = wire.rebuild_graph(_graph([*cats, _call("loss", "torch.sum", {"ref": "c3"})]))
    t = time.perf_counter()
    graph_cost.check_at_upload(gm, [1], Limits())
    took = time.perf_counter() - t
    print(f"metering {4 * per} references took {took:.2f} s, load {os.getloadavg()}")
    assert took < graph_cost.CHECK_S


def test_forward_backward_reads_the_cost_from_the_graphs_table():
    """The graph is metered at upload and once per new shape class (each axis rounded up to a power of
    two), not per forward_backward: a training run's requests, whose lengths vary, meet a handful."""
    gm = wire.rebuild_graph(_graph(_neg_chain(31)))
    limits = Limits()
    graph_cost.check_at_upload(gm, [1], limits)
    assert graph_cost.meter_runs(gm) == 1
    graph_cost.check_request(gm, [_datum(5), _datum(7)], limits)  # the upload's own class (8 tokens)
    assert graph_cost.meter_runs(gm) == 1
    for lengths in ([100, 70], [90], [128, 3, 65], [100] * 40):  # all in the 128-token class
        graph_cost.check_request(gm, [_datum(t) for t in lengths], limits)
    assert graph_cost.meter_runs(gm) == 2
    graph_cost.check_request(gm, [_datum(129)], limits)
    assert graph_cost.meter_runs(gm) == 3


def _size_graph(op: str, *args) -> list[dict]:
    return [
        _call("shape", "getattr", {"ref": "logprobs"}, "shape"),
        _call("t", "operator.getitem", {"ref": "shape"}, 0),
        _call("k", op, *args),
        _call("s", "torch.sum", {"ref": "logprobs"}),
        _call("loss", "operator.mul", {"ref": "s"}, {"ref": "k"}),
    ]


@pytest.mark.parametrize("op,args", [
    ("operator.sub", ({"ref": "t"}, 1)),
    ("operator.floordiv", (4096, {"ref": "t"})),
    ("operator.lt", ({"ref": "t"}, 600)),
    ("operator.mul", ({"ref": "t"}, -1)),
])
def test_a_number_that_falls_as_the_inputs_grow_is_refused(op, args):
    """Costs are read at shapes rounded up, which bounds them only if they grow with the shapes: a number
    computed from a size that could shrink as it grows (`4096 // (T - 1)` would size a list or an
    exponent) is refused at upload."""
    with pytest.raises(graph_cost.CostExceeded, match="derived from a tensor's size"):
        graph_cost.check_at_upload(wire.rebuild_graph(_graph(_size_graph(op, *args))), [1], Limits())


def test_a_size_used_as_it_grows_is_accepted():
    gm = wire.rebuild_graph(_graph(_size_graph("operator.truediv", {"ref": "t"}, 2)))
    graph_cost.check_at_upload(gm, [1], Limits())
    assert graph_cost.check_request(gm, [_datum(100)], Limits()) > 0


def test_a_graph_that_fails_on_a_class_is_metered_once_for_it():
    """A graph that cannot run on a request's shapes (here a reshape to 3 rows, which 8 or 128 tokens do
    not divide) is answered from the table too: its failure is kept, not metered again per request."""
    nodes = [_call("r", "torch.reshape", {"ref": "logprobs"}, [3, -1]), _call("loss", "torch.sum", {"ref": "r"})]
    gm = wire.rebuild_graph(_graph(nodes))
    graph_cost.check_at_upload(gm, [1], Limits())  # fails at 8 tokens: left to the requests
    runs = graph_cost.meter_runs(gm)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="invalid for input of size"):
            graph_cost.check_request(gm, [_datum(100)], Limits())  # 128 and 100 do not divide by 3
    assert graph_cost.meter_runs(gm) == runs + 2  # the 128-token class, then the exact 100 tokens
    assert graph_cost.check_request(gm, [_datum(99)], Limits()) > 0  # 128 fails, 99 fits: exact shapes


def test_the_check_stops_past_its_time_bound(monkeypatch):
    monkeypatch.setattr(graph_cost, "CHECK_S", 0.0)
    with pytest.raises(graph_cost.CostExceeded, match="ran past 0 s"):
        graph_cost.check_at_upload(wire.rebuild_graph(_graph(_neg_chain(3))), [1], Limits())
