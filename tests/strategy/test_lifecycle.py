"""Process-group lifecycle on gloo CPU ranks (issue 24: R8 and "clean exit, always").

* Two ``trainer.fit`` calls on one trainer (a new model and a new optimizer the second time) create no process group
  the second time, and the second optimizer runs its overlapped exchange in the very groups of the first: flat with
  overlap on 2 ranks, hierarchical with overlap on 4 ranks playing 2 nodes x 2. Creation is counted twice: calls of
  ``dist.new_group`` / ``dist.split_group`` (wrapped) and the groups torch has registered on the rank.
* After each fit, the fit's DDP module is freed by reference counting alone (garbage collector off): no cycle
  through the comm hook's state (strategy <-> DDP reducer) or :class:`OverlapState` keeps it, and its process group,
  alive.
* The strategy destroys what it made: :meth:`OnebitStrategy.destroy_process_groups` unregisters its groups and,
  with the garbage collector off since before they were made, they are freed at once although the trainer is still
  referenced (nothing but torch's registry and the strategy held them: no reference cycle). The exit handler does the
  same for every live strategy, drops the strategy's and its optimizers' references to DDP's group, then destroys
  WORLD: WORLD is freed and no gloo thread is left running into the process's C++ exit (flat in 16-mixed, the path
  of the last abort at exit; hierarchical with overlap).
* Plain torch: after the training function returns, DDP, the optimizer and the :class:`OverlapState` are freed by
  reference counting alone (garbage collector off): the state holds DDP weakly, so the DDP <-> hook-state cycle that
  kept the groups alive until a collection, possibly during interpreter finalization, is gone. Its second-phase group
  is then held by torch's registry only: destroying it frees it.
* ``dist.split_group``: gloo cannot split on CPU (torch wants an accelerator and a device bound to the default
  group), so a stand-in split (one ``new_group`` per member list, called once per family) checks that a hierarchical
  topology and its second-phase copies are made with one split per family and no ``new_group`` of their own.

Every test here also runs its ranks to a normal exit: ``run_distributed`` fails on any non-zero exit code.
"""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world
from torch.nn.parallel import DistributedDataParallel

import lightning.pytorch as pl
from lightning.pytorch.plugins import MixedPrecision
import lightning_onebit.strategy as strategy_module
import lightning_onebit.comm.groups as groups_module
from lightning_onebit import OnebitAdam, OnebitStrategy, Topology
from lightning_onebit.hooks import OverlapState, overlapped_exchange_hook
from lightning_onebit.comm.topology import new_gather_groups, split_group_supported
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import Regressor, loader, trainer_kwargs

FREEZE, STEPS = 3, 8
BUCKET_CAP_MB = 40 / 2**20  # several DDP buckets for the 65-parameter Regressor, so the second phase overlaps


# ======================================================================================== in-rank helpers
class GroupCounter:
    """Counts ``dist.new_group`` and ``dist.split_group`` calls while active (the library calls them through the
    ``torch.distributed`` module, so replacing the module attributes sees every call)."""

    def __init__(self) -> None:
        self.new_group = 0
        self.split_group = 0

    @contextlib.contextmanager
    def active(self) -> Iterator["GroupCounter"]:
        real_new, real_split = dist.new_group, getattr(dist, "split_group", None)

        def new_group(*args: Any, **kwargs: Any) -> Any:
            self.new_group += 1
            return real_new(*args, **kwargs)

        def split_group(*args: Any, **kwargs: Any) -> Any:
            self.split_group += 1
            assert real_split is not None
            return real_split(*args, **kwargs)

        dist.new_group, dist.split_group = new_group, split_group
        try:
            yield self
        finally:
            dist.new_group = real_new
            if real_split is None:
                del dist.split_group
            else:
                dist.split_group = real_split

    @property
    def calls(self) -> int:
        return self.new_group + self.split_group


def _registered() -> int:
    """Process groups torch has registered on this rank (WORLD included)."""
    return len(_world.pg_map)


@contextlib.contextmanager
def _no_garbage_collector() -> Iterator[None]:
    """Objects in reference cycles stay alive while this is active: whatever is freed inside was freed by reference
    counting, as it is when no collection happens to run before the interpreter's finalization."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DDPRefs(pl.Callback):
    """Weak references to the ``DistributedDataParallel`` module of every fit."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(trainer.strategy.model, DistributedDataParallel)
        self.refs.append(weakref.ref(trainer.strategy.model))


def _two_fits(rank: int, world_size: int, ranks_per_node: Optional[int]) -> dict[str, Any]:
    """Two fits of one trainer with overlap on; group creation counted per fit; then the groups destroyed."""
    out: dict[str, Any] = dict(registered_before=_registered(), split_supported=split_group_supported())
    counter = GroupCounter()
    with _no_garbage_collector(), counter.active():
        strategy = OnebitStrategy(overlap=True, ddp_bucket_cap_mb=BUCKET_CAP_MB, ranks_per_node=ranks_per_node)
        ddp_refs = DDPRefs()
        trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy, callbacks=[ddp_refs]))
        trainer.fit(Regressor(freeze_step=FREEZE), loader(rank, STEPS))
        first_optimizer = strategy.onebit_optimizer
        first_gather = first_optimizer.compression.gather_groups()
        first_topology = strategy.topology
        out["first"] = dict(
            calls=counter.calls, registered=_registered(), owned=len(strategy.process_groups),
            hierarchical=first_topology.is_hierarchical, buckets_started=strategy.overlap_state.buckets_started,
            ddp_freed=ddp_refs.refs[0]() is None,
        )
        calls_after_first = counter.calls
        trainer.fit_loop.epoch_loop.max_steps = 2 * STEPS
        trainer.fit(Regressor(freeze_step=FREEZE), loader(rank, STEPS))
        second_optimizer = strategy.onebit_optimizer
        second_gather = second_optimizer.compression.gather_groups()
        out["second"] = dict(
            calls=counter.calls - calls_after_first, registered=_registered(), global_step=trainer.global_step,
            new_optimizer=second_optimizer is not first_optimizer,
            has_gather_groups=second_optimizer.compression.has_gather_groups,
            same_gather_groups=all(a is b for a, b in zip(first_gather, second_gather)),
            same_topology=strategy.topology is first_topology,
            buckets_started=strategy.overlap_state.buckets_started,
            owned_in_registry=all(_world.pg_map.get(g) is not None for g in strategy.process_groups),
            ddp_freed=len(ddp_refs.refs) == 2 and ddp_refs.refs[1]() is None,
        )
        # torn down for good: destroyed, unregistered, and freed at once (the trainer is still referenced)
        owned = [weakref.ref(g) for g in strategy.process_groups]
        del first_gather, second_gather, first_topology  # this scenario's own references
        strategy.destroy_process_groups()
        out["destroyed"] = dict(
            registered=_registered(), owned=len(strategy.process_groups), freed=sum(r() is None for r in owned),
            of=len(owned), optimizer_gather_groups=second_optimizer.compression.has_gather_groups,
        )
    return out


def scenario_two_fits(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return _two_fits(rank, world_size, ranks_per_node=2 if world_size == 4 else None)


def scenario_exit_handler(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """What runs at interpreter exit, run now: every live strategy's groups destroyed and freed, then WORLD. Flat runs
    16-mixed (the rank-synced GradScaler; the exchange then falls back to ``step``), the path of the one abort at exit the
    suite showed after the groups were first released; hierarchical runs 32-true with overlap."""
    with _no_garbage_collector():
        strategy = OnebitStrategy(overlap=True if world_size == 4 else "auto", ddp_bucket_cap_mb=BUCKET_CAP_MB,
                                  ranks_per_node=2 if world_size == 4 else None)
        plugins = [] if world_size == 4 else [
            MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))]
        trainer = pl.Trainer(**trainer_kwargs(world_size, STEPS, strategy=strategy, plugins=plugins))
        trainer.fit(Regressor(freeze_step=FREEZE), loader(rank, STEPS))
        owned = [weakref.ref(g) for g in strategy.process_groups]
        registered = len(owned)
        world = weakref.ref(dist.group.WORLD)
        strategy_module.release_process_groups_at_exit()
        return dict(
            owned=registered, freed=sum(r() is None for r in owned), world_destroyed=not dist.is_initialized(),
            # the strategy and its optimizers held DDP's group (WORLD) too: released, its gloo backend is freed now,
            # its threads joined while the interpreter is whole, not left running into the process's C++ exit
            world_freed=world() is None, gloo_threads=_gloo_threads(), trainer_alive=trainer is not None,
        )


def _gloo_threads() -> list[str]:
    """Names of this process's gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``), from /proc."""
    names = [open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")]
    return sorted(name for name in names if "gloo" in name)


def _plain_ddp_training(rank: int) -> dict[str, Any]:
    """Plain DDP + OnebitAdam + the overlapped hook; returns weak references to what it made."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*(m for _ in range(3) for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())),
                              torch.nn.Linear(8, 1))
    ddp = DistributedDataParallel(net, bucket_cap_mb=300 / 2**20)
    optimizer = OnebitAdam(ddp.parameters(), lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
    state = OverlapState(ddp, optimizer)
    ddp.register_comm_hook(state, overlapped_exchange_hook)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 1, generator=generator)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert state.buckets_started > 0
    gather, _ = optimizer.compression.gather_groups()
    return dict(ddp=weakref.ref(ddp), optimizer=weakref.ref(optimizer), state=weakref.ref(state),
                gather=weakref.ref(gather))


def scenario_plain_ddp(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    with _no_garbage_collector():
        refs = _plain_ddp_training(rank)
        alive = {name: ref() is not None for name, ref in refs.items()}
        gather = refs["gather"]()
        registered = gather is not None and _world.pg_map.get(gather) is not None
        if registered:
            dist.destroy_process_group(gather)  # what dist.destroy_process_group() does to every group
        del gather
        return dict(alive=alive, gather_registered=registered, gather_freed=refs["gather"]() is None)


def _stand_in_split(calls: list[list[list[int]]]) -> Callable[..., Any]:
    """``dist.split_group`` for gloo: one ``new_group`` per member list (ranks of ``parent_pg``), this rank's back.
    It calls the ``new_group`` of the moment it is made, so a counter activated later does not count those calls."""
    new_group = dist.new_group

    def split_group(parent_pg: Any = None, split_ranks: Any = None, **kwargs: Any) -> Any:
        calls.append([list(r) for r in split_ranks])
        parent_ranks = dist.get_process_group_ranks(parent_pg) if parent_pg is not None else list(
            range(dist.get_world_size()))
        own, mine = dist.get_rank(parent_pg), None
        for members in split_ranks:
            made = new_group([parent_ranks[r] for r in sorted(members)])
            mine = made if own in members else mine
        return mine

    return split_group


def scenario_split_families(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    counter, splits = GroupCounter(), []
    real_supported, real_split = groups_module.split_group_supported, getattr(dist, "split_group", None)
    groups_module.split_group_supported = lambda group=None: True
    dist.split_group = _stand_in_split(splits)
    try:
        with counter.active():
            topology = Topology.build(rank // 2, rank % 2, "hierarchical", ranks_per_node=2)
            inter, intra = new_gather_groups(None, topology)
            flat_copy, none = new_gather_groups(None, Topology.build(0, rank, "flat"))
        groups = (topology.intra_group, topology.inter_group, intra, inter, flat_copy)
        members = [dist.get_process_group_ranks(g) for g in groups]
        groups_module.destroy_groups(groups)
        return dict(splits=splits, new_group_calls=counter.new_group, split_calls=counter.split_group,
                    members=members, flat_intra=none)
    finally:
        groups_module.split_group_supported = real_supported
        if real_split is None:
            del dist.split_group
        else:
            dist.split_group = real_split


_FLAT = (("two_fits", scenario_two_fits), ("plain_ddp", scenario_plain_ddp), ("exit_handler", scenario_exit_handler))
_HIERARCHICAL = (("two_fits", scenario_two_fits), ("split_families", scenario_split_families),
                 ("exit_handler", scenario_exit_handler))


@pytest.fixture(scope="module")
def flat_session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 2, _FLAT, str(tmp_path_factory.mktemp("lifecycle")), timeout_s=300)


@pytest.fixture(scope="module")
def hierarchical_session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 4, _HIERARCHICAL, str(tmp_path_factory.mktemp("lifecycle")), timeout_s=420)


# ======================================================================================== tests
def _check_two_fits(results: list[dict[str, Any]], first_calls: int, owned: int) -> None:
    for rank, r in enumerate(results):
        first, second, destroyed = r["first"], r["second"], r["destroyed"]
        assert not r["split_supported"], "gloo on CPU cannot split (torch wants an accelerator-bound default group)"
        assert first["calls"] == first_calls, f"rank {rank}: {first['calls']} group creations in the first fit"
        assert first["buckets_started"] > 0, "the first fit never overlapped: the second-phase groups went unused"
        # Lightning unwraps DDP at teardown; nothing else holds it (the comm hook's state holds the strategy weakly,
        # OverlapState holds DDP weakly), so it is freed then, with the garbage collector off
        assert first["ddp_freed"] and second["ddp_freed"], f"rank {rank}: a fit's DDP module outlived its teardown"
        # the second fit: a new optimizer, no group made, the first fit's groups in use
        assert second["calls"] == 0, f"rank {rank}: the second fit created {second['calls']} process groups"
        assert second["registered"] == first["registered"] == r["registered_before"] + owned
        assert first["owned"] == owned
        assert second["global_step"] == 2 * STEPS and second["new_optimizer"]
        assert second["has_gather_groups"] and second["same_gather_groups"] and second["same_topology"]
        assert second["buckets_started"] > 0 and second["owned_in_registry"]
        # destroyed: unregistered, and freed although the trainer, strategy and optimizers are alive
        assert destroyed == dict(registered=r["registered_before"], owned=0, freed=owned, of=owned,
                                 optimizer_gather_groups=False), f"rank {rank}: {destroyed}"


def test_second_fit_creates_no_process_groups_flat(flat_session: list[dict[str, Any]]) -> None:
    # flat: one group of the strategy's own, the second phase's copy of WORLD
    _check_two_fits(scenario_results(flat_session, "two_fits"), first_calls=1, owned=1)


def test_second_fit_creates_no_process_groups_hierarchical(hierarchical_session: list[dict[str, Any]]) -> None:
    # 2 nodes x 2: the topology's M intra + L inter groups and the second phase's copies, made with new_group on
    # gloo (every rank creates every group: 2 (M + L) calls); a rank is a member of 4 of them
    _check_two_fits(scenario_results(hierarchical_session, "two_fits"), first_calls=8, owned=4)


def test_plain_ddp_overlap_leaves_no_reference_cycle(flat_session: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(scenario_results(flat_session, "plain_ddp")):
        assert r["alive"] == dict(ddp=False, optimizer=False, state=False, gather=True), (
            f"rank {rank}: still alive after the training function returned, without a garbage collection: "
            f"{[k for k, v in r['alive'].items() if v]} (the gather group is expected: torch's registry holds it)"
        )
        assert r["gather_registered"] and r["gather_freed"], f"rank {rank}: {r}"


@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_exit_handler_destroys_and_frees_the_strategys_groups(
    topology: str, request: pytest.FixtureRequest
) -> None:
    session = request.getfixturevalue(f"{topology}_session")
    owned = 0 if topology == "flat" else 4  # flat runs 16-mixed: not overlapped, so no second-phase group
    for rank, r in enumerate(scenario_results(session, "exit_handler")):
        assert r == dict(owned=owned, freed=owned, world_destroyed=True, world_freed=True, gloo_threads=[],
                         trainer_alive=True), f"rank {rank}: {r}"


def test_topology_families_are_one_split_each_where_torch_can_split(
    hierarchical_session: list[dict[str, Any]],
) -> None:
    intra, inter = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    for rank, r in enumerate(scenario_results(hierarchical_session, "split_families")):
        # the topology's two families, their second-phase copies, the flat copy of WORLD: one split each
        assert r["splits"] == [intra, inter, intra, inter, [[0, 1, 2, 3]]], f"rank {rank}: {r['splits']}"
        assert r["split_calls"] == 5 and r["new_group_calls"] == 0
        node, local = rank // 2, rank % 2
        assert r["members"] == [intra[node], inter[local], intra[node], inter[local], [0, 1, 2, 3]]
        assert r["flat_intra"] is None
