"""Fake quantisation of the sampler's projection weights (`backend.sampler_quant`): each weight is rounded to
a serving format and dequantised back, so the sampler computes with the values a quantised inference
engine would hold while the trainer keeps the exact weights (a train-inference mismatch on purpose).

Formats (`SAMPLER_QUANTS`), each on a weight `[out, in]` whose rows are output channels:
- `fp16`: a cast to float16 and back (saturating at +-65504 rather than overflowing to inf);
- `fp8_e4m3`: per-output-channel scale `max|w_row| / 448`, `w / scale` clamped to +-448 (E4M3's largest
  finite value) and cast to `float8_e4m3fn` (round to nearest even), times the scale: the layout of vLLM's
  and SGLang's FP8 weight-only checkpoints (per-channel `weight_scale`);
- `int8`: symmetric per-output-channel, `scale = max|w_row| / 127`, `round(w / scale)` clamped to [-127, 127];
- `int4`: the same with `max|w_row| / 7` and [-7, 7] (symmetric: the code -8 is never used).
`round` is torch's, round-half-to-even. A row of zeros keeps scale 1 (it stays zeros).
"""

from __future__ import annotations

import torch

from trainer.config.enums import SAMPLER_QUANTS

# the largest code of each scaled format: a row's max |w| maps to it
_TOP = {"fp8_e4m3": 448.0, "int8": 127.0, "int4": 7.0}
_FP16_MAX = 65504.0


def fake_quant(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """`w` rounded to `fmt` and dequantised, in float64 for a float64 `w`, else float32; `none` returns
    `w` itself (no copy)."""
    if fmt not in SAMPLER_QUANTS:
        raise ValueError(f"sampler_quant must be one of {list(SAMPLER_QUANTS)}, got {fmt!r}")
    if fmt == "none":
        return w
    x = w if w.dtype == torch.float64 else w.float()
    if fmt == "fp16":
        return x.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16).to(x.dtype)
    top = _TOP[fmt]
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    y = x / scale
    if fmt == "fp8_e4m3":
        q = y.clamp(-top, top).to(torch.float8_e4m3fn).to(x.dtype)
    else:
        q = torch.round(y).clamp(-top, top)
    return q * scale
