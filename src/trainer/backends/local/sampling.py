"""Sampling clients (immutable weight snapshots) and the batching scheduler behind them.

Every `sample` / `compute_logprobs` call becomes a request in one queue per service client; a
worker thread drains it, grouping requests for the same snapshot (and kind) into batches of up to
`max_sample_batch` sequences, so the hundreds of concurrent one-group requests of an RL step or the
1319 requests of an eval run as a few large batches. A single request with more samples than
`max_sample_batch` runs alone.

Fairness: each request carries its sampling client's `tenant` (the server sets it to the key that made
the client; in-process clients share one). Each tenant has at most one running batch, and up to
`MAX_ACTIVE` tenants' batches run at once, interleaved on the compute thread in slices of `SLICE_S`
seconds of decode steps (`generate.generate_steps`), least recently served tenant first. A request of
a tenant with nothing running therefore starts within one burst wait (`max_wait_s`) and one slice,
and then shares the compute equally with the other running tenants, however many requests (or long
batches) one tenant queued. A batch's numbers do not depend on the interleaving (`generate`).

Cancellation: `LocalSamplingClient.cancel()` (a server ending the client's session) fails the client's
queued requests at once with `RequestCancelled`, and its running ones at the running batch's next slice;
a batch whose every request is cancelled stops decoding there.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.types.topk_logprobs import MASK_LOGPROB, TopkLogprobs

from trainer.backends.local.common import COMPUTE, Faults, RequestCancelled, SelfFuture, failed_future
from trainer.backends.local.engine import LoraSnapshot, SharedBase
from trainer.backends.local.generate import SampleJob, SampleResult, generate_steps
from trainer.backends.local.sampler_forward import score
from trainer.utils.futures import then


@dataclass
class _Request:
    base: SharedBase
    snap: LoraSnapshot
    kind: str  # "sample" | "score"
    job: Any  # SampleJob or list[int]
    future: Future
    fail: bool = False
    tenant: str = ""
    cancelled: threading.Event | None = None  # its client's: set when the client is cancelled

    @property
    def rows(self) -> int:
        return self.job.num_samples if self.kind == "sample" else 1

    @property
    def dropped(self) -> bool:
        return self.cancelled is not None and self.cancelled.is_set()


SLICE_S = 0.25  # decode time a running batch gets before another tenant's batch takes a turn
MAX_ACTIVE = 4  # tenants whose batches run interleaved (each holds its KV cache meanwhile)


@dataclass
class _Running:
    """A batch in progress: its requests and its step generator (`_steps`)."""

    tenant: str
    live: list[_Request]
    steps: Any

    def drop_cancelled(self) -> bool:
        """Fail the cancelled requests of the batch; True when none is left (the batch stops)."""
        for r in self.live:
            if r.dropped and not r.future.done():
                r.future.set_exception(RequestCancelled("the sampling client was cancelled (its session ended)"))
        return all(r.future.done() for r in self.live)


class SampleScheduler:
    """Queue + worker that batches requests sharing a snapshot, and interleaves tenants' batches."""

    def __init__(self, dtype: torch.dtype, max_batch: int, faults: Faults, batch_wait_s: float = 0.01,
                 max_wait_s: float = 0.5, start: bool = True, *, quant: str = "none",
                 logit_noise: float = 0.0, coupling: str = "inverse_cdf"):
        self.dtype = dtype
        # the sampler's mismatch knobs and its draw (`backend.sampler_quant`, `backend.sampler_logit_noise`,
        # `sampling.coupling`; checked by the service client)
        self.quant, self.logit_noise, self.coupling = quant, logit_noise, coupling
        self.max_batch = max_batch
        self.faults = faults
        self.batch_wait_s = batch_wait_s
        self.max_wait_s = max_wait_s
        self._queue: list[_Request] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="local-sampler", daemon=True)
        self.batches_run = 0
        self._turns = 0
        self._served: dict[str, int] = {}  # tenant -> the turn it was last served
        self._running: dict[str, _Running] = {}  # the worker's batches in progress (read by `load`)
        if start:  # start=False: no worker, a caller drives `_take_batch` itself (the fairness test)
            self._thread.start()

    def submit(self, req: _Request) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the local service client was closed")
            self._queue.append(req)
            self._cv.notify()

    def cancel(self, token: threading.Event) -> None:
        """Drop the queued requests of a cancelled client (`token` already set) and fail their futures; its
        running ones end at their batch's next slice (`_Running.drop_cancelled`)."""
        with self._cv:
            gone = [r for r in self._queue if r.cancelled is token]
            self._queue = [r for r in self._queue if r.cancelled is not token]
            self._cv.notify()  # a worker waiting while only cancelled work runs looks again
        for r in gone:
            if not r.future.done():
                r.future.set_exception(RequestCancelled("the sampling client was cancelled (its session "
                                                        "ended) before this request started"))

    def load(self) -> dict[str, int]:
        """Work on the sampler now: requests queued and their rows, batches decoding and their rows (a
        batch counts until it stops decoding, with the rows of requests already cancelled)."""
        with self._cv:
            queued = list(self._queue)
        running = list(self._running.values())  # a batch decodes all its rows until it stops
        return {"queued": len(queued), "queued_rows": sum(r.rows for r in queued),
                "running": len(running), "running_rows": sum(r.rows for run in running for r in run.live)}

    def close(self) -> None:
        """Stop the worker and wait for it: a daemon thread still dropping its last batch's tensors when
        the interpreter finalizes is killed inside torch's deallocator, which aborts the process."""
        with self._cv:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cv.notify()
        for r in pending:  # not started: failed now rather than run by a worker that is shutting down
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(RuntimeError("the local service client was closed"))
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join()

    def _take_batch(self, running: dict[str, _Running]) -> list[_Request]:
        """The next batch of a tenant with no batch running; waits for one while nothing runs."""
        with self._cv:
            while not running and not self._queue and not self._closed:
                self._cv.wait()
            if self._closed or not any(r.tenant not in running for r in self._queue):
                return []
        # Let a burst of concurrent submissions land first: wait while requests keep arriving (a quiet
        # gap of batch_wait_s ends it), up to max_wait_s or a full batch. A client renders each prompt
        # before submitting it, so a burst of eval requests takes a while to arrive; a short fixed wait
        # would start a batch of a few rows that then runs the full decode length on its own.
        deadline = time.monotonic() + self.max_wait_s
        seen = -1
        while self.batch_wait_s > 0:
            with self._cv:
                n, rows = len(self._queue), sum(r.rows for r in self._queue)
            if n == seen or rows >= self.max_batch or time.monotonic() >= deadline:
                break
            seen = n
            time.sleep(self.batch_wait_s)
        with self._cv:
            waiting = dict.fromkeys(r.tenant for r in self._queue if r.tenant not in running)  # queue order
            tenant = min(waiting, key=lambda t: self._served.get(t, -1))
            first = next(r for r in self._queue if r.tenant == tenant)
            self._turns += 1
            self._served[tenant] = self._turns
            if len(self._served) > 4096:  # tenants with nothing queued start over as never served
                self._served = {t: n for t, n in self._served.items() if t in waiting}
            batch, rows, rest = [], 0, []
            for r in self._queue:
                same = (r.snap.id == first.snap.id and r.kind == first.kind and r.base is first.base
                        and r.tenant == tenant)
                if same and (not batch or rows + r.rows <= self.max_batch):
                    batch.append(r)
                    rows += r.rows
                else:
                    rest.append(r)
            self._queue = rest
        return batch

    def _run(self) -> None:
        while self._turn(self._running):
            pass

    def _turn(self, running: dict[str, _Running]) -> bool:
        """One turn of the worker: start a batch, or advance one by a slice; False once closed. A turn's
        locals end with it, so a finished batch's requests (and their snapshots) are not held meanwhile."""
        for t in [t for t, run in running.items() if run.drop_cancelled()]:
            del running[t]  # every request of the batch was cancelled: it decodes no further
        if self._closed:
            for run in running.values():
                self._fail(run.live, RuntimeError("the local service client was closed"))
            return False
        if len(running) < MAX_ACTIVE:
            batch = self._take_batch(running)
            if batch:
                self._start(batch, running)
                return True  # another tenant may be waiting too
        if not running:
            return True
        tenant = min(running, key=lambda t: self._served.get(t, -1))
        self._turns += 1
        self._served[tenant] = self._turns
        run, shared = running[tenant], len(running) > 1
        try:
            outs = COMPUTE.run(lambda: self._advance(run, shared))
        except BaseException as e:  # noqa: BLE001
            del running[tenant]
            self._fail(run.live, e)
            return True
        if outs is not None:
            del running[tenant]
            self.batches_run += 1
            for r, o in zip(run.live, outs):
                if not r.future.done():  # a request cancelled during its batch's last slice
                    r.future.set_result(_to_response(o) if r.kind == "sample" else o)
        return True

    def _start(self, batch: list[_Request], running: dict[str, _Running]) -> None:
        live = []
        self.faults.apply("sample", False)  # the configured latency, once per batch
        for r in batch:
            if r.dropped and not r.future.done():  # cancelled after it was taken from the queue
                r.future.set_exception(RequestCancelled("the sampling client was cancelled (its session ended)"))
            if r.future.done() or not r.future.set_running_or_notify_cancel():
                continue
            try:
                self.faults.apply("sample", r.fail, latency=False)
                live.append(r)
            except Exception as e:  # noqa: BLE001 - delivered through the future
                r.future.set_exception(e)
        if live:
            running[live[0].tenant] = _Running(live[0].tenant, live, self._steps(live))

    @staticmethod
    def _fail(live: list[_Request], e: BaseException) -> None:
        for r in live:
            if not r.future.done():
                r.future.set_exception(e)

    def _others_waiting(self, tenant: str) -> bool:
        with self._cv:
            return any(r.tenant != tenant for r in self._queue)

    def _advance(self, run: _Running, shared: bool) -> list[Any] | None:
        """Run `run`'s steps for one slice (to the end while no other tenant waits); its results when done."""
        end = time.monotonic() + SLICE_S
        with run.live[0].base.lock:
            while True:
                try:
                    next(run.steps)
                except StopIteration as done:
                    return done.value
                if time.monotonic() < end:
                    continue
                if (shared or COMPUTE.waiting() or self._others_waiting(run.tenant)
                        or any(r.dropped for r in run.live)):
                    return None  # a training request, or another tenant, takes a turn; or a cancel is seen

    def _steps(self, live: list[_Request]) -> Any:
        """The batch as a generator of steps (prefill, each decode step) returning its results."""
        base = live[0].base
        W = base.sampler_weights(live[0].snap, self.dtype, self.quant)
        if live[0].kind == "sample":
            return (yield from generate_steps(W, [r.job for r in live], base.tokenizer,
                                              logit_noise=self.logit_noise, coupling=self.coupling))
        return score(W, [r.job for r in live])


def _check_last_n(n: Any, prompt_len: int) -> int | None:
    """`prompt_logprobs_last_n`: None, or an int in [1, len(prompt) - 1] (`SamplingClient.compute_logprobs`'
    documented range). The engine scores the whole prompt and returns the last n (earlier entries None):
    the same values a full scoring gives, without the service's prefix-cache saving."""
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= prompt_len - 1:
        raise ValueError(f"prompt_logprobs_last_n must be an int in [1, len(prompt) - 1 = {prompt_len - 1}], "
                         f"got {n!r}")
    return n


def _then(fut: AwaitableConcurrentFuture, fn: Callable[[Any], Any]) -> AwaitableConcurrentFuture:
    """An `APIFuture` of `fn(result)` (its exception passed on)."""
    return AwaitableConcurrentFuture(then(fut.future(), fn))


def _to_response(res: SampleResult) -> types.SampleResponse:
    seqs = [types.SampledSequence(stop_reason=reason, sequence_id=f"local-{uuid.uuid4().hex}",
                                  tokens_np=np.asarray(toks, dtype=np.int32),
                                  logprobs_np=np.asarray(lps, dtype=np.float32))
            for toks, lps, reason in res.sequences]
    plp = None
    if res.prompt_logprobs is not None:
        plp = np.asarray([np.nan if v is None else v for v in res.prompt_logprobs], dtype=np.float32)
    topk = None
    if res.topk_prompt is not None:
        topk = TopkLogprobs(token_ids=res.topk_prompt[0], logprobs=res.topk_prompt[1])
    return types.SampleResponse(sequences=seqs, prompt_logprobs_np=plp, topk_prompt_logprobs_np=topk)


def _stop_sets(stop: Any, eos: int | None) -> tuple[frozenset[int], tuple[str, ...]]:
    """SamplingParams.stop: None -> the tokenizer's EOS; [] -> no stop; str / list[str] / list[int]."""
    if stop is None:
        return (frozenset([eos]) if eos is not None else frozenset()), ()
    if isinstance(stop, str):
        stop = [stop]
    ids = frozenset(int(s) for s in stop if isinstance(s, (int, np.integer)) and not isinstance(s, bool))
    strs = tuple(s for s in stop if isinstance(s, str))
    if len(ids) + len(strs) != len(set(stop)) or any(s == "" for s in strs):
        raise ValueError(f"SamplingParams.stop must be a string, a list of non-empty strings or a list of token "
                         f"ids, got {stop!r}")
    return ids, strs


class LocalSamplingClient(SelfFuture):
    """A sampling client bound to one immutable snapshot (later optim steps never change it)."""

    def __init__(self, base: SharedBase, snapshot: LoraSnapshot | Future, scheduler: SampleScheduler,
                 faults: Faults, model_path: str | None = None):
        self._base = base
        self._snap_future: Future
        if isinstance(snapshot, Future):
            self._snap_future = snapshot
        else:
            self._snap_future = Future()
            self._snap_future.set_result(snapshot)
        self._scheduler = scheduler
        self._faults = faults
        self.model_path = model_path
        self.tenant = ""  # whose requests these are: the scheduler serves tenants in turn
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop this client's work: its queued requests fail now with `RequestCancelled`, its running ones
        at their batch's next decode slice, and any later request fails at once."""
        self._cancelled.set()
        self._scheduler.cancel(self._cancelled)

    # SelfFuture: a client from save_weights_and_get_sampling_client is ready once its snapshot is taken
    def _ready(self, timeout: float | None = None) -> None:
        self._snap_future.result(timeout)

    @property
    def snapshot(self) -> LoraSnapshot:
        return self._snap_future.result()

    def get_base_model(self) -> str:
        return self._base.base_model

    def get_tokenizer(self) -> Any:
        return self._base.tokenizer

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if not isinstance(prompt, types.ModelInput):
            raise ValueError(f"prompt must be a tinker.ModelInput, got {type(prompt).__name__}")
        try:
            ids = [int(t) for t in prompt.to_ints()]
        except Exception as e:  # noqa: BLE001 - image chunks etc.
            raise ValueError(f"prompt: the local engine takes token chunks only ({e})") from e
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self._base.vocab_size]
        if bad:
            raise ValueError(f"prompt holds token ids outside the vocabulary [0, {self._base.vocab_size}): {bad[:5]}")
        if len(ids) >= self._base.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model context of "
                             f"{self._base.max_context} tokens")
        return ids

    def _job(self, prompt: Any, num_samples: int, p: Any, include_prompt_logprobs: bool) -> SampleJob:
        ids = self._prompt_ids(prompt)
        if not isinstance(p, types.SamplingParams):
            raise ValueError(f"sampling_params must be a tinker.SamplingParams, got {type(p).__name__}")
        if not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        if p.temperature is None or p.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {p.temperature}")
        if not 0.0 < p.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {p.top_p}")
        if p.top_k == 0 or p.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (off) or >= 1, got {p.top_k}")
        room = self._base.max_context - len(ids)
        max_tokens = room if p.max_tokens is None else int(p.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {p.max_tokens}")
        if max_tokens > room:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the model context "
                             f"of {self._base.max_context} tokens")
        stop_ids, stop_strs = _stop_sets(p.stop, self._base.tokenizer.eos_token_id)
        return SampleJob(prompt=ids, num_samples=num_samples, max_tokens=max_tokens,
                           temperature=float(p.temperature), top_k=int(p.top_k), top_p=float(p.top_p),
                           seed=p.seed, stop_ids=stop_ids, stop_strs=stop_strs,
                           include_prompt_logprobs=bool(include_prompt_logprobs))

    def _submit(self, kind: str, job: Any) -> AwaitableConcurrentFuture:
        fut: Future = Future()
        fail = self._faults.draw("sample")

        def enqueue(_: Any = None) -> None:
            try:
                if self._cancelled.is_set():
                    raise RequestCancelled("the sampling client was cancelled (its session ended)")
                snap = self._snap_future.result()
                self._scheduler.submit(_Request(self._base, snap, kind, job, fut, fail, self.tenant,
                                                self._cancelled))
            except BaseException as e:  # noqa: BLE001
                if not fut.done():
                    fut.set_exception(e)

        self._snap_future.add_done_callback(enqueue)
        return AwaitableConcurrentFuture(fut)

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, topk_sample_logprobs: int = 0,
               target_prompt_logprobs: Any = None, prompt_alt_tokens_k: int = 0,
               prompt_logprobs_last_n: int | None = None) -> AwaitableConcurrentFuture:
        """`APIFuture[SampleResponse]`; bad arguments give a future that raises ValueError."""
        try:
            if topk_sample_logprobs or target_prompt_logprobs is not None or prompt_alt_tokens_k:
                raise ValueError("the local engine does not support top-k sample / target / alt-token prompt "
                                 "logprobs; use include_prompt_logprobs, topk_prompt_logprobs (with "
                                 "prompt_logprobs_last_n) or compute_logprobs")
            job = self._job(prompt, num_samples, sampling_params, include_prompt_logprobs)
            k = topk_prompt_logprobs or 0
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self._base.vocab_size:
                raise ValueError(f"topk_prompt_logprobs must be an int in [0, {self._base.vocab_size}], got {k!r}")
            job = dataclasses.replace(job, topk_prompt=k)
            if prompt_logprobs_last_n is not None and not include_prompt_logprobs:  # as the SDK's sample() says
                raise ValueError("prompt_logprobs_last_n requires include_prompt_logprobs")
            last_n = _check_last_n(prompt_logprobs_last_n, len(job.prompt))
        except ValueError as e:
            return failed_future(e)
        out = self._submit("sample", job)
        if last_n is None:
            return out

        def mask(resp: types.SampleResponse) -> types.SampleResponse:
            cut = len(job.prompt) - last_n
            plp, topk = resp.prompt_logprobs_np, resp.topk_prompt_logprobs_np
            if plp is not None:
                plp = np.array(plp, dtype=np.float32)
                plp[:cut] = np.nan  # the SDK reads NaN as None (`SampleResponse.prompt_logprobs`)
            if topk is not None:  # earlier rows become the SDK's empty-row sentinel
                ids, lps = np.array(topk.token_ids), np.array(topk.logprobs)
                ids[:cut], lps[:cut] = 0, MASK_LOGPROB
                topk = TopkLogprobs(token_ids=ids, logprobs=lps)
            return dataclasses.replace(resp, prompt_logprobs_np=plp, topk_prompt_logprobs_np=topk)

        return _then(out, mask)

    def compute_logprobs(self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
                         ) -> AwaitableConcurrentFuture:
        """`APIFuture[list[float | None]]`: one entry per prompt token, None first."""
        try:
            ids = self._prompt_ids(prompt)
            last_n = _check_last_n(prompt_logprobs_last_n, len(ids))
        except ValueError as e:
            return failed_future(e)
        out = self._submit("score", ids)
        if last_n is None:
            return out
        return _then(out, lambda lps: [None] * (len(lps) - last_n) + list(lps[len(lps) - last_n:]))

    async def sample_async(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
                           include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0,
                           **kwargs: Any) -> types.SampleResponse:
        return await self.sample(prompt, num_samples, sampling_params, include_prompt_logprobs,
                                 topk_prompt_logprobs, **kwargs)

    async def compute_logprobs_async(self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None
                                     ) -> list[float | None]:
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)
