"""What goes into every run folder besides the metrics: resolved config, git revision, versions."""

from __future__ import annotations

import importlib.metadata as md
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from trainer.config.digest import decision_hash
from trainer.config.schema import Config, config_dict, config_yaml
from trainer.utils.io import atomic_write_json, atomic_write_text
from trainer.utils.machine import cpu_model

SECRET_ENV_VARS = ("TINKER_API_KEY", "WANDB_API_KEY")
_SECRET_KEYS = ("api_key", "apikey", "token", "access_token", "secret", "password")
# the userinfo of a URL (`http://user:password@host`, `https://token@host`): a credential whatever the key
_URL_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s?#'\"]+@")


def package_versions() -> dict[str, str]:
    out = {}
    for name in ("pairedrl", "tinker", "tinker-cookbook", "torch", "transformers", "peft", "hydra-core"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    out["python"] = platform.python_version()
    return out


def git_revision(repo: Path | None = None) -> dict[str, Any]:
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"rev": None, "dirty": None}
    return {"rev": rev or None, "dirty": dirty if rev else None}


def redact(obj: Any, secrets: list[str]) -> Any:
    """Drop secret values wherever they appear (keys that look secret, the values themselves, and the
    credentials inside URLs such as `backend.base_url=http://user:password@host`)."""
    if isinstance(obj, dict):
        return {k: ("<redacted>" if _is_secret_key(str(k)) else redact(v, secrets)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact(v, secrets) for v in obj]
    if isinstance(obj, str):
        for s in secrets:
            if s and s in obj:
                obj = obj.replace(s, "<redacted>")
        obj = _URL_USERINFO.sub(r"\g<scheme><redacted>@", obj)
    return obj


def _is_secret_key(key: str) -> bool:
    k = key.lower()
    return k in _SECRET_KEYS or k.endswith(("_api_key", "_secret", "_password", "_access_token"))


def current_secrets() -> list[str]:
    import os

    return [v for k in SECRET_ENV_VARS if (v := os.environ.get(k)) and len(v) >= 4]


def config_secrets(d: dict[str, Any]) -> list[str]:
    """The secrets a run must not write anywhere: the environment's (`current_secrets`) and the values under
    secret-looking keys of the composed config `d` (`trainer.config.schema.composed_dict`: an override such
    as `+backend.api_key=...`), 4 characters or more (a shorter value would be replaced inside unrelated
    text)."""
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                if _is_secret_key(str(k)) and isinstance(v, (str, int)) and len(str(v)) >= 4:
                    found.append(str(v))
                else:
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(d)
    return sorted(set(found + current_secrets()), key=len, reverse=True)


def redact_argv(argv: list[str], secrets: list[str]) -> list[str]:
    """Command-line arguments with secret values replaced: `key=value` overrides whose key looks secret,
    and any known secret inside an argument."""
    out = []
    for a in argv:
        key, eq, _ = a.partition("=")
        if eq and _is_secret_key(key.lstrip("+~").rsplit(".", 1)[-1]):
            a = f"{key}=<redacted>"
        out.append(redact(a, secrets))
    return out


def redact_hydra_record(run_dir: Path, sweep_dir: Path | None, secrets: list[str]) -> None:
    """Rewrite Hydra's own record of the invocation (`<run>/.hydra/*.yaml`, `<sweep>/multirun.yaml`) with the
    secrets replaced, as config.yaml has them: Hydra writes the composed config and the overrides as given
    before the task runs."""
    files = sorted((run_dir / ".hydra").glob("*.yaml")) + ([sweep_dir / "multirun.yaml"] if sweep_dir else [])
    for f in files:
        try:
            text = f.read_text()
        except OSError:
            continue
        clean = redact(text, secrets)
        if clean != text:
            atomic_write_text(f, clean)


def resolved_config_dict(config: Config) -> dict:
    """The run's config as config.yaml, the config hash and wandb have it (secrets replaced)."""
    return redact(config_dict(config), current_secrets())


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


#: what a run_info.json of this build holds for eval.compare's provenance checks: 2 = `decision_sha256` and
#: `sweep` (the launch's membership, null for a single run) are always written, so a run that says 2 and
#: lacks either had it removed
RUN_INFO_VERSION = 2


def write_run_files(run_dir: Path, config: Config, extra: dict[str, Any]) -> dict[str, Any]:
    cfg_d = resolved_config_dict(config)
    atomic_write_text(run_dir / "config.yaml", config_yaml(cfg_d))
    info = {
        "git": git_revision(),
        "versions": package_versions(),
        "arm": cfg_d.get("run_name") or f"{cfg_d['loss']['name']}_seed{cfg_d['seed']}",
        "loss": cfg_d["loss"]["name"],
        "seed": cfg_d["seed"],
        "experiment": cfg_d.get("experiment"),
        # the local engine's numbers are reproducible for the same thread count and CPU (docs/engine.md)
        "torch_threads": _torch_threads(),
        "cpu": cpu_model(),
        # where the run was written, and the decision rule it was trained under: eval.compare reads sweep
        # membership and the pre-registered rule from these, so a run linked or copied elsewhere, or a
        # config.yaml edited afterwards, cannot pass for another comparison's
        "run_dir": str(Path(run_dir).resolve()),
        "decision_sha256": decision_hash(cfg_d.get("decision")),
        "run_info_version": RUN_INFO_VERSION,
        "sweep": None,
        **extra,
    }
    atomic_write_json(run_dir / "run_info.json", redact(info, current_secrets()))
    return info


def batch_arithmetic(config: Config) -> dict[str, int]:
    s = config.schedule
    rollouts = s.groups_per_batch * s.group_size
    return {
        "prompts_per_step": s.groups_per_batch,
        "samples_per_prompt": s.group_size,
        "rollouts_per_step": rollouts,
        "minibatches_per_step": s.updates_per_batch,
        "rollouts_per_minibatch": rollouts // s.updates_per_batch,
        "optim_steps_per_rollout_batch": s.updates_per_batch,
        "rollout_steps": s.num_steps,
        "total_optim_steps": s.num_steps * s.updates_per_batch,
    }


def format_batch_arithmetic(b: dict[str, int]) -> str:
    rem = b["rollouts_per_step"] % b["minibatches_per_step"]
    mb = f"{b['rollouts_per_minibatch']}" + (f" (+1 for {rem} of them)" if rem else "")
    return "\n".join([
        "==== batch arithmetic ====",
        f"  prompts per step           {b['prompts_per_step']}",
        f"  samples per prompt         {b['samples_per_prompt']}",
        f"  rollouts per step          {b['rollouts_per_step']}",
        f"  minibatches per step       {b['minibatches_per_step']}  ({mb} rollouts each)",
        f"  optim steps per batch      {b['optim_steps_per_rollout_batch']}",
        f"  rollout steps              {b['rollout_steps']}",
        f"  total optimizer steps      {b['total_optim_steps']}",
        "==========================",
    ])


def resolved_precision(info: dict[str, Any]) -> dict[str, Any] | None:
    """The dtypes a run's local engine resolved (`sampler_dtype`, `train_dtype`), from its run_info.json: the
    `engine` record, or the `precision` record runs wrote beside it before the engine record held the dtypes.
    None where neither is there (backend=tinker: the service decides)."""
    for key in ("engine", "precision"):
        rec = info.get(key)
        if isinstance(rec, dict) and "sampler_dtype" in rec:
            return {k: rec.get(k) for k in ("sampler_dtype", "train_dtype")}
    return None
