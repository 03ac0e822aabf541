"""A minimal LightningCLI app used by tests/strategy/test_cli.py: a regression model whose optimizer comes from the
config."""

import json
import os

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset

import lightning_onebit  # noqa: F401  (registers the onebit_adam strategies)


class RegressionModule(L.LightningModule):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)


class RegressionData(L.LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=self.batch_size)


class Report(L.Callback):
    """Writes what each rank ended with to $CLI_REPORT_DIR/rank{N}.json."""

    def on_train_end(self, trainer, pl_module):
        optimizer = trainer.strategy.onebit_optimizer
        report = dict(
            strategy=type(trainer.strategy).__name__,
            optimizer=type(trainer.optimizers[0]).__name__,
            freeze_step=optimizer.freeze_step,
            step_count=optimizer.step_count,
            stage=optimizer.stage.value,
            params=[p.detach().flatten().tolist() for p in pl_module.parameters()],
        )
        path = os.path.join(os.environ["CLI_REPORT_DIR"], f"rank{trainer.global_rank}.json")
        with open(path, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    LightningCLI(RegressionModule, RegressionData, trainer_defaults={"callbacks": [Report()]}, seed_everything_default=0)
