"""Turning logits into the distributions p (target) and q (draft).

Both sides go through :func:`probs_from_logits` with the same :class:`SamplingConfig`, so
temperature, top-k and top-p shape p and q identically; that is what lets rejection sampling
reproduce the target's *shaped* distribution exactly.
"""

from __future__ import annotations

import torch

from specdec.config import SamplingConfig


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), then softmax, row-wise.

    Works in at least float32 (float64 logits stay float64). For ``cfg.greedy`` it returns the
    one-hot distribution of the argmax, so the greedy case is the deterministic limit.

    >>> cfg = SamplingConfig(temperature=1.0, top_k=2)
    >>> [round(p, 3) for p in probs_from_logits(torch.tensor([[0.0, 1.0, 2.0]]), cfg)[0].tolist()]
    [0.0, 0.269, 0.731]
    """
    x = logits if logits.dtype == torch.float64 else logits.float()  # [N, V]
    if cfg.greedy:
        out = torch.zeros_like(x)
        out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
        return out
    x = x / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]  # [N, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token
        # always survives, so the nucleus is never empty.
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        drop_sorted = before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.softmax(x, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a 1-D distribution, reproducible through ``generator`` (on ``probs``'
    device); reading the token back is one device-to-host transfer."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A private RNG per request: seeded runs repeat, and requests never share random state.

    It lives on the model's ``device``, where the probabilities it samples from are, so drawing
    needs no transfer; a seed therefore reproduces output per device (CPU and CUDA generators
    produce different streams from the same seed)."""
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(int(seed))
    return g
