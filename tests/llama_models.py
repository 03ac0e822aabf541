"""A tiny Llama-style language model for the ``onebit_fsdp`` tests, as a user would port one: RMSNorm, rotary
position embeddings, causal self-attention and a SwiGLU MLP in pre-norm blocks, an embedding that may be tied to the
output layer, and a LightningModule that shards itself in ``configure_model`` with the strategy's mesh (module level,
so that spawned ranks can unpickle it).

The LightningModule does not seed anything: each process builds its own random weights, as under a launcher without
``seed_everything`` (``init_seed`` makes that reproducible per rank in the tests). Its data are a function of the
global step and the rank only, so a resumed run sees the batches an uninterrupted one did.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 32, 16, 2, 2, 8, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos`` and ``sin`` of the rotary angles, ``(seq, head_dim // 2)`` each."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (``(batch, heads, seq, head_dim)``) by the position's angles."""
    first, second = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """Pre-norm attention and SwiGLU MLP, each with a residual; ``checkpointing``: the block's activations are
    recomputed in backward (``torch.utils.checkpoint``)."""

    def __init__(self, dim: int, heads: int, checkpointing: bool = False) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, 4 * dim)
        self.checkpointing = checkpointing
        self.forward_passes = 0  # counted where the block computes: twice per step with checkpointing

    def _forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        self.forward_passes += 1
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.checkpointing:
            return torch.utils.checkpoint.checkpoint(self._forward, x, cos, sin, use_reentrant=False)
        return self._forward(x, cos, sin)


class TinyLlama(nn.Module):
    def __init__(self, tie: bool = True, checkpointing: bool = False, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([LlamaBlock(DIM, HEADS, checkpointing) for _ in range(layers)])
        self.norm = RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        cos, sin = rotary_tables(SEQ, DIM // HEADS)
        self.register_buffer("rotary_cos", cos, persistent=False)
        self.register_buffer("rotary_sin", sin, persistent=False)
        nn.init.normal_(self.embed.weight, std=1.0 / math.sqrt(DIM))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.rotary_cos, self.rotary_sin)
        return self.lm_head(self.norm(x))


def token_batch(step: int, rank: int) -> torch.Tensor:
    """``(BATCH, SEQ + 1)`` tokens of a learnable sequence (each token a function of the previous two), a function of
    ``step`` and ``rank`` only."""
    g = torch.Generator().manual_seed(10_007 * step + rank)
    start = torch.randint(0, VOCAB, (BATCH, 2), generator=g)
    tokens = [start[:, 0], start[:, 1]]
    for _ in range(SEQ - 1):
        tokens.append((3 * tokens[-1] + tokens[-2] + 1) % VOCAB)
    return torch.stack(tokens, 1)


class LlamaLM(pl.LightningModule):
    """The LightningModule around :class:`TinyLlama`: ``configure_model`` shards every block, then the whole model,
    over ``self.device_mesh["shard"]`` (or nothing, ``shard=False``, for ``OnebitFSDPStrategy(shard_modules=...)``).

    Args:
        init_seed: the seed this process builds its weights from (a different one per rank: unseeded processes).
        freeze_step: 1-bit Adam's warmup, optimizer steps.
        optimizer: ``"onebit_adam"`` or a callable ``params -> optimizer``.
    """

    def __init__(self, init_seed: int, tie: bool = True, checkpointing: bool = False, shard: bool = True,
                 freeze_step: int = 3, lr: float = 3e-3, optimizer: Any = "onebit_adam",
                 steps_per_epoch: int = 64) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(init_seed)
            self.llama = TinyLlama(tie=tie, checkpointing=checkpointing)
        self.shard = shard
        self.freeze_step = freeze_step
        self.lr = lr
        self.optimizer = optimizer
        self.steps_per_epoch = steps_per_epoch
        self.losses: list[float] = []
        self.logits_dtype: Any = None

    def configure_model(self) -> None:
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["shard"]
        for block in self.llama.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.llama(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = token_batch(self.global_step, self.global_rank)
        logits = self(tokens[:, :-1])
        self.logits_dtype = logits.dtype  # bf16 under precision="bf16-mixed"
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        if callable(self.optimizer):
            return self.optimizer(self.parameters())
        return OnebitAdam(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)

    def train_dataloader(self) -> DataLoader:
        # placeholders: training_step makes its batch from the step and the rank
        return DataLoader(TensorDataset(torch.zeros(self.steps_per_epoch * 4, 1)), batch_size=1)


def local_shards(module: nn.Module) -> torch.Tensor:
    """Every parameter's local shard (the parameter itself if not sharded), flattened and concatenated."""
    return torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).clone()
                      for p in module.parameters()])


def whole_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter whole (gathered over its mesh: a collective over the shard group)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in module.parameters()]
