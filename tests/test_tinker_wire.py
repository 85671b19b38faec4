"""`backend=tinker` end to end: the unmodified tinker SDK against `python -m trainer.serve` on loopback.

The server runs the embedded engine, so a run through the wire must equal the same run in-process
(`backend=local`): same metrics.jsonl rows and the same eval records. Both sides pin fp32 (sampler and
training), so the only differences left are float rounding from how the wire path batches work (the
SDK's two-pass custom loss sends its forward and backward as separate requests, so prompts are packed
differently): values are compared to 1e-4 relative, tokens and eval records exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
from runs import TINY, read_metrics, run_train, safe_rows

# the model config's LoRA alpha is not part of the Tinker protocol: the server is told it
ENGINE = ["--lora-alpha", "8", "--sampler-dtype", "float32", "--train-dtype", "float32"]
ARGS = [a for a in TINY if not a.startswith("backend.")]
LOCAL = [*ARGS, "backend.sampler_dtype=float32", "backend.train_dtype=float32"]
WIRE = [*ARGS, "backend=tinker"]
# a seeded request draws one random stream for all its samples, so both sides split groups alike
SPLIT_PIN = ["sampling.requests=per_group"]


class Server:
    """`python -m trainer.serve` in a subprocess; `url` from its first stdout line."""

    def __init__(self, state_dir: Path, *extra: str, engine: tuple[str, ...] | list[str] = tuple(ENGINE)):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.serve", "--state-dir", str(state_dir), *engine,
                                      *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().strip()
        assert line.startswith("listening on http://127.0.0.1:"), (line, self.proc.stderr.read()[-2000:])
        self.url = line.split()[-1]

    def env(self) -> dict:
        return {"TINKER_API_KEY": "tml-local", "TINKER_BASE_URL": self.url, "TINKER_TELEMETRY": "0"}

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stats", headers={"X-API-Key": "tml-local"}, timeout=10).json()

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err[-2000:]
        assert out.strip().endswith("stopped"), out
        return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve_state"))
    yield s
    s.stop()


def _comparable(rows: list[dict]) -> list[dict]:
    # engine/ counters differ by construction on the two-pass path: over the wire the SDK keeps the
    # metrics of the second (backward) request only
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "faults/", "engine/"))} for r in rows]


def assert_same_rows(rows_a: list[dict], rows_b: list[dict], rel: float = 1e-4) -> None:
    assert [(r["step"], r["update"]) for r in rows_a] == [(r["step"], r["update"]) for r in rows_b]
    for ra, rb in zip(_comparable(rows_a), _comparable(rows_b)):
        assert set(ra) == set(rb), set(ra) ^ set(rb)
        for k, v in ra.items():
            if isinstance(v, float):
                assert rb[k] == pytest.approx(v, rel=rel, abs=1e-6), (ra["step"], ra["update"], k)
            else:
                assert rb[k] == v, (ra["step"], ra["update"], k)


def eval_records(run: Path, name: str = "gsm8k_test") -> list[tuple]:
    rows = [json.loads(x) for x in (run / "eval" / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    return [(r["index"], r["completion"], r["parsed"], r["correct"]) for r in rows]


def rollouts(run: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["group"], r["completion"], r["reward"]) for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("path", ["one_pass", "two_pass"])
def test_wire_run_equals_in_process_run(tmp_path, server, path):
    # one request per group on both sides (the local engine's default; the wire's is per_sample, pinned by
    # the resume and fault tests below)
    extra = [f"backend.loss_path={path}", *SPLIT_PIN] + (["eval=none"] if path == "two_pass" else [])
    local, wire = tmp_path / "local", tmp_path / "wire"
    p = run_train([*LOCAL, *extra, f"hydra.run.dir={local}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    sessions = server.stats()["sessions"]
    p = run_train([*WIRE, *extra, f"hydra.run.dir={wire}"], tmp_path, env=server.env())
    assert p.returncode == 0, p.stderr[-3000:]
    # the run finished its session: a process running several arms in turn (a multirun) leaves none open
    assert server.stats()["sessions"] == sessions
    rows_l, rows_w = read_metrics(local), read_metrics(wire)
    assert {r["loss/path"] for r in rows_w} == {path}
    assert_same_rows(rows_l, rows_w)
    assert rollouts(local) == rollouts(wire)
    if path == "one_pass":
        assert eval_records(local) == eval_records(wire)
        assert json.loads((wire / "result.json").read_text())["eval"]["greedy_deterministic"] is True
    ck = json.loads((wire / "checkpoint.json").read_text())
    assert ck["tinker_path"].startswith("tinker://") and ck["optim_steps"] == 4


# the resume and fault tests share one in-process reference: 3 steps, one request per sample (the wire's
# default), with the final eval
REF_ARGS = ["schedule.num_steps=3", "retry.backoff_s=0.0", "sampling.requests=per_sample"]


@pytest.fixture(scope="module")
def local_ref(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("local_ref")
    p = run_train([*LOCAL, *REF_ARGS, f"hydra.run.dir={tmp / 'ref'}"], tmp)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "ref"


@pytest.mark.slow
def test_sigkill_and_resume_over_the_wire(tmp_path, server, local_ref):
    args = REF_ARGS
    run = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *WIRE, *args, f"hydra.run.dir={run}"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **server.env()})
    deadline = time.time() + 240
    while time.time() < deadline:  # kill once step 1 is logged: after the step-1 checkpoint, mid-run
        if (run / "metrics.jsonl").exists() and any(r.get("step", 0) >= 1 for r in safe_rows(run)):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    p = run_train([*WIRE, *args, f"hydra.run.dir={run}"], tmp_path, env=server.env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming the run in" in p.stdout
    assert_same_rows(read_metrics(local_ref), read_metrics(run))
    assert eval_records(local_ref) == eval_records(run)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_run(run: Path, tmp_path: Path, srv: Server, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *WIRE, *args, f"hydra.run.dir={run}"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **srv.env()})


def _kill_server_when(proc: subprocess.Popen, srv: Server, ready: Callable[[], bool]) -> None:
    """SIGKILL the server once `ready()` holds, while the run `proc` is still going."""
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if ready():
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before the server was killed"
    srv.proc.kill()
    srv.proc.wait()


def _kill_after_step(proc: subprocess.Popen, run: Path, srv: Server, step: int) -> None:
    """SIGKILL the server once the run logged `step` (its checkpoint is taken: save_every=1), mid-run."""
    _kill_server_when(proc, srv, lambda: (run / "metrics.jsonl").exists()
                      and any(r.get("step", 0) >= step for r in safe_rows(run)))


@pytest.mark.slow
def test_server_sigkilled_and_restarted_mid_run_leaves_a_complete_run(tmp_path, local_ref):
    """The server dies (SIGKILL) in the middle of a run and comes back on the same port and state dir, with
    none of the run's session, model, sampler or future ids: the run itself redoes the step from its last
    checkpoint with a new client and ends complete, each (step, update) once, with the values and the eval
    of the uninterrupted in-process run."""
    port, state, run = _free_port(), tmp_path / "state", tmp_path / "run"
    srv = Server(state, "--port", str(port))
    proc = _start_run(run, tmp_path, srv, *REF_ARGS, "schedule.save_every=1", "backend.call_deadline_s=30")
    try:
        _kill_after_step(proc, run, srv, 1)
        time.sleep(2.0)
        srv = Server(state, "--port", str(port))
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        srv.stop()
    assert proc.returncode == 0, err[-3000:]
    assert "recovering from the last checkpoint" in out + err, (out + err)[-3000:]
    assert json.loads((run / "result.json").read_text())["recoveries"] >= 1
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(s, u) for s in range(3) for u in range(2)]
    assert [r["global_update"] for r in rows] == list(range(6))
    assert_same_rows(read_metrics(local_ref), rows)
    assert eval_records(local_ref) == eval_records(run)


@pytest.mark.slow
def test_server_that_stays_down_ends_the_run_within_the_deadline(tmp_path):
    """The server dies and does not come back: the pending call is given up after backend.call_deadline_s
    without a successful reply, each new client is refused within connect_timeout_s, and after
    retry.max_attempts tries the run ends with one line and exit code 2 (not the SDK's retries without
    end), its finished steps kept for a resume."""
    run = tmp_path / "run"
    srv = Server(tmp_path / "state")
    proc = _start_run(run, tmp_path, srv, "schedule.num_steps=3", "schedule.save_every=1", "eval=none",
                      "backend.call_deadline_s=5", "backend.connect_timeout_s=2", "retry.max_attempts=2",
                      "retry.backoff_s=0.1")
    try:
        _kill_after_step(proc, run, srv, 1)
        t_kill = time.time()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - t_kill < 60, time.time() - t_kill
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: backend: giving up") and "resumes from its last checkpoint" in last, last
    assert "backend.call_deadline_s" in out, out[-3000:]  # the deadline, not an error, ended the call
    steps = {r["step"] for r in read_metrics(run)}
    assert {0, 1} <= steps and json.loads((run / "checkpoint.json").read_text())["step"] >= 1


@pytest.mark.slow
def test_server_lost_during_the_final_eval_ends_with_one_line_and_resumes(tmp_path):
    """The final eval runs after the loop: a server that dies then ends the run with one line (exit code 2)
    within the deadline, and a rerun in the folder, the server back, resumes at the final checkpoint and
    redoes the eval."""
    port, state, run = _free_port(), tmp_path / "state", tmp_path / "run"
    args = ["schedule.num_steps=2", "schedule.save_every=1", "eval.n_examples=8", "backend.call_deadline_s=5",
            "backend.connect_timeout_s=2", "retry.max_attempts=2", "retry.backoff_s=0.1"]
    srv = Server(state, "--port", str(port), "--latency-s", "0.5")
    proc = _start_run(run, tmp_path, srv, *args)
    try:
        ck = run / "checkpoint.json"  # the final checkpoint is saved: the eval is next
        _kill_server_when(proc, srv, lambda: ck.exists()
                          and json.loads(ck.read_text())["tinker_path"].endswith("_final"))
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: backend: the final eval: ") and "redoes it when started again" in last, last
    assert not (run / "result.json").exists()
    srv = Server(state, "--port", str(port))
    try:
        p = run_train([*WIRE, *args, f"hydra.run.dir={run}"], tmp_path, env=srv.env())
    finally:
        srv.stop()
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming the run in" in p.stdout
    assert len(eval_records(run)) == 8
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(s, u) for s in range(2) for u in range(2)]


@pytest.mark.parametrize("url, needle", [
    ("http://127.0.0.1:9", "did not answer within"),  # nothing listens on the discard port
])
def test_unreachable_service_fails_fast_naming_the_url(tmp_path, url, needle):
    t0 = time.time()
    p = run_train([*WIRE, "backend.connect_timeout_s=5", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                  env={"TINKER_API_KEY": "tml-local", "TINKER_BASE_URL": url, "TINKER_TELEMETRY": "0"})
    assert time.time() - t0 < 30
    assert p.returncode == 2
    assert url in p.stderr and needle in p.stderr
    assert "Traceback" not in p.stderr


def test_wrong_url_or_key_fails_fast_naming_it(tmp_path, server):
    for url, key, needle in ((server.url + "/not-tinker", "tml-local", "does not look like a Tinker service"),
                             (server.url, "sk-wrong", "refused the API key in $TINKER_API_KEY")):
        p = run_train([*WIRE, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path,
                      env={"TINKER_API_KEY": key, "TINKER_BASE_URL": url, "TINKER_TELEMETRY": "0"})
        assert p.returncode == 2 and needle in p.stderr and url in p.stderr, p.stderr[-2000:]
        assert "Traceback" not in p.stderr


def test_sdk_errors_are_classified():
    """What the pinned SDK raises once its own retries are spent, and what the trainer does about it."""
    import httpx
    import tinker
    from tinker.lib.retryable_exception import RetryableException

    from trainer.backends.errors import RECOVER, RESEND, USER, classify, is_retryable
    from trainer.losses.adapter import LossFunctionError

    req = httpx.Request("POST", "http://tinker.invalid/api/v1/forward_backward")

    def status(code: int) -> Exception:
        return tinker.APIStatusError("x", response=httpx.Response(code, request=req), body=None)

    def failed(category: str) -> Exception:
        return tinker.RequestFailedError("Request failed", request_id="r",
                                         category=tinker.types.RequestErrorCategory(category))

    def sdk_value_error() -> Exception:
        try:
            raise ValueError("Error retrieving result: ... with status 404") from status(404)
        except ValueError as e:
            return e

    cases = {
        RESEND: [tinker.RateLimitError("x", response=httpx.Response(429, request=req), body=None)],
        RECOVER: [failed("server"), failed("user"), RetryableException(message="Promise expired"), sdk_value_error(),
                  ValueError("Proto deserialization failed: bad bytes"), status(500), status(409), status(410),
                  tinker.APITimeoutError(request=req), tinker.APIConnectionError(request=req),
                  RuntimeError("A previous request failed; this TrainingClient is poisoned")],
        USER: [status(400), status(401), status(404), status(422), ValueError("datum[0] has no target_tokens"),
               LossFunctionError("loss raised RuntimeError: bug")],
        None: [KeyError("bug"), AttributeError("bug")],
    }
    for want, excs in cases.items():
        for exc in excs:
            assert classify(exc) == want, (exc, want)
    assert not is_retryable(cases[RECOVER][-1])  # a poisoned client: resending on it cannot succeed
    assert is_retryable(failed("server")) and not is_retryable(status(401))


FAULT_KINDS = "500,429,408,410,failed_server,failed_user,drop,poison"


@pytest.mark.slow
def test_ten_percent_faults_on_the_wire_give_the_fault_free_run(tmp_path, local_ref):
    """A tenth of the calls fail across the kinds the service can produce (`delay` aside: each costs the
    SDK's 45-60 s timeout), plus chosen ones that force a dropped reply after the work was taken, a lost
    model and a failed future: every (step, update) row still appears once, with the values of the
    fault-free in-process run, and the final eval is the same."""
    args, ref, run = REF_ARGS, local_ref, tmp_path / "faulty"
    at = "at=optim_step#2:drop,forward_backward#5:poison,save_weights#2:drop,asample#3:drop"
    srv = Server(tmp_path / "state", "--faults", f"rate=0.1 seed=7 kinds={FAULT_KINDS} {at}")
    try:
        p = run_train([*WIRE, *args, f"hydra.run.dir={run}"], tmp_path, env=srv.env(), timeout=600)
        stats = srv.stats()
    finally:
        out = srv.stop()
    assert p.returncode == 0, p.stderr[-3000:]
    injected = stats["faults"]
    assert sum(injected.values()) >= 8 and {"drop", "poison"} <= set(injected), injected
    assert "faults injected" in out
    result = json.loads((run / "result.json").read_text())
    assert result["recoveries"] >= 1  # the lost model was replaced from a checkpoint
    rows = read_metrics(run)
    assert [(r["step"], r["update"]) for r in rows] == [(s, u) for s in range(3) for u in range(2)]
    assert [r["global_update"] for r in rows] == list(range(6))
    assert_same_rows(read_metrics(ref), rows)
    assert eval_records(ref) == eval_records(run)


def test_group_samples_differ_by_construction_and_rerun_identically(tmp_path):
    """Per-sample requests carry distinct derived seeds: a group's samples differ even where one seeded
    request would repeat itself, and a rerun draws the same tokens; duplicates are measured and warned."""
    import asyncio

    import tinker

    from trainer.backends.local import LocalServiceClient
    from trainer.config.compose import run_config
    from trainer.datums import Rollout
    from trainer.loop import frac_duplicate_in_group
    from trainer.retry import RetryPolicy
    from trainer.rollouts import sample_batch, sample_seed
    from trainer.setup import build_components

    assert len({sample_seed(0, 3, 1, i) for i in range(64)}) == 64
    assert sample_seed(0, 3, 1, 5) == sample_seed(0, 3, 1, 5) != sample_seed(1, 3, 1, 5)
    cfg = run_config(["model=tiny_random", "env=gsm8k", "env.n_examples=4", "env.convo_prefix=none"])
    _, _, task = build_components(cfg)
    sc = LocalServiceClient(state_dir=tmp_path / "engine", sampler_dtype="float32", train_dtype="float32")
    sampler = sc.create_sampling_client(base_model="pairedrl/tiny-random")

    def draw():
        params = tinker.SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1)
        return asyncio.run(sample_batch(task, task.train_problems()[:2], sampler, params, seed=0, step=0,
                                        group_size=4, max_seq_len=512, concurrency=8, retry=RetryPolicy(),
                                        per_sample=True))

    a, b = draw(), draw()
    assert [[r.tokens for r in g] for g in a] == [[r.tokens for r in g] for g in b]
    assert frac_duplicate_in_group(a) == 0.0
    same = [[Rollout(group=0, prompt_tokens=[1], tokens=[5, 6], logprobs=[0.0, 0.0], reward=0.0, metrics={},
                     stop_reason="stop") for _ in range(4)]]
    assert frac_duplicate_in_group(same) == 0.75
    sc.close()


def test_optim_step_is_sent_before_forward_backward_returns(tmp_path):
    """backend.pipeline_optim_step: the loop submits optim_step while forward_backward is still running
    (the client orders them), and the pair's results are those of the unpipelined calls."""
    import tinker

    from trainer.backends.local import LocalServiceClient
    from trainer.datums import Rollout, rollout_to_datum
    from trainer.loop import RLLoop
    from trainer.losses.grpo import GRPOLoss
    from trainer.losses.paths import TwoPassLossPath

    sc = LocalServiceClient(state_dir=tmp_path / "engine", sampler_dtype="float32", train_dtype="float32")
    rollouts = [Rollout(group=0, prompt_tokens=[1, 7, 9, 11], tokens=[20 + i, 30, 40, 2], logprobs=[-3.0] * 4,
                        reward=0.0, metrics={}, stop_reason="stop", advantage=(-1.0) ** i) for i in range(4)]
    mb = [rollout_to_datum(r) for r in rollouts]
    params = tinker.AdamParams(learning_rate=0.01)
    events: list[str] = []

    class Spy:  # the real client; records when each call is submitted and whether forward_backward had finished
        def __init__(self, tc):
            self.tc, self.fb = tc, None

        def forward_backward_custom(self, data, fn):
            self.fb = self.tc.forward_backward_custom(data, fn)
            events.append("fb submitted")
            return self.fb

        def optim_step(self, p):
            events.append("optim submitted" + (" after fb finished" if self.fb.future().done() else ""))
            return self.tc.optim_step(p)

    outs = []
    for pipelined in (True, False):
        loop = RLLoop.__new__(RLLoop)
        tc = sc.create_lora_training_client("pairedrl/tiny-random", rank=4, seed=0)
        loop.tc, call = Spy(tc), TwoPassLossPath(GRPOLoss()).prepare(mb)
        if pipelined:
            fb, opt = loop._fb_then_optim(call, params)
        else:
            fb = loop.tc.forward_backward_custom(call.data, call.loss_fn).result()
            opt = loop.tc.optim_step(params).result()
        outs.append((fb.metrics["loss:sum"], opt.metrics["grad_norm:mean"]))
    assert events[:2] == ["fb submitted", "optim submitted"]
    assert events[2:] == ["fb submitted", "optim submitted after fb finished"]
    assert outs[0] == pytest.approx(outs[1], rel=1e-6)
    sc.close()


def test_the_readme_names_every_pin_the_rehearsal_test_needs():
    """README's rehearsal paragraph lists exactly what `test_wire_run_equals_in_process_run` pins: the
    server's fp32 flags and the model's LoRA alpha, the local run's fp32 overrides, the request split."""
    import yaml

    text = " ".join((ROOT / "README.md").read_text().split())
    flags = dict(zip(ENGINE[::2], ENGINE[1::2]))
    assert yaml.safe_load((ROOT / "conf" / "model" / "tiny_random.yaml").read_text())["lora_alpha"] == float(
        flags["--lora-alpha"])
    assert "--lora-alpha A` (A = the model config's `lora_alpha`" in text
    for pin in [f"{k} {v}" for k, v in flags.items() if k != "--lora-alpha"] + LOCAL[len(ARGS):] + SPLIT_PIN:
        assert pin in text, pin


def test_a_groups_tokens_depend_on_how_it_is_split_into_requests(tmp_path):
    """Why the rehearsal pins the split: one seeded request for a group draws one stream shared by its
    samples, so the same group sent as one request per sample (seeded per sample, the wire's `auto`) gets
    other tokens, while each split alone reruns identically."""
    import asyncio

    import tinker

    from trainer.backends.local import LocalServiceClient
    from trainer.config.compose import run_config
    from trainer.retry import RetryPolicy
    from trainer.rollouts import sample_batch
    from trainer.setup import build_components

    cfg = run_config(["model=tiny_random", "env=gsm8k", "env.n_examples=4", "env.convo_prefix=none"])
    _, _, task = build_components(cfg)
    sc = LocalServiceClient(state_dir=tmp_path / "engine", sampler_dtype="float32", train_dtype="float32")
    sampler = sc.create_sampling_client(base_model="pairedrl/tiny-random")

    def draw(per_sample: bool) -> list:
        params = tinker.SamplingParams(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1)
        groups = asyncio.run(sample_batch(task, task.train_problems()[:2], sampler, params, seed=0, step=0,
                                          group_size=4, max_seq_len=512, concurrency=8, retry=RetryPolicy(),
                                          per_sample=per_sample))
        return [[r.tokens for r in g] for g in groups]

    per_group, per_sample = draw(False), draw(True)
    assert draw(False) == per_group and draw(True) == per_sample
    assert per_group != per_sample
    sc.close()


def _readme_rehearsal() -> tuple[list[str], list[str]]:
    """The README's offline rehearsal as written: the server's flags and train.py's overrides."""
    import shlex

    lines = (ROOT / "README.md").read_text().splitlines()
    serve = next(ln for ln in lines if ln.startswith("python -m trainer.serve "))
    train = next(ln for ln in lines if ln.startswith("python train.py backend=tinker schedule=smoke"))
    serve_args = shlex.split(serve.split("&")[0])[3:]
    return serve_args, shlex.split(train, comments=True)[2:]


def test_the_readme_rehearsal_tells_the_server_the_default_models_lora_alpha():
    """The protocol does not carry `lora_alpha`: the rehearsal's server flag must be the model's, or every
    LoRA update it trains is scaled wrong."""
    import yaml

    serve_args, train_args = _readme_rehearsal()
    model = next((a.split("=", 1)[1] for a in train_args if a.startswith("model=")), "smollm2_135m")
    alpha = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())["lora_alpha"]
    assert float(serve_args[serve_args.index("--lora-alpha") + 1]) == alpha


@pytest.mark.slow
def test_the_readme_rehearsal_trains(tmp_path):
    """The README's rehearsal block, run as written against the server it starts, trains: some update has a
    non-zero reward and gradient norm (a rehearsal whose every gradient is 0 never exercises the training
    path), and the paired eval before and after is written."""
    serve_args, train_args = _readme_rehearsal()
    server = Server(tmp_path / "state", engine=serve_args)
    try:
        run = tmp_path / "run"
        p = run_train([*train_args, f"hydra.run.dir={run}"], tmp_path, env=server.env(), timeout=900)
        assert p.returncode == 0, p.stderr[-3000:]
    finally:
        server.stop()
    rows = read_metrics(run)
    assert any(r["env/reward_mean"] > 0 and r["optim/grad_norm"] > 0 for r in rows), rows
    result = json.loads((run / "result.json").read_text())
    assert result["eval_vs_start"]["n"] == 32, result["eval_vs_start"]
