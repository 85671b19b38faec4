"""What a refused client reads: each refusal names what the client can change (a flag, a config field, a
file), before any work is queued. The real-client review (round 5, "User-facing messages") listed the ones
that did not: limits named by field, the 401 under `--api-key-file`, `dro` / `gspo` without a config
accepted and failed later, the cookbook's `max_tokens=32768`, `stable_reinforce`'s `kl_coeff`, `DmelChunk`.

A real server subprocess on 127.0.0.1 started with `--api-key-file`, raw HTTP with the SDK's types."""

from __future__ import annotations

import itertools
import subprocess
import sys

import httpx
import pytest
from test_serve_security import Raw, fwdbwd_body
from test_tinker_wire import ROOT, Server
from tinker import types

from trainer.serve.limits import Limits

KEY = "tml-messages-key-1"
PROTO = {"content-type": "application/x-protobuf"}
SEQ = itertools.count(1)  # the model's training requests, in order


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("messages")
    (tmp / "keys").write_text(f"{KEY}\n")
    s = Server(tmp / "state", "--api-key-file", str(tmp / "keys"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def raw(server):
    return Raw(server.url, KEY)


@pytest.fixture(scope="module")
def model(raw):
    return raw.model(0)


@pytest.fixture(scope="module")
def sampler(raw):
    reply = raw.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=raw.session, sampling_session_seq_id=0, base_model="pairedrl/tiny-random"))
    return reply["sampling_session_id"]


def test_a_limit_set_out_of_range_is_named_by_its_flag():
    with pytest.raises(ValueError, match="--max-models-per-key must be a positive number, got 0"):
        Limits(models_per_key=0)
    p = subprocess.run([sys.executable, "-m", "trainer.serve", "--max-loss-nodes", "0"], capture_output=True,
                       text=True, timeout=60, check=False, env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert p.returncode == 2 and "--max-loss-nodes must be a positive number" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "trainer.serve", "--max-connections", str(10**12)],
                       capture_output=True, text=True, timeout=60, check=False,
                       env={"PYTHONPATH": str(ROOT / "src"), "PATH": ""})
    assert p.returncode == 2 and "lower --max-connections" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_the_401_under_an_api_key_file_names_the_file_option(server):
    r = httpx.get(server.url + "/api/v1/healthz", headers={"X-API-Key": "tml-not-in-the-file"}, timeout=30)
    assert r.status_code == 401 and "--api-key-file" in r.json()["detail"], r.text


@pytest.mark.parametrize("loss_fn,needs", [("dro", "beta"), ("gspo", "clip_low_threshold")])
def test_a_built_in_loss_without_its_config_is_refused_before_it_is_queued(raw, model, loss_fn, needs):
    """400 naming the missing config at once (it was a 200, then a failed future)."""
    body = fwdbwd_body(model, next(SEQ), loss_fn=loss_fn)
    r = raw.http.post("/forward_backward", content=body, headers=PROTO)
    assert r.status_code == 400 and f"needs loss_fn_config={{'{needs}'" in r.json()["detail"], r.text


def test_stable_reinforce_is_refused_naming_the_workaround_and_kl_coeff(raw, model):
    body = fwdbwd_body(model, next(SEQ), loss_fn="stable_reinforce", config={"kl_coeff": 0.1})
    r = raw.http.post("/forward_backward", content=body, headers=PROTO)
    detail = r.json()["detail"]
    assert r.status_code == 400 and "loss_fn='importance_sampling'" in detail and "kl_coeff" in detail, r.text


def _asample(raw: Raw, sampler: str, prompt: types.ModelInput, max_tokens: int) -> httpx.Response:
    req = types.SampleRequest(sampling_session_id=sampler, seq_id=next(SEQ), num_samples=1,
                              prompt=prompt, sampling_params=types.SamplingParams(max_tokens=max_tokens))
    return raw.post("asample", req)


def test_max_tokens_past_the_limit_tells_a_cookbook_user_what_to_set(raw, sampler):
    r = _asample(raw, sampler, types.ModelInput.from_ints([5, 6, 7]), 32768)
    detail = r.json()["detail"]
    assert r.status_code == 413 and "--max-tokens" in detail, r.text
    assert "BenchmarkConfig(max_tokens=" in detail


def test_an_audio_chunk_is_refused_by_its_type(raw, sampler):
    audio = types.DmelChunk(dmel=bytes([0, 2, 3, 4]) + bytes(48))  # a TensorContainer header: 3 x 4 frames
    r = _asample(raw, sampler, types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]), audio]), 2)
    assert r.status_code == 400 and "DmelChunk" in r.json()["detail"], r.text
