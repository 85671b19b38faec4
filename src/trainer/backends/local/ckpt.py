"""On-disk LoRA checkpoints of the local engine: `<dir>/meta.json`, `adapter.safetensors`
(`<module>.lora_A` / `<module>.lora_B`), and for full states `optimizer.pt` (AdamW moments + step).
Written into a temp folder next to the target, fsynced (files, then the folder), then `os.replace`d and the
parent fsynced: a reader never sees half a checkpoint, and after a power loss the run's checkpoint.json
(written after this returns) never names a folder whose files did not reach the disk."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "pairedrl-local-lora-v1"
ADAPTER_FILE = "adapter.safetensors"


def write(folder: Path, meta: dict[str, Any], tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
          optimizer: dict[str, Any] | None, overwrite: bool) -> Path:
    def fill(tmp: Path) -> None:
        flat = {}
        for name, (A, B) in tensors.items():
            flat[f"{name}.lora_A"] = A.detach().contiguous().clone()
            flat[f"{name}.lora_B"] = B.detach().contiguous().clone()
        save_file(flat, str(tmp / ADAPTER_FILE))
        if optimizer is not None:
            torch.save(optimizer, tmp / "optimizer.pt")
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, **meta,
                                                   "has_optimizer": optimizer is not None}, indent=1))

    return _atomic_folder(Path(folder), overwrite, fill)


#: the files of an external-weights checkpoint: what a PEFT `LoraModel` reads
#: (`peft.PeftModel.from_pretrained(base, folder)`), plus the engine's meta.json for listings
PEFT_FILES = ("adapter_config.json", "adapter_model.safetensors")


def write_peft(folder: Path, meta: dict[str, Any], tensors: dict[str, tuple[torch.Tensor, torch.Tensor]],
               overwrite: bool) -> Path:
    """The adapter as a PEFT LoRA folder: `base_model.model.<HF module>.lora_A.weight` / `lora_B.weight`
    (PEFT's `get_peft_model_state_dict` naming for the default adapter) and an `adapter_config.json` with
    rank, alpha, target modules and base model; the factors are the same tensors `write` stores."""
    def fill(tmp: Path) -> None:
        flat = {}
        for name, (A, B) in tensors.items():
            flat[f"base_model.model.{name}.lora_A.weight"] = A.detach().contiguous().clone()
            flat[f"base_model.model.{name}.lora_B.weight"] = B.detach().contiguous().clone()
        save_file(flat, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": meta["base_model"],
                  "r": int(meta["rank"]), "lora_alpha": float(meta["alpha"]),
                  "target_modules": sorted({n.rsplit(".", 1)[-1] for n in tensors}), "lora_dropout": 0.0,
                  "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False}
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        (tmp / "meta.json").write_text(json.dumps({"format": FORMAT, **meta, "has_optimizer": False,
                                                   "peft": True}, indent=1))

    return _atomic_folder(Path(folder), overwrite, fill)


def _atomic_folder(folder: Path, overwrite: bool, fill: Any) -> Path:
    if folder.exists() and not overwrite:
        raise ValueError(f"checkpoint {folder.parent.name}/{folder.name} already exists "
                         "(pass overwrite=True to replace it)")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        fill(tmp)
        for f in tmp.iterdir():
            _fsync(f, os.O_RDONLY)
        _fsync(tmp, os.O_RDONLY)
        if folder.exists():  # overwrite: move the old one aside first (os.replace needs an empty target)
            old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
            os.replace(folder, old / "x")
            os.replace(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, folder)
        _fsync(folder.parent, os.O_RDONLY)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read(folder: Path, with_optimizer: bool) -> tuple[dict[str, Any], dict[str, tuple[torch.Tensor, torch.Tensor]],
                                                     dict[str, Any] | None]:
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("peft"):
        raise ValueError(f"{folder.parent.name}/{folder.name} is an external (PEFT) export, not a checkpoint "
                         "the engine loads; load the weights or sampler_weights checkpoint it came from")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: not a local-engine checkpoint (format {meta.get('format')!r})")
    flat = load_file(str(folder / ADAPTER_FILE))
    tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in flat:
        if key.endswith(".lora_A"):
            name = key[: -len(".lora_A")]
            tensors[name] = (flat[key], flat[name + ".lora_B"])
    opt = None
    if with_optimizer:
        if not meta.get("has_optimizer"):
            raise ValueError(f"{folder}: a sampler-weights checkpoint has no optimizer state; "
                             "use a save_state checkpoint")
        opt = torch.load(folder / "optimizer.pt", weights_only=True)
    return meta, tensors, opt
