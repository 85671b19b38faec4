"""A Tinker-shaped backend that answers instantly, to time the trainer's own client-side work.

Sampling returns canned GSM8K-style completions of a fixed length; forward_backward_custom runs the
SDK's own client-side custom-loss step (`tinker.TrainingClient._compute_custom_loss`, tinker 0.38)
on logprobs near the sampler's, exactly the work a client does on the two-pass path; a registered
loss handle (one-pass path) costs the client nothing but the request."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import numpy as np
import tinker
from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture


def _done(value: Any) -> AwaitableConcurrentFuture:
    f: cf.Future = cf.Future()
    f.set_result(value)
    return AwaitableConcurrentFuture(f)


class _Sampler:
    def __init__(self, tokenizer: Any, n_tokens: int, answers: list[str]) -> None:
        self.n_tokens = n_tokens
        filler = tokenizer.encode(" Let me think step by step about the quantities involved.",
                                  add_special_tokens=False)
        self.completions = []
        for a in answers:
            tail = tokenizer.encode(f" So the answer is \\boxed{{{a}}}.", add_special_tokens=False)
            body = (filler * (n_tokens // max(1, len(filler)) + 1))[: max(0, n_tokens - len(tail) - 1)]
            self.completions.append(body + tail)
        self.stop_id = tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
        self.rng = np.random.default_rng(0)

    def sample(self, prompt: Any, num_samples: int, sampling_params: Any, **_: Any) -> Any:
        seqs = []
        for i in range(num_samples):
            toks = self.completions[(i + (sampling_params.seed or 0)) % len(self.completions)] + [self.stop_id]
            lp = (-np.abs(self.rng.normal(0.3, 0.5, len(toks)))).astype(np.float32)
            seqs.append(types.SampledSequence(stop_reason="stop", sequence_id=f"s{i}", _tokens_list=toks,
                                              _logprobs_list=lp.tolist()))
        return _done(types.SampleResponse(sequences=seqs, prompt_logprobs_np=None))


class InstantTrainingClient:
    def __init__(self, sampler: _Sampler) -> None:
        self.sampler = sampler
        self.forward_passes = 0
        self.rng = np.random.default_rng(1)

    def save_weights_and_get_sampling_client(self, *a: Any, **k: Any) -> Any:
        return _done(self.sampler)

    def forward_backward_custom(self, data: list, loss_fn: Any) -> Any:
        if callable(loss_fn):
            # the server's forward pass, answered instantly: logprobs near the sampler's
            outs = []
            for d in data:
                slp = d.loss_fn_inputs["logprobs"].to_numpy()
                lp = (slp + self.rng.normal(0, 0.02, slp.shape)).astype(np.float32)
                outs.append({"logprobs": types.TensorData.from_numpy(lp)})
            fwd = types.ForwardBackwardOutput(loss_fn_output_type="cross_entropy", loss_fn_outputs=outs, metrics={})
            res = tinker.TrainingClient._compute_custom_loss(data, loss_fn, fwd)
            self.forward_passes += 2
            metrics = {**res.metrics, "loss:sum": res.loss_sum}
            outs = []
        else:
            # the server ran the registered loss in one pass: it returns summed counts and the logprobs
            self.forward_passes += 1
            n = float(sum(d.loss_fn_inputs["mask"].to_numpy().sum() for d in data))
            metrics = {"loss:sum": 0.0, **{f"custom/{k}:sum": 0.0 for k in (
                "loss/dppo_masked", "loss/nonzero_adv_tokens", "loss/dppo_masked_nonzero_adv", "loss/grpo_clipped",
                "ratio/cap_hits", "drift/kl_k3")}, "custom/loss/n_tokens:sum": n, "custom/ratio/sum:sum": n}
            outs = []
            for d in data:
                slp = d.loss_fn_inputs["logprobs"].to_numpy()
                outs.append({"logprobs": types.TensorData.from_numpy(
                    (slp + self.rng.normal(0, 0.02, slp.shape)).astype(np.float32))})
        return _done(types.ForwardBackwardOutput(loss_fn_output_type="custom", loss_fn_outputs=outs, metrics=metrics))

    def optim_step(self, params: Any) -> Any:
        return _done(types.OptimStepResponse(metrics={}))

    def save_state(self, name: str, **_: Any) -> Any:
        return _done(types.SaveWeightsResponse(path=f"tinker://instant/{name}"))

    def get_info(self) -> Any:
        return None


class InstantServiceClient:
    def __init__(self, tokenizer: Any, n_tokens: int, answers: list[str]) -> None:
        self.tc = InstantTrainingClient(_Sampler(tokenizer, n_tokens, answers))

    def create_lora_training_client(self, **_: Any) -> Any:
        return _done(self.tc)

    def create_training_client_from_state_with_optimizer(self, path: str) -> Any:
        return _done(self.tc)
