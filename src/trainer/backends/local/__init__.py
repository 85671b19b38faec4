"""The embedded local engine: tinker 0.38's client surface in-process on torch + transformers + peft.

`LocalServiceClient(state_dir=...)` is a drop-in for `tinker.ServiceClient` for the models in
`models.SUPPORTED_MODELS`; its clients return tinker's own types and `APIFuture`s.
"""

from trainer.model_registry import SUPPORTED_MODELS, resolve_base_model, resolve_tokenizer
from trainer.backends.local.sampling import LocalSamplingClient
from trainer.backends.local.service import DEFAULT_LORA_ALPHA, LocalServiceClient
from trainer.backends.local.training import LocalTrainingClient

__all__ = ["LocalServiceClient", "LocalTrainingClient", "LocalSamplingClient", "SUPPORTED_MODELS",
           "resolve_base_model", "resolve_tokenizer", "DEFAULT_LORA_ALPHA"]
