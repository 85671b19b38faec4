"""Local engine checkpoints: save_state -> restore gives identical logprobs and the identical next step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from local_client import local_service_client
from tinker import types

TINY = "pairedrl/tiny-random"


@pytest.fixture(scope="module")
def sc(tmp_path_factory):
    yield from local_service_client(tmp_path_factory, "ckpt", micro_batch_size=2)


def batch(tok, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in ["Natalia sold 48 clips", "12 + 7 = 19 is the answer", "She earned $10 today."]:
        s = tok.encode(t, add_special_tokens=False)
        n = len(s) - 1
        out.append(types.Datum(model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={
            "target_tokens": s[1:], "logprobs": (-4 * torch.rand(n, generator=g)).tolist(),
            "advantages": torch.randn(n, generator=g).tolist()}))
    return out


def logprobs(tc, data):
    return [o["logprobs"].to_torch() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]


ADAM = types.AdamParams(learning_rate=0.02, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.01, grad_clip_norm=1.0)


def test_save_state_then_restore_with_optimizer_is_exact(sc):
    tc = sc.create_lora_training_client(TINY, rank=4, seed=3).result()
    data = batch(tc.get_tokenizer(), 0)
    for i in range(2):
        tc.forward_backward(data, "ppo").result()
        tc.optim_step(ADAM).result()
    saved = tc.save_state("step2").result()
    saved_lp = logprobs(tc, data)
    assert saved.path == f"tinker://{tc.run_id}/weights/step2"
    assert types.ParsedCheckpointTinkerPath.from_tinker_path(saved.path).checkpoint_id == "weights/step2"
    folder = sc.state_dir / tc.run_id / "weights" / "step2"
    assert (folder / "meta.json").is_file() and (folder / "optimizer.pt").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    assert json.loads((folder / "meta.json").read_text())["optim_steps"] == 2

    restored = sc.create_training_client_from_state_with_optimizer(saved.path).result()
    assert restored.model_id != tc.model_id and restored.optim_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(saved_lp, logprobs(restored, data)))
    # the next step (Adam moments + step count restored) gives bit-identical weights
    nxt = batch(tc.get_tokenizer(), 1)
    r1 = (tc.forward_backward(nxt, "ppo").result(), tc.optim_step(ADAM).result())
    r2 = (restored.forward_backward(nxt, "ppo").result(), restored.optim_step(ADAM).result())
    assert r1[0].metrics["loss:sum"] == r2[0].metrics["loss:sum"]
    assert r1[1].metrics["grad_norm:mean"] == r2[1].metrics["grad_norm:mean"]
    assert all(torch.equal(a, b) for a, b in zip(tc.compute.params, restored.compute.params))
    assert all(torch.equal(a, b) for a, b in zip(logprobs(tc, data), logprobs(restored, data)))

    # weights only: same logprobs, fresh optimizer -> a different next step
    fresh = sc.create_training_client_from_state(saved.path).result()
    assert fresh.optim_steps == 0
    # the saved weights, not the base model's: the base logprobs differ from the saved ones
    base_lp = logprobs(sc.create_lora_training_client(TINY, rank=4, seed=3).result(), data)
    assert not all(torch.equal(a, b) for a, b in zip(saved_lp, base_lp))
    fresh_lp = logprobs(fresh, data)
    assert len(fresh_lp) == len(data)
    assert all(torch.equal(a, b) for a, b in zip(saved_lp, fresh_lp))
    fresh.forward_backward(nxt, "ppo").result()
    fresh.optim_step(ADAM).result()
    assert not all(torch.equal(a, b) for a, b in zip(tc.compute.params, fresh.compute.params))


def test_load_state_into_an_existing_client_and_sampler_checkpoints(sc):
    tc = sc.create_lora_training_client(TINY, rank=4, seed=5).result()
    tok = tc.get_tokenizer()
    data = batch(tok, 2)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    path = tc.save_state("a").result().path
    with pytest.raises(ValueError, match="already exists"):
        tc.save_state("a").result()
    assert tc.save_state("a", overwrite=True).result().path == path
    other = sc.create_lora_training_client(TINY, rank=4, seed=6).result()
    assert not all(torch.equal(a, b) for a, b in zip(logprobs(tc, data), logprobs(other, data)))
    other.load_state(path).result()
    assert all(torch.equal(a, b) for a, b in zip(logprobs(tc, data), logprobs(other, data)))

    # a sampler checkpoint serves the same weights as the live snapshot
    spath = tc.save_weights_for_sampler("s").result().path
    prompt = types.ModelInput.from_ints(tok.encode("What is 12 + 7?", add_special_tokens=False))
    params = types.SamplingParams(max_tokens=10, temperature=0.0, stop=[])
    live = tc.save_weights_and_get_sampling_client().sample(prompt, 1, params).result().sequences[0]
    from_path = sc.create_sampling_client(model_path=spath).sample(prompt, 1, params).result().sequences[0]
    from_tc = tc.create_sampling_client(spath).sample(prompt, 1, params).result().sequences[0]
    assert live.tokens == from_path.tokens == from_tc.tokens and live.logprobs == from_path.logprobs
    with pytest.raises(ValueError, match="optimizer"):
        sc.create_training_client_from_state_with_optimizer(spath)
    wrong_rank = sc.create_lora_training_client(TINY, rank=2, seed=0).result()
    with pytest.raises(ValueError, match="does not match"):
        wrong_rank.load_state(path).result()


def test_bad_paths_and_names(sc, tmp_path):
    tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()
    with pytest.raises(ValueError, match="tinker://<run_id>/weights/<name>"):
        sc.create_training_client_from_state("tinker://abc/x")
    with pytest.raises(ValueError, match="no checkpoint"):
        sc.create_sampling_client(model_path="tinker://nope/sampler_weights/nothing")
    with pytest.raises(ValueError, match="letters, digits"):
        tc.save_state("../escape").result()
    assert tc.save_state("ok").result().path.endswith("/weights/ok")  # still usable


def test_load_paths_are_confined_to_the_state_dir(sc, tmp_path):
    """Every way out of the state dir gets the answer a missing checkpoint gets: `..`, an absolute
    legacy path elsewhere, a symlink inside pointing outside."""
    import shutil

    from trainer.backends.local.common import CheckpointPathError

    tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()
    path = tc.save_state("inside").result().path
    folder = sc.state_dir / tc.run_id / "weights" / "inside"
    outside = tmp_path / "outside" / "run" / "weights" / "x"
    shutil.copytree(folder, outside)
    (sc.state_dir / tc.run_id / "weights" / "link").symlink_to(outside)
    refused = {
        "tinker://../weights/inside": 400, f"tinker://{tc.run_id}/weights/..": 400,
        f"tinker://{tc.run_id}/weights/link": 404, f"tinker://{tc.run_id}/weights/missing": 404,
        f"tinker://local{outside}": 404, f"tinker://local{sc.state_dir}/../outside/run/weights/x": 404,
        "tinker:///etc/passwd/x": 400, "tinker://" + "a" * 2000: 400,
    }
    for bad, status in refused.items():
        with pytest.raises(CheckpointPathError) as e:
            sc.create_sampling_client(model_path=bad)
        assert e.value.status == status, bad
    # the link and a missing name read the same
    msgs = set()
    for bad in (f"tinker://{tc.run_id}/weights/link", f"tinker://{tc.run_id}/weights/missing"):
        with pytest.raises(CheckpointPathError) as e:
            sc.create_sampling_client(model_path=bad)
        msgs.add(str(e.value).replace(bad, "P"))
    assert len(msgs) == 1
    # the form from before SDK paths: loads from inside the state dir, says how to convert otherwise
    assert sc.create_sampling_client(model_path=f"tinker://local{folder}").model_path == f"tinker://local{folder}"
    with pytest.raises(CheckpointPathError, match="copy the checkpoint folder"):
        sc.create_training_client_from_state(f"tinker://local{outside}")
    assert sc.create_training_client_from_state(path).result().optim_steps == 0


def test_checkpoint_files_and_folders_reach_the_disk_before_the_rename(tmp_path, monkeypatch):
    """Every file, the temp folder and (after the rename) the parent are fsynced: checkpoint.json, written
    next, must never name a folder whose files are still only in the page cache."""
    import os

    from trainer.backends.local import ckpt

    synced: list[str] = []
    renamed: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    def replace(a, b) -> None:
        renamed.append(str(b))
        real_replace(a, b)

    monkeypatch.setattr(ckpt.os, "fsync", fsync)
    monkeypatch.setattr(ckpt.os, "replace", replace)
    A, B = torch.randn(2, 4), torch.randn(4, 2)
    folder = ckpt.write(tmp_path / "ck" / "step1", {"step": 1}, {"m": (A, B)}, {"state": {}}, overwrite=False)
    names = [Path(p).name for p in synced]
    for f in ("adapter.safetensors", "optimizer.pt", "meta.json"):
        assert f in names, f
    assert renamed == [str(folder)]
    tmp_dir = Path(synced[3])
    # the temp folder, before its rename
    assert tmp_dir.parent == folder.parent and tmp_dir.name.startswith(".step1.")
    assert synced[-1] == str(folder.parent)  # the rename itself made durable
    meta, tensors, opt = ckpt.read(folder, with_optimizer=True)
    assert meta["step"] == 1 and torch.equal(tensors["m"][0], A) and opt == {"state": {}}


def test_load_state_refuses_a_checkpoint_of_another_lora_alpha(sc, tmp_path):
    """Same rank and modules but another alpha: the factors would run at another scale (alpha / rank)."""
    from trainer.backends.local import LocalServiceClient

    # the same state dir: checkpoint paths name folders under the engine's own state dir
    other = LocalServiceClient(state_dir=sc.state_dir, sampler_dtype="float32", train_dtype="float32",
                               lora_alpha=32.0)
    try:
        path = other.create_lora_training_client(TINY, rank=4, seed=0).result().save_state("a32").result().path
        tc = sc.create_lora_training_client(TINY, rank=4, seed=0).result()  # the fixture's alpha is 8
        with pytest.raises(ValueError, match=r"alpha 32\.0.*alpha 8\.0"):
            tc.load_state(path).result()
        assert sc.create_training_client_from_state(path).result().alpha == 32.0  # adopts the checkpoint's
    finally:
        other.close()
