"""The module-scoped local service client the engine tests share."""

from __future__ import annotations


def local_service_client(tmp_path_factory, name: str, **overrides):
    """Generator for module-scoped fixtures: an fp32 `LocalServiceClient` (LoRA alpha 8) with its state
    under a fresh temp folder, closed when the module's tests are done. `overrides`: micro-batch sizes."""
    from trainer.backends.local import LocalServiceClient

    c = LocalServiceClient(state_dir=tmp_path_factory.mktemp(name), sampler_dtype="float32",
                           train_dtype="float32", lora_alpha=8.0, **overrides)
    yield c
    c.close()
