"""The package's top level: what it exports, and the lower-level names that left it (still resolved, with a
``FutureWarning`` naming their new module, until 0.3)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import lightning_onebit
from tests.paths import ROOT

KEPT = {
    "AutoFreeze",
    "CommunicationMonitor",
    "CompressedOptimizer",
    "CompressionAdvice",
    "ErrorFeedbackCheckpoint",
    "LocalStepsAdvice",
    "MomentumMask",
    "OnebitAdam",
    "OnebitAdamStrategy",
    "OnebitDiLoCoFSDPStrategy",
    "OnebitDiLoCoStrategy",
    "OnebitFSDPStrategy",
    "OnebitLamb",
    "OnebitStage",
    "OnebitStrategy",
    "ReplicaCheck",
    "Topology",
    "ZeroOneAdam",
    "__version__",
}

MOVED = {
    "BucketLayout": "lightning_onebit.comm",
    "CommunicationCounters": "lightning_onebit.comm",
    "CompressedAllreduceState": "lightning_onebit.comm",
    "agree_kernel_backend": "lightning_onebit.comm",
    "assert_replicas_identical": "lightning_onebit.comm",
    "bytes_leaving_node": "lightning_onebit.comm",
    "compressed_allreduce_": "lightning_onebit.comm",
    "compressed_allreduce_buckets_": "lightning_onebit.comm",
    "ring_allreduce_bytes": "lightning_onebit.comm",
    "GradientSyncState": "lightning_onebit.hooks",
    "OverlapState": "lightning_onebit.hooks",
    "leaves_gradients_unchanged": "lightning_onebit.hooks",
    "overlapped_exchange_hook": "lightning_onebit.hooks",
    "switchable_allreduce_hook": "lightning_onebit.hooks",
    "RankSyncedGradScaler": "lightning_onebit.strategy.precision",
}


def test_the_top_level_exports_exactly_the_kept_names() -> None:
    assert set(lightning_onebit.__all__) == KEPT
    assert len(lightning_onebit.__all__) == len(KEPT)  # no name listed twice
    assert set(dir(lightning_onebit)) == KEPT
    for name in KEPT:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a kept name resolves without any warning
            assert getattr(lightning_onebit, name) is not None


def test_no_moved_name_is_exported_or_bound_at_the_top_level() -> None:
    assert not set(MOVED) & set(lightning_onebit.__all__)
    # not imported eagerly: the module's namespace does not hold them (access goes through __getattr__)
    assert not set(MOVED) & set(vars(lightning_onebit))


def test_star_import_brings_only_the_kept_names() -> None:
    namespace: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from lightning_onebit import *", namespace)
    assert set(namespace) - {"__builtins__"} == KEPT


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_moved_name_still_resolves_with_a_future_warning_naming_its_new_path(name: str) -> None:
    new_home = MOVED[name]
    with pytest.warns(FutureWarning) as record:
        obj = getattr(lightning_onebit, name)
    assert obj is getattr(importlib.import_module(new_home), name)
    messages = [str(w.message) for w in record if issubclass(w.category, FutureWarning)]
    assert messages == [
        f"lightning_onebit.{name} moved to {new_home}.{name}; import it from there. "
        "The top-level name will be removed in 0.3."
    ]
    assert record[0].filename == __file__  # the warning points at the caller, not at the package


@pytest.mark.parametrize("name", ["compressed_allreduce_", "OverlapState", "RankSyncedGradScaler"])
def test_a_from_import_of_a_moved_name_warns_and_gives_the_same_object(name: str) -> None:
    namespace: dict = {}
    with pytest.warns(FutureWarning, match=f"moved to {MOVED[name]}.{name};"):
        exec(f"from lightning_onebit import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(MOVED[name]), name)


def test_an_unknown_attribute_raises_attribute_error() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="'lightning_onebit' has no attribute 'no_such_name'"):
            lightning_onebit.no_such_name  # noqa: B018
        assert not hasattr(lightning_onebit, "precision_plugin")
        with pytest.raises(ImportError):
            exec("from lightning_onebit import no_such_name", {})


def test_the_internal_strategy_modules_moved_without_shims() -> None:
    from lightning_onebit.strategy import precision, sidecar

    assert precision.RankSyncedGradScaler.__module__ == "lightning_onebit.strategy.precision"
    assert sidecar.sidecar_path.__module__ == "lightning_onebit.strategy.sidecar"
    for old in ("lightning_onebit.precision", "lightning_onebit.sidecar"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_the_topology_shim_is_gone() -> None:
    """``lightning_onebit.topology`` was a shim for :mod:`lightning_onebit.comm.topology`; it was removed."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("lightning_onebit.topology")
    assert lightning_onebit.Topology is importlib.import_module("lightning_onebit.comm.topology").Topology


def test_importing_the_package_emits_no_future_warning() -> None:
    """In a fresh interpreter, where nothing is imported yet: the package's own imports use the new paths."""
    proc = subprocess.run(
        [sys.executable, "-W", "error::FutureWarning", "-c", "import lightning_onebit"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr


def test_the_error_feedback_mechanics_live_in_the_strategy_layer_only() -> None:
    """``ErrorFeedbackCheckpoint`` only chooses the policy: the save, load and cross-rank agreement moved down to
    :mod:`lightning_onebit.strategy.error_feedback`, with no copy left in the callback's module."""
    from lightning_onebit.callbacks import error_feedback as callback_module
    from lightning_onebit.strategy import ERROR_FEEDBACK_KEY, ERROR_FEEDBACK_POLICIES
    from lightning_onebit.strategy import error_feedback as strategy_module

    assert strategy_module.ErrorFeedbackKeeper.__module__ == "lightning_onebit.strategy.error_feedback"
    assert (ERROR_FEEDBACK_KEY, ERROR_FEEDBACK_POLICIES) == ("onebit_error_feedback", ("reset", "keep", "require"))
    for name in ("failures_text", "gather_verdicts", "_failures_text", "_gather_verdicts", "PER_RANK_STATE_KEY"):
        assert not hasattr(callback_module, name), name
    from lightning.pytorch.callbacks import Callback

    for hook in ("on_train_start", "on_save_checkpoint", "on_load_checkpoint", "state_dict"):
        assert getattr(lightning_onebit.ErrorFeedbackCheckpoint, hook) is getattr(Callback, hook), hook


#: What each layer package exported before the refactor into parts (issue 45), as its ``__all__`` listed it: every
#: name must still resolve (the private ones the comm namespace listed, with a ``FutureWarning``).
EXPORTED_BEFORE_PARTS = {
    "lightning_onebit.comm": [
        "BucketLayout", "CollectiveFailedError", "CommunicationCounters", "CompressedAllreduceState", "PendingExchange",
        "Topology", "_ALL_TO_ALL", "_GATHER", "_NODE_GATHER", "_advance", "_all_gather", "_bytes_sent",
        "agree_kernel_backend", "assert_replicas_identical", "bytes_leaving_node", "check_buckets",
        "compressed_allreduce_", "compressed_allreduce_buckets_", "count_ring_allreduce", "finish_exchanges_",
        "full_precision_allreduce_", "progress_exchanges_", "replica_checksums", "ring_allreduce_bytes",
        "simulate_compressed_allreduce_", "sparse_rows_allreduce_", "start_exchange_",
    ],
    "lightning_onebit.kernels": [
        "Backend", "Segments", "Workspace", "add_mean_of_signs_", "available_backends", "compress_in_place",
        "compress_with_error_feedback", "decompress", "effective_backend", "foreach_sqrt", "foreach_sqrt_",
        "frozen_adam_denominators", "frozen_adam_update_", "pack_signs", "resolve_backend", "set_default_backend",
        "sqrt_into", "unpack_signs",
    ],
    "lightning_onebit.optim": [
        "AutoFreeze", "CompressedOptimizer", "OnebitAdam", "OnebitLamb", "OnebitStage", "StepKind", "ZeroOneAdam",
        "check_exp_avg_mask",
    ],
    "lightning_onebit.hooks": [
        "GradientSyncState", "OverlapFallbackReason", "OverlapState", "is_marked_read_only",
        "leaves_gradients_unchanged", "overlapped_exchange_hook", "switchable_allreduce_hook",
    ],
    "lightning_onebit.hooks.fsdp": [
        "ReplicaAllReduceState", "ShardedOverlapState", "fsdp_managed_parameters", "fsdp_modules",
        "register_replica_allreduce_hook", "replica_allreduce_hook", "sharded_exchange_hook",
    ],
    "lightning_onebit.strategy": [
        "ERROR_FEEDBACK_KEY", "ERROR_FEEDBACK_POLICIES", "OnebitAdamStrategy", "OnebitFSDPStrategy", "OnebitStrategy",
        "PER_RANK_STATE_KEY", "PER_RANK_STATUS_KEY", "_release_process_groups_at_exit",
    ],
    "lightning_onebit.callbacks": [
        "CommunicationMonitor", "CompressionAdvice", "ErrorFeedbackCheckpoint", "MaskSpec", "MomentumMask",
        "ReplicaCheck",
    ],
}


@pytest.mark.parametrize("package", sorted(EXPORTED_BEFORE_PARTS))
def test_every_name_a_layer_package_exported_still_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in EXPORTED_BEFORE_PARTS[package]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated private names (next test)
            assert getattr(module, name) is not None, f"{package}.{name}"
        if not name.startswith("_"):
            assert name in module.__all__, f"{package}.{name}"


@pytest.mark.parametrize(("name", "replacement"), [
    ("_ALL_TO_ALL", "ExchangePhase.ALL_TO_ALL"), ("_GATHER", "ExchangePhase.GATHER"),
    ("_NODE_GATHER", "ExchangePhase.NODE_GATHER"), ("_advance", "advance_exchange_"),
    ("_all_gather", "all_gather_async"), ("_bytes_sent", "BucketLayout.bytes_sent"),
])
def test_the_private_names_the_comm_namespace_listed_resolve_with_a_future_warning(name: str,
                                                                                   replacement: str) -> None:
    import lightning_onebit.comm as comm

    assert name not in comm.__all__ and name not in vars(comm)
    with pytest.warns(FutureWarning, match=f"use lightning_onebit.comm.{replacement};") as record:
        value = getattr(comm, name)
    assert record[0].filename == __file__
    if replacement.startswith("ExchangePhase."):
        assert value == getattr(comm.ExchangePhase, replacement.split(".")[1])
    elif name == "_bytes_sent":
        layout = comm.BucketLayout.build([100, 28], 2)
        assert value(layout, 4, None, 0) == layout.bytes_sent(4, None, 0) == (0, layout.bytes_per_call())
    else:
        assert value is getattr(comm, replacement)


def test_the_exit_release_keeps_its_old_private_name_with_a_future_warning() -> None:
    import lightning_onebit.strategy as strategy

    assert "_release_process_groups_at_exit" not in strategy.__all__
    with pytest.warns(FutureWarning, match="use lightning_onebit.strategy.release_process_groups_at_exit;"):
        old = strategy._release_process_groups_at_exit
    assert old is strategy.release_process_groups_at_exit


#: Names that left an optim module when 0/1 Adam's schedule moved beside its step (issue 45), and their new module.
OPTIM_MOVED = {
    ("lightning_onebit.optim.zeroone_schedule", "ZeroOneSchedule"): "lightning_onebit.optim.zeroone_adam",
    ("lightning_onebit.optim.zeroone_schedule", "SYNC_STATE"): "lightning_onebit.optim.checkpoint",
}


@pytest.mark.parametrize("old, name", sorted(OPTIM_MOVED))
def test_a_name_moved_inside_optim_still_imports_from_its_old_module_with_a_future_warning(old: str, name: str) -> None:
    new_home = OPTIM_MOVED[(old, name)]
    namespace: dict = {}
    with pytest.warns(FutureWarning, match=f"{old}.{name} moved to {new_home}.{name}; import it from there") as record:
        exec(f"from {old} import {name}", namespace)
    assert namespace[name] is getattr(importlib.import_module(new_home), name)
    assert record[0].filename == "<string>"  # the warning points at the importer
    with pytest.raises(AttributeError, match="has no attribute 'NOT_THERE'"):
        getattr(importlib.import_module(old), "NOT_THERE")
