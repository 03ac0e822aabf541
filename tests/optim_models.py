"""A small network, per-rank batches and param groups for the optimizer tests (module level, so spawned ranks can
unpickle them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """Two tanh layers and a head, plus a parameter multiplied by 0: its gradient, momentum and variance stay zero."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(6, 16)
        self.l2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)
        self.unused_scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        return self.head(h) + 0.0 * self.unused_scale.sum()


def rank_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at step ``step`` (different on every rank and step)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 6, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


def two_groups(net: Net, wd: float) -> list[dict[str, Any]]:
    """Two param groups: the first layer and the unused scale at the defaults, the rest with weight decay ``wd`` and
    lr 2e-3."""
    return [
        {"params": [net.l1.weight, net.l1.bias, net.unused_scale]},
        {"params": [net.l2.weight, net.l2.bias, net.head.weight, net.head.bias], "weight_decay": wd, "lr": 2e-3},
    ]


class EmbeddingNet(nn.Module):
    """An embedding of 40 x 16, four tanh layers and a 2-way head: several DDP buckets at a small ``bucket_cap_mb``,
    the embedding (the first parameter) in DDP's last one."""

    vocab = 40

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(self.vocab, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x).mean(1)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def token_batch(rank: int, step: int, vocab: int = EmbeddingNet.vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at step ``step`` for :class:`EmbeddingNet` (and nets like it): 8 sequences of 5 token ids
    below ``vocab`` and their 2-way labels, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, vocab, (8, 5), generator=g), torch.randint(0, 2, (8,), generator=g)
