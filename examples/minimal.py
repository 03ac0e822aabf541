"""The smallest 1-bit Adam run: an MLP learns a random linear map on 2 CPU processes, offline, in seconds.

    python examples/minimal.py

The first steps are plain DDP (gradients averaged in fp32); ``freeze_step="auto"`` ends that warmup once the gradient
statistics settle, by half the run at the latest, and the remaining steps exchange 1-bit compressed momenta instead.
"""

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_onebit import OnebitAdam  # importing lightning_onebit registers strategy="onebit_adam"


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return OnebitAdam(self.parameters(), lr=1e-2, freeze_step="auto")


if __name__ == "__main__":
    pl.seed_everything(0)  # every process makes the same data
    x = torch.randn(4096, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(4096, 1)  # a random linear map plus noise: learnable
    trainer = pl.Trainer(strategy="onebit_adam", accelerator="cpu", devices=2, max_steps=300, logger=False,
                         enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Regressor(), DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    optimizer, sent = trainer.strategy.onebit_optimizer, trainer.strategy.communication
    if trainer.global_rank == 0:
        print(f"train_loss {trainer.callback_metrics['train_loss']:.4f} (predicting 0: {y.square().mean():.2f}); "
              f"stage {optimizer.stage.value} from step {optimizer.freeze_step + 1}; "
              f"{sent.bytes_fp32_equivalent / sent.bytes_sent:.1f}x fewer bytes than DDP fp32")
