"""The ``onebit_diloco_fsdp`` Lightning strategy (:class:`OnebitDiLoCoFSDPStrategy`): local steps with FSDP2 inside
each replica and the compressed outer step across replicas (DiLoCo family, sharded).

A replica is a node, as for ``onebit_diloco``; inside it the model is sharded with FSDP2 over the node's ranks (the
``("replicate", "shard")`` mesh of ``onebit_fsdp``: parameter all-gathers and gradient reduce-scatters stay on the
fast links), and the user's optimizer steps the shards. Nothing crosses nodes between outer syncs. The outer step
(:class:`~lightning_onebit.strategy.local_steps_run.OuterSync`) works on each rank's local shards: rank ``l`` of
every replica holds the same shard of every parameter, so it averages its pseudo-gradient shard over the ranks
``l`` of the other replicas (the mesh's ``"replicate"`` group) and keeps the outer values, error feedback and outer
momentum of its shard only (``1/L`` of the model per rank, as the inner state).

Checkpoints are distributed checkpoints laid out by parameter
(:mod:`~lightning_onebit.strategy.local_steps_fsdp_checkpoint`), so a run resumes at another number of ranks per
replica (4 ranks as 2 x 2 saved, 2 as 2 x 1 resumed).
"""

from __future__ import annotations

import logging
import weakref
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Generator, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning.pytorch as pl
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.agreement import agree
from lightning_onebit.comm.outer import OuterCompression, make_outer_compressor
from lightning_onebit.strategy.arguments import check_mixed_precision, check_process_group_options
from lightning_onebit.strategy.arguments import check_ranks_per_node, shard_module_classes
from lightning_onebit.strategy.local_steps_fsdp_checkpoint import load_local_steps_checkpoint, outer_model_state
from lightning_onebit.strategy.local_steps_fsdp_checkpoint import save_local_steps_checkpoint
from lightning_onebit.strategy.local_steps_run import DEFAULTS, LocalStepsSettings, OuterSync, replica_layout
from lightning_onebit.strategy.local_steps_run import check_inner_optimizers, persistent_buffers
from lightning_onebit.strategy.local_steps_run import with_local_steps_attributes
from lightning_onebit.strategy.fsdp import setup_sharded_model
from lightning_onebit.strategy.sharding import no_gradient_sync, node_device_mesh, node_mesh_ranks
from lightning_onebit.strategy.sharding import point_at_sharded_parameters

log = logging.getLogger(__name__)

__all__ = ["OnebitDiLoCoFSDPStrategy"]

_D = DEFAULTS


@with_local_steps_attributes
class OnebitDiLoCoFSDPStrategy(ModelParallelStrategy):
    """Local steps with FSDP2 inside each replica and a compressed outer step across replicas (see the module
    docstring). What :class:`~lightning_onebit.OnebitDiLoCoStrategy` does, on a model sharded inside each node.

    The device mesh (:attr:`device_mesh`, also the LightningModule's ``self.device_mesh``) has the dimensions
    ``"replicate"`` (across replicas) and ``"shard"`` (inside one). The model is sharded either by the strategy
    (``shard_modules``) or by the LightningModule's ``configure_model`` with ``fully_shard(module,
    mesh=self.device_mesh["shard"])``. ``configure_optimizers`` returns any torch optimizer over ``self.parameters()``
    (the sharded ones, e.g. ``torch.optim.AdamW``), with LR schedulers as usual. At setup, after sharding, each
    replica gets the first replica's shards and every rank rank 0's buffers (the replicas start alike unseeded).

    * **Outer step** after every ``sync_every`` inner optimizer steps, streaming and overlap as ``onebit_diloco``;
      the outer values, error feedback and momentum are kept per rank for its shard.
    * **Validation** runs on the synced outer model; **end of fit** syncs what is left, as ``onebit_diloco``.
    * **Checkpoints** are distributed checkpoints (a folder, saved whole or not at all, its files' digests verified
      on load): the module's state dict holds the outer model; each replica's own parameters, inner optimizer state
      and error feedback, and the outer momentum, are saved by parameter as ``DTensor`` s, so a run resumes bitwise
      at the same layout, and at another number of ranks per replica (the replicas must be as many). The two-phase
      1-bit exchange (more than two replicas) also keeps a server error per rank, laid out by its buckets: restored at
      the same layout, reset (and logged) at another.
    * **Precision:** ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-true"`` (Lightning's
      ``ModelParallelStrategy``'s), or FSDP2's ``mixed_precision`` policy for the modules the strategy shards.
    * **Buffers** (e.g. BatchNorm statistics): every rank takes rank 0's at every sync of the first fragment and at
      the end of fit, as under ``onebit_diloco``. A checkpoint's module state dict holds rank 0's, and each rank's
      sidecar its own, so a resume from one saved between two syncs is bit for bit at the same layout; at another
      every rank starts from rank 0's (with a warning).

    Args:
        sync_every, compressor, fragments, overlap_steps, outer_optimizer, outer_lr, outer_momentum, bucket_cap_mb:
            as for :class:`~lightning_onebit.OnebitDiLoCoStrategy` (the same defaults); ``bucket_cap_mb`` is of one
            rank's local shards. Fragments are cut by the whole parameters' sizes (every layout cuts alike).
        ranks_per_node: ranks per replica (ranks ``kL .. kL + L - 1`` form replica ``k``); ``None`` (default): the
            nodes of Lightning's cluster environment. There must be two replicas or more.
        shard_modules: module classes the strategy wraps with ``fully_shard`` over the node (innermost first, then the
            LightningModule's children, then the LightningModule): as for :class:`~lightning_onebit.OnebitFSDPStrategy`;
            ``None`` (default): ``configure_model`` shards the model.
        mixed_precision: FSDP2's ``MixedPrecisionPolicy`` for the modules the strategy shards (needs
            ``shard_modules``). Default ``None``.
        process_group_backend, timeout: as for :class:`~lightning.pytorch.strategies.ModelParallelStrategy`; the
            mesh's groups wait ``timeout`` too.
    """

    strategy_name = "onebit_diloco_fsdp"

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
        shard_modules: Optional[Union[type[Module], Sequence[type[Module]]]] = None,
        mixed_precision: Optional[Any] = None,
        bucket_cap_mb: float = _D.bucket_cap_mb,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        settings = LocalStepsSettings.checked(sync_every, compressor, fragments, overlap_steps, outer_optimizer,
                                              outer_lr, outer_momentum, bucket_cap_mb)
        check_ranks_per_node(ranks_per_node)
        check_process_group_options(timeout, process_group_backend)
        shard_modules = shard_module_classes(shard_modules)
        if mixed_precision is not None:
            check_mixed_precision(mixed_precision)
            if shard_modules is None:
                raise ValueError(
                    "mixed_precision applies to the modules the strategy shards (shard_modules); with configure_model, "
                    "pass mp_policy=... to your fully_shard calls instead"
                )
        super().__init__(process_group_backend=process_group_backend, timeout=timeout,
                         save_distributed_checkpoint=True)
        self.ranks_per_node = ranks_per_node
        self.shard_modules = shard_modules
        self.mixed_precision = mixed_precision
        #: the outer step and its bookkeeping (:class:`~lightning_onebit.strategy.local_steps_run.OuterSync`)
        self.outer_sync = OuterSync(settings)
        #: the trainable parameters by name (``DTensor`` s), in the outer step's order (this fit's)
        self.sharded_parameters: list[tuple[str, torch.Tensor]] = []
        self._names_before_sharding: dict[int, tuple[Any, str]] = {}
        self._views_settled = False  # whether FSDP2's lazy init has run since the outer step took the local views

    # ------------------------------------------------------------------ the mesh
    def replica_layout(self) -> tuple[int, int]:
        """``(M replicas, L ranks per replica)``, checked (``ValueError`` naming the fix) before any collective."""
        per_replica = self.ranks_per_node if self.ranks_per_node is not None else self.num_processes
        return replica_layout(self.num_nodes * self.num_processes, per_replica, self.strategy_name)

    @property
    def replica_index(self) -> int:
        """This rank's replica: its row of the mesh."""
        return int((self.device_mesh.mesh == self.global_rank).nonzero()[0, 0])

    @override
    def setup_environment(self) -> None:
        ParallelStrategy.setup_environment(self)
        self.replica_layout()  # before the process group: a bad layout stops every rank
        env = self.cluster_environment
        assert env is not None and self.lightning_module is not None
        # the parameters before sharding, by name: an optimizer built from them (LightningCLI builds its optimizer
        # before fit) is pointed at the sharded ones in setup_optimizers
        self._names_before_sharding = {id(p): (weakref.ref(p), name)
                                       for name, p in self.lightning_module.named_parameters()}
        self._setup_distributed()
        grid = node_mesh_ranks(agree((env.node_rank(), env.local_rank())), self.ranks_per_node, self.strategy_name)
        self._device_mesh = node_device_mesh(self.root_device.type, grid, self._timeout)
        self.lightning_module._device_mesh = self._device_mesh  # the module's configure_model shards with it
        rank_zero_info(f"{self.strategy_name}: {len(grid)} replicas x {len(grid[0])} rank(s), the model sharded inside "
                       f"each; {self.outer_sync.settings.describe()}")

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}  # every rank trains on its own data

    # ------------------------------------------------------------------ the model
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        setup_sharded_model(self, self.shard_modules, self.mixed_precision)  # no gradient crosses replicas
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        assert self.model is not None
        check_inner_optimizers(self.optimizers, self.strategy_name)
        for optimizer in self.optimizers:
            point_at_sharded_parameters(optimizer, self.model, self._names_before_sharding, self.strategy_name)
        self._names_before_sharding = {}
        named = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        replicate = self.device_mesh["replicate"].get_group()
        compression = self.outer_sync.settings.compression
        with torch.no_grad():
            local = [p.to_local().detach() for _, p in named]
        self.outer_sync.build(local, lambda: make_outer_compressor(compression, replicate), shard_group=None,
                              sizes=[p.numel() for _, p in named], buffers=persistent_buffers(self.model))
        assert self.outer_step is not None
        self._views_settled = False
        by_id = {id(t): pair for t, pair in zip(local, named)}
        self.sharded_parameters = [by_id[id(t)] for t in self.outer_step.params]

    def _point_at_local_shards(self) -> None:
        """FSDP2 may give a parameter a new local tensor once (its lazy init, at the first forward, re-pads the shard;
        and a state dict loaded with ``assign``): the outer step then follows it (same shapes, same values). Checked
        up to the first optimizer step of a fit and of a resumed run, not on every step."""
        outer_step = self.outer_step
        if outer_step is None or self._views_settled:
            return
        with torch.no_grad():  # views, no autograd node per parameter and step
            current = [p.to_local() for _, p in self.sharded_parameters]
        if any(t.data_ptr() != held.data_ptr() for t, held in zip(current, outer_step.params)):
            outer_step.replace_params([t.detach() for t in current])

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
        self._point_at_local_shards()
        self._views_settled = True  # a forward ran: FSDP2's lazy init is behind us
        self.outer_sync.after_optimizer_step()
        return output

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No reduce-scatter inside the node on the micro-batches before the last of an accumulation."""
        with no_gradient_sync(self.model):
            yield

    def sync(self) -> None:
        """Sync every fragment that took inner steps since its last sync now, unoverlapped, so that every rank's
        shards are the outer ones (a collective: every rank calls it at the same inner step)."""
        self._point_at_local_shards()
        self.outer_sync.sync()

    @override
    def on_train_end(self) -> None:
        self._point_at_local_shards()
        self.outer_sync.sync_at_end_of_fit(self.strategy_name)
        super().on_train_end()

    @override
    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._point_at_local_shards()
        self.outer_sync.swap_in_outer()

    @override
    def on_validation_end(self) -> None:
        self.outer_sync.swap_back()
        super().on_validation_end()

    @property
    def communication(self) -> CommunicationCounters:
        """This rank's cumulative bytes of the outer syncs (FSDP's collectives inside the node are not counted)."""
        return self.outer_communication

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state dict with the outer parameters (``DTensor`` s: the model every replica agrees on)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        assert self.model is not None
        state = get_model_state_dict(self.model)
        if self.outer_step is None:
            return state
        self._point_at_local_shards()
        return outer_model_state(state, self.model, self.outer_step, self.sharded_parameters)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return {}  # each replica's inner state is saved by parameter with the rest (save_checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A distributed checkpoint, saved whole or not at all
        (:func:`~lightning_onebit.strategy.local_steps_fsdp_checkpoint.save_local_steps_checkpoint`)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(..., storage_options=...) is not supported: the "
                            "strategy writes its distributed checkpoints itself, not through a CheckpointIO")
        assert self.model is not None
        if self.outer_step is not None:
            self._point_at_local_shards()
        save_local_steps_checkpoint(self, checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a distributed checkpoint of this strategy at this run's mesh (resharded when the ranks per replica
        changed): every rank checks the folder against its manifest first and raises the same error if any rank
        found a problem
        (:func:`~lightning_onebit.strategy.local_steps_fsdp_checkpoint.load_local_steps_checkpoint`)."""
        self._point_at_local_shards()
        self._views_settled = False  # a load may assign new tensors
        return load_local_steps_checkpoint(self, Path(agree(checkpoint_path)[0]), weights_only)

    # ------------------------------------------------------------------ teardown and registry
    @override
    def teardown(self) -> None:
        self.outer_sync.release()  # its compressors hold the replicate group
        self.sharded_parameters = []
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="local steps with FSDP2 inside each replica and a compressed outer "
            "step across replicas (DiLoCo family)")
