"""Small LightningModules and data for the strategy tests (module level, so spawned ranks can unpickle them)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam
from lightning_onebit.hooks import leaves_gradients_unchanged

N_IN = 6
HIDDEN = 8


def teacher(x: torch.Tensor) -> torch.Tensor:
    a = torch.randn(N_IN, 3, generator=torch.Generator().manual_seed(123))
    return torch.tanh(x @ a).sum(-1, keepdim=True) * 0.7 + 0.3


def regression_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, N_IN, generator=torch.Generator().manual_seed(seed))
    return x, teacher(x)


def held_out_loss(model: nn.Module) -> float:
    """The MSE of ``model`` on 512 held-out samples of the regression task (seed 999, never trained on), in the
    model's dtype (a bf16-true model takes bf16 inputs), computed in float32."""
    x, y = regression_data(seed=999, n=512)
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).item()


def loader(seed: int, n_batches: int, batch_size: int = 8) -> DataLoader:
    """``n_batches`` batches of a fixed regression set (no shuffling, so batch ``i`` is always the same)."""
    x, y = regression_data(seed, n_batches * batch_size)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def trainer_kwargs(world_size: int, max_steps: int, **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        strategy="onebit_adam",
        accelerator="cpu",
        devices=world_size,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(overrides)
    return kwargs


def flat_params(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in module.parameters()])


def hand_gradient(params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, **model_kwargs: Any) -> torch.Tensor:
    """The flat gradient of ``Regressor``'s MSE loss on ``(x, y)`` at the flat parameters ``params`` (zeros for
    parameters without a gradient), in ``parameters()`` order."""
    model = Regressor(**model_kwargs)
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()]
    )


def step_batch(seed: int, step: int, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch determined by ``(seed, step)`` alone (see ``Regressor(data_seed=...)``)."""
    return regression_data(seed * 100_003 + step, batch_size)


def batch(seed: int, n_batches: int, index: int, batch_size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of ``loader(seed, n_batches, batch_size)``."""
    x, y = regression_data(seed, n_batches * batch_size)
    return x[index * batch_size : (index + 1) * batch_size], y[index * batch_size : (index + 1) * batch_size]


class Regressor(pl.LightningModule):
    """A 2-layer MLP regressor that records, per optimizer step, the stage it ran in, the gradient it saw (in
    ``on_before_optimizer_step``) and the parameters after it.

    ``optimizer`` is ``"onebit"`` (OnebitAdam) or ``"adamw"`` (torch.optim.AdamW, for plain DDP, or to check that the
    onebit strategy refuses it). ``lr_lambda_zero_from`` adds a LambdaLR whose factor is 0 from that
    (0-based) scheduler step on. ``inf_at_step``/``inf_rank`` multiply the loss by inf on one rank at one global step.
    With ``data_seed`` the training batch is replaced by ``step_batch(data_seed, global_step)``: the data then follow
    the step, so a run resumed from a mid-epoch checkpoint sees what the original run saw (Lightning restarts a plain
    DataLoader from its first batch on such a resume).
    """

    def __init__(
        self,
        lr: float = 1e-2,
        freeze_step: int = 5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        optimizer: str = "onebit",
        seed: int = 0,
        lr_lambda_zero_from: Optional[int] = None,
        inf_at_step: Optional[int] = None,
        inf_rank: int = 1,
        data_seed: Optional[int] = None,
        unused_layer: bool = False,
        frozen_layer: bool = False,
        eps: float = 1e-8,
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(N_IN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, 1)
        self.unused = nn.Linear(HIDDEN, HIDDEN) if unused_layer else None
        self.frozen = nn.Linear(HIDDEN, HIDDEN) if frozen_layer else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)
        self.lr = lr
        self.freeze_step = freeze_step
        self.weight_decay = weight_decay
        self.betas = betas
        self.eps = eps
        self.optimizer_kind = optimizer
        self.lr_lambda_zero_from = lr_lambda_zero_from
        self.inf_at_step = inf_at_step
        self.inf_rank = inf_rank
        self.data_seed = data_seed
        self.records: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.batch_ids: list[float] = []  # x[0, 0] of every training batch, to identify the data a step saw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))
        if self.frozen is not None:
            h = h + self.frozen(h)
        return self.l2(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch if self.data_seed is None else step_batch(self.data_seed, self.global_step)
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.batch_ids.append(x[0, 0].item())
        if self.inf_at_step is not None and self.global_step == self.inf_at_step and self.global_rank == self.inf_rank:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self) -> Any:
        params = list(self.parameters())  # frozen (requires_grad=False) ones included, as users typically do
        if self.optimizer_kind == "onebit":
            opt = OnebitAdam(
                params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay, freeze_step=self.freeze_step
            )
        else:
            opt = torch.optim.AdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)
        if self.lr_lambda_zero_from is None:
            return opt
        zero_from = self.lr_lambda_zero_from
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.0 if i >= zero_from else 1.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ---------------------------------------------------------------- recording
    def _onebit(self) -> Optional[OnebitAdam]:
        opt = self.trainer.strategy.optimizers[0]
        opt = getattr(opt, "_optimizer", opt)
        return opt if isinstance(opt, OnebitAdam) else None

    @leaves_gradients_unchanged  # records only: the overlapped exchange stays on
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        onebit = self._onebit()
        self.records.append(
            dict(
                global_step=self.trainer.global_step,
                stage=None if onebit is None else onebit.stage.value,
                step_count=None if onebit is None else onebit.step_count,
                lr=optimizer.param_groups[0]["lr"],
                params_before=flat_params(self),
                grad=torch.cat(
                    [
                        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).clone()
                        for p in self.parameters()
                    ]
                ),
            )
        )

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.records[-1]["params_after"] = flat_params(self)
        onebit = self._onebit()
        self.records[-1]["step_count_after"] = None if onebit is None else onebit.step_count


class ManualRegressor(Regressor):
    """The same model with manual optimization (``manual_backward`` + ``opt.step()``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        self.batch_ids.append(x[0, 0].item())
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()  # on_before_optimizer_step (inherited) records stage, gradient and parameters before the step
        self.records[-1]["params_after"] = flat_params(self)
        self.records[-1]["step_count_after"] = self._onebit().step_count


def fit_save_and_resume(fit: Any, workdir: str, **common: Any) -> dict[str, dict[str, Any]]:
    """The runs an exact-resume test compares: ``fit(**kwargs)`` with a checkpoint every epoch and
    ``ErrorFeedbackCheckpoint("keep")`` (``"full"``), then a run resumed from its epoch-1 checkpoint with ``"keep"``
    (``"resumed"``, with ``"restored"``: whether the error feedback was restored)."""
    import os

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_onebit import ErrorFeedbackCheckpoint

    def checkpoints(run: str) -> ModelCheckpoint:
        return ModelCheckpoint(dirpath=os.path.join(workdir, run), filename="{epoch}", every_n_epochs=1, save_top_k=-1)

    out = {"full": fit(callbacks=[ErrorFeedbackCheckpoint("keep"), checkpoints("full")], **common)}
    keep = ErrorFeedbackCheckpoint("keep")
    out["resumed"] = fit(callbacks=[keep, checkpoints("resumed")],
                         ckpt_path=os.path.join(workdir, "full", "epoch=1.ckpt"), **common)
    out["resumed"]["restored"] = keep.restored
    return out


class TinyClassifier(pl.LightningModule):
    """A small model shaped like the example's (a token embedding, dense layers with a LayerNorm, a classification
    head; cross-entropy), trained by OnebitAdam on data that follow the step (``token_batch(data_seed, step)``: a
    resumed run sees what the original saw). Records the flat parameters after every optimizer step."""

    vocab, width, classes = 40, 16, 3

    def __init__(self, freeze_step: int = 8, data_seed: int = 0, lr: float = 1e-2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(self.vocab, self.width)
        self.dense = nn.Linear(self.width, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, self.classes)
        self.freeze_step, self.data_seed, self.lr = freeze_step, data_seed, lr
        self.params_after: list[torch.Tensor] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.tanh(self.dense(self.emb(tokens).mean(1)))))

    @classmethod
    def token_batch(cls, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed * 100_003 + step)
        tokens = torch.randint(0, cls.vocab, (8, 5), generator=generator)
        return tokens, tokens[:, 0] % cls.classes  # the class is in the first token

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, labels = self.token_batch(self.data_seed, self.global_step)
        return nn.functional.cross_entropy(self(tokens), labels)

    def configure_optimizers(self) -> Any:
        return OnebitAdam(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self.params_after.append(flat_params(self))
