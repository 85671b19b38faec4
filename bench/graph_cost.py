"""The custom-loss cost model (`src/trainer/serve/graph_cost.py`) against the time the engine takes: fits
the per-node constant `NODE_COST` and prints, for each graph, its predicted cost and measured seconds.

The engine runs a registered loss once per datum and then one backward over their sum (tinker 0.38
`custom_loss.py::run_loss_handle`, called by `LoraCompute.run_handle`); this script runs each graph the
same way on random inputs. The model says one request's time is `b * (a_nodes * node_runs + elements)`
with `elements` what the meter counts besides the node overhead (reads, writes, multiply-adds); the fit
(least squares on `seconds = alpha * node_runs + b * elements`) gives the per-element time `b` and the
constant `NODE_COST = alpha / b`. A good constant puts predicted / measured near one for every row, the
cheap-node chains (the review's C6) and the contractions alike. It also times the meter itself, once per
graph, for the cat-heavy graph at the reference cap among others (the review's C7).

Graphs: the project's losses (`conf/loss/*.yaml`, traced as `train.py backend=tinker` registers them),
chains of `neg` nodes at 3 and 512 tokens, a chain of element-wise products on a long datum, `o @ o` on
an outer product, and `cat` nodes at the reference cap.

    python bench/graph_cost.py [--reps 3] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np
import torch
from tinker import types

from trainer.serve import graph_cost, wire
from trainer.serve.limits import Limits


def _call(name: str, target: str, *args) -> dict:
    return {"op": "call_function", "name": name, "target": target, "args": list(args), "kwargs": {}}


def _graph(nodes: list[dict], inputs: tuple[str, ...] = ("logprobs",)) -> torch.fx.GraphModule:
    head = [{"op": "placeholder", "name": n, "target": n, "args": [], "kwargs": {}} for n in inputs]
    out = {"op": "output", "name": "output", "target": "output",
           "args": [{"tuple": [{"ref": nodes[-1]["name"]}, {"dict": {}}]}], "kwargs": {}}
    return wire.rebuild_graph(types.CustomLossGraph.model_validate({"nodes": head + nodes + [out]}))


def _chain(op: str, n: int, other: bool = False) -> list[dict]:
    nodes, prev = [], "logprobs"
    for i in range(n - 1):
        args = ({"ref": prev}, {"ref": "logprobs"}) if other else ({"ref": prev},)
        nodes.append(_call(f"x{i}", op, *args))
        prev = f"x{i}"
    return [*nodes, _call("loss", "torch.sum", {"ref": prev})]


def project_losses() -> list[tuple[str, torch.fx.GraphModule, list[str]]]:
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    from trainer.config.compose import run_config
    from trainer.losses.build import build_loss
    from trainer.losses.per_datum import make_per_datum_fn

    out = []
    for path in sorted((ROOT / "conf" / "loss").glob("*.yaml")):
        cfg = run_config([f"loss={path.stem}", "loss.aggregation=sum", "loss.kl_coef=0.1"])
        pd = make_per_datum_fn(build_loss(cfg.loss))
        handle = trace_loss(pd.fn, pd.input_ranks, "bench")
        out.append((path.stem, wire.rebuild_graph(encode_graph(handle)), list(handle.input_names)))
    return out


def cases() -> list[tuple[str, torch.fx.GraphModule, list[str], int, int]]:
    """(name, graph, input names besides logprobs, tokens per datum, datums)."""
    outer = [_call("u", "torch.unsqueeze", {"ref": "logprobs"}, 1),
             _call("v", "torch.unsqueeze", {"ref": "logprobs"}, 0),
             _call("o", "torch.matmul", {"ref": "u"}, {"ref": "v"}),
             _call("m", "torch.matmul", {"ref": "o"}, {"ref": "o"}),
             _call("loss", "torch.sum", {"ref": "m"})]
    per = (graph_cost.MAX_GRAPH_REFS - 2) // 4
    cats = [_call(f"c{i}", "torch.cat", [{"ref": "logprobs"}] * per) for i in range(4)]
    few = [_call(f"f{i}", "torch.cat", [{"ref": "logprobs"}] * 64) for i in range(16)]
    out = [(f"project {name}", gm, names, 512, 32) for name, gm, names in project_losses()]
    out += [(f"neg chain {n} x 3 tokens", _graph(_chain("torch.neg", n)), [], 3, 128)
            for n in (2, 11, 31, 64)]
    out += [(f"neg chain {n} x 512 tokens", _graph(_chain("torch.neg", n)), [], 512, 64) for n in (2, 31)]
    out += [("mul chain 16 x 65536 tokens", _graph(_chain("operator.mul", 16, other=True)), [], 65_536, 2),
            ("o @ o, 256 tokens", _graph(outer), [], 256, 4),
            ("o @ o, 512 tokens", _graph(outer), [], 512, 1),
            (f"4 cat x {per} refs, 8 tokens", _graph([*cats, _call("loss", "torch.sum", {"ref": "c3"})]), [],
             8, 64),
            ("16 cat x 64 refs, 8 tokens", _graph([*few, _call("loss", "torch.sum", {"ref": "f15"})]), [], 8,
             64)]
    return out


def _inputs(names: list[str], tokens: int) -> list[torch.Tensor]:
    out = []
    for n in names:
        if "mask" in n:
            out.append(torch.ones(tokens))
        elif "logprob" in n:
            out.append(-torch.rand(tokens))
        else:
            out.append(torch.randn(tokens))
    return out


def run_once(gm: torch.fx.GraphModule, names: list[str], tokens: int, datums: int) -> float:
    """Seconds of one request as the engine runs it: the graph per datum, then one backward."""
    lps = [(-torch.rand(tokens)).requires_grad_() for _ in range(datums)]
    extra = [_inputs(names, tokens) for _ in range(datums)]
    t = time.perf_counter()
    total = None
    for lp, xs in zip(lps, extra, strict=True):
        loss = gm(lp, *xs)[0]
        total = loss if total is None else total + loss
    total.backward()
    return time.perf_counter() - t


def meter(gm: torch.fx.GraphModule, names: list[str], tokens: int) -> tuple[int, int, int, int, float]:
    """Per datum: (node runs, references between nodes, elements read and written, multiply-adds of
    contractions), and the seconds one meter run takes with the module's constants."""
    shapes = [(tokens,)] * (1 + len(names))
    dtypes = [torch.float32] * len(shapes)
    t = time.perf_counter()
    graph_cost.datum_cost(gm, shapes, dtypes, float("inf"))
    took = time.perf_counter() - t
    saved = graph_cost.NODE_COST, graph_cost.REF_COST, graph_cost.FLOP_COST
    try:
        graph_cost.NODE_COST, graph_cost.REF_COST, graph_cost.FLOP_COST = 0, 0, 0.0
        elements = graph_cost.datum_cost(gm, shapes, dtypes, float("inf"))
        graph_cost.FLOP_COST = 1.0
        flops = graph_cost.datum_cost(gm, shapes, dtypes, float("inf")) - elements
    finally:
        graph_cost.NODE_COST, graph_cost.REF_COST, graph_cost.FLOP_COST = saved
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    refs: list[torch.fx.Node] = []
    for n in calls:
        torch.fx.node.map_arg((n.args, n.kwargs), refs.append)
    return len(calls), len(refs), elements, flops, took


def nnls(A: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of the unconstrained fits over each subset of the
    columns whose coefficients all come out non-negative (4 columns: 15 subsets)."""
    best, best_res = np.zeros(A.shape[1]), float(b @ b)
    for mask in range(1, 1 << A.shape[1]):
        cols = [j for j in range(A.shape[1]) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(A[:, cols], b, rcond=None)
        if (sol < 0).any():
            continue
        res = float(np.sum((A[:, cols] @ sol - b) ** 2))
        if res < best_res:
            best, best_res = np.zeros(A.shape[1]), res
            best[cols] = sol
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3, help="runs per graph; the fastest is kept")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()}")
    graph_cost.check_at_upload(_graph(_chain("torch.neg", 2)), [1], Limits())  # imports warm
    names_, counts, secs, meter_s = [], [], [], []
    for name, gm, names, tokens, datums in cases():
        nodes, refs, elements, flops, took = meter(gm, names, tokens)
        run_once(gm, names, tokens, 1)  # warm
        secs.append(min(run_once(gm, names, tokens, datums) for _ in range(args.reps)))
        names_.append((name, datums))
        counts.append([nodes * datums, refs * datums, elements * datums, flops * datums])
        meter_s.append(took)
    X, y = np.array(counts, dtype=float), np.array(secs)
    w = 1 / y  # relative error: short and long rows weigh alike
    coef = nnls(X * w[:, None], y * w)  # seconds per node run, reference, element, multiply-add
    node_s, ref_s, elem_s, flop_s = coef
    print(f"fit: {node_s * 1e6:.3f} us per node run, {ref_s * 1e6:.3f} us per reference, "
          f"{elem_s * 1e9:.3f} ns per element read or written, {flop_s * 1e9:.4f} ns per multiply-add")
    if elem_s > 0:
        print(f"  -> NODE_COST = {node_s / elem_s:,.0f}, REF_COST = {ref_s / elem_s:,.0f}, "
              f"FLOP_COST = {flop_s / elem_s:.3g}")
    module = np.array([graph_cost.NODE_COST, graph_cost.REF_COST, 1.0, graph_cost.FLOP_COST])
    print(f"  module: NODE_COST = {graph_cost.NODE_COST:,}, REF_COST = {graph_cost.REF_COST:,}, "
          f"FLOP_COST = {graph_cost.FLOP_COST:.3g}")
    limits = Limits()
    print(f"at the default --max-loss-cost {limits.loss_cost:.3g}: about {limits.loss_cost * elem_s:.2f} s "
          "of loss work per request (the fitted time of one element operation)")
    head = (f"{'graph':<34} {'datums':>6} {'node runs':>9} {'refs':>8} {'elements':>9} {'mult-adds':>9} "
            f"{'measured s':>10} {'pred/meas (module)':>18} {'pred/meas (fit)':>15} {'meter s':>8}")
    print(head)
    for (name, datums), row, s, m in zip(names_, X, y, meter_s, strict=True):
        by_module = elem_s * float(row @ module) / s
        by_fit = float(row @ coef) / s
        print(f"{name:<34} {datums:>6} {row[0]:>9.0f} {row[1]:>8.0f} {row[2]:>9.3g} {row[3]:>9.3g} "
              f"{s:>10.3f} {by_module:>18.2f} {by_fit:>15.2f} {m:>8.3f}")
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
