"""The ``onebit_diloco`` Lightning strategy (:class:`OnebitDiLoCoStrategy`): local steps inside each replica and a
compressed outer step across replicas every ``sync_every`` inner steps (DiLoCo, SparseLoCo).

A replica is a node (:class:`~lightning_onebit.Topology`; ``ranks_per_node`` simulates nodes on one host). Inside it
the inner steps are ordinary DDP over the node's ranks (gradients averaged on the fast link) with the user's own
optimizer; across replicas nothing is sent between outer syncs. The outer step is :class:`~lightning_onebit.optim.
streaming.StreamingOuterStep` (fragments, overlap) of :class:`~lightning_onebit.optim.outer_step.OuterStep`s, whose
exchange is sharded over the node's ranks: the bytes leaving a node per sync are those of one exchange.

:data:`~lightning_onebit.strategy.local_steps_run.DEFAULTS` is the one place where the defaults are chosen, from the
measurements its docstring cites; :class:`~lightning_onebit.strategy.local_steps_run.OuterSync` runs the outer step
(this strategy and ``onebit_diloco_fsdp`` hold one).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_onebit._checks import check_integer
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.groups import broadcast_coalesced, destroy_groups, is_distributed
from lightning_onebit.comm.outer import OuterCompression, make_outer_compressor
from lightning_onebit.comm.topology import Topology
from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook
from lightning_onebit.strategy.arguments import check_process_group_options, ddp_kwargs_for
from lightning_onebit.strategy.checkpoint import PER_RANK_STATE_KEY, agree_run_id, owned_sidecar
from lightning_onebit.strategy.checkpoint import remove_sidecar, restore_per_rank_state, save_per_rank_state
from lightning_onebit.strategy.checkpoint_files import LoadProblems, agree_on_problems
from lightning_onebit.strategy.checkpoint_kinds import ddp_folder_problem
from lightning_onebit.strategy.local_steps_run import DEFAULTS, OUTER_LR, OuterSync, LocalStepsDefaults
from lightning_onebit.strategy.local_steps_run import LocalStepsSettings, check_inner_optimizers, replica_layout
from lightning_onebit.strategy.local_steps_run import persistent_buffers, with_local_steps_attributes
from lightning_onebit.strategy.local_steps_state import STATE_KEY, agreed_per_rank_state, streaming_outer_state
from lightning_onebit.strategy.sidecar import sidecar_path

log = logging.getLogger(__name__)

__all__ = ["DEFAULTS", "OUTER_LR", "LocalStepsDefaults", "OnebitDiLoCoStrategy"]

_D = DEFAULTS


@with_local_steps_attributes
class OnebitDiLoCoStrategy(DDPStrategy):
    """Local steps with a compressed outer step (the DiLoCo family) on Lightning's DDP.

    Replicas are nodes: ``M`` nodes of ``L`` ranks each train ``M`` replicas. ``configure_optimizers`` returns any
    torch optimizer (the *inner* optimizer, e.g. ``torch.optim.AdamW``), with LR schedulers as usual; inside a
    replica its steps run on gradients averaged by DDP over the node's ranks; a replica of one rank trains alone.
    After every ``sync_every`` inner optimizer steps the outer step runs (:class:`~lightning_onebit.optim.outer_step.
    OuterStep`): the pseudo-gradient ``theta_outer - theta_local`` is averaged over the replicas by ``compressor``
    (with error feedback per rank), the outer optimizer applies it, and every rank's parameters become the new outer
    parameters, bitwise the same everywhere. At the start of ``fit`` every rank gets rank 0's parameters and buffers.

    * **Validation** runs on the synced outer model: between syncs each rank's parameters are swapped for the outer
      ones for the validation loop and swapped back after it (one copy of the parameters meanwhile).
    * **End of fit:** when the last outer period is partial, one more outer step runs, so that the model ``fit``
      leaves behind holds every inner step, the same on every rank.
    * **Checkpoints** hold the outer model as the module's ``state_dict`` (loadable by the plain model, what every
      replica agrees on); each rank writes a sidecar (``<checkpoint>.onebit-rank<r>``) with its own parameters, the
      inner optimizers' and its loss scaler's states, its outer-optimizer state and error feedback (its shard) and the
      position in the outer period: a resumed run continues bit for bit. Resuming needs every rank's sidecar: a
      missing or foreign one stops every rank with the reason.
    * **Bytes:** :attr:`communication` (inner DDP allreduces inside the node, outer syncs), :attr:`outer_communication`
      and :attr:`last_sync_communication`; :class:`~lightning_onebit.CommunicationMonitor` logs them per step.
    * **Buffers** (e.g. BatchNorm statistics) are not parameters: at every sync of the first fragment (once per outer
      period) and at the end of fit every rank takes rank 0's, as DDP does at every forward (one broadcast per
      dtype, counted in :attr:`outer_communication`), so the replicas then hold the same bits; a checkpoint keeps
      each rank's own in its sidecar.
    * An inner step is an optimizer step (not a batch: accumulation), one a loss scaler skips included; with several
      optimizers, every one's step counts.

    Args:
        sync_every: inner optimizer steps between outer syncs, an integer >= 1. Default 4 (:data:`DEFAULTS`, which
            says how it was chosen).
        compressor: ``"none"`` (fp32), ``"bf16"``, ``"onebit"`` or ``"topk"``, or an
            :class:`~lightning_onebit.comm.outer.OuterCompression` with its options (top-k's chunk and kept values,
            error decay). Default ``"onebit"``.
        fragments: streaming: the parameters cut into this many fragments (contiguous, about equal sizes), each
            synced every ``sync_every`` steps at its own offset, so a sync sends ``1/fragments`` of the bytes
            (:mod:`~lightning_onebit.optim.streaming`); in ``[1, sync_every]``. Default 1.
        overlap_steps: inner steps that run while a fragment's exchange is in flight; after them its parameters are
            rebased on the new outer values, keeping those steps (replicas then differ by them until the fragment's
            next sync; the outer model is bitwise the same everywhere). In ``[0, sync_every - 1]``. Default 0.
        outer_optimizer: ``"sgd"`` (no momentum: ``theta_outer -= outer_lr * average``, SparseLoCo's
            error-feedback-only form) or ``"nesterov"`` (SGD with Nesterov momentum, DiLoCo's). Default ``"sgd"``.
        outer_lr: the outer learning rate, > 0 (1 with ``"sgd"``: the average applied as it is). Default ``None``:
            0.7 for ``"sgd"`` (measured), DiLoCo's 0.7 for ``"nesterov"`` (:data:`OUTER_LR`).
        outer_momentum: ``"nesterov"``'s momentum, in (0, 1). Default 0.9 (DiLoCo's).
        ranks_per_node: ranks per replica: ranks ``kL .. kL + L - 1`` form replica ``k`` (e.g. to simulate nodes on
            one host); ``None`` (default): the nodes of Lightning's cluster environment (``Trainer(num_nodes=M,
            devices=L)``). It must divide the world size into two replicas or more.
        bucket_cap_mb: most MB of one bucket of the outer exchange (of one rank's shard). Default 16.
        accelerator, parallel_devices, cluster_environment, checkpoint_io: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy`.
        precision_plugin, process_group_backend, timeout, start_method: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy`.
        find_unused_parameters, static_graph, gradient_as_bucket_view: passed to the inner ``DistributedDataParallel``.
            Default ``False``.
        ddp_bucket_cap_mb: the inner DDP's gradient bucket size in MB; ``None`` keeps DDP's default (25).
        ddp_kwargs: any other ``DistributedDataParallel`` arguments of the inner DDP (not ``process_group``: it is
            the node's).
    """

    strategy_name = "onebit_diloco"

    def __init__(
        self,
        sync_every: int = _D.sync_every,
        compressor: Union[str, OuterCompression] = _D.compressor,
        fragments: int = 1,
        overlap_steps: int = 0,
        outer_optimizer: str = _D.outer_optimizer,
        outer_lr: Optional[float] = None,
        outer_momentum: float = _D.outer_momentum,
        ranks_per_node: Optional[int] = None,
        bucket_cap_mb: float = _D.bucket_cap_mb,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        ddp_bucket_cap_mb: Optional[float] = None,
        ddp_kwargs: Optional[dict[str, Any]] = None,
    ) -> None:
        settings = LocalStepsSettings.checked(sync_every, compressor, fragments, overlap_steps, outer_optimizer,
                                              outer_lr, outer_momentum, bucket_cap_mb)
        self.ranks_per_node = check_integer(ranks_per_node, "ranks_per_node", none=True)
        check_process_group_options(timeout, process_group_backend)
        if ddp_kwargs is not None and "process_group" in ddp_kwargs:
            raise ValueError("the inner DDP runs over the ranks of each replica (node); do not pass process_group")
        ddp_kwargs = ddp_kwargs_for(ddp_kwargs, find_unused_parameters=find_unused_parameters,
                                    static_graph=static_graph, gradient_as_bucket_view=gradient_as_bucket_view,
                                    ddp_bucket_cap_mb=ddp_bucket_cap_mb, ddp_comm_hook=None)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method, **ddp_kwargs)
        self.topology: Optional[Topology] = None
        #: the inner gradient allreduce inside the replica, counted (its process group is the node's)
        self.gradient_sync = GradientSyncState()
        #: the outer step and its bookkeeping (:class:`~lightning_onebit.strategy.local_steps_run.OuterSync`)
        self.outer_sync = OuterSync(settings)
        self._run_id, self._save_index = "", 0

    # ------------------------------------------------------------------ replicas
    def replica_layout(self) -> tuple[int, int]:
        """``(M replicas, L ranks per replica)`` from ``ranks_per_node`` or the Trainer's nodes and devices, checked
        (``ValueError`` naming the fix) before any collective."""
        per_replica = self.ranks_per_node if self.ranks_per_node is not None else self.num_processes
        return replica_layout(self.num_nodes * self.num_processes, per_replica, self.strategy_name)

    @override
    def setup_distributed(self) -> None:
        self.replica_layout()  # before the process group: a bad layout stops every rank here
        super().setup_distributed()

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            replicas, per_replica = self.replica_layout()
            env = self.cluster_environment
            assert env is not None
            self.topology = Topology.build(env.node_rank(), env.local_rank(),
                                           mode="hierarchical" if per_replica > 1 else "flat",
                                           ranks_per_node=self.ranks_per_node, timeout=self._timeout)
            self._run_id, self._save_index = agree_run_id(self.global_rank), 0
            rank_zero_info(f"onebit_diloco: {replicas} replicas x {per_replica} rank(s); "
                           f"{self.outer_sync.settings.describe()}")
        super().setup(trainer)

    @property
    def replica_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks with this rank's local index in every replica, which exchange one shard (``None``: WORLD)."""
        topology = self.topology
        return topology.inter_group if topology is not None and topology.is_hierarchical else None

    @property
    def node_group(self) -> Optional[dist.ProcessGroup]:
        """The ranks of this rank's replica (``None``: the replica is this rank alone)."""
        topology = self.topology
        return topology.intra_group if topology is not None and topology.is_hierarchical else None

    @override
    def _setup_model(self, model: Module) -> Module:
        if is_distributed():  # every replica starts from rank 0's model (one broadcast per dtype, not per tensor)
            with torch.no_grad():
                broadcast_coalesced(list(model.parameters()) + list(model.buffers()))
        group = self.node_group
        if group is None:
            return model  # a replica of one rank: its inner steps need no communication
        self.gradient_sync.process_group = group
        # every peer of the inner allreduce is on this rank's node
        self.gradient_sync.topology = Topology.plan([(0, r) for r in range(dist.get_world_size(group))], "flat",
                                                    dist.get_rank(group))
        return DistributedDataParallel(module=model, device_ids=self.determine_ddp_device_ids(), process_group=group,
                                       **self._ddp_kwargs)

    @override
    def _register_ddp_hooks(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model.register_comm_hook(self.gradient_sync, switchable_allreduce_hook)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        module = self.lightning_module
        check_inner_optimizers(self.optimizers, self.strategy_name)
        assert module is not None
        compression = self.outer_sync.settings.compression
        self.outer_sync.build([p for p in module.parameters() if p.requires_grad],
                               lambda: make_outer_compressor(compression, self.replica_group),
                               shard_group=self.node_group, buffers=persistent_buffers(module))

    # ------------------------------------------------------------------ steps
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union["pl.LightningModule", Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.outer_sync.after_optimizer_step()
        return output

    def sync(self) -> None:
        """Sync every fragment that took inner steps since its last sync now, unoverlapped (the exchanges in flight
        finished and rebased first), so that every rank's parameters are the outer ones, the same bits everywhere (a
        collective: every rank calls it at the same inner step)."""
        self.outer_sync.sync()

    @override
    def on_train_end(self) -> None:
        self.outer_sync.sync_at_end_of_fit(self.strategy_name)
        super().on_train_end()

    # ------------------------------------------------------------------ validation on the outer model
    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self.outer_sync.swap_in_outer()

    @override
    def on_validation_end(self) -> None:
        self.outer_sync.swap_back()
        super().on_validation_end()

    # ------------------------------------------------------------------ bytes
    @property
    def communication(self) -> CommunicationCounters:
        """This rank's cumulative communication: the inner gradient allreduces inside the replica (intra-node) and
        the outer syncs (:attr:`outer_communication`)."""
        self.gradient_sync.settle_timings()
        return self.gradient_sync.counters.snapshot() + self.outer_communication

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the outer parameters (the model every replica agrees on)."""
        module = self.lightning_module
        if self.outer_step is None or module is None:
            return super().lightning_module_state_dict()
        self.outer_step.finish_in_flight()  # every rank dumps every checkpoint; the training does not change
        outer = self.outer_step.outer_values()
        return {name: outer[id(t)].clone() if id(t) in outer else t.detach()
                for name, t in module.state_dict(keep_vars=True).items()}

    def _per_rank_state(self) -> dict[str, Any]:
        assert self.outer_step is not None
        self.outer_step.finish_in_flight()
        local = self.outer_sync.local_values()
        # the loss scaler's state too: replicas skip different steps, and the main file holds only rank 0's scaler
        return {"inner_steps": self.inner_steps, "local_params": local, "outer": self.outer_step.state_dict(),
                "inner_optimizers": [optimizer.state_dict() for optimizer in self.optimizers],
                "precision": self.precision_plugin.state_dict(),
                "local_buffers": [b.detach().clone() for b in self.outer_sync.buffers]}

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, "os.PathLike[str]"],
                        storage_options: Optional[Any] = None) -> None:
        # every rank comes here for every save (Lightning writes the main file on rank 0 only)
        if self.outer_step is not None:
            checkpoint[PER_RANK_STATE_KEY] = {STATE_KEY: self._per_rank_state()}
            checkpoint_id = f"{self._run_id}/{self._save_index + 1}"
            if save_per_rank_state(checkpoint, sidecar_path(filepath, self.global_rank), checkpoint_id,
                                   self.global_rank, self.world_size, self.topology):
                self._save_index += 1
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: Union[str, "os.PathLike[str]"], weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        problem = ddp_folder_problem(Path(os.fspath(checkpoint_path)), self.strategy_name)  # a distributed one
        agree_on_problems(LoadProblems(wrong_kind=[problem] if problem else []), checkpoint_path, self.strategy_name)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        restore_per_rank_state(checkpoint, sidecar_path(checkpoint_path, self.global_rank), self.global_rank,
                               self.world_size)
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """The inner optimizers' states, then this rank's own state from its sidecar (every rank, or a
        ``RuntimeError`` on every rank naming the ranks whose sidecar cannot be used)."""
        super().load_optimizer_state_dict(checkpoint)
        if self.outer_step is None:
            return
        self._load_per_rank_state(agreed_per_rank_state(checkpoint))

    def _load_per_rank_state(self, state: dict[str, Any]) -> None:
        assert self.outer_step is not None
        self.outer_step.load_state_dict(streaming_outer_state(state, self.outer_sync.settings.sync_every))
        for optimizer, saved in zip(self.optimizers, state["inner_optimizers"]):
            optimizer.load_state_dict(saved)
        with torch.no_grad():
            for p, local in zip(self.outer_step.params, state["local_params"]):
                p.copy_(local)
            # this rank's own buffers (an older sidecar has none: rank 0's stay)
            for buffer, saved in zip(self.outer_sync.buffers, state.get("local_buffers") or ()):
                buffer.copy_(saved)
        self.outer_sync.inner_steps = int(state["inner_steps"])
        if state.get("precision"):  # this rank's loss scaler (an older sidecar has none: rank 0's stays)
            self.precision_plugin.load_state_dict(state["precision"])

    @override
    def remove_checkpoint(self, filepath: Union[str, "os.PathLike[str]"]) -> None:
        sidecar = owned_sidecar(filepath, self.global_rank)  # before the file goes (a link owns no sidecar)
        super().remove_checkpoint(filepath)
        remove_sidecar(sidecar)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        super().teardown()  # unwraps DDP, which holds the node group
        self.outer_sync.release()  # its compressors hold the replica group
        self.gradient_sync.process_group = None
        self.gradient_sync.topology = None
        if self.topology is not None:
            destroy_groups(self.topology.groups)
            self.topology = None

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("onebit_diloco", "popen"), ("onebit_diloco_spawn", "spawn"),
                                   ("onebit_diloco_fork", "fork")):
            strategy_registry.register(
                name, cls, description=f"local steps with a compressed outer step (DiLoCo family), start_method "
                f"'{start_method}'", start_method=start_method)

