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
turns them back into a `torch.fx.GraphModule`, each target looked up in the closed tables of
`graph_ops` (function objects, never names walked), so a graph can only call what is listed there.
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.response_conv import _tensor_data_from_proto

from trainer.serve.graph_ops import ATTRIBUTES, FUNCTIONS, METHODS, tensor_attribute

_NP = {"float32": (np.float32, pb.DTYPE_FLOAT32), "int64": (np.int64, pb.DTYPE_INT64)}
_STOP = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


# ----------------------------------------------------------------------------- forward_backward
_MODEL_ID_FIELD = pb.ForwardBackwardRequest.DESCRIPTOR.fields_by_name["model_id"].number


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("truncated protobuf")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if not b & 0x80:
            return value, i


def peek_model_id(body: bytes, max_fields: int = 16) -> str:
    """The `model_id` of a `ForwardBackwardRequest` from its first fields, without decoding the data.

    The server checks the id (and its owner) before paying for the full decode of a body that may be
    tens of MB. Protobuf encoders write fields in number order (`model_id` is field 1), so it is within
    the first few fields of any SDK request; the caller still compares it with the full decode's,
    because a repeated singular field takes its last value there.
    """
    i = 0
    for _ in range(max_fields):
        if i >= len(body):
            break
        tag, i = _varint(body, i)
        field, wire_type = tag >> 3, tag & 7
        if wire_type == 0:
            _, i = _varint(body, i)
        elif wire_type == 2:
            n, i = _varint(body, i)
            if field == _MODEL_ID_FIELD:
                return body[i:i + n].decode("utf-8", errors="strict")[:256]
            i += n
        elif wire_type in (1, 5):
            i += 8 if wire_type == 1 else 4
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type}")
    raise ValueError("no model_id in the first fields of the request")


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
    topk = resp.topk_prompt_logprobs_np  # row-major [length, k] (response_conv._deserialize_topk_logprobs)
    if topk is not None:
        t = msg.topk_prompt_logprobs
        t.length, t.k = topk.token_ids.shape
        t.token_ids = np.ascontiguousarray(topk.token_ids, dtype=np.int32).tobytes()
        t.logprobs = np.ascontiguousarray(topk.logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()


# ----------------------------------------------------------------------------- custom losses
# bounds on an uploaded graph, checked before anything is built from it
MAX_GRAPH_NODES = 2048
MAX_ARG_DEPTH = 8
MAX_ARG_ITEMS = 4096
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16,
                                                          torch.bfloat16, torch.int64, torch.int32, torch.bool)}
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
_LAYOUTS = {"strided": torch.strided}
_MEMORY_FORMATS = {"contiguous_format": torch.contiguous_format, "preserve_format": torch.preserve_format}


def _resolve_function(target: str) -> Any:
    """The function an uploaded node names, from `graph_ops.FUNCTIONS` only (no import, no attribute walk)."""
    fn = FUNCTIONS.get(target)
    if fn is None:
        raise ValueError(f"custom loss calls {target!r}, which this server does not allow "
                         "(see trainer/serve/graph_ops.py for the functions a custom loss may call)")
    return fn


def _decode_arg(arg: Any, env: dict[str, Any], depth: int = 0) -> Any:
    if depth > MAX_ARG_DEPTH:
        raise ValueError(f"custom loss argument nests deeper than {MAX_ARG_DEPTH} levels")
    if isinstance(arg, list):
        if len(arg) > MAX_ARG_ITEMS:
            raise ValueError(f"custom loss argument list has {len(arg)} items (at most {MAX_ARG_ITEMS})")
        return [_decode_arg(a, env, depth + 1) for a in arg]
    if isinstance(arg, float) and not math.isfinite(arg):
        raise ValueError("custom loss argument is not a finite number")
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return arg
    if not isinstance(arg, dict) or len(arg) != 1:
        raise ValueError(f"custom loss argument {str(arg)[:80]!r} is not a one-key object")
    (kind, v), = arg.items()
    if kind == "ref":
        if not isinstance(v, str) or v not in env:
            raise ValueError(f"custom loss refers to node {str(v)[:80]!r} before defining it")
        return env[v]
    if kind in ("tuple", "slice"):
        if not isinstance(v, list) or len(v) > MAX_ARG_ITEMS or (kind == "slice" and len(v) != 3):
            raise ValueError(f"custom loss {kind} argument is malformed")
        items = tuple(_decode_arg(a, env, depth + 1) for a in v)
        return items if kind == "tuple" else slice(*items)
    if kind == "dict":
        if not isinstance(v, dict) or len(v) > MAX_ARG_ITEMS or not all(isinstance(k, str) for k in v):
            raise ValueError("custom loss dict argument is malformed")
        return {k: _decode_arg(a, env, depth + 1) for k, a in v.items()}
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":  # non-finite constants (e.g. -inf as a mask fill) arrive as strings
        if v not in ("inf", "-inf"):
            raise ValueError(f"custom loss float argument {str(v)[:20]!r} is not inf or -inf")
        return float(v)
    tables = {"dtype": _DTYPE_NAMES, "layout": _LAYOUTS, "memory_format": _MEMORY_FORMATS,
              "device": {"cpu": torch.device("cpu")}}
    if kind in tables:
        value = tables[kind].get(v) if isinstance(v, str) else None
        if value is None:
            raise ValueError(f"custom loss names {kind} {str(v)[:40]!r}; allowed: {sorted(tables[kind])}")
        return value
    raise ValueError(f"custom loss argument kind {str(kind)[:40]!r} is not part of the wire format")


def rebuild_graph(graph: types.CustomLossGraph) -> torch.fx.GraphModule:
    """A `torch.fx.GraphModule` from the uploaded nodes; every target from the explicit tables.

    The whole graph is checked while it is built, so a graph with one refused node is refused
    before it is stored or run (the server answers 400, category user).
    """
    import torch.fx

    if len(graph.nodes) > MAX_GRAPH_NODES:
        raise ValueError(f"custom loss graph has {len(graph.nodes)} nodes (at most {MAX_GRAPH_NODES})")
    g = torch.fx.Graph()
    env: dict[str, Any] = {}
    for node in graph.nodes:
        if node.name in env:
            raise ValueError(f"custom loss defines node {node.name[:80]!r} twice")
        if not all(_NAME.fullmatch(k) for k in node.kwargs):  # fx writes keyword names into generated code
            raise ValueError(f"custom loss node {node.name[:80]!r} passes a keyword that is not a plain name")
        args = tuple(_decode_arg(a, env) for a in node.args)
        kwargs = {k: _decode_arg(a, env) for k, a in node.kwargs.items()}
        if node.op == "placeholder":
            if not _NAME.fullmatch(node.target):  # and placeholder names into the generated signature
                raise ValueError(f"custom loss input name {node.target[:80]!r} is not a plain name")
            out = g.placeholder(node.target)
        elif node.op == "call_function":
            fn = _resolve_function(node.target)
            if fn is tensor_attribute and (len(args) != 2 or kwargs or args[1] not in ATTRIBUTES):
                raise ValueError(f"custom loss reads attribute {str(args[1:])[:80]}; only {sorted(ATTRIBUTES)} "
                                 "of a tensor may be read")
            out = g.call_function(fn, args, kwargs)
        elif node.op == "call_method":
            if not args or not isinstance(args[0], torch.fx.Node):  # fx would write `7.__pow__(...)` as code
                raise ValueError(f"custom loss calls method {node.target[:80]!r} on a constant; methods are "
                                 "called on the graph's values only")
            if node.target not in METHODS:
                raise ValueError(f"custom loss calls method {node.target[:80]!r}, which this server does not "
                                 "allow (see trainer/serve/graph_ops.py)")
            out = g.call_method(node.target, args, kwargs)
        elif node.op == "output":
            out = g.output(args[0] if args else None)
        else:
            raise ValueError(f"custom loss node {node.name[:80]!r} has op {node.op!r}; only placeholder, "
                             "call_function, call_method and output are allowed")
        env[node.name] = out
    g.lint()
    return torch.fx.GraphModule(torch.nn.Module(), g)
