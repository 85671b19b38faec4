"""The observed rows of docs/tinker.md's compatibility table: each call below is made against a live
`python -m trainer.serve` with the unmodified SDK or CLI (tinker 0.38), and its row is what happened.

A row's status is never written by hand here: a call that returns is "supported" (its evidence names the
test that checks what it returns), a 4xx is "refused" with the server's own one-line reason, an error the
SDK or CLI raises before any request is "refused by the SDK" with its message, and a 5xx is "broken" (the
table test fails on it). `tests/test_tinker_rest.py::test_compatibility_table_is_current` calls `observe`
against its server and compares the rendered table with the doc; `python tests/tinker_compat.py` starts a
server and rewrites the table.

The rest of the rows, supported calls each driven by a named test of `tests/test_tinker_rest.py`, come from
that module's `covers` marks (a broken call fails its test).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TINY = "pairedrl/tiny-random"
PROTO = "test_serve_protocol.py"


@dataclass
class Ctx:
    url: str
    key: str
    sc: Any = None
    rc: Any = None
    tc: Any = None
    sampler: Any = None
    extra: dict = field(default_factory=dict)

    def env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        return {**env, "TINKER_API_KEY": self.key, "TINKER_BASE_URL": self.url, "TINKER_TELEMETRY": "0",
                "NO_PROXY": "127.0.0.1,localhost", "HF_HUB_OFFLINE": "1"}

    def cli(self, *args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "tinker.cli", *args], env=self.env(), capture_output=True,
                             text=True, timeout=120, check=False)
        if out.returncode != 0:
            raise CliError(out.returncode, (out.stderr or out.stdout).strip())
        return out.stdout


class CliError(RuntimeError):
    def __init__(self, code: int, text: str):
        super().__init__(text)
        self.code = code


def _datum():
    from tinker import types

    toks = [5, 6, 7, 8, 9, 10]
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                       loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 5,
                                       "logprobs": [-1.0] * 5, "advantages": [0.5] * 5})


def _sample(ctx: Ctx, **kwargs: Any) -> Any:
    from tinker import types

    return ctx.sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2),
                              **kwargs).result()


def _target(ctx: Ctx) -> Any:
    from tinker import types

    return _sample(ctx, target_prompt_logprobs=types.TensorData(data=[6, 7], dtype="int64", shape=[2, 1]))


def _dmel(ctx: Ctx) -> Any:
    from tinker import types

    # a TensorContainer header (dtype byte 0, 2 dimensions: 3 x 4) and its payload: audio frames to the SDK
    audio = types.DmelChunk(dmel=bytes([0, 2, 3, 4]) + bytes(48))
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]), audio])
    return ctx.sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def _session_id(ctx: Ctx) -> str:
    return ctx.rc.list_sessions().result().sessions[0]


def _dimuon_client(ctx: Ctx) -> Any:
    from tinker import types

    return ctx.sc.create_lora_training_client(TINY, rank=4, optimizer=types.DimuonOptimizerConfig()).result()


def _dimuon_step(ctx: Ctx) -> Any:
    from tinker import types

    ctx.tc.forward_backward([_datum()], "cross_entropy").result()
    return ctx.tc.optim_step(types.DimuonParams(learning_rate=1e-4)).result()


def _provenance(ctx: Ctx) -> Any:
    from tinker import types

    seq = ctx.extra["recorded"]
    spans = [types.SampledProvenanceSpan(sequence_id=seq, length=5)]
    return ctx.tc.forward_backward([_datum().with_provenance(spans, spans)], "importance_sampling").result()


def _recorded(ctx: Ctx) -> Any:
    from tinker import types

    sampler = ctx.tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 2,
                          types.SamplingParams(max_tokens=2, seed=0)).result().sequences
    ids = [s.sequence_id for s in seqs]
    assert all(ids) and len(set(ids)) == 2, ids
    ctx.extra["recorded"] = ids[0]
    return ids


def _search(ctx: Ctx) -> Any:
    from tinker import types

    return ctx.rc.search_sessions(types.SessionSearchRequest()).result()


def _service_copy(ctx: Ctx) -> Any:
    import tinker

    sc = tinker.ServiceClient(api_key=ctx.key, base_url=ctx.url, project_id="proj")  # the SDK needs a project
    try:
        return sc.copy_weights(_state_path(ctx)).result()
    finally:
        sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server


def _printed(out: str, expected: str) -> str:
    assert expected in out, out[-500:]
    return out


def _state_path(ctx: Ctx) -> str:
    if "state" not in ctx.extra:
        ctx.extra["state"] = ctx.tc.save_state("compat").result().path
    return ctx.extra["state"]


# row -> (the call, the test that checks a supported call's result, or None where only a refusal is expected)
PROBES: dict[str, tuple[Callable[[Ctx], Any], str | None]] = {
    "RestClient.search_sessions": (_search, None),
    "RestClient.export_session_trace": (lambda c: c.rc.export_session_trace(_session_id(c)).result(), None),
    "RestClient.assign_session_project": (lambda c: c.rc.assign_session_project(_session_id(c), "p").result(),
                                          None),
    "RestClient.copy_weights": (lambda c: c.rc.copy_weights(_state_path(c), "proj").result(), None),
    "ServiceClient.copy_weights": (_service_copy, None),
    "RestClient.whoami": (lambda c: c.rc.whoami().result(), None),
    "RestClient.get_audit_log": (lambda c: c.rc.get_audit_log().result(), None),
    "RestClient.get_billing_usage": (lambda c: c.rc.get_billing_usage("2026-01-01", "2026-02-01").result(), None),
    "RestClient.get_current_checkpoint_storage_usage": (
        lambda c: c.rc.get_current_checkpoint_storage_usage().result(), None),
    "ServiceClient.create_lora_training_client(optimizer=DimuonOptimizerConfig())": (_dimuon_client, None),
    "TrainingClient.optim_step(DimuonParams)": (_dimuon_step, None),
    "TrainingClient.forward_backward(loss_fn='stable_reinforce')": (
        lambda c: c.tc.forward_backward([_datum()], "stable_reinforce").result(), None),
    "TrainingClient.forward_backward(loss_fn='dro', no loss_fn_config)": (
        lambda c: c.tc.forward_backward([_datum()], "dro").result(), None),
    "TrainingClient.forward_backward(loss_fn='gspo', no loss_fn_config)": (
        lambda c: c.tc.forward_backward([_datum()], "gspo").result(), None),
    "SamplingClient.sample(ModelInput with a DmelChunk)": (_dmel, None),
    "SamplingClient.sample(topk_sample_logprobs)": (lambda c: _sample(c, topk_sample_logprobs=2), None),
    "SamplingClient.sample(target_prompt_logprobs)": (_target, None),
    "SamplingClient.sample(prompt_alt_tokens_k)": (lambda c: _sample(c, prompt_alt_tokens_k=2), None),
    "TrainingClient.save_weights_and_get_sampling_client(record_stability_info=True)": (
        _recorded, f"`{PROTO}::test_cookbook_06_surface_sequence_ids_provenance_inflight_and_stable_reinforce`"),
    "TrainingClient.forward_backward(datums with provenance spans)": (
        _provenance, f"`{PROTO}::test_cookbook_06_surface_sequence_ids_provenance_inflight_and_stable_reinforce`"),
    "TrainingClient.save_weights_and_get_sampling_client(kind='inflight')": (
        lambda c: c.tc.save_weights_and_get_sampling_client(kind="inflight").result(),
        f"`{PROTO}::test_cookbook_06_surface_sequence_ids_provenance_inflight_and_stable_reinforce`"),
    "tinker version": (lambda c: _printed(c.cli("version"), "0.38"), "the CLI prints its version (no request)"),
    "tinker auth status": (lambda c: _printed(c.cli("auth", "status"), "Tinker accessible: yes"),
                           "prints `Tinker accessible: yes` for this server"),
    "tinker auth whoami": (lambda c: c.cli("auth", "whoami"), None),
    "tinker session export-trace": (lambda c: c.cli("session", "export-trace", _session_id(c)), None),
    "tinker billing checkpoint-storage": (lambda c: c.cli("billing", "checkpoint-storage"), None),
    "tinker billing usage": (lambda c: c.cli("billing", "usage", "2026-07-13T00:00:00Z", "2026-07-14T00:00:00Z"),
                             None),
}

# CLI commands not run: they write the user's credential store under ~ (login also opens a browser)
NOT_RUN = {
    "tinker auth login": ("not run", "interactive: opens a browser and writes a credential under ~"),
    "tinker auth logout": ("not run", "removes the credential `auth login` stores under ~; no server request"),
}


def _one_line(text: str, limit: int = 320) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def classify(fn: Callable[[Ctx], Any], evidence: str | None, ctx: Ctx) -> tuple[str, str]:
    """(status, evidence or reason) of one call as it happened."""
    import tinker

    try:
        fn(ctx)
    except tinker.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        why = body.get("detail") or e.message
        if 400 <= e.status_code < 500:
            return "refused", f"{e.status_code}: {_one_line(why)}"
        return "broken", f"{e.status_code}: {_one_line(why)}"
    except tinker.RequestFailedError as e:  # accepted, then failed: category user is the client's input
        why = _one_line(e.message.split(" for self.request_id=")[0])
        return ("refused" if str(e.category).lower().endswith("user") else "broken"), f"failed future: {why}"
    except CliError as e:
        text = str(e)
        lines = [ln for ln in text.splitlines() if ln.strip()]
        first = next((i for i, ln in enumerate(lines) if ln.startswith("Error")), max(len(lines) - 1, 0))
        why = " ".join(lines[first:first + 2])  # the CLI's message, then its details line (the server's)
        if "Error code: 5" in text:
            return "broken", _one_line(why)
        # the CLI quotes the server's reply ("Error code: 4xx - {'detail': ...}") when it sent a request
        return ("refused" if "Error code: 4" in text else "refused by the CLI"), _one_line(why)
    except (RuntimeError, ValueError, NotImplementedError) as e:  # raised before any request was sent
        return "refused by the SDK", _one_line(e)
    if evidence is None:
        return "supported", "answered (no test checks its result)"
    return "supported", evidence


def observe(url: str, key: str) -> dict[str, tuple[str, str]]:
    """Every probed row against the server at `url`, as it happened."""
    import tinker

    ctx = Ctx(url=url, key=key)
    ctx.sc = tinker.ServiceClient(api_key=key, base_url=url)
    ctx.rc = ctx.sc.create_rest_client()
    ctx.tc = ctx.sc.create_lora_training_client(TINY, rank=4, seed=0).result()
    ctx.sampler = ctx.tc.save_weights_and_get_sampling_client().result()
    rows = {row: classify(fn, evidence, ctx) for row, (fn, evidence) in PROBES.items()}
    ctx.sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server
    return {**rows, **NOT_RUN}


def cli_commands() -> list[str]:
    """Every command of the `tinker` CLI, as `tinker <group> <command>` (or `tinker <command>`)."""
    import importlib

    import click
    from tinker.cli.__main__ import main_cli

    out = []
    for name, target in main_cli.lazy_subcommands.items():
        module, attr = target.split(":")
        cmd = getattr(importlib.import_module(module), attr)
        if isinstance(cmd, click.Group):
            out += [f"tinker {name} {sub}" for sub in cmd.list_commands(click.Context(cmd))]
        else:
            out.append(f"tinker {name}")
    return sorted(out)


if __name__ == "__main__":  # start a server, observe, rewrite the table in docs/tinker.md
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_tinker_rest as rest
    from test_tinker_wire import Server

    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), "--ttl-sweep-s", "0.3")
        try:
            observed = observe(server.url, rest.KEY)
        finally:
            server.stop()
    rest.write_table(observed)
