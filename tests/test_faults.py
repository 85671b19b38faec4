"""Backend faults: injected failures are retried or recovered without losing or doubling a step; an error
that may have been applied is never resent in place; a server that drops metrics does not crash a step."""

from __future__ import annotations

import json

import pytest
from runs import TINY, assert_same_run, read_metrics, run_train

SHORT = [*TINY, "schedule.num_steps=3", "schedule.save_every=1", "eval=none"]


@pytest.mark.slow
def test_injected_faults_give_the_fault_free_result(tmp_path):
    ref, faulty = tmp_path / "ref", tmp_path / "faulty"
    assert run_train([*SHORT, f"hydra.run.dir={ref}"], tmp_path).returncode == 0
    faults = [f"backend.faults.{k}=0.1" for k in ("p_sample", "p_forward_backward", "p_optim_step", "p_save_state")]
    p = run_train([*SHORT, *faults, "backend.faults.seed=3", "retry.backoff_s=0.0",
                   f"hydra.run.dir={faulty}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(faulty)
    assert rows[-1]["faults/retries"] > 0, "no fault was injected: the test would prove nothing"
    assert_same_run(ref, faulty)


def _timeout() -> Exception:
    import httpx
    import tinker

    return tinker.APITimeoutError(request=httpx.Request("POST", "http://tinker.invalid/forward_backward"))


@pytest.mark.parametrize("what", ["forward_backward", "optim_step"])
def test_weight_changing_calls_are_not_resent_after_an_ambiguous_error(what):
    """A timeout may arrive after the server applied the call: resending forward_backward / optim_step
    could accumulate a gradient or apply an update twice, so the loop hands it to checkpoint recovery
    (one attempt); an error that guarantees nothing was applied is retried in place, and idempotent
    calls (save_state) are retried after a timeout too."""
    from trainer.backends.errors import TransientBackendError
    from trainer.loop import RLLoop, _ClientFailure
    from trainer.retry import RetryPolicy

    loop = RLLoop.__new__(RLLoop)
    loop.retry = RetryPolicy(max_attempts=3, backoff_s=0.0)

    def failing_once(exc: Exception):
        calls = []

        def fn():
            calls.append(1)
            if len(calls) == 1:
                raise exc
            return "ok"
        return fn, calls

    fn, calls = failing_once(_timeout())
    with pytest.raises(_ClientFailure, match=f"{what}: APITimeoutError"):
        loop._train_call(what, fn)
    assert len(calls) == 1
    fn, calls = failing_once(TransientBackendError("refused before doing any work"))
    assert loop._train_call(what, fn) == "ok" and len(calls) == 2
    fn, calls = failing_once(_timeout())
    assert loop._train_call("save_state", fn) == "ok" and len(calls) == 2
    from trainer.losses.adapter import LossFunctionError

    fn, calls = failing_once(LossFunctionError("loss grpo_custom_loss raised RuntimeError: bug"))
    with pytest.raises(LossFunctionError):  # a bug in the loss: no retry, no checkpoint recovery
        loop._train_call(what, fn)
    assert len(calls) == 1


def test_a_failed_final_save_is_recovered_like_a_step(tmp_path):
    """The final save_state failing for good (a _ClientFailure) recovers from the last checkpoint and redoes
    the steps after it, then saves again, instead of ending the run without a final checkpoint."""
    from trainer.checkpoint import CheckpointInfo
    from trainer.config.compose import run_config
    from trainer.loop import LoopState, RLLoop, _ClientFailure
    from trainer.retry import RetryPolicy

    cfg = run_config(["schedule.num_steps=3", "schedule.save_every=0", "schedule.updates_per_batch=1",
                      "retry.max_attempts=3", "logger=jsonl", "logger.rollouts_per_step=0", "loss=grpo"])
    loop = RLLoop.__new__(RLLoop)
    loop.cfg, loop.run_dir, loop.progress, loop.config_dict, loop.sweep_dir = cfg, tmp_path, False, {}, None
    loop.retry, loop.recoveries, loop.info, loop.on_step_end = RetryPolicy(), 0, {}, None
    calls = {"start": 0, "steps": 0, "final_saves": 0}

    def start(renew=False):
        calls["start"] += 1
        return LoopState()

    def do_step(state, sink):
        calls["steps"] += 1
        state.step += 1
        return 0.0

    def save(state, final=False):
        assert final and state.step == 3
        calls["final_saves"] += 1
        if calls["final_saves"] == 1:
            raise _ClientFailure("save_state: APITimeoutError: timed out")
        state.last_checkpoint = CheckpointInfo("tinker://local/x", state.step, 6, 9, "h")

    loop._start, loop._do_step, loop._save = start, do_step, save
    out = loop.run()
    assert out["steps"] == 3 and out["checkpoint"] == "tinker://local/x" and out["recoveries"] == 1
    assert calls == {"start": 2, "steps": 6, "final_saves": 2}


class _Failed:
    """A future whose result is an error, as the SDK's futures raise it."""

    def __init__(self, exc: Exception):
        self.exc = exc

    def result(self, timeout: float | None = None):
        raise self.exc


@pytest.mark.parametrize("method,pipelined", [
    pytest.param("forward_backward_custom", False, id="forward_backward", marks=pytest.mark.slow),
    pytest.param("optim_step", True, id="optim_step_pipelined")])
def test_an_error_after_the_call_was_applied_is_recovered_from_the_checkpoint(
        tmp_path, monkeypatch, train_in_process, method, pipelined):
    """A timeout that reaches the client after the backend applied forward_backward (the gradient is in the
    buffers) or optim_step (the weights moved): the loop must not resend the call, but recreate the training
    client from the last checkpoint and redo the step. The run then equals the fault-free run; a resend in
    place would accumulate a second gradient or apply a second update. The fault hits the step's second
    update, so the first one (already applied on that client) must be rolled back too."""
    from trainer.backends.local.training import LocalTrainingClient

    # no end-of-run report: its plots cost seconds of CPU per run and the recovery does not touch them
    args = [*TINY, "eval=none", "report.enabled=false", "retry.backoff_s=0.0",
            f"backend.pipeline_optim_step={str(pipelined).lower()}"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    code, out = train_in_process([*args, f"hydra.run.dir={ref}"], tmp_path)
    assert code == 0, out[-3000:]

    real = getattr(LocalTrainingClient, method)
    calls = []

    def applied_then_timeout(self, *a, **k):
        fut = real(self, *a, **k)
        calls.append(method)
        if len(calls) == 4:  # step 1, update 1 (smoke: 2 steps x 2 updates, a checkpoint after step 0)
            fut.result()  # the engine applied it; only the reply is lost
            return _Failed(_timeout())
        return fut

    monkeypatch.setattr(LocalTrainingClient, method, applied_then_timeout)
    code, out = train_in_process([*args, f"hydra.run.dir={run}"], tmp_path)
    assert code == 0, out[-3000:]
    assert len(calls) == 6, calls  # 4 updates, the 2 of step 1 redone once
    assert "recovering from the last checkpoint" in out, out[-3000:]
    assert json.loads((run / "result.json").read_text())["recoveries"] == 1
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r["global_update"] for r in rows] == [0, 1, 2, 3]
    assert_same_run(ref, run)


def test_a_call_past_the_deadline_is_given_up_as_a_lost_client():
    """backend.call_deadline_s: a call that gets no reply (a server that died: the SDK would retry without
    end) is given up once no call of the run has had a successful reply for the deadline, raising
    ClientLostError, which is not resent in place; a call waiting behind others while replies keep
    arriving is not given up; an awaited request given up is cancelled."""
    import asyncio
    import threading
    import time

    from trainer.backends.errors import ClientLostError, is_retryable
    from trainer.retry import RetryPolicy

    retry = RetryPolicy(max_attempts=3, backoff_s=0.0, deadline_s=0.6, tick_s=0.05)
    calls, hang = [], threading.Event()

    def dead_server():
        calls.append(1)
        hang.wait(30)  # released at the end of the test

    t0 = time.monotonic()
    with pytest.raises(ClientLostError, match="backend.call_deadline_s"):
        retry.call("optim_step", dead_server)
    assert 0.5 < time.monotonic() - t0 < 5 and len(calls) == 1
    assert not is_retryable(ClientLostError("x"))
    assert retry.call("get_info", lambda: "ok") == "ok"  # a live server: no deadline in the way

    async def batch():
        """A slow request (1.5 s, past the deadline) among fast ones that keep succeeding, then a dead one."""
        async def fast():
            await asyncio.sleep(0.1)
            return "fast"

        async def slow():
            await asyncio.sleep(1.5)
            return "slow"

        async def keep_replying():
            for _ in range(20):
                await retry.acall("sample", fast)

        got = await asyncio.gather(retry.acall("sample", slow), keep_replying())
        assert got[0] == "slow"
        never = asyncio.get_running_loop().create_future()
        with pytest.raises(ClientLostError):
            await retry.acall("sample", lambda: never)
        await asyncio.sleep(0)
        assert never.cancelled()

    asyncio.run(batch())
    hang.set()


def test_a_lost_client_is_recovered_from_the_checkpoint_not_refused():
    """A 404 on a model, sampler or future the run created (the server restarted or dropped it) and a call
    past the deadline are a lost client: the loop's one wrapper, for training and sampling calls alike,
    redoes the step from the checkpoint; a request the backend refuses ends the run with one line; an
    error of our own propagates as it is."""
    import httpx
    import tinker

    from trainer.backends.errors import (
        USER,
        BackendRequestError,
        ClientLostError,
        classify,
        is_lost,
        is_retryable,
    )
    from trainer.loop import RLLoop, _ClientFailure

    req = httpx.Request("POST", "http://127.0.0.1:1/api/v1/asample")

    def status(code: int) -> Exception:
        return tinker.APIStatusError("x", response=httpx.Response(code, request=req), body=None)

    def future_gone() -> Exception:  # the SDK's error for a future the server no longer knows
        try:
            raise ValueError("Error retrieving result: unknown request_id with status 404") from status(404)
        except ValueError as e:
            return e

    lost = [status(404), future_gone(), ClientLostError("no successful reply")]
    for exc in lost:
        assert is_lost(exc) and not is_retryable(exc), exc
    assert classify(status(404)) == USER  # a 404 on what the user named (a base model, a path) stays USER
    for exc in (status(400), status(401), status(500), ValueError("datum[0] has no target_tokens")):
        assert not is_lost(exc), exc
    loop = RLLoop.__new__(RLLoop)
    for what in ("sample", "forward_backward", "step-end eval at step 2"):
        for exc in lost:
            assert isinstance(loop._backend_failure(what, exc), _ClientFailure), (what, exc)
        assert isinstance(loop._backend_failure(what, status(400)), BackendRequestError)
        own = ValueError("bad datum")
        assert loop._backend_failure(what, own) is own
