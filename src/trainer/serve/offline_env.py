"""What an unmodified Tinker program needs on this machine to run against the server with no network.

The SDK and the cookbook find a tokenizer by the model's hub id: `TrainingClient.get_tokenizer()` loads
`get_info().model_data.tokenizer_id`, `SamplingClient.get_tokenizer()` the base model's name, and
tinker-cookbook's `tokenizer_utils.get_tokenizer(model_name)` calls `AutoTokenizer.from_pretrained(model_name)`;
offline (`HF_HUB_OFFLINE=1`) each of them reads the Hugging Face hub cache only. `seed_hf_cache` writes the
engine's own tokenizer files (the converted model folders, `trainer.model_registry.model_dir`) into a
hub cache under the served ids, in the cache's layout (`hub/models--<org>--<name>/refs/main` naming a
snapshot folder), so those calls resolve with no code change. Weights are not copied: only the server
loads them. `python -m trainer.serve --print-env [--hf-home DIR]` seeds and prints the exports.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from trainer.model_registry import SUPPORTED_MODELS, TINY, cache_root, model_dir

#: the cookbook renderer that matches SmolLM2's chat template (ChatML `<|im_start|>` / `<|im_end|>` turns);
#: SmolLM2 is not in the cookbook's model table (`model_info.get_recommended_renderer_name` raises), so
#: recipes that take `renderer_name=` need it named
RENDERER = "qwen3_instruct"
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth")


def available() -> list[str]:
    """The served models whose converted folder exists on this machine, and the tiny model (built in
    seconds from nothing): seeding never starts a conversion that needs the network."""
    return [m for m, spec in SUPPORTED_MODELS.items()
            if m == TINY or (cache_root(None) / spec.folder_name / "config.json").is_file()]


def _repo_dir(hf_home: Path, model_id: str) -> Path:
    return hf_home / "hub" / ("models--" + model_id.replace("/", "--"))


def seed_hf_cache(hf_home: Path, models: list[str] | None = None) -> dict[str, Path]:
    """Each model's tokenizer and config files as the hub cache's snapshot of `model_id`; returns
    model id -> snapshot folder. The snapshot name is a digest of the files, so reseeding the same files is
    a no-op and a changed tokenizer gets a new snapshot that `refs/main` then names."""
    hf_home = Path(hf_home).expanduser().resolve()
    out = {}
    for model_id in models if models is not None else available():
        src = model_dir(model_id)
        files = sorted(f for f in src.iterdir() if f.is_file() and not f.name.endswith(_WEIGHTS))
        h = hashlib.sha1()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        rev = h.hexdigest()
        repo = _repo_dir(hf_home, model_id)
        snap = repo / "snapshots" / rev
        if not snap.is_dir():
            snap.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{rev}.", dir=snap.parent))
            for f in files:
                shutil.copy2(f, tmp / f.name)
            try:
                os.replace(tmp, snap)
            except OSError:  # another process seeded the same snapshot first
                shutil.rmtree(tmp, ignore_errors=True)
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        ref_tmp = repo / "refs" / f".main.{os.getpid()}"
        ref_tmp.write_text(rev)
        os.replace(ref_tmp, repo / "refs" / "main")
        out[model_id] = snap
    return out


def env_lines(hf_home: Path, seeded: list[str], url: str | None = None) -> list[str]:
    """The shell lines a Tinker program's environment needs (after `seed_hf_cache(hf_home)`)."""
    hf_home = Path(hf_home).expanduser().resolve()
    missing = [m for m in SUPPORTED_MODELS if m not in seeded]
    return [f"# tokenizers seeded: {', '.join(seeded)}"] + [
        f"# not seeded (not converted on this machine yet; serve it once, then rerun --print-env): {m}"
        for m in missing] + [
        f"export HF_HOME={hf_home} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_TELEMETRY=0",
        f"export TINKER_API_KEY=tml-local TINKER_BASE_URL={url or 'http://127.0.0.1:PORT  # the URL the server printed'}",
        f"# renderer for {', '.join(SUPPORTED_MODELS)}: renderer_name={RENDERER}",
    ]
