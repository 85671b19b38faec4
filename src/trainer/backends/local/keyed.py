"""Counter-based draws for the sampler: a uniform per (salt, request seed, sample index, position, token
id), computed from those integers alone, so no row's draws depend on another row's, on the batch or
on any generator's state.

The hash is lowbias32 (Chris Wellons, skeeto/hash-prospector README, "lowbias32"; nullprogram.com
2018-07-31: `x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16`), a bijection
of 32-bit words with low avalanche bias. It runs on int64 tensors holding 32-bit words: every product
is split in 16-bit halves so no intermediate passes 2^49 (int64 overflow would be undefined in torch's
kernels), and right shifts of a non-negative word are logical.

Uses: `gumbel_argmax` (coupled sampling: Gumbel-max with one shared noise value per token id, so two
distributions sampled at one key agree wherever they allow) and `normal` (the sampler's logit noise,
`backend.sampler_logit_noise`). Each use has its own salt, so the two draws are independent.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
GUMBEL_SALT = 0x6A09E667  # sqrt(2)'s fraction bits (SHA-256's first word): any fixed, distinct words
NOISE_SALT = 0xBB67AE85  # sqrt(3)'s


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """`(x * c) mod 2^32` for words `x` in [0, 2^32) and a 32-bit constant `c`, with every intermediate below
    2^49: `x * c = x * lo + ((x * hi) << 16)`, and only the low 16 bits of `x * hi` survive the shift."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 words in [0, 2^32) (see the module docstring)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(salt: int, seed_N: torch.Tensor, sample_N: torch.Tensor, pos: int | torch.Tensor
             ) -> torch.Tensor:
    """One 32-bit key per row from `salt`, the row's request seed (any int64: both halves are mixed in),
    its sample index within the request and its position: int64 `[N]`."""
    seed = seed_N.to(torch.int64)
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    k = mix32(lo ^ (salt & _MASK32))
    k = mix32(k ^ hi)
    k = mix32(k ^ (sample_N.to(torch.int64) & _MASK32))
    pos_N = pos if isinstance(pos, torch.Tensor) else torch.full_like(k, int(pos))
    return mix32(k ^ (pos_N.to(torch.int64) & _MASK32))


def uniform(keys_N: torch.Tensor, vocab: int) -> torch.Tensor:
    """float64 `[N, vocab]` uniforms in (0, 1) (never 0 or 1: `(bits + 0.5) / 2^32`), entry (n, t) a function
    of `keys_N[n]` and the token id t alone: two rounds of the hash over the token id xor-ed with the key."""
    tok = torch.arange(vocab, dtype=torch.int64)
    bits = mix32(mix32(tok.unsqueeze(0) ^ keys_N.unsqueeze(1)) ^ mix32(keys_N ^ 0x9E3779B9).unsqueeze(1))
    return (bits.double() + 0.5) * (1.0 / 4294967296.0)


def normal(keys_N: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard normal float32 `[N, vocab]`: the inverse normal CDF of `uniform` (|z| <= 6.3)."""
    return torch.special.ndtri(uniform(keys_N, vocab)).float()


def gumbel_argmax(scaled_NV: torch.Tensor, keys_N: torch.Tensor) -> torch.Tensor:
    """Token ids `[N]`: `argmax_t (scaled[n, t] + G(n, t))` with `G = -log(-log U)` the keyed Gumbel noise
    (`uniform`), an exact draw from `softmax(scaled[n])` (the Gumbel-max trick; `-inf` entries are never
    drawn). Summed in float64 so that ties need equal float64 sums."""
    g = -torch.log(-torch.log(uniform(keys_N, scaled_NV.shape[-1])))
    return torch.argmax(scaled_NV.double() + g, dim=-1)
