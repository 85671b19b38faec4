"""The four guarantees a Tinker-compatible server owes its clients, each checked on a real
`python -m trainer.serve` over loopback HTTP (docs/tinker.md, "What the server guarantees"):

1. each model's training commands form an ordered, idempotent log (applied in the order the server takes
   them, each `seq_id` once; an identical resend gets the first reply, another body 409);
2. a checkpoint, once saved, never changes;
3. sampling is stateless: an answer depends on the sampler's fixed weights and the request alone;
4. state is per model: one model's commands never change another's.

The idempotence half of (1) is held by `test_serve_security.py::test_a_replayed_seq_id_with_another_body_is_
refused`; the tests here hold the rest.
"""

from __future__ import annotations

import pytest
from test_serve_security import BASE, Raw, fwdbwd_body
from test_tinker_wire import Server
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

LR = types.AdamParams(learning_rate=0.5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("guarantees_state"))
    yield s
    s.stop()


def _model(c: Raw, seq: int, seed: int = 3) -> str:
    reply = c.ok("create_model", types.CreateModelRequest(
        session_id=c.session, model_seq_id=seq, base_model=BASE,
        lora_config=types.LoraConfig(rank=4, seed=seed)))
    assert c.result(reply["request_id"]).status_code == 200
    return reply["model_id"]


def _post_fb(c: Raw, model_id: str, seq: int, forward_only: bool = False) -> str:
    r = c.http.post("/forward_backward", content=fwdbwd_body(model_id, seq, forward_only=forward_only),
                    headers={"content-type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    return r.json()["request_id"]


def _post_step(c: Raw, model_id: str, seq: int) -> str:
    reply = c.ok("optim_step", types.OptimStepRequest(model_id=model_id, seq_id=seq, adam_params=LR))
    return reply["request_id"]


def _logprobs(c: Raw, request_id: str) -> list[float]:
    r = c.result(request_id)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-protobuf"), r.text
    return list(deserialize_forward_backward_output(r.content).loss_fn_outputs[0]["logprobs"].data)


def _done(c: Raw, request_id: str) -> None:
    r = c.result(request_id)
    assert r.status_code == 200 and "error" not in r.text, r.text


def _forward(c: Raw, model_id: str, seq: int) -> list[float]:
    return _logprobs(c, _post_fb(c, model_id, seq, forward_only=True))


def _train(c: Raw, model_id: str, seq: int) -> int:
    """One forward_backward and one optim_step, each waited for; returns the next seq_id."""
    _done(c, _post_fb(c, model_id, seq))
    _done(c, _post_step(c, model_id, seq + 1))
    return seq + 2


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 for x, y in zip(a, b))


def test_a_models_commands_apply_in_the_order_taken_even_when_sent_without_waiting(server):
    """Guarantee 1 (ordered): forward_backward, optim_step and a forward posted back to back, no reply
    awaited in between, give what the same three give one at a time: the forward sees the step."""
    c = Raw(server.url, "tml-order")
    piped, waited = _model(c, 0), _model(c, 1)
    ids = [_post_fb(c, piped, 0), _post_step(c, piped, 1), _post_fb(c, piped, 2, forward_only=True)]
    before = _forward(c, waited, 0)
    after = _forward(c, waited, _train(c, waited, 1))
    assert not _close(before, after), "one step at lr 0.5 must move the logprobs, or this test means nothing"
    _done(c, ids[0])
    _done(c, ids[1])
    assert _close(_logprobs(c, ids[2]), after), (_logprobs(c, ids[2]), after, before)


def _sample(c: Raw, sampler: str, seq: int, prompt: list[int], seed: int, logprobs: bool = False) -> str:
    return c.ok("asample", types.SampleRequest(
        sampling_session_id=sampler, seq_id=seq, num_samples=2, prompt=types.ModelInput.from_ints(prompt),
        sampling_params=types.SamplingParams(max_tokens=6, seed=seed, temperature=1.0),
        prompt_logprobs=logprobs))["request_id"]


def _samples(c: Raw, request_id: str) -> tuple:
    r = c.result(request_id)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-protobuf"), r.text
    resp = deserialize_sample_response(r.content)
    return (tuple(tuple(s.tokens) for s in resp.sequences),
            tuple(round(float(x), 4) for s in resp.sequences for x in (s.logprobs or [])),
            tuple(round(float(x), 4) for x in (resp.prompt_logprobs or [])[1:]))


def _sampler(c: Raw, seq: int, **where: str) -> str:
    return c.ok("create_sampling_session", types.CreateSamplingSessionRequest(
        session_id=c.session, sampling_session_seq_id=seq, **where))["sampling_session_id"]


def test_a_sample_depends_on_the_sampler_and_the_request_alone(server):
    """Guarantee 3 (stateless sampling): the same request answered first, inside a burst of other keys'
    and prompts' requests, and last, is the same answer; a snapshot sampler answers the same after its
    model trained on."""
    c, other = Raw(server.url, "tml-stateless"), Raw(server.url, "tml-stateless-other")
    base = _sampler(c, 0, base_model=BASE)
    theirs = _sampler(other, 0, base_model=BASE)
    first = _samples(c, _sample(c, base, 0, [5, 6, 7], seed=11))
    burst = [_sample(other, theirs, i, [9 + i, 4, 2 + i], seed=100 + i) for i in range(3)]
    burst += [_sample(c, base, 1, [8, 9], seed=12), _sample(c, base, 2, [5, 6, 7], seed=11)]
    answers = [_samples(c if i >= 3 else other, rid) for i, rid in enumerate(burst)]
    last = _samples(c, _sample(c, base, 3, [5, 6, 7], seed=11))
    assert answers[-1] == first and last == first
    assert answers[-2][0] != first[0]  # another prompt and seed: the test can tell answers apart

    model = _model(c, 9)
    seq = _train(c, model, 0)
    snap = c.ok("save_weights_for_sampler", types.SaveWeightsForSamplerRequest(
        model_id=model, seq_id=seq, sampling_session_seq_id=50))
    _done(c, snap["request_id"])
    sid = f"{c.session}:sample:50"
    before = _samples(c, _sample(c, sid, 0, [5, 6, 7], seed=11))
    _train(c, model, seq + 1)
    assert _samples(c, _sample(c, sid, 1, [5, 6, 7], seed=11)) == before


def test_a_saved_checkpoint_never_changes(server):
    """Guarantee 2 (immutable checkpoints): after the model trains on, a save under the same name is
    refused and a sampler made from the checkpoint scores a prompt as one made before did."""
    c = Raw(server.url, "tml-immutable")
    model = _model(c, 0)
    save = c.ok("save_weights", types.SaveWeightsRequest(model_id=model, seq_id=0, path="ck0"))
    r = c.result(save["request_id"])
    assert r.status_code == 200 and "error" not in r.json(), r.text
    path = r.json()["path"]
    scored = _samples(c, _sample(c, _sampler(c, 1, model_path=path), 0, [5, 6, 7, 8], seed=1, logprobs=True))
    seq = _train(c, model, 1)
    again = c.ok("save_weights", types.SaveWeightsRequest(model_id=model, seq_id=seq, path="ck0"))
    refused = c.result(again["request_id"]).json()
    assert refused.get("category") == "user" and "already exists" in refused["error"], refused
    later = _samples(c, _sample(c, _sampler(c, 2, model_path=path), 0, [5, 6, 7, 8], seed=1, logprobs=True))
    assert later == scored


def test_training_one_model_leaves_another_of_the_same_session_as_it_was(server):
    """Guarantee 4 (per-model state): two models of one session, same seed: steps on one leave the
    other's forward pass unchanged."""
    c = Raw(server.url, "tml-per-model")
    a, b = _model(c, 0), _model(c, 1)
    b_before = _forward(c, b, 0)
    a_after = _forward(c, a, _train(c, a, 0))
    assert not _close(a_after, b_before)
    assert _close(_forward(c, b, 1), b_before)
