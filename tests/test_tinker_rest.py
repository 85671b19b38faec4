"""The Tinker REST surface and the `tinker` CLI, unmodified (tinker 0.38), against `python -m trainer.serve`.

One server subprocess on loopback serves the whole module (tiny model, TTL sweeper every 0.3 s); every call
goes through the SDK's `ServiceClient` / `RestClient` or the CLI (`python -m tinker.cli`), as a user's program
would. Each test names the SDK calls it shows working through `covers`; the compatibility table in
docs/tinker.md is generated from those marks and from the calls `tinker_compat.observe` makes against this
module's server (refusals, options, the CLI: each row as it happened), and
`test_compatibility_table_is_current` fails when the doc, the marks, the server's answers or the SDK's
public surface drift apart (`python tests/tinker_compat.py` rewrites it).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_tinker_wire import ROOT, Server  # noqa: E402

TINY = "pairedrl/tiny-random"
KEY, OTHER = "tml-rest-a", "tml-rest-b"
DOC = ROOT / "docs" / "tinker.md"
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"

# SDK call -> (status, where / why), filled by @covers as the module is imported
COMPAT: dict[str, tuple[str, str]] = {}


def covers(*calls: str, refused: str | None = None):
    """Mark a test as the evidence for `calls` (supported, or refused with the reason given)."""
    def mark(fn):
        for c in calls:
            COMPAT[c] = ("refused", refused) if refused else ("supported", f"`{fn.__name__}`")
        return fn
    return mark


# calls whose evidence lives in another test module of this repository, or that never reach a server
ELSEWHERE = {
    "SamplingClient.create": ("client-side", "the SDK's internal constructor (takes its connection holder); "
                                             "`create_sampling_client` calls it"),
    "ServiceClient.get_console_url": ("client-side", "builds a web-console URL; no request"),
    "TrainingClient.get_console_url": ("client-side", "builds a web-console URL; no request"),
    "ServiceClient.get_telemetry": ("client-side", "telemetry off (TINKER_TELEMETRY=0); the server accepts "
                                                   "and drops /telemetry"),
    "TrainingClient.get_telemetry": ("client-side", "as ServiceClient.get_telemetry"),
    "SamplingClient.get_telemetry": ("client-side", "as ServiceClient.get_telemetry"),
    "RestClient.get_telemetry": ("client-side", "as ServiceClient.get_telemetry"),
    "SamplingClient.on_queue_state_change": ("client-side", "a callback hook of the SDK's queue"),
    "tinker checkpoint push-hf": ("needs the network", "uploads a download to the Hugging Face hub"),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("rest_state"), "--ttl-sweep-s", "0.3")
    s.state_dir = Path(s.proc.args[s.proc.args.index("--state-dir") + 1])
    yield s
    s.stop()


def _env(server: Server, key: str = KEY) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return {**env, **server.env(), "TINKER_API_KEY": key, "NO_PROXY": "127.0.0.1,localhost",
            "HF_HUB_OFFLINE": "1"}


@pytest.fixture(scope="module")
def sdk(server):
    """(ServiceClient, RestClient) for KEY; a training run with one state and one sampler checkpoint."""
    import tinker

    sc = tinker.ServiceClient(api_key=KEY, base_url=server.url)
    rc = sc.create_rest_client()
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0,
                                       user_metadata={"renderer": "qwen3_instruct"}).result()
    yield sc, rc, tc
    sc.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server


def _rest(server: Server, key: str):
    import tinker

    return tinker.RestClient(api_key=key, base_url=server.url)


def _cli(server: Server, *args: str, key: str = KEY, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tinker.cli", *args], env=_env(server, key), cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def _datum(n: int = 6):
    from tinker import types

    toks = list(range(5, 5 + n))
    return [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * (n - 1)})]


# ----------------------------------------------------------------------------- paths
@covers("TrainingClient.save_state", "TrainingClient.save_weights_for_sampler", "TrainingClient.forward",
        "TrainingClient.forward_backward", "TrainingClient.optim_step", "ServiceClient.create_lora_training_client",
        "TrainingClient.get_info", "ServiceClient.create_training_client_from_state", "TrainingClient.load_state",
        "ServiceClient.create_sampling_client", "TrainingClient.create_sampling_client", "SamplingClient.sample",
        "SamplingClient.get_base_model", "TrainingClient.save_weights_and_get_sampling_client")
def test_every_returned_path_parses_with_the_sdk_and_loads(server, sdk):
    from tinker import types

    sc, rc, tc = sdk
    tc.forward_backward(_datum(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert tc.forward(_datum(), "cross_entropy").result().loss_fn_outputs
    state = tc.save_state("s1").result().path
    sampler = tc.save_weights_for_sampler("w1").result().path
    run_id = tc.get_info().model_id
    for path, kind, cid in ((state, "training", "weights/s1"), (sampler, "sampler", "sampler_weights/w1")):
        p = types.ParsedCheckpointTinkerPath.from_tinker_path(path)
        assert (p.training_run_id, p.checkpoint_type, p.checkpoint_id) == (run_id, kind, cid)
        assert (server.state_dir / run_id / cid / "meta.json").is_file()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    live = tc.save_weights_and_get_sampling_client().sample(prompt, 1, params).result().sequences[0].tokens
    assert sc.create_sampling_client(model_path=sampler).result().sample(prompt, 1, params).result().sequences[0].tokens == live
    assert tc.create_sampling_client(sampler).result().get_base_model() == TINY
    loaded = sc.create_training_client_from_state(state).result()
    assert loaded.get_info().model_id != run_id
    loaded.load_state(state).result()
    assert rc.get_training_run(loaded.get_info().model_id).result().training_run_id == loaded.get_info().model_id


def test_load_paths_outside_the_state_dir_get_a_4xx_that_says_nothing_about_files(server, sdk, tmp_path):
    import tinker

    sc, _, tc = sdk
    real = tc.save_state("confine").result().path
    run_id = tc.get_info().model_id
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (server.state_dir / run_id / "weights" / "escape").symlink_to(server.state_dir / run_id / "weights" / "confine")
    bad = {f"tinker://local{outside}/r/weights/x": "copy the checkpoint folder",  # the old form, outside
           f"tinker://{run_id}/weights/..": "checkpoint name must be",
           f"tinker://{run_id}/weights/missing": "no checkpoint",
           "tinker://local/etc/passwd": "copy the checkpoint folder"}
    for path, says in bad.items():
        with pytest.raises((tinker.BadRequestError, tinker.NotFoundError), match=re.escape(says)):
            sc.create_sampling_client(model_path=path).result().sample(
                tinker.types.ModelInput.from_ints([5]), 1, tinker.types.SamplingParams(max_tokens=1)).result()
    # a symlink inside that stays inside loads; the same name pointing outside is refused like a missing one
    assert sc.create_sampling_client(model_path=f"tinker://{run_id}/weights/escape").result().get_base_model() == TINY
    (server.state_dir / run_id / "weights" / "escape").unlink()
    (server.state_dir / run_id / "weights" / "escape").symlink_to(outside)
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        sc.create_training_client_from_state(f"tinker://{run_id}/weights/escape").result()
    # another key may not load this key's checkpoint (same answer as a missing one) until it is published
    other = tinker.ServiceClient(api_key=OTHER, base_url=server.url)
    try:
        with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
            other.create_training_client_from_state(real).result()
    finally:
        other.close("success").result(timeout=30)  # waited: else its heartbeat outlives the server


@covers("ServiceClient.create_custom_loss", "TrainingClient.forward_backward_custom",
        "SamplingClient.compute_logprobs", "SamplingClient.from_sampler_handle",
        "TrainingClient.load_state_with_optimizer", "ServiceClient.create_training_client_from_state_with_optimizer")
def test_the_rest_of_the_training_surface(server, sdk):
    """Custom loss both ways (a callable runs client-side in two passes, a handle on the server: the same
    value), a sampler rebuilt from its handle, and a resume with the optimizer state (the step count)."""
    import tinker
    import torch
    from tinker import types

    sc, _, tc = sdk

    def nll(logprobs: torch.Tensor, weights: torch.Tensor):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/nll:sum": loss}

    handle = sc.create_custom_loss(nll, {"logprobs": 1, "weights": 1}).result()
    by_handle = tc.forward_backward_custom(_datum(), handle).result().metrics["loss:sum"]
    ref = -tc.forward(_datum(), "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch().sum().item()
    by_callable = tc.forward_backward_custom(
        _datum(), lambda data, lps: (-(lps[0] * torch.tensor(data[0].loss_fn_inputs["weights"].data)).sum(), {})
    ).result().metrics["loss:sum"]
    assert by_handle == pytest.approx(ref, rel=1e-4) and by_callable == pytest.approx(ref, rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    again = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=KEY)
    assert again.compute_logprobs(prompt).result() == sampler.compute_logprobs(prompt).result()
    state = tc.save_state("with-opt").result().path
    steps = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optim_steps:max"]
    resumed = sc.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optim_steps:max"] == steps
    fresh = sc.create_lora_training_client(TINY, rank=4, seed=1).result()
    fresh.load_state_with_optimizer(state).result()
    assert fresh.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["optim_steps:max"] == steps


@covers("SamplingClient.compute_logprobs(prompt_logprobs_last_n)",
        "SamplingClient.sample(include_prompt_logprobs, prompt_logprobs_last_n)")
def test_prompt_logprobs_last_n_is_the_tail_of_the_full_scoring(server, sdk, tmp_path):
    """`prompt_logprobs_last_n=n`: the last n entries are the full scoring's, earlier ones None
    (`SamplingClient.compute_logprobs` / `sample` docstrings); n outside [1, len(prompt) - 1] is refused."""
    import tinker
    from tinker import types

    _, _, tc = sdk
    sampler = tc.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints([5, 9, 14, 3, 27, 8])
    full = sampler.compute_logprobs(prompt).result()
    assert full[0] is None and all(v is not None for v in full[1:])
    for n in (1, 3, 5):
        assert sampler.compute_logprobs(prompt, prompt_logprobs_last_n=n).result() == [None] * (6 - n) + full[-n:]
        got = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                             prompt_logprobs_last_n=n).result().prompt_logprobs
        assert got[:6 - n] == [None] * (6 - n) and got[-n:] == pytest.approx(full[-n:], abs=1e-6)
    # in-process (backend=local) the engine's own compute_logprobs answers the same
    from trainer.backends.local import LocalServiceClient

    with LocalServiceClient(state_dir=tmp_path, sampler_dtype="float32",
                            train_dtype="float32") as local:
        base = local.create_sampling_client(base_model=TINY)
        whole = base.compute_logprobs(prompt).result()
        assert base.compute_logprobs(prompt, prompt_logprobs_last_n=2).result() == [None] * 4 + whole[-2:]
        with pytest.raises(ValueError, match="prompt_logprobs_last_n must be"):
            base.compute_logprobs(prompt, prompt_logprobs_last_n=0).result()
    # 0 the SDK itself refuses; len(prompt) the engine does
    with pytest.raises(tinker.TinkerError, match=r"prompt_logprobs_last_n must be an int in \[1, len\(prompt\) - 1"):
        sampler.compute_logprobs(prompt, prompt_logprobs_last_n=6).result()


@covers("SamplingClient.sample(topk_prompt_logprobs)")
def test_topk_prompt_logprobs_match_a_float64_reference(server, sdk):
    """Top-k prompt logprobs of the base model over the wire against the HF model's float64 log-softmax:
    row i is the distribution that scored prompt token i (aligned with `prompt_logprobs`), row 0 the SDK's
    empty row; with `prompt_logprobs_last_n` the rows before the last n are empty too."""
    import torch
    from tinker import types

    from trainer.model_registry import resolve_base_model

    sc, _, _ = sdk
    sampler = sc.create_sampling_client(base_model=TINY).result()
    toks = [5, 9, 14, 3, 27, 8, 40]
    prompt, k = types.ModelInput.from_ints(toks), 4
    resp = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          topk_prompt_logprobs=k).result()
    rows = resp.topk_prompt_logprobs
    assert len(rows) == len(toks) and rows[0] is None and all(len(r) == k for r in rows[1:])
    factory, _ = resolve_base_model(TINY)
    with torch.no_grad():
        ref = torch.log_softmax(factory(torch.float64)(torch.tensor([toks])).logits[0].double(), -1)
    for i in range(1, len(toks)):
        want = torch.topk(ref[i - 1], k)
        got_ids, got_lps = zip(*rows[i])
        assert list(got_lps) == pytest.approx(want.values.tolist(), abs=2e-4), i
        gaps = (want.values[:-1] - want.values[1:]).tolist()
        for j, tok in enumerate(want.indices.tolist()):  # ids in order wherever the ranks are not near-tied
            if (j == 0 or gaps[j - 1] > 1e-3) and (j == k - 1 or gaps[j] > 1e-3):
                assert got_ids[j] == tok, (i, j)
        lp = resp.prompt_logprobs[i]
        if toks[i] in got_ids:  # the scored token's own logprob agrees with prompt_logprobs
            assert dict(rows[i])[toks[i]] == pytest.approx(lp, abs=1e-4)
        assert lp == pytest.approx(ref[i - 1, toks[i]].item(), abs=2e-4)
    tail = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                          topk_prompt_logprobs=k, prompt_logprobs_last_n=2).result().topk_prompt_logprobs
    assert tail[:5] == [None] * 5 and tail[5:] == rows[5:]


def test_topk_prompt_rows_computed_in_chunks_equal_one_pass(tmp_path, monkeypatch):
    """`prompt_topk` runs the head over TOPK_ROWS positions at a time (memory); chunk edges change nothing."""
    import numpy as np
    from tinker import types

    from trainer.backends.local import LocalServiceClient, sampler_forward

    prompt = types.ModelInput.from_ints(list(range(5, 45)))
    with LocalServiceClient(state_dir=tmp_path, sampler_dtype="float32", train_dtype="float32") as local:
        s = local.create_sampling_client(base_model=TINY)
        def topk():
            return s.sample(prompt, 1, types.SamplingParams(max_tokens=1),
                            topk_prompt_logprobs=3).result().topk_prompt_logprobs_np
        whole = topk()
        monkeypatch.setattr(sampler_forward, "TOPK_ROWS", 7)
        chunked = topk()
    assert np.array_equal(whole.token_ids, chunked.token_ids) and np.array_equal(whole.logprobs, chunked.logprobs)
    assert (whole.token_ids[1:] != 0).all()


# ----------------------------------------------------------------------------- training runs
@covers("RestClient.list_training_runs", "RestClient.get_training_run", "RestClient.get_training_run_by_tinker_path",
        "RestClient.list_checkpoints", "RestClient.list_user_checkpoints", "RestClient.get_weights_info_by_tinker_path")
def test_runs_and_checkpoints_listed_for_their_owner_only(server, sdk):
    import tinker

    _, rc, tc = sdk
    path = tc.save_state("listed", ttl_seconds=7200).result().path
    run_id = tc.get_info().model_id
    run = rc.get_training_run(run_id).result()
    assert run.base_model == TINY and run.lora_rank == 4 and run.user_metadata == {"renderer": "qwen3_instruct"}
    assert rc.get_training_run_by_tinker_path(path).result().training_run_id == run_id
    ids = [c.checkpoint_id for c in rc.list_checkpoints(run_id).result().checkpoints]
    assert "weights/listed" in ids
    ck = next(c for c in rc.list_checkpoints(run_id).result().checkpoints if c.checkpoint_id == "weights/listed")
    assert ck.tinker_path == path and ck.size_bytes > 0 and ck.expires_at is not None
    assert 7000 < ck.expires_at.timestamp() - time.time() <= 7200
    info = rc.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.lora_rank, info.is_lora, info.train_unembed) == (TINY, 4, True, True)
    # pagination: pages of one cover every run exactly once; total_count is the owner's run count
    first = rc.list_training_runs(limit=1, offset=0).result()
    total = first.cursor.total_count
    pages = [rc.list_training_runs(limit=1, offset=i).result().training_runs for i in range(total)]
    assert all(len(p) == 1 for p in pages) and len({p[0].training_run_id for p in pages}) == total
    assert run_id in {p[0].training_run_id for p in pages}
    user = rc.list_user_checkpoints(limit=500).result()
    assert path in {c.tinker_path for c in user.checkpoints}
    # another key sees none of it, and gets the SDK's not-found error for the ids
    other = _rest(server, OTHER)
    assert run_id not in {r.training_run_id for r in other.list_training_runs().result().training_runs}
    assert path not in {c.tinker_path for c in other.list_user_checkpoints().result().checkpoints}
    for call in (lambda: other.get_training_run(run_id), lambda: other.list_checkpoints(run_id),
                 lambda: other.get_weights_info_by_tinker_path(path),
                 lambda: rc.get_training_run("no-such-run"), lambda: rc.list_checkpoints("no-such-run")):
        with pytest.raises(tinker.NotFoundError):
            call().result()


@covers("RestClient.delete_checkpoint_from_tinker_path", "RestClient.delete_checkpoint")
def test_a_deleted_checkpoint_leaves_the_listing_and_the_disk(server, sdk):
    import tinker

    _, rc, tc = sdk
    run_id = tc.get_info().model_id
    path = tc.save_state("doomed").result().path
    folder = server.state_dir / run_id / "weights" / "doomed"
    assert folder.is_dir()
    with pytest.raises(tinker.NotFoundError):  # another key cannot delete it, and learns nothing
        _rest(server, OTHER).delete_checkpoint_from_tinker_path(path).result()
    assert folder.is_dir()
    rc.delete_checkpoint_from_tinker_path(path).result()
    assert not folder.exists()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".deleted")]
    assert path not in {c.tinker_path for c in rc.list_checkpoints(run_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rc.delete_checkpoint_from_tinker_path(path).result()
    p2 = tc.save_weights_for_sampler("doomed2").result().path
    rc.delete_checkpoint(run_id, "sampler_weights/doomed2").result()
    assert p2 not in {c.tinker_path for c in rc.list_checkpoints(run_id).result().checkpoints}


@covers("RestClient.set_checkpoint_ttl_from_tinker_path")
def test_expired_ttl_deletes_the_checkpoint(server, sdk):
    import tinker

    _, rc, tc = sdk
    run_id = tc.get_info().model_id
    by_save = tc.save_state("short", ttl_seconds=1).result().path
    by_rest = tc.save_weights_for_sampler("later").result().path
    kept = tc.save_state("kept", ttl_seconds=1).result().path
    rc.set_checkpoint_ttl_from_tinker_path(by_rest, 1).result()
    rc.set_checkpoint_ttl_from_tinker_path(kept, None).result()  # removing a TTL keeps it
    with pytest.raises(tinker.BadRequestError):
        rc.set_checkpoint_ttl_from_tinker_path(kept, -5).result()
    deadline = time.time() + 20
    gone = [server.state_dir / run_id / "weights" / "short", server.state_dir / run_id / "sampler_weights" / "later"]
    while time.time() < deadline and any(g.exists() for g in gone):
        time.sleep(0.2)
    assert not any(g.exists() for g in gone)
    assert (server.state_dir / run_id / "weights" / "kept").is_dir()
    listed = {c.tinker_path for c in rc.list_checkpoints(run_id).result().checkpoints}
    assert kept in listed and by_save not in listed and by_rest not in listed


@covers("RestClient.publish_checkpoint_from_tinker_path", "RestClient.unpublish_checkpoint_from_tinker_path")
def test_publish_lets_another_key_load_and_unpublish_takes_it_back(server, sdk):
    import tinker

    _, rc, tc = sdk
    path = tc.save_state("shared").result().path
    other = _rest(server, OTHER)
    rc.publish_checkpoint_from_tinker_path(path).result()
    ck = next(c for c in rc.list_checkpoints(tc.get_info().model_id).result().checkpoints if c.tinker_path == path)
    assert ck.public
    assert other.get_weights_info_by_tinker_path(path).result().base_model == TINY
    assert other.get_training_run_by_tinker_path(path, access_scope="accessible").result().base_model == TINY
    rc.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        other.get_weights_info_by_tinker_path(path).result()


# ----------------------------------------------------------------------------- sessions
@covers("RestClient.list_sessions", "RestClient.get_session", "RestClient.get_sampler",
        "SamplingClient.get_sampler_handle")
def test_sessions_list_their_runs_and_samplers(server, sdk):
    import tinker

    sc, rc, tc = sdk
    sampler = tc.save_weights_and_get_sampling_client()
    sessions = rc.list_sessions().result().sessions
    assert sessions
    found = [rc.get_session(s).result() for s in sessions]
    mine = next(f for f in found if tc.get_info().model_id in f.training_run_ids)
    assert mine.sampler_ids
    sid = mine.sampler_ids[-1]
    assert rc.get_sampler(sid).result().base_model == TINY
    assert sampler.get_sampler_handle() is not None
    assert not set(sessions) & set(_rest(server, OTHER).list_sessions().result().sessions)
    with pytest.raises(tinker.NotFoundError):
        _rest(server, OTHER).get_session(sessions[0]).result()
    with pytest.raises(tinker.NotFoundError):
        rc.get_session("s-nope").result()


# ----------------------------------------------------------------------------- download
@covers("TrainingClient.save_weights_external", "RestClient.get_external_weights_urls")
def test_external_weights_are_a_peft_adapter_of_the_same_factors(server, sdk, tmp_path):
    import urllib.request

    import torch
    from safetensors.torch import load_file

    _, rc, tc = sdk
    state = tc.save_state("for-export").result().path
    ext = tc.save_weights_external("export").result().path
    assert ext == f"tinker://{tc.get_info().model_id}/external_weights/export"
    urls = rc.get_external_weights_urls(ext).result().urls
    assert set(urls) == {"adapter_config.json", "adapter_model.safetensors"}
    for name, url in urls.items():
        assert url.startswith(server.url + "/files/")
        (tmp_path / name).write_bytes(urllib.request.urlopen(url, timeout=30).read())
    # a URL with its signature altered or another file's name is refused
    bad = urls["adapter_config.json"].replace("sig=", "sig=0")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=30)
    assert e.value.code == 403
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["peft_type"], cfg["r"], cfg["base_model_name_or_path"]) == ("LORA", 4, TINY)
    peft_tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    run_id = tc.get_info().model_id
    own = load_file(str(server.state_dir / run_id / "weights" / "for-export" / "adapter.safetensors"))
    assert len(peft_tensors) == len(own) > 0
    for key, t in own.items():
        module, ab = key.rsplit(".", 1)
        assert torch.equal(peft_tensors[f"base_model.model.{module}.{ab}.weight"], t), key
    assert state


@covers("tinker checkpoint list", "tinker run list", "tinker checkpoint info", "tinker checkpoint download",
        "tinker run info", "tinker checkpoint set-ttl", "tinker checkpoint delete", "tinker model list",
        "tinker checkpoint publish", "tinker checkpoint unpublish")
def test_cli_lists_shows_downloads_and_deletes(server, sdk, tmp_path):
    _, rc, tc = sdk
    run_id = tc.get_info().model_id
    path = tc.save_state("cli").result().path
    for args in (["checkpoint", "list"], ["run", "list"], ["checkpoint", "list", "--run-id", run_id],
                 ["checkpoint", "info", path], ["run", "info", run_id]):
        c = _cli(server, "--format", "json", *args)
        assert c.returncode == 0, (args, c.stdout[-1000:], c.stderr[-2000:])
        assert run_id in c.stdout, args
    c = _cli(server, "checkpoint", "download", path, "--output", str(tmp_path))
    assert c.returncode == 0, (c.stdout[-1000:], c.stderr[-2000:])
    out = tmp_path / path.replace("tinker://", "").replace("/", "_")
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # the temporary export the CLI made was deleted through the REST surface
    assert not (server.state_dir / run_id / "external_weights" / "download").exists() or not [
        c for c in rc.list_user_checkpoints(limit=1000).result().checkpoints if c.checkpoint_id.endswith("/download")]
    c = _cli(server, "--format", "json", "model", "list")
    assert c.returncode == 0 and TINY in c.stdout, c.stderr[-2000:]
    for verb, public in (("publish", True), ("unpublish", False)):
        c = _cli(server, "checkpoint", verb, path)
        assert c.returncode == 0, c.stderr[-2000:]
        assert next(k for k in rc.list_checkpoints(run_id).result().checkpoints if k.tinker_path == path).public == public
    c = _cli(server, "checkpoint", "set-ttl", path, "--ttl", "3600")
    assert c.returncode == 0, c.stderr[-2000:]
    c = _cli(server, "checkpoint", "delete", path, "--yes")
    assert c.returncode == 0, c.stderr[-2000:]
    assert not (server.state_dir / run_id / "weights" / "cli").exists()
    c = _cli(server, "checkpoint", "info", f"tinker://{run_id}/weights/nope")
    assert c.returncode != 0 and "not found" in (c.stdout + c.stderr).lower()


def test_downloaded_adapter_loads_with_peft_and_matches_the_engine(server, sdk, tmp_path):
    """`tinker checkpoint download` writes an adapter PEFT loads onto the base model, and the result computes
    the logprobs the server computes for the same checkpoint."""
    import torch
    from peft import PeftModel
    from tinker import types

    from trainer.model_registry import resolve_base_model

    _, _, tc = sdk
    tc.forward_backward(_datum(), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_state("peft-check").result().path
    c = _cli(server, "checkpoint", "download", path, "--output", str(tmp_path))
    assert c.returncode == 0, c.stderr[-2000:]
    folder = tmp_path / path.replace("tinker://", "").replace("/", "_")
    factory, _ = resolve_base_model(TINY)
    model = PeftModel.from_pretrained(factory().float(), str(folder)).eval()
    d = _datum()[0]
    toks = d.model_input.to_ints()
    with torch.no_grad():
        logits = model(torch.tensor([toks])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[torch.arange(len(toks)), torch.tensor(d.loss_fn_inputs["target_tokens"].data)]
    served = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    assert torch.allclose(ref, served.float(), atol=1e-4), (ref, served)


def test_bad_ids_and_parameters_get_4xx_never_5xx(server, sdk):
    """Every management route, with ids that do not exist, escape, or are malformed, and with bad query
    parameters and bodies: a 4xx with a JSON `detail`, and nothing on disk changes."""
    import httpx

    _, _, tc = sdk
    run_id = tc.get_info().model_id
    tc.save_state("probe").result()
    before = sorted(str(p) for p in server.state_dir.rglob("*") if ".run.json" not in p.name)
    ck = f"/api/v1/training_runs/{run_id}/checkpoints"
    cases = [
        ("GET", "/api/v1/training_runs?limit=0"), ("GET", "/api/v1/training_runs?limit=abc"),
        ("GET", "/api/v1/training_runs?offset=-1"), ("GET", "/api/v1/training_runs?access_scope=all"),
        ("GET", "/api/v1/training_runs/nope"), ("GET", "/api/v1/training_runs/..%2F.."),
        ("GET", "/api/v1/training_runs/nope/checkpoints"), ("GET", "/api/v1/checkpoints?limit=100000"),
        ("DELETE", f"{ck}/weights/nope"), ("DELETE", f"{ck}/weights/..%2F..%2Fx"), ("DELETE", f"{ck}/bogus/probe"),
        ("DELETE", f"{ck}/weights/.hidden"), ("PUT", f"{ck}/weights/probe/ttl"), ("PUT", f"{ck}/weights/nope/ttl"),
        ("POST", f"{ck}/weights/nope/publish"), ("GET", f"{ck}/weights/probe/external_weights_urls"),
        ("GET", f"{ck}/external_weights/nope/external_weights_urls"), ("POST", "/api/v1/weights_info"),
        ("GET", "/api/v1/sessions/nope"), ("GET", "/api/v1/sessions?limit=-3"),
        ("GET", f"/files/{run_id}/probe/adapter_config.json"), ("GET", f"/files/{run_id}/probe/meta.json?exp=1&sig=x"),
    ]
    bodies = {("PUT", f"{ck}/weights/probe/ttl"): b"not json", ("POST", "/api/v1/weights_info"): b'{"x": 1}'}
    for method, path in cases:
        r = httpx.request(method, server.url + path, headers={"X-API-Key": KEY}, timeout=30,
                          content=bodies.get((method, path)))
        assert 400 <= r.status_code < 500, (method, path, r.status_code, r.text[:300])
        assert "detail" in r.json(), (method, path, r.text[:300])
    r = httpx.put(server.url + f"{ck}/weights/probe/ttl", headers={"X-API-Key": KEY}, json={"ttl_seconds": "1"})
    assert r.status_code == 400
    after = sorted(str(p) for p in server.state_dir.rglob("*") if ".run.json" not in p.name)
    assert after == before


# ----------------------------------------------------------------------------- offline tokenizers
_TOKENIZE = """
import json, sys, tinker
from tinker_cookbook.tokenizer_utils import get_tokenizer
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(sys.argv[1], rank=2).result()
text = "What is 12 + 7? <|im_end|>"
print(json.dumps([get_tokenizer(sys.argv[1]).encode(text, add_special_tokens=False),
                  tc.get_tokenizer().encode(text, add_special_tokens=False),
                  tc.save_weights_and_get_sampling_client().get_tokenizer().encode(text, add_special_tokens=False)]))
sc.close("success")
"""


@covers("TrainingClient.get_tokenizer", "SamplingClient.get_tokenizer")
def test_print_env_lets_the_sdk_and_the_cookbook_load_tokenizers_offline(server, tmp_path):
    """`--print-env` seeds a hub cache; with its exports the SDK's `get_tokenizer()` and the cookbook's
    `get_tokenizer(model_name)` load the engine's own tokenizer with the network off. An empty HF_HOME is
    the control: the same program fails there."""
    from trainer.model_registry import resolve_tokenizer

    out = subprocess.run([sys.executable, "-m", "trainer.serve", "--print-env", "--hf-home", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=300, env=_env(server))
    assert out.returncode == 0, out.stderr[-2000:]
    exports = dict(kv.split("=", 1) for line in out.stdout.splitlines() if line.startswith("export ")
                   for kv in line.split("#")[0].split()[1:])
    assert exports["HF_HOME"] == str(tmp_path / "hf") and exports["HF_HUB_OFFLINE"] == "1"
    assert "renderer_name=qwen3_instruct" in out.stdout
    expected = resolve_tokenizer(TINY).encode("What is 12 + 7? <|im_end|>", add_special_tokens=False)
    env = {**_env(server), "HF_HOME": exports["HF_HOME"], "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", _TOKENIZE, TINY], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == [expected] * 3
    empty = subprocess.run([sys.executable, "-c", _TOKENIZE, TINY], capture_output=True, text=True, timeout=300,
                           env={**env, "HF_HOME": str(tmp_path / "empty")})
    assert empty.returncode != 0 and "OSError" in empty.stderr


@pytest.mark.slow
@covers("tinker_cookbook.recipes.math_rl.train env=arithmetic (run, then resume)")
def test_cookbook_math_rl_arithmetic_runs_and_resumes_unmodified(server, tmp_path):
    """The recipe as shipped, as docs/tinker.md runs it: two steps with checkpoints, then a resume to a third
    step from the same log dir (which reads the run's `user_metadata` through the REST surface)."""
    hf = subprocess.run([sys.executable, "-m", "trainer.serve", "--print-env", "--hf-home", str(tmp_path / "hf")],
                        capture_output=True, text=True, timeout=300, env=_env(server))
    assert hf.returncode == 0, hf.stderr[-2000:]
    env = {**_env(server), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "disabled"}
    log = tmp_path / "math_rl"
    common = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={TINY}",
              "renderer_name=qwen3_instruct", "env=arithmetic", "group_size=2", "groups_per_batch=2",
              "max_tokens=8", "eval_every=0", "save_every=1", "lora_rank=4", f"log_path={log}"]
    first = subprocess.run([*common, "max_steps=2", "behavior_if_log_dir_exists=delete"], capture_output=True,
                           text=True, timeout=900, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()]
    from tinker import types

    for rec in saved:
        for k in ("state_path", "sampler_path"):
            if rec.get(k):
                types.ParsedCheckpointTinkerPath.from_tinker_path(rec[k])
    second = subprocess.run([*common, "max_steps=3", "behavior_if_log_dir_exists=resume"], capture_output=True,
                            text=True, timeout=900, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Could not fetch renderer metadata" not in second.stderr + second.stdout
    batches = [json.loads(line).get("progress/batch") for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert sorted(b for b in batches if b is not None) == [0, 1, 2]  # resumed at batch 2, nothing redone
    last = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    run = _rest(server, KEY).get_training_run_by_tinker_path(last["state_path"]).result()
    assert "qwen3_instruct" in (run.user_metadata or {}).values()
    assert last["state_path"] in {c.tinker_path for c in _rest(server, KEY).list_checkpoints(
        run.training_run_id).result().checkpoints}


@pytest.mark.slow
@covers("tinker_cookbook 0.6.1 recipes.math_rl.train env=arithmetic loss_fn=importance_sampling (run, then resume)")
def test_cookbook_061_math_rl_runs_with_importance_sampling_and_names_the_workaround(server, tmp_path):
    """tinker-cookbook 0.6.1 (installed with --no-deps into a throwaway folder: it wants tml-renderers>=0.4.1,
    which its math_rl recipe with a ChatML renderer never imports). Its default loss, `stable_reinforce`,
    samples with `record_stability_info=True` and sends provenance spans, which the server takes; the loss
    itself is refused, and the run stops with the server's reason naming the workaround. With
    `loss_fn=importance_sampling` it runs two steps and resumes to a third, unmodified."""
    target = tmp_path / "cookbook-0.6.1"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target),
                          "tinker-cookbook==0.6.1"], capture_output=True, text=True, timeout=300, check=False)
    if pip.returncode != 0:
        pytest.skip(f"tinker-cookbook 0.6.1 cannot be installed here: {pip.stderr.strip()[-300:]}")
    hf = subprocess.run([sys.executable, "-m", "trainer.serve", "--print-env", "--hf-home", str(tmp_path / "hf")],
                        capture_output=True, text=True, timeout=300, env=_env(server), check=False)
    assert hf.returncode == 0, hf.stderr[-2000:]
    env = {**_env(server), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "WANDB_MODE": "disabled", "PYTHONPATH": os.pathsep.join([str(target), str(ROOT / "src")])}
    probe = subprocess.run([sys.executable, "-c", "import tinker_cookbook; print(tinker_cookbook.__version__)"],
                           capture_output=True, text=True, env=env, timeout=60, check=False)
    assert probe.stdout.strip() == "0.6.1", probe.stderr[-1000:]
    log = tmp_path / "math_rl"
    common = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"model_name={TINY}",
              "renderer_name=qwen3_instruct", "env=arithmetic", "group_size=2", "groups_per_batch=2",
              "max_tokens=8", "eval_every=0", "save_every=1", "lora_rank=4", f"log_path={log}"]
    default = subprocess.run([*common, "max_steps=1", "behavior_if_log_dir_exists=delete"], capture_output=True,
                             text=True, timeout=900, env=env, check=False)
    assert default.returncode != 0
    assert "loss_fn='importance_sampling'" in default.stderr, default.stderr[-3000:]
    runs = [[*common, "loss_fn=importance_sampling", "max_steps=2", "behavior_if_log_dir_exists=delete"],
            [*common, "loss_fn=importance_sampling", "max_steps=3", "behavior_if_log_dir_exists=resume"]]
    for cmd in runs:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
    batches = [json.loads(line).get("progress/batch") for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert sorted(b for b in batches if b is not None) == [0, 1, 2]


@covers("RestClient.get_server_capabilities", "ServiceClient.get_server_capabilities",
        "ServiceClient.create_rest_client", "ServiceClient.close")
def test_capabilities(server, sdk):
    sc, rc, _ = sdk
    names = {m.model_name for m in rc.get_server_capabilities().result().supported_models}
    assert TINY in names


# ----------------------------------------------------------------------------- the table
def _public_calls() -> list[str]:
    import tinker

    out = []
    for cls in (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient):
        for name, v in inspect.getmembers(cls):
            if not name.startswith("_") and callable(v) and not name.endswith("_async"):
                out.append(f"{cls.__name__}.{name}")
    return sorted(out)


def render_table(observed: dict[str, tuple[str, str]]) -> str:
    rows = {**ELSEWHERE, **COMPAT, **observed}
    lines = ["| SDK call / CLI command (tinker 0.38; each `*_async` twin behaves as its call) | status | "
             "evidence / why |", "|---|---|---|"]
    for call in sorted(rows, key=lambda c: (c.startswith("tinker "), c)):
        status, why = rows[call]
        lines.append(f"| `{call}` | {status} | {why} |")
    return "\n".join(lines)


def write_table(observed: dict[str, tuple[str, str]]) -> None:
    doc = DOC.read_text()
    head, tail = doc[:doc.index(BEGIN) + len(BEGIN)], doc[doc.index(END):]
    DOC.write_text(f"{head}\n{render_table(observed)}\n{tail}")
    print(f"wrote the compatibility table of {DOC}")


def test_compatibility_table_is_current(server):
    """The table from this run: the refused and probe-only rows as `tinker_compat.observe` saw them against
    this server, the rest from the `covers` marks of this module's tests. It fails when a row differs from
    docs/tinker.md, when a probed call got a 5xx, or when an SDK call or CLI command has no row."""
    from tinker_compat import cli_commands, observe

    observed = observe(server.url, KEY)
    broken = {c: r for c, r in observed.items() if r[0] == "broken"}
    assert not broken, broken
    rows = {**ELSEWHERE, **COMPAT, **observed}
    missing = [c for c in _public_calls() + cli_commands() if c not in rows]
    assert not missing, f"SDK calls or CLI commands without a row (add a probe or a test): {missing}"
    doc = DOC.read_text()
    table = doc[doc.index(BEGIN) + len(BEGIN):doc.index(END)].strip()
    assert table == render_table(observed), "docs/tinker.md's table is stale: run `python tests/tinker_compat.py`"


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, str(Path(__file__).with_name("tinker_compat.py"))]))
