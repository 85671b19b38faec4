"""The Tinker wire formats the server reads and writes, built on the SDK's own messages and types.

Requests and replies of tinker 0.38 (`tinker/resources/*.py`, `tinker/proto/request_conv.py`,
`tinker/proto/response_conv.py`): JSON bodies are the SDK's pydantic request types, so they are parsed
with those types; `/forward_backward` arrives as a `tinker_public_pb2.ForwardBackwardRequest`, and the
results of forward/backward and sampling go back as `ForwardBackwardOutput` / `SampleResponse` protobufs
(the SDK refuses JSON for those two, `lib/api_future_impl.py::_handle_outcome`). Encoders here are the
inverses of the SDK's `response_conv` decoders; tensors are decoded with the SDK's own
`response_conv._tensor_data_from_proto`.

A custom loss uploaded with `create_custom_loss` (client config `custom_loss_server_side=True`) arrives
as `CustomLossGraph` nodes (`lib/public_interfaces/custom_loss.py::encode_graph`); `rebuild_graph`
turns them back into a `torch.fx.GraphModule`, resolving each function against an allow-list (torch,
math, operator) and refusing the same operations the SDK's tracer refuses (`_check_graph`).
"""

from __future__ import annotations

import builtins
import importlib
import math
import operator
from typing import Any

import numpy as np
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto

_NP = {"float32": (np.float32, pb.DTYPE_FLOAT32), "int64": (np.int64, pb.DTYPE_INT64)}
_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# ----------------------------------------------------------------------------- forward_backward
def decode_forward_backward(body: bytes) -> tuple[str, int, list[types.Datum], str, dict[str, Any], bool]:
    """(model_id, seq_id, data, loss_fn, loss_fn_config, forward_only) of a protobuf request body."""
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(body)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError(f"datum[{i}]: this server takes token chunks only")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor_data_from_proto(t) for name, t in d.loss_fn_inputs.items()}
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs))
    config: dict[str, Any] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # the SDK dual-writes numbers; strings only live in v2
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    return msg.model_id, int(msg.seq_id), data, msg.loss_fn, config, bool(msg.forward_only)


def encode_forward_backward_output(out: types.ForwardBackwardOutput) -> bytes:
    """One `ArrayRecord` holding every datum's outputs (byte offsets per datum), plus the metrics."""
    msg = pb.ForwardBackwardOutput()
    msg.loss_fn_output_type = out.loss_fn_output_type
    for k, v in (out.metrics or {}).items():
        msg.metrics[k] = float(v)
    outs = list(out.loss_fn_outputs or [])
    if outs:
        rec = msg.loss_fn_outputs.add()
        rec.type_tag = out.loss_fn_output_type
        rec.num_datums = len(outs)
        for name in outs[0]:
            tds = [o[name] for o in outs]
            np_dtype, pb_dtype = _NP[tds[0].dtype]
            arrays = [np.asarray(td.to_numpy(), dtype=np_dtype) for td in tds]
            trailing = list(tds[0].shape[1:]) if tds[0].shape else []
            offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([a.nbytes for a in arrays])
            bt = rec.fields[name]
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = offsets.tobytes()
            bt.dtype = pb_dtype
            bt.trailing_shape.extend(trailing)
    return msg.SerializeToString()


# ----------------------------------------------------------------------------- sampling
def encode_sample_response(resp: types.SampleResponse) -> bytes:
    msg = pb.SampleResponse()
    for seq in resp.sequences:
        s = msg.sequences.add()
        s.stop_reason = _STOP[str(seq.stop_reason)]
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    plp = getattr(resp, "prompt_logprobs_np", None)
    if plp is None and resp.prompt_logprobs is not None:
        plp = np.asarray([np.nan if v is None else v for v in resp.prompt_logprobs], dtype=np.float32)
    if plp is not None:
        msg.prompt_logprobs = np.asarray(plp, dtype=np.float32).tobytes()
    return msg.SerializeToString()


# ----------------------------------------------------------------------------- custom losses
_ALLOWED_MODULES = ("torch", "math", "operator")
_REFUSED_METHODS = frozenset({"backward", "item", "numpy", "tolist"})


def _resolve_function(target: str) -> Any:
    """`torch.exp`, `operator.mul`, `math.log`, `getattr`... -> the function, from allowed modules only."""
    if target in ("getattr", "builtins.getattr"):
        return builtins.getattr
    root = target.split(".")[0]
    if root not in _ALLOWED_MODULES:
        raise ValueError(f"custom loss calls {target!r}; only torch, math and operator functions are allowed")
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for p in parts[cut:]:
            obj = getattr(obj, p)
        if not callable(obj):
            raise ValueError(f"custom loss target {target!r} is not a function")
        return obj
    raise ValueError(f"custom loss target {target!r} cannot be resolved")


def _decode_arg(arg: Any, env: dict[str, Any]) -> Any:
    if isinstance(arg, list):
        return [_decode_arg(a, env) for a in arg]
    if not isinstance(arg, dict):
        return arg
    if len(arg) != 1:
        raise ValueError(f"custom loss argument {arg!r} is not a one-key object")
    (kind, v), = arg.items()
    if kind == "ref":
        if v not in env:
            raise ValueError(f"custom loss refers to node {v!r} before defining it")
        return env[v]
    if kind == "tuple":
        return tuple(_decode_arg(a, env) for a in v)
    if kind == "dict":
        return {k: _decode_arg(a, env) for k, a in v.items()}
    if kind == "slice":
        return slice(*(_decode_arg(a, env) for a in v))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(v)
    if kind == "dtype":
        dt = getattr(torch, v, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"custom loss names an unknown dtype {v!r}")
        return dt
    if kind == "device":
        return torch.device(v)
    if kind == "layout":
        return getattr(torch, v)
    if kind == "memory_format":
        return getattr(torch, v)
    raise ValueError(f"custom loss argument kind {kind!r} is not part of the wire format")


def rebuild_graph(graph: types.CustomLossGraph) -> torch.fx.GraphModule:
    """A `torch.fx.GraphModule` from the uploaded nodes, resolving only allowed operations."""
    import torch.fx

    g = torch.fx.Graph()
    env: dict[str, Any] = {}
    for node in graph.nodes:
        args = tuple(_decode_arg(a, env) for a in node.args)
        kwargs = {k: _decode_arg(a, env) for k, a in node.kwargs.items()}
        if node.op == "placeholder":
            out = g.placeholder(node.target)
        elif node.op == "call_function":
            out = g.call_function(_resolve_function(node.target), args, kwargs)
        elif node.op == "call_method":
            if node.target in _REFUSED_METHODS or not hasattr(torch.Tensor, node.target):
                raise ValueError(f"custom loss calls method {node.target!r}, which is not allowed")
            out = g.call_method(node.target, args, kwargs)
        elif node.op == "output":
            out = g.output(args[0] if args else None)
        else:
            raise ValueError(f"custom loss node {node.name!r} has op {node.op!r}; only placeholder, "
                             "call_function, call_method and output are allowed")
        env[node.name] = out
    g.lint()
    return torch.fx.GraphModule(torch.nn.Module(), g)


# math and operator are imported so an allowed target resolves without a fresh import at request time
_ = (math, operator)
