"""Token-loss aggregation shared by every loss plugin.

Modes (pinned to sail-sg/Stable-RL @ c6af1d119c0fe30d16dd9a837d35fdf695acd226,
verl/trainer/ppo/core_algos.py::agg_loss, and to Tinker's token sum):
- `sum`: sum over loss tokens of all sequences (the default; Tinker's documented `-(...).sum()`, and
  what spindle computes: its `_loss` returns the masked sum and Megatron never divides it by the token
  count. spindle = modal-projects/spindle @ 88b2e5f3cd0addb93b4579725ed97d6e988856e0, an open-source
  server of Tinker's training API on Megatron, src/spindle/backends/megatron_runtime/common/
  forward_backward.py).
- `token_mean`: sum / number of loss tokens (Stable-RL `token-mean` with dp_size 1).
- `seq_mean_token_sum`: per-sequence token sum, averaged over sequences that have at
  least one loss token (Stable-RL `seq-mean-token-sum`).
- `seq_mean_token_mean`: per-sequence token mean, averaged over non-empty sequences
  (Stable-RL `seq-mean-token-mean`; its `+1e-8` guard is unnecessary here because empty
  sequences are excluded exactly).
- `seq_mean_token_sum_norm`: Dr. GRPO's constant normaliser (Liu et al. 2025, arXiv 2503.20783:
  the per-sequence 1/|o_i| replaced by a constant, the generation budget): the
  per-sequence token sum averaged over non-empty sequences, divided by `norm_length` H.
  Pinned to verl-project/verl @ 018f23b5, verl/trainer/ppo/core_algos.py::agg_loss
  (`seq-mean-token-sum-norm`, `(sum / #seqs) / loss_scale_factor`); Stable-RL @ c6af1d1 omits
  the sequence mean there, verl's later fix keeps it. H is configured (`loss.norm_length`,
  the completion budget by default), never the padded width of a minibatch, so it is the same
  constant for every minibatch and every arm.
A flat `[T]` input is one sequence.
"""

from __future__ import annotations

import torch

from trainer.config.enums import AGGREGATIONS, NEEDS_NORM_LENGTH

__all__ = ["AGGREGATIONS", "NEEDS_NORM_LENGTH", "aggregate", "check_aggregation", "check_norm_length"]


def check_aggregation(mode: str, owner: str = "aggregation") -> str:
    """Return `mode` if it is a known aggregation, else raise ValueError naming the options."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"{owner} must be one of {list(AGGREGATIONS)}, got {mode!r}")
    return mode


def check_norm_length(mode: str, norm_length: float | None, owner: str = "norm_length") -> float | None:
    """`norm_length` as a float (> 0) when `mode` needs it, else None; ValueError when missing or bad."""
    if mode not in NEEDS_NORM_LENGTH:
        return None
    if isinstance(norm_length, bool) or not isinstance(norm_length, (int, float)) or not norm_length > 0:
        raise ValueError(
            f"{owner} must be a number > 0 for aggregation {mode!r} (the constant normaliser H), "
            f"got {norm_length!r}"
        )
    return float(norm_length)


def aggregate(
    token_loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: float | None = None
) -> torch.Tensor:
    """Reduce a per-token loss (`[T]` or `[B, T]`) over the loss tokens (mask == 1).

    Non-loss positions are excluded with `torch.where` (not multiplied by 0), so garbage in
    padding cannot leak NaN/inf into the value. The mask is detached.
    """
    check_aggregation(mode)
    norm = check_norm_length(mode, norm_length)
    if token_loss.shape != mask.shape:
        raise ValueError(
            f"aggregate: mask shape {tuple(mask.shape)} != token_loss shape {tuple(token_loss.shape)}"
        )
    if token_loss.dim() not in (1, 2):
        raise ValueError(f"aggregate: expected [T] or [B, T] tensors, got shape {tuple(token_loss.shape)}")
    loss_BT = token_loss if token_loss.dim() == 2 else token_loss.unsqueeze(0)
    mask_BT = (mask if mask.dim() == 2 else mask.unsqueeze(0)).detach() > 0
    n_tokens = int(mask_BT.sum().item())
    if n_tokens == 0:
        raise ValueError("aggregate: mask has no loss tokens (all zero)")

    masked_BT = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))
    if mode == "sum":
        return masked_BT.sum()
    if mode == "token_mean":
        return masked_BT.sum() / n_tokens
    tokens_B = mask_BT.sum(dim=-1)
    n_seqs = int((tokens_B > 0).sum().item())
    seq_sum_B = masked_BT.sum(dim=-1)
    if mode == "seq_mean_token_sum":
        return seq_sum_B.sum() / n_seqs
    if mode == "seq_mean_token_sum_norm":
        return seq_sum_B.sum() / n_seqs / norm
    # seq_mean_token_mean: empty rows have seq_sum 0, so clamping their count to 1 adds 0.
    return (seq_sum_B / tokens_B.clamp(min=1).to(seq_sum_B.dtype)).sum() / n_seqs
