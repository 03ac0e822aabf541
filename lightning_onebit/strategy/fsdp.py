"""The ``onebit_fsdp`` Lightning strategy: FSDP2 inside each node, the compressed optimizers across nodes.

With ``M`` nodes of ``L`` ranks each, the strategy builds a ``("replicate", "shard")`` device mesh of shape
``(M, L)``: a row is one node's ranks, a column the ranks that hold the same shard on every node. The model is
sharded over the ``"shard"`` dimension (``fully_shard(module, mesh=device_mesh["shard"])``), so parameter all-gathers
and gradient reduce-scatters stay on the fast links inside a node. Across nodes, each rank's gradient shard is averaged
over its replicate group in full precision during warmup (:mod:`lightning_onebit.hooks.fsdp`), and after the freeze
the optimizer averages its 1-bit compressed momentum shard over that group instead: about ``N / 8 · 2 (M-1)/M`` bytes
leave a node per step, as with the hierarchical DDP exchange, while each rank holds ``1/L`` of the parameters,
gradients, momentum, variance and error feedback.
"""

from __future__ import annotations

import logging
import uuid
import weakref
from contextlib import contextmanager
from pathlib import Path
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_onebit._checks import check_flag
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.agreement import agree
from lightning_onebit.comm.groups import destroy_groups
from lightning_onebit.comm.topology import new_gather_groups
from lightning_onebit.hooks import OverlapFallbackReason
from lightning_onebit.hooks.fsdp import ReplicaAllReduceState, ShardedOverlapState
from lightning_onebit.hooks.fsdp import register_replica_allreduce_hook
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy.arguments import check_mixed_precision, check_overlap, check_process_group_options
from lightning_onebit.strategy.arguments import check_ranks_per_node, shard_module_classes, the_compressed_optimizer
from lightning_onebit.strategy.checkpoint import restore_per_rank_state, save_per_rank_state
from lightning_onebit.strategy.checkpoint_files import MANIFEST_NAME, SAVE_RECORD_KEY, FolderSave, agree_on_problems
from lightning_onebit.strategy.checkpoint_files import folder_problems
from lightning_onebit.strategy.error_feedback import ErrorFeedbackPolicy
from lightning_onebit.strategy.overlap_policy import decide_overlap, overlap_blocker, overlap_fallback
from lightning_onebit.strategy.sharded_precision import ShardedPrecision, sharded_precision
from lightning_onebit.strategy.sharded_checkpoint import is_distributed_checkpoint, load_sharded_checkpoint
from lightning_onebit.strategy.sharded_checkpoint import with_rank0_buffers
from lightning_onebit.strategy.sharded_checkpoint import save_sharded_checkpoint, sharded_optimizer_state
from lightning_onebit.strategy.sharding import (
    broadcast_from_first_replica,
    check_sharded,
    fsdp_buckets,
    node_device_mesh,
    no_gradient_sync,
    node_mesh_ranks,
    point_at_sharded_parameters,
    shard_model,
)
from lightning_onebit.strategy.sidecar import sidecar_in_folder, sidecar_path
from lightning_onebit.strategy.stage_log import StageLog
from lightning_onebit.strategy.stepping import CompressedStepping
from lightning_onebit.strategy.warmup_exchange import check_sharded_warmup_exchange

log = logging.getLogger(__name__)

__all__ = ["OnebitFSDPStrategy", "node_mesh_ranks"]


class OnebitFSDPStrategy(CompressedStepping, ModelParallelStrategy):
    """FSDP2 inside each node and 1-bit Adam, 0/1 Adam or 1-bit LAMB across nodes (see the module docstring).

    The device mesh (:attr:`device_mesh`, also the LightningModule's ``self.device_mesh``) has the dimensions
    ``"replicate"`` (across nodes) and ``"shard"`` (inside a node). The model is sharded either by the strategy
    (``shard_modules``) or by the LightningModule's ``configure_model`` with ``fully_shard(module,
    mesh=self.device_mesh["shard"])``. Every rank gets different data (the sampler splits over all ranks).
    ``configure_optimizers`` returns one :class:`~lightning_onebit.OnebitAdam`, :class:`~lightning_onebit.ZeroOneAdam`
    or :class:`~lightning_onebit.OnebitLamb` over ``self.parameters()``; the strategy points its exchange at the
    replicate group and lays its momentum buckets out like the FSDP groups (one bucket per module that ``fully_shard``
    wrapped). At setup, after sharding, each parameter's local shard is broadcast over its replicate group from the
    group's first rank, and the buffers over every rank from rank 0, so that every node trains the same model even
    when the processes were not seeded alike (as DDP does; a checkpoint to resume from is loaded afterwards). The
    mesh's groups wait ``timeout``.

    Args:
        ranks_per_node: ranks per node; ``None`` (default) takes the placement from Lightning's cluster environment
            (torchrun, SLURM, ...). Set it to simulate nodes on one host (ranks ``kL .. kL + L - 1`` form node ``k``).
        shard_modules: module classes whose instances the strategy wraps with ``fully_shard`` over the shard mesh
            (innermost first), then every direct child of the LightningModule that holds parameters (FSDP gathers a
            module's parameters in that module's forward: ``training_step`` may call ``self.bert(...)`` rather than
            ``self(...)``), then the LightningModule if it holds parameters of its own (its ``forward`` must then be
            what ``training_step`` calls); ``None`` (default): the LightningModule's ``configure_model`` shards the
            model. One class alone is taken as a list of one. A module holding a parameter shared with a module
            outside it (tied weights) is left to the group of a module above that holds both, so that they stay tied.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` for the modules the strategy shards, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: forward and backward in
            bf16 on all-gathered bf16 parameters, gradients reduced in fp32, the optimizer on fp32 master shards.
            Its dtypes must be floating point or ``None``. With ``configure_model`` pass ``mp_policy`` to
            ``fully_shard`` there. Default ``None`` (no policy: the Trainer's ``precision`` applies).
        timeout, process_group_backend: as for :class:`~lightning.pytorch.strategies.ModelParallelStrategy`; the
            device mesh's groups wait ``timeout`` too (a stalled rank makes its peers fail after it).
        error_feedback: what happens to each rank's compression error feedback (the worker and server error of its
            shards) when training resumes from a checkpoint. ``"keep"`` (default): every rank writes it to a sidecar
            file in the checkpoint's folder (``<checkpoint>/onebit-rank<r>``), and on resume every rank restores
            it if every rank can, else every rank resets it, with one warning naming the ranks, files and reasons
            (sidecars of another world size never restore). ``"reset"``: no sidecars; the
            buffers restart from zero and rank 0's dropped norm is logged. ``"require"``: as ``"keep"``, but a rank
            that cannot restore raises ``RuntimeError`` before any training step. Any other value is a
            ``ValueError``. An :class:`~lightning_onebit.ErrorFeedbackCheckpoint` callback overrides it
            (:attr:`error_feedback`, :mod:`~lightning_onebit.strategy.error_feedback`).
        save_distributed_checkpoint: ``True`` (default): checkpoints are distributed checkpoints (below).
            ``False``: ``trainer.save_checkpoint(path, weights_only=True)`` (or ``ModelCheckpoint(save_weights_only=
            True)``) writes one file on rank 0 with the whole, consolidated model weights, loadable by the plain
            model's ``load_state_dict`` for inference. A checkpoint to resume training from stays distributed: with
            ``False``, a ``ModelCheckpoint`` that saves more than the weights is refused at setup.
        overlap: start each FSDP group's compressed momentum exchange during backward, as soon as FSDP has its
            gradient shards (:class:`~lightning_onebit.hooks.fsdp.ShardedOverlapState`), rather than in
            ``optimizer.step``. ``"auto"`` (default): overlap unless the run changes gradients after backward or
            the optimizer cannot (the reasons of ``OnebitStrategy(overlap=...)``: clipping by norm, a GradScaler,
            a gradient-editing hook, manual optimization, 0/1 Adam), which is logged once
            (:attr:`overlap_fallback_reason`); ``True``: overlap, and a run it cannot serve is a ``ValueError`` at
            setup; ``False``: exchange in ``optimizer.step``. Same bits either way.
        warmup_exchange: how the warmup averages gradients across nodes: ``"fp32"`` only (each node's gradients are
            reduce-scattered by FSDP, and the shards allreduced across nodes in fp32,
            :class:`~lightning_onebit.hooks.fsdp.ReplicaAllReduceState`; the DDP-bucket exchanges of
            ``OnebitStrategy(warmup_exchange=...)``, ``"bf16"``, ``"int8"`` and ``"powersgd"``, do not apply to
            shards and are a ``ValueError``). Default ``None``: ``"fp32"`` (whatever ``OnebitStrategy``'s default).

    Checkpoints are distributed checkpoints (a folder with a shard per rank; model and optimizer state as
    ``DTensor`` s), loadable at another world size; per-rank error feedback goes to a sidecar file per rank
    (``error_feedback``). A save is atomic (written to a temporary folder, then put in place) and records every
    file's SHA-256, which a load verifies before reading any tensor (:meth:`save_checkpoint`,
    :meth:`load_checkpoint`).

    1-bit LAMB's per-tensor norms and maxima are the whole tensor's: each rank's figures of its shards are reduced over
    the shard group, one collective per param group per step. An optimizer that cannot train sharded parameters is
    refused at setup with the reason (none of the package's).
    """

    strategy_name = "onebit_fsdp"

    def __init__(
        self,
        ranks_per_node: Optional[int] = None,
        shard_modules: Optional[Union[type[Module], Sequence[type[Module]]]] = None,
        mixed_precision: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        error_feedback: ErrorFeedbackPolicy = "keep",
        save_distributed_checkpoint: bool = True,
        overlap: Union[bool, Literal["auto"]] = "auto",
        warmup_exchange: Optional[str] = None,
    ) -> None:
        check_overlap(overlap)
        check_sharded_warmup_exchange(warmup_exchange)
        check_ranks_per_node(ranks_per_node)
        check_flag(save_distributed_checkpoint, "save_distributed_checkpoint")
        check_process_group_options(timeout, process_group_backend)
        shard_modules = shard_module_classes(shard_modules)  # one class alone is a list of one
        if mixed_precision is not None:
            check_mixed_precision(mixed_precision)
            if shard_modules is None:
                raise ValueError(
                    "mixed_precision applies to the modules the strategy shards (shard_modules); with configure_model, "
                    "pass mp_policy=... to your fully_shard calls instead"
                )
        super().__init__(error_feedback=error_feedback, stage_log=StageLog(self.strategy_name, "each node's averaged "
                         "gradient"), process_group_backend=process_group_backend, timeout=timeout,
                         save_distributed_checkpoint=save_distributed_checkpoint)
        self.ranks_per_node = ranks_per_node
        self.shard_modules = shard_modules
        self.mixed_precision = mixed_precision
        self.replica_sync: Optional[ReplicaAllReduceState] = None
        self.overlap = overlap
        self.overlap_state: Optional[ShardedOverlapState] = None
        self.overlap_fallback_reason: Optional[OverlapFallbackReason] = None
        self._gather_group: Optional[Any] = None  # the overlapped exchange's second-phase group (this fit's)
        self._names_before_sharding: dict[int, tuple[Any, str]] = {}

    # ------------------------------------------------------------------ precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else ShardedPrecision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # clipping must see the sharded parameters, not the optimizer's stand-ins over one shard
        self._precision_plugin = None if precision_plugin is None else sharded_precision(precision_plugin)

    # ------------------------------------------------------------------ the mesh
    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        assert self.lightning_module is not None
        # the parameters before sharding, by name: an optimizer built from them (LightningCLI builds its optimizer
        # before fit) is pointed at the sharded ones in setup_optimizers
        self._names_before_sharding = {
            id(p): (weakref.ref(p), name) for name, p in self.lightning_module.named_parameters()
        }
        self._setup_distributed()
        self._device_mesh = self._build_mesh()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # the module's configure_model shards with it

    def _build_mesh(self) -> Any:
        """The ``(M, L)`` ``("replicate", "shard")`` mesh from every rank's placement (a collective)."""
        env = self.cluster_environment
        assert env is not None
        grid = node_mesh_ranks(agree((env.node_rank(), env.local_rank())), self.ranks_per_node)
        rank_zero_info(
            f"onebit_fsdp: {len(grid)} nodes x {len(grid[0])} ranks; parameters sharded inside each node, momenta "
            "compressed across nodes"
            + ("" if len(grid[0]) > 1 else " (one rank per node: nothing is sharded, and strategy='onebit_adam' "
               "trains the same with less overhead)")
        )
        # its groups wait the strategy's timeout (DeviceMesh's own would wait torch's default of 30 minutes)
        return node_device_mesh(self.root_device.type, grid, self._timeout)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank trains on its own data (the shard ranks of a node too: FSDP averages their gradients)
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # ------------------------------------------------------------------ the model
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        if self.overlap is True and trainer.state.fn == TrainerFn.FITTING:  # before any collective
            overlap_fallback(True, self._overlap_blocker(trainer), type(self).__name__, self.strategy_name)
        full = [type(c).__name__ for c in trainer.checkpoint_callbacks if not getattr(c, "save_weights_only", False)]
        if not self._save_distributed_checkpoint and full and trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(
                f"OnebitFSDPStrategy(save_distributed_checkpoint=False) writes consolidated model weights only, but "
                f"{full[0]} saves the training state: give it save_weights_only=True (or enable_checkpointing=False), "
                "or leave save_distributed_checkpoint=True for checkpoints to resume from"
            )
        self.accelerator.setup(trainer)
        replicate_group = setup_sharded_model(self, self.shard_modules, self.mixed_precision)
        self.replica_sync = ReplicaAllReduceState(replicate_group, self._sync_predicate)
        register_replica_allreduce_hook(self.model, self.replica_sync)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ------------------------------------------------------------------ the optimizer
    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        optimizer = the_compressed_optimizer(self.optimizers)
        assert self.model is not None
        point_at_sharded_parameters(optimizer, self.model, self._names_before_sharding)
        self._names_before_sharding = {}
        if optimizer.sharded_unsupported_reason is not None:
            raise ValueError(
                f"strategy='onebit_fsdp' cannot train with {type(optimizer).__name__} yet: "
                f"{optimizer.sharded_unsupported_reason}"
            )
        if not optimizer.shards:
            raise ValueError(
                f"{type(optimizer).__name__} holds none of the sharded parameters: create it in configure_optimizers "
                "from self.parameters() (after configure_model sharded them)"
            )
        optimizer.process_group = self.device_mesh["replicate"].get_group()
        assert self.model is not None
        optimizer.set_bucket_plan(fsdp_buckets(self.model, optimizer))
        self._take_optimizer(trainer, optimizer)
        self._configure_overlap(trainer, optimizer)

    # ------------------------------------------------------------------ overlap
    def _overlap_blocker(self, trainer: "pl.Trainer") -> Optional[OverlapFallbackReason]:
        return overlap_blocker(trainer, self.lightning_module, self.precision_plugin, {})

    def _configure_overlap(self, trainer: "pl.Trainer", optimizer: CompressedOptimizer) -> None:
        """Register the overlapped exchange's hooks, or log once why the exchange stays in ``optimizer.step``."""
        self._remove_overlap()
        self.overlap_state = None
        self.overlap_fallback_reason = decide_overlap(self.overlap, optimizer, lambda: self._overlap_blocker(trainer),
                                                      type(self).__name__, self.strategy_name)
        if self.overlap is False or self.overlap_fallback_reason is not None:
            return
        # the second phase in a group of its own: a copy of the replicate group (a collective over WORLD)
        self._gather_group, _ = new_gather_groups(optimizer.process_group, None, self._timeout)
        optimizer.compression.install_gather_groups(self._gather_group)
        clip_value = trainer.gradient_clip_val if trainer.gradient_clip_val else None
        self.overlap_state = ShardedOverlapState(optimizer, clip_value=clip_value)
        self.overlap_state.register()

    def _remove_overlap(self) -> None:
        """Remove the hooks and destroy the second-phase group (no collective on gloo; every rank does it at the same
        point, as NCCL wants). :attr:`overlap_state` stays, for its figures, until the next fit."""
        if self.overlap_state is not None:
            self.overlap_state.remove()
            self.overlap_state.optimizer.compression.release_gather_groups()
        if self._gather_group is not None:
            destroy_groups([self._gather_group])
            self._gather_group = None

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self.overlap_state is not None:
            self.overlap_state.new_backward()

    @override
    def teardown(self) -> None:
        self._remove_overlap()
        super().teardown()

    def _sync_predicate(self) -> bool:
        return self._onebit_optimizer is None or self._onebit_optimizer.needs_gradient_allreduce

    def _replicas(self) -> tuple[Optional[Any], Optional[list[list[int]]]]:
        # the ranks that hold the same shard on every node (the mesh's columns), compared over every rank so that
        # every rank raises when one column diverged (its other ranks would otherwise wait for the diverged ones)
        return None, self.device_mesh.mesh.t().tolist()

    @property
    def warmup_communication(self) -> CommunicationCounters:
        """This rank's cumulative counters of the replica all-reduces across nodes (the warmup's, and 0/1 Adam's
        variance steps'); :attr:`communication` adds the compressed exchange's."""
        return CommunicationCounters() if self.replica_sync is None else self.replica_sync.counters.snapshot()


    # ------------------------------------------------------------------ stepping
    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduce-scatter (and no replica all-reduce) on the micro-batches before the last of an accumulation."""
        with no_gradient_sync(self.model):
            yield

    # ------------------------------------------------------------------ checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The compressed optimizer's state keyed by parameter name, its shards as ``DTensor`` s
        (:func:`~lightning_onebit.strategy.sharded_checkpoint.sharded_optimizer_state`)."""
        inner = getattr(optimizer, "_optimizer", optimizer)
        if not isinstance(inner, CompressedOptimizer) or not inner.shards:
            return super().optimizer_state(optimizer)
        if not self._save_distributed_checkpoint:
            raise ValueError(
                "OnebitFSDPStrategy(save_distributed_checkpoint=False) writes consolidated model weights only: "
                "trainer.save_checkpoint(path, weights_only=True); the training state (optimizer shards, error "
                "feedback) is saved in distributed checkpoints (save_distributed_checkpoint=True)"
            )
        assert self.model is not None
        return sharded_optimizer_state(inner, self.model)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict, rank 0's buffers in it (:func:`with_rank0_buffers`)."""
        return with_rank0_buffers(super().lightning_module_state_dict(), self.model)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A distributed checkpoint, saved whole or not at all: a folder with the model and optimizer shards,
        ``meta.pt``, each rank's sidecar for per-rank state (the error feedback, unless :attr:`error_feedback` is
        ``"reset"``) and the manifest of the files' digests, written to a temporary sibling folder and put in place
        once every rank has written (:mod:`~lightning_onebit.strategy.checkpoint_files`). With
        ``save_distributed_checkpoint=False``, Lightning's one file of consolidated weights."""
        if not self._save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: the "
                            "strategy writes its distributed checkpoints itself, not through a CheckpointIO")
        # rank 0's path (Lightning's rule) and a save id, the same on every rank
        target, save_id = agree((filepath, uuid.uuid4().hex if self.global_rank == 0 else None))[0]
        save = FolderSave(Path(target), save_id, self.global_rank, self.world_size)
        self._error_feedback.save(checkpoint, self._onebit_optimizer)
        save.begin(lambda folder: save_per_rank_state(checkpoint, sidecar_in_folder(folder, self.global_rank), save_id,
                                                      self.global_rank, self.world_size, None))
        save_sharded_checkpoint(save, checkpoint)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a distributed checkpoint at this run's mesh (resharded when the world size changed), and this rank's
        sidecar; a bad or missing sidecar is reported under ``PER_RANK_STATUS_KEY`` (never raised here). Before
        anything is read, every rank checks what the path holds and its share of the files against the manifest,
        and every rank raises the same error if any rank found one (:func:`~lightning_onebit.strategy.
        checkpoint_files.agree_on_problems`): ``ValueError`` for a path that holds no distributed checkpoint (a
        ``onebit_adam`` file, say), :class:`~lightning_onebit.strategy.checkpoint_files.CheckpointIntegrityError`
        for a damaged one or one that mixes saves."""
        path = Path(agree(checkpoint_path)[0])
        onebit = self._onebit_optimizer
        problems = folder_problems(path, self.global_rank, self.world_size, onebit is not None, weights_only)
        verified = agree_on_problems(problems, path, self.strategy_name)
        if is_distributed_checkpoint(path) and not verified:
            rank_zero_warn(f"onebit_fsdp: {path} records no digests of its files (it was written before "
                           f"lightning_onebit recorded them in {MANIFEST_NAME}): it is loaded unverified")
        if onebit is None or not is_distributed_checkpoint(path):
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        else:
            assert self.model is not None
            checkpoint = load_sharded_checkpoint(self.model, onebit, path, verified, weights_only)
        # a save that recorded itself keeps the sidecars in its folder; earlier ones, next to it
        in_folder = checkpoint.pop(SAVE_RECORD_KEY, None) is not None
        sidecar = sidecar_in_folder(path, self.global_rank) if in_folder else sidecar_path(path, self.global_rank)
        restore_per_rank_state(checkpoint, sidecar, self.global_rank, self.world_size)
        self._error_feedback.load(checkpoint)
        return checkpoint

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "onebit_fsdp", cls, description="FSDP2 inside each node, 1-bit Adam / 0/1 Adam across nodes"
        )


def setup_sharded_model(strategy: ModelParallelStrategy, shard_modules: Optional[tuple[type[Module], ...]],
                        mixed_precision: Any) -> Any:
    """What both FSDP2 strategies (``onebit_fsdp``, ``onebit_diloco_fsdp``) do to the model at setup: shard it over
    the node (``shard_modules``, else the LightningModule's ``configure_model``: a ``TypeError`` naming both when
    neither applies), materialise it on the device, apply the precision plugin, check that every parameter is
    sharded over the node (:func:`~lightning_onebit.strategy.sharding.check_sharded`), and make the replicas
    identical as DDP does: the first replica's shards and rank 0's buffers, whatever each process's random state (a
    checkpoint to resume from is loaded after setup, over these). A collective. Returns the replicate group."""
    model, mesh = strategy.model, strategy.device_mesh
    assert model is not None
    if shard_modules is not None:
        shard_model(model, mesh["shard"], shard_modules, mixed_precision)
    elif not is_overridden("configure_model", strategy.lightning_module):
        raise TypeError(
            f"strategy='{strategy.strategy_name}' needs the model sharded over the node: pass "
            f"{type(strategy).__name__}(shard_modules=[YourBlock, ...]), or override the LightningModule's "
            "configure_model() and call fully_shard(module, mesh=self.device_mesh['shard']) there"
        )
    _materialize_distributed_module(model, strategy.root_device)
    strategy.model = strategy.precision_plugin.convert_module(model)
    strategy.model_to_device()
    check_sharded(strategy.model, mesh["shard"])
    replicate_group = mesh["replicate"].get_group()
    broadcast_from_first_replica(strategy.model, replicate_group)
    return replicate_group
