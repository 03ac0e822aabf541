"""The ``onebit_adam`` Lightning strategy: DDP whose gradient allreduce the compressed optimizer switches off after its
warmup (1-bit Adam, 1-bit LAMB) or on chosen steps only (0/1 Adam)."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

import lightning.pytorch as pl
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.topology import Topology, TopologyMode
from lightning_onebit.hooks import ExchangeHookState, GradientSyncState, OverlapFallbackReason, OverlapState
from lightning_onebit.hooks import ParameterKeyedState, exchange_hook
from lightning_onebit.optim import CompressedOptimizer
from lightning_onebit.strategy.arguments import check_options, check_process_group_options, ddp_kwargs_for
from lightning_onebit.strategy.arguments import the_compressed_optimizer
from lightning_onebit.strategy.clipping import AgreedClippingPrecision, agreed_clipping_precision
from lightning_onebit.strategy.checkpoint import PER_RANK_STATE_KEY, PER_RANK_STATUS_KEY, agree_run_id
from lightning_onebit.strategy.checkpoint import restore_per_rank_state, save_per_rank_state
from lightning_onebit.strategy.checkpoint_files import LoadProblems, agree_on_problems
from lightning_onebit.strategy.checkpoint_kinds import ddp_folder_problem
from lightning_onebit.strategy.error_feedback import ErrorFeedbackPolicy
from lightning_onebit.strategy.overlap_policy import GRADIENT_HOOKS, decide_overlap, note_bucket_cap, overlap_blocker
from lightning_onebit.strategy.overlap_policy import overlap_fallback
from lightning_onebit.strategy.precision import RankSyncedGradScaler
from lightning_onebit.strategy.process_groups import OwnedProcessGroups, build_topology, release_at_exit
from lightning_onebit.strategy.sidecar import sidecar_path
from lightning_onebit.strategy.stepping import CompressedStepping
from lightning_onebit.strategy.warmup_exchange import WarmupExchange, WarmupExchangeKeeper, choose_warmup_exchange

log = logging.getLogger(__name__)

# the checkpoint keys live in strategy.checkpoint; they are re-exported here, where they were defined before
__all__ = ["PER_RANK_STATE_KEY", "PER_RANK_STATUS_KEY", "OnebitAdamStrategy", "OnebitStrategy"]


class OnebitStrategy(CompressedStepping, DDPStrategy):
    """Data-parallel training with 1-bit Adam, 0/1 Adam or 1-bit LAMB: DDP during warmup, compressed averaging after.

    ``configure_optimizers`` must return one compressed optimizer: :class:`~lightning_onebit.OnebitAdam`,
    :class:`~lightning_onebit.ZeroOneAdam` or :class:`~lightning_onebit.OnebitLamb`. For its first ``freeze_step``
    steps this is DDP (gradients averaged by ``warmup_exchange``, PowerSGD by default; a full-precision AdamW or LAMB
    update). From step ``freeze_step + 1`` on, DDP's gradient allreduce is switched off by a communication hook, each
    rank's local gradient enters its momentum, and the optimizer averages momenta with the 1-bit compressed allreduce
    (~32x fewer bytes than fp32). The hook asks the optimizer before every backward (``needs_gradient_allreduce``),
    so 0/1 Adam's variance steps get their gradient average and its local steps send nothing; the strategy syncs 0/1
    Adam's replicas before every checkpoint it saves and at the end of ``fit``.

    The stage follows the optimizer's own step, so resuming from a checkpoint lands in the right stage; every rank's
    compression error feedback is kept across checkpoints by default (``error_feedback``).

    Semantics worth knowing:

    * Gradient accumulation: Lightning averages micro-batch losses, so the gradient entering the momentum is the
      mean over micro-batches in both stages.
    * Gradient clipping by norm in the compression stage, where each rank holds its own gradient: every rank scales
      its gradient by the same factor, ``min(1, gradient_clip_val / norm)`` with ``norm`` an estimate of the averaged
      gradient's norm (one all-reduce of 257 numbers per step; :mod:`~lightning_onebit.strategy.clipping`), so the
      momenta average DDP's clipped gradient up to the estimate's error. In the warmup it is DDP's clipping,
      unchanged. Clipping by value is elementwise, the same in both stages. With a precision plugin other than
      Lightning's ``Precision`` and ``MixedPrecision`` each rank clips by its own norm, and a warning says so once.
    * ``16-mixed``: the GradScaler's inf/NaN verdict is agreed across ranks, so an overflow on one rank skips the step
      on all of them (a per-rank skip would deadlock the compressed collective).
    * Combining with FSDP, DeepSpeed or other sharded strategies is not supported: this strategy *is* DDP.
    * Process groups: the hierarchical topology's node groups and the overlapped exchange's second-phase groups are
      made once per strategy (per process group) and reused by every later ``fit`` (:attr:`process_groups`), with
      the strategy's ``timeout``: a stalled or dead rank makes its peers' collectives in them fail after ``timeout``,
      with an error naming the group's ranks, as in the process group Lightning makes. At
      interpreter exit the strategy destroys them, detaches its optimizers from them and destroys WORLD if it is
      still initialised, so that its gloo groups are freed while the interpreter is whole: nothing needs
      ``gc.collect()``, and a process that trained and succeeded exits 0 (a gloo group freed during interpreter
      finalization can abort it with "terminate called without an active exception"). Nothing to do in a script;
      in a process that goes on after training (a notebook), :meth:`destroy_process_groups` releases them earlier.
    * Several nodes: with ``topology="auto"`` and several nodes of several ranks each (``Trainer(num_nodes=M,
      devices=L)``), momenta are averaged in full precision inside each node and with 1 bit between nodes, so about
      ``N/8`` bytes per node and step cross the slow link. Which ranks share a node comes from Lightning's cluster
      environment (torchrun, SLURM, LSF, ...), gathered from every rank.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy`.
        precision_plugin, process_group_backend, timeout, start_method: as for
            :class:`~lightning.pytorch.strategies.DDPStrategy`.
        find_unused_parameters: passed to ``DistributedDataParallel``. Default ``False``.
        static_graph: passed to ``DistributedDataParallel``. Default ``False``.
        gradient_as_bucket_view: passed to ``DistributedDataParallel``. Default ``False``.
        ddp_bucket_cap_mb: DDP's gradient bucket size in MB (warmup allreduce), a number > 0 (below ``2**43``);
            ``None`` keeps DDP's default (25).
        ddp_kwargs: any other ``DistributedDataParallel`` arguments (e.g. ``{"broadcast_buffers": False}``).
        warmup_exchange: how gradients are averaged whenever the strategy averages them (the warmup, and 0/1 Adam's
            variance steps; the compression stage is unchanged): ``"fp32"`` (DDP's ``mean`` allreduce), ``"bf16"``
            (torch's ``bf16_compress_hook``: half the bytes), ``"int8"`` (8 bits per element with error feedback,
            :func:`~lightning_onebit.hooks.int8_allreduce_hook`: about a quarter) or ``"powersgd"`` (PowerSGD of
            rank ``powersgd_rank`` with error feedback and warm start after ``powersgd_vanilla_steps`` uncompressed
            steps, :func:`~lightning_onebit.hooks.powersgd_exchange_hook`: ``(n + m) r`` elements per ``n x m``
            matrix). The int8 and PowerSGD state (error feedback, ``Q``, step count) is kept per rank across
            checkpoints under ``error_feedback``'s policy, so a resumed run continues bit for bit. Default ``None``:
            :data:`~lightning_onebit.strategy.warmup_exchange.DEFAULT_WARMUP_EXCHANGE` (``"powersgd"``, rank 4 after
            10 uncompressed steps: chosen on the example and two fine-tuning tasks, 2 seeds each, where 1-bit Adam
            stayed within 0.5 point of AdamW-DDP in all six runs, matched DDP + PowerSGD rank 4's accuracy in five
            and sent 2.4-3.1x fewer bytes than it; ``docs/benchmarks.md``), or the ``ddp_comm_hook`` when one is
            given; both at once are a ``ValueError``. ``"fp32"`` gives the AdamW-DDP warmup bit for bit.
        powersgd_rank: PowerSGD's rank ``r``, an integer >= 1 (only with ``warmup_exchange="powersgd"``). Default
            ``None``: 4.
        powersgd_vanilla_steps: the first averaged steps (optimizer steps whose gradients are averaged) PowerSGD
            sends uncompressed, an integer >= 0 (only with ``warmup_exchange="powersgd"``). Default ``None``: 10.
        ddp_comm_hook: a DDP comm hook of your own that averages gradients whenever the strategy averages them,
            instead of a ``warmup_exchange``, as Lightning's ``DDPStrategy`` takes it, on every device (CPU too);
            e.g. :func:`~lightning_onebit.hooks.ordered_powersgd_hook` (torch's PowerSGD). Bytes: a hook whose state
            counts its own is counted as it counts; torch's bf16/fp16 compression hooks as a ring allreduce in
            bf16/fp16; any other in the gradient's dtype. A state that keeps per-parameter state
            (:class:`~lightning_onebit.hooks.ParameterKeyedState`: the int8 and PowerSGD exchanges' states) is bound
            to the model and saved with checkpoints as the named exchanges' are. Default ``None``.
        ddp_comm_state: the state passed to ``ddp_comm_hook`` (torch's default hooks take a process group; ``None``:
            WORLD). Default ``None``.
        topology: how compressed momenta travel between ranks. ``"auto"`` (default): hierarchical when there are
            several nodes with the same number (> 1) of ranks each, flat otherwise (the log says why).
            ``"hierarchical"``: full-precision reduce-scatter inside each node, 1-bit exchange between nodes,
            all-gather inside the node; an error at setup where it is impossible (one node, one rank per node, uneven
            nodes). ``"flat"``: every rank exchanges 1-bit momenta with every other rank.
        ranks_per_node: treat ranks ``k K .. k K + K - 1`` as node ``k`` instead of asking the cluster environment
            (for one host playing several nodes, e.g. tests and benchmarks). Default ``None``.
        overlap: start the compressed momentum exchange during backward, bucket by bucket as DDP's gradient buckets
            become ready (:class:`~lightning_onebit.hooks.OverlapState`), so that ``optimizer.step`` only finishes it;
            same results, bit for bit, as without. ``"auto"`` (default): on wherever it is correct, else off with the
            reason logged once (:attr:`overlap_fallback_reason`, whose ``cause`` names the case): clipping by norm
            (it needs the whole gradient; clipping by value runs in the hook), a ``configure_gradient_clipping``
            override, an ``on_after_backward`` or ``on_before_optimizer_step`` override of the LightningModule or of a
            user callback (it could edit gradients the hooks already folded; one that only reads them keeps overlap
            when marked :func:`~lightning_onebit.hooks.leaves_gradients_unchanged`; Lightning's and this package's
            callbacks do not count), ``16-mixed`` (the GradScaler decides to skip a step only after backward),
            ``static_graph`` with gradient accumulation, manual optimization (several backward passes per step cannot
            be told apart in advance). ``True``: on, and any of these cases is a ``ValueError`` at setup (before any
            collective; the optimizer's own reason after ``configure_optimizers``), except manual optimization, where
            a second backward pass before ``step`` raises ``RuntimeError``. ``False``: off. Freezing or unfreezing
            parameters (``requires_grad``) between steps works: that step exchanges in ``step``.
        error_feedback: what happens to each rank's compression error feedback (its worker and server error
            buffers) when training resumes from a checkpoint. ``"keep"`` (default): every rank writes its buffers to
            a sidecar file next to each checkpoint (``<checkpoint>.onebit-rank<r>``, at most about ``(1 + 1/N)``
            times the bytes of the compressed parameters, ``N`` the world size); on resume every rank restores them
            if every rank can (the resumed run continues bitwise as the uninterrupted one), else every rank resets
            them, with one warning naming the ranks, files and reasons. ``"reset"``: no sidecars; the buffers
            restart from zero (DeepSpeed's behaviour) and rank 0's dropped norm is logged. ``"require"``: as
            ``"keep"``, but a rank that cannot restore makes every rank raise ``RuntimeError`` before any training
            step. Any other value is a ``ValueError``. An :class:`~lightning_onebit.ErrorFeedbackCheckpoint` callback
            overrides it (:attr:`error_feedback`, :mod:`~lightning_onebit.strategy.error_feedback`).
    """

    strategy_name = "onebit_adam"

    def __init__(
        self,
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
        topology: TopologyMode = "auto",
        ranks_per_node: Optional[int] = None,
        overlap: Union[bool, Literal["auto"]] = "auto",
        ddp_comm_hook: Optional[Callable[..., Any]] = None,
        ddp_comm_state: Optional[object] = None,
        error_feedback: ErrorFeedbackPolicy = "keep",
        warmup_exchange: Optional[WarmupExchange] = None,
        powersgd_rank: Optional[int] = None,
        powersgd_vanilla_steps: Optional[int] = None,
    ) -> None:
        check_options(overlap, topology, ranks_per_node)
        self.warmup_exchange, averaging_hook, averaging_state = choose_warmup_exchange(
            warmup_exchange, ddp_comm_hook, ddp_comm_state, powersgd_rank, powersgd_vanilla_steps)
        check_process_group_options(timeout, process_group_backend)
        self.topology_mode = topology
        self.overlap = overlap
        self.overlap_fallback_reason: Optional[str] = None
        self.ranks_per_node = ranks_per_node
        self._run_id = "unset"  # agreed at setup; identifies this run's checkpoints in their per-rank files
        self._save_index = 0
        ddp_kwargs = ddp_kwargs_for(
            ddp_kwargs, find_unused_parameters=find_unused_parameters, static_graph=static_graph,
            gradient_as_bucket_view=gradient_as_bucket_view, ddp_bucket_cap_mb=ddp_bucket_cap_mb,
            ddp_comm_hook=ddp_comm_hook,
        )
        super().__init__(
            error_feedback=error_feedback,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        # the warmup allreduce (its predicate follows each fit's optimizer, from setup_optimizers on), the one DDP comm
        # hook's state (holds no reference to the strategy: DDP keeps it alive) and every process group made
        self.gradient_sync = GradientSyncState(averaging_hook=averaging_hook, averaging_hook_state=averaging_state)
        self._warmup_state = averaging_state if isinstance(averaging_state, ParameterKeyedState) else None
        self._warmup_keeper = WarmupExchangeKeeper(self.strategy_name)
        self._hook = ExchangeHookState(self.gradient_sync)
        self._groups = OwnedProcessGroups(self.gradient_sync,
                                          self._warmup_state if self.warmup_exchange is not None else None)

    # ------------------------------------------------------------------ precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else AgreedClippingPrecision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # clipping by norm in the compression stage: one factor for every rank (strategy.clipping)
        self._precision_plugin = None if precision_plugin is None else agreed_clipping_precision(precision_plugin)

    # ------------------------------------------------------------------ wiring
    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        release_at_exit(self._groups)

    @property
    def overlap_state(self) -> Optional[OverlapState]:
        """The overlapped exchange's hook state this ``fit`` (``None``: the exchange runs in ``optimizer.step``)."""
        return self._hook.overlap

    @overlap_state.setter
    def overlap_state(self, state: Optional[OverlapState]) -> None:
        self._hook.overlap = state

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        self._refuse_explicit_overlap(trainer)
        super().setup(trainer)
        self._run_id, self._save_index = agree_run_id(self.global_rank), 0
        precision = self.precision_plugin
        if isinstance(precision, MixedPrecision) and precision.scaler is not None:
            if not isinstance(precision.scaler, RankSyncedGradScaler):
                precision.scaler = RankSyncedGradScaler.from_scaler(precision.scaler)

    @property
    def topology(self) -> Optional[Topology]:
        """How compressed momenta travel between ranks (``None`` until the first ``fit`` sets up its optimizer, and
        after :meth:`destroy_process_groups`)."""
        return self._groups.topology

    @property
    def warmup_communication(self) -> CommunicationCounters:
        """This rank's cumulative counters of the full-precision gradient averages (the warmup's, and 0/1 Adam's
        variance steps'); :attr:`communication` adds the compressed exchange's."""
        self.gradient_sync.settle_timings()
        return self.gradient_sync.counters.snapshot()

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning registers `ddp_comm_hook` only on CUDA; this hook must run on every device. DDP takes one hook,
        # registered before the optimizer exists: it dispatches to the overlapped hook once setup_optimizers made one.
        assert isinstance(self.model, DistributedDataParallel)
        self.gradient_sync.process_group = self.model.process_group
        if self.warmup_exchange == "bf16":
            self.gradient_sync.averaging_hook_state = self.model.process_group
        if self._warmup_state is not None:
            if self.warmup_exchange is not None:  # built here: the strategy's group (a user's state keeps its own)
                self._warmup_state.process_group = self.model.process_group
            self._warmup_state.bind(self.model)  # its state is kept per parameter (by index in the module)
        self.model.register_comm_hook(self._hook, exchange_hook)

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        super().setup_optimizers(trainer)
        if trainer.state.fn != TrainerFn.FITTING:
            return
        optimizer = the_compressed_optimizer(self.optimizers)
        assert isinstance(self.model, DistributedDataParallel)
        process_group = self.model.process_group
        self._groups.attach(optimizer, process_group, self.build_topology)
        self.gradient_sync.topology = self.topology
        if self._warmup_state is not None and self.warmup_exchange is not None:
            self._warmup_state.topology = self.topology
        # gradients are averaged when this fit's optimizer asks (a closure over it: it holds no strategy)
        self.gradient_sync.sync_predicate = lambda: optimizer.needs_gradient_allreduce
        self._take_optimizer(trainer, optimizer)
        self.overlap_state = self._configure_overlap(trainer, optimizer)

    # ------------------------------------------------------------------ overlap
    def overlap_unsupported_reason(self, trainer: "pl.Trainer") -> Optional[str]:
        """Why the exchange cannot overlap backward in this run (``None``: it can), as an
        :class:`~lightning_onebit.hooks.OverlapFallbackReason` (a string with a ``cause``;
        :func:`~lightning_onebit.strategy.overlap_policy.overlap_blocker`). Override to add cases (a plain string
        counts as cause ``"custom"``). Manual optimization comes last: ``overlap=True`` accepts it, so any other reason
        must be found first."""
        return overlap_blocker(trainer, self.lightning_module, self.precision_plugin, self._ddp_kwargs)

    #: The hooks that run between backward and ``optimizer.step`` and may edit ``.grad``.
    GRADIENT_HOOKS = GRADIENT_HOOKS

    def _refuse_explicit_overlap(self, trainer: "pl.Trainer") -> None:
        """``overlap=True`` in a run it cannot serve: raise on every rank at the start of setup, before any collective
        (DDP's parameter broadcast, the topology, the run id). The optimizer's own reason is known only after
        ``configure_optimizers`` (:meth:`_configure_overlap`)."""
        if self.overlap is True and trainer.state.fn == TrainerFn.FITTING:
            overlap_fallback(True, OverlapFallbackReason.of(self.overlap_unsupported_reason(trainer)))

    def _configure_overlap(self, trainer: "pl.Trainer", optimizer: CompressedOptimizer) -> Optional[OverlapState]:
        """The overlapped hook's state, or ``None`` with the reason logged once (``overlap='auto'``)."""
        self.overlap_fallback_reason = decide_overlap(self.overlap, optimizer,
                                                      lambda: self.overlap_unsupported_reason(trainer))
        if self.overlap is False or self.overlap_fallback_reason is not None:
            return None
        assert isinstance(self.model, DistributedDataParallel)
        note_bucket_cap(optimizer)
        clip_value = trainer.gradient_clip_val if trainer.gradient_clip_val else None
        gather_groups = self._groups.gather_groups(self.model.process_group, self._timeout)
        optimizer.compression.install_gather_groups(*gather_groups)
        return OverlapState(self.model, optimizer, clip_value=clip_value, gradient_sync=self.gradient_sync)

    # ------------------------------------------------------------------ process groups
    @property
    def process_groups(self) -> tuple[Any, ...]:
        """The process groups this strategy made and owns, in creation order: the hierarchical topology's intra- and
        inter-node groups, then the overlapped exchange's second-phase groups. Made once per process group (at the
        first ``fit`` that needs them), reused by every later ``fit``, destroyed by :meth:`destroy_process_groups`."""
        return self._groups.groups

    def destroy_process_groups(self) -> None:
        """Destroy the process groups this strategy made (:attr:`process_groups`) and detach its optimizers (this
        ``fit``'s and earlier ones' still alive) from them.

        ``teardown``, which Lightning calls after every ``fit``, keeps them for the next ``fit``. This runs by itself
        at interpreter exit; call it when done with the strategy for good in a process that goes on (e.g. a
        notebook). A later ``fit`` makes new groups. Every rank must call it, as they are destroyed in creation order
        (NCCL wants the same order of communicator teardown on every rank); it is not a collective on gloo.
        """
        self._groups.detach_optimizers()
        self.overlap_state = None
        self._groups.destroy()

    def build_topology(self, process_group: Any) -> Topology:
        """Every rank's ``(node_rank, local_rank)`` from the cluster environment, gathered, and the process groups of
        the chosen exchange (a collective: runs on every rank at setup). Override to place ranks differently."""
        env = self.cluster_environment
        assert env is not None
        return build_topology(env, self.topology_mode, self.ranks_per_node, process_group, self._timeout)

    # ------------------------------------------------------------------ checkpoints
    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Union[str, "os.PathLike[str]"],
        storage_options: Optional[Any] = None,
    ) -> None:
        # Every rank comes here for every save (Lightning writes the main file on rank 0 only), so the save index, and
        # with it the checkpoint id, is the same on every rank without a collective.
        self._error_feedback.save(checkpoint, self._onebit_optimizer)
        self._warmup_keeper.save(checkpoint, self._warmup_state, self.error_feedback)
        checkpoint_id = f"{self._run_id}/{self._save_index + 1}"
        if save_per_rank_state(checkpoint, sidecar_path(filepath, self.global_rank), checkpoint_id, self.global_rank,
                               self.world_size, self.topology):
            self._save_index += 1
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(
        self, checkpoint_path: Union[str, "os.PathLike[str]"], weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """Load the checkpoint and this rank's sidecar. A folder (``onebit_fsdp``'s distributed checkpoint) is a
        ``ValueError`` on every rank that says which strategy loads it (one ``all_gather_object``, which every rank
        reaches). A bad sidecar is never an exception here: its reason goes to ``checkpoint[PER_RANK_STATUS_KEY]``,
        and the ranks agree at the start of training what to do (the error feedback's policy,
        :attr:`error_feedback`)."""
        problem = ddp_folder_problem(Path(os.fspath(checkpoint_path)))
        agree_on_problems(LoadProblems(wrong_kind=[problem] if problem else []), checkpoint_path, self.strategy_name)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        restore_per_rank_state(checkpoint, sidecar_path(checkpoint_path, self.global_rank), self.global_rank,
                               self.world_size)
        self._error_feedback.load(checkpoint)
        self._warmup_keeper.load(checkpoint)
        return checkpoint

    @property
    def warmup_exchange_state(self) -> Optional[ParameterKeyedState]:
        """The warmup exchange's per-parameter state (int8, PowerSGD; a ``ddp_comm_state`` of that kind), ``None``
        for a stateless exchange."""
        return self._warmup_state

    @property
    def warmup_exchange_restored(self) -> Optional[bool]:
        """After a resume with a stateful warmup exchange: ``True`` if its state was restored on every rank, ``False``
        if reset; ``None`` before."""
        return self._warmup_keeper.restored

    @override
    def on_train_start(self) -> None:
        super().on_train_start()  # the optimizer's error feedback first
        self._warmup_keeper.on_train_start(self._warmup_state, self.error_feedback, self.global_rank)

    @override
    def teardown(self) -> None:
        self._warmup_keeper.end_run()
        super().teardown()

    # ------------------------------------------------------------------ registry
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries = (("onebit_adam", "popen"), ("onebit_adam_spawn", "spawn"), ("onebit_adam_fork", "fork"),
                   ("onebit_adam_notebook", "fork"),
                   # the same strategy, under the names users of 1-bit LAMB and 0/1 Adam look for
                   ("onebit_lamb", "popen"), ("zeroone_adam", "popen"))
        for name, start_method in entries:
            strategy_registry.register(
                name,
                cls,
                description=f"1-bit Adam / 0/1 Adam / 1-bit LAMB on DDP with start_method '{start_method}'",
                start_method=start_method,
            )


#: The earlier name of :class:`OnebitStrategy` (it drives all three optimizers), kept so existing code and
#: ``class_path: lightning_onebit.OnebitAdamStrategy`` configs go on working.
OnebitAdamStrategy = OnebitStrategy
