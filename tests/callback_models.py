"""A small LightningModule with embedding rows that are never looked up, for the callback tests (module level, so
spawned ranks can unpickle it).

``TokenRegressor``: ``y = head(tanh(mean_t emb[token_t]))`` with an ``Embedding(VOCAB, DIM)`` of which only the rows
``0..USED_ROWS-1`` ever appear in the data. The gradient of rows ``USED_ROWS..VOCAB-1`` is therefore exactly zero on
every rank and step: the coordinates 1-bit Adam's momentum mask exists for.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam

VOCAB = 20
USED_ROWS = 10
DIM = 8
SEQ = 5
BATCH = 8


def token_data(seed: int, n: int, rows: int = USED_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences of token ids in ``[0, rows)`` and a regression target that depends on the tokens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, rows, (n, SEQ), generator=g)
    values = torch.randn(USED_ROWS, generator=torch.Generator().manual_seed(4242))
    y = torch.tanh(values[tokens]).mean(1, keepdim=True) * 2.0 + 0.5
    return tokens, y


def token_loader(seed: int, n_batches: int, rows: int = USED_ROWS) -> DataLoader:
    """``n_batches`` fixed batches in a fixed order (no shuffling: every epoch sees the same batches)."""
    tokens, y = token_data(seed, n_batches * BATCH, rows)
    return DataLoader(TensorDataset(tokens, y), batch_size=BATCH, shuffle=False)


def unused_rows_mask() -> torch.Tensor:
    """1 on the rows the data use, 0 on the rows never looked up."""
    mask = torch.ones(VOCAB, DIM)
    mask[USED_ROWS:] = 0
    return mask


class TokenRegressor(pl.LightningModule):
    """Records the training loss of every step and the embedding weight after every optimizer step."""

    def __init__(self, lr: float = 1e-2, freeze_step: int = 4, seed: int = 0, vocab: int = VOCAB,
                 dead_coordinates: str = "mask", cap_update: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(vocab, DIM)
        self.head = nn.Linear(DIM, 1)
        self.lr = lr
        self.freeze_step = freeze_step
        self.dead_coordinates, self.cap_update = dead_coordinates, cap_update
        self.losses: list[float] = []
        self.emb_trace: list[torch.Tensor] = []  # emb.weight after each optimizer step of this fit

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(tokens).mean(1)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, y = batch
        loss = nn.functional.mse_loss(self(tokens), y)
        self.losses.append(loss.item())
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.emb_trace.append(self.emb.weight.detach().clone())

    def configure_optimizers(self) -> Any:
        # weight_decay 0: masked coordinates must not move at all
        return OnebitAdam(self.parameters(), lr=self.lr, weight_decay=0.0, freeze_step=self.freeze_step,
                          dead_coordinates=self.dead_coordinates, cap_update=self.cap_update)

    def eval_loss(self, loader: DataLoader) -> float:
        """Mean MSE over ``loader`` at the current parameters."""
        with torch.no_grad():
            losses = [nn.functional.mse_loss(self(tokens), y).item() for tokens, y in loader]
        return sum(losses) / len(losses)


class GrownVocabRegressor(TokenRegressor):
    """A ``TokenRegressor`` whose vocabulary grew to ``vocab`` rows since the checkpoint it resumes from: its
    ``on_load_checkpoint`` pads the saved embedding with zero rows, as a user extending a vocabulary would."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        weight = checkpoint["state_dict"]["emb.weight"]
        grown = torch.zeros(self.emb.num_embeddings, DIM, dtype=weight.dtype)
        grown[: weight.shape[0]] = weight
        checkpoint["state_dict"]["emb.weight"] = grown
