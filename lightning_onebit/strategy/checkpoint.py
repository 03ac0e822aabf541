"""The strategy's side of checkpoints: per-rank state (e.g. compression error feedback) saved to, restored from and
removed with one sidecar file per rank (the file format is :mod:`lightning_onebit.strategy.sidecar`), and the run id
that tells this run's checkpoints from another's.

Lightning writes only rank 0's checkpoint under DDP, so what differs per rank goes under :data:`PER_RANK_STATE_KEY`
(the strategy's compression error feedback, :mod:`~lightning_onebit.strategy.error_feedback`, and any callback's);
every rank writes its own part next to the checkpoint, and the main checkpoint records which sidecars belong to it.
A bad sidecar is never an exception on load: its reason goes to :data:`PER_RANK_STATUS_KEY`, and the owner of the
state (for the error feedback, the strategy at the start of training) agrees across ranks what to do.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Optional, Union

from lightning_onebit.comm.agreement import agree
from lightning_onebit.comm.topology import Topology
from lightning_onebit.strategy.sidecar import SIDECAR_RECORD_KEY, read_sidecar, sidecar_path, write_sidecar

#: Checkpoint key of the state that differs per rank (the strategy's compression error feedback; callbacks may add
#: their own). The strategy writes it to one sidecar file per rank (Lightning writes only rank 0's checkpoint, see
#: :mod:`lightning_onebit.strategy.sidecar`) and, on load, puts each rank's own validated sidecar back under this key.
PER_RANK_STATE_KEY = "onebit_per_rank"
#: Checkpoint key under which the strategy reports, on load, this rank's sidecar ``{"file": path, "reason": None or
#: why it could not be restored}``, with ``"recorded": False`` (and ``"detail"``) when the checkpoint records none.
PER_RANK_STATUS_KEY = "onebit_per_rank_status"
#: The start of the status reason of a checkpoint that records no per-rank files (it was saved without per-rank state).
NO_PER_RANK_FILES = "the checkpoint records no per-rank files"


def agree_run_id(global_rank: int) -> str:
    """Rank 0's fresh run id, the same on every rank (:func:`~lightning_onebit.comm.agree`: a collective when the
    default process group exists): it identifies this run's checkpoints in their per-rank files."""
    return agree(uuid.uuid4().hex if global_rank == 0 else None)[0]


def save_per_rank_state(
    checkpoint: dict[str, Any],
    sidecar_file: str,
    checkpoint_id: str,
    rank: int,
    world_size: int,
    topology: Optional[Topology],
) -> bool:
    """Move ``checkpoint[PER_RANK_STATE_KEY]``, if any, to this rank's sidecar ``sidecar_file`` (:func:`sidecar_path`
    next to a checkpoint file, :func:`~lightning_onebit.strategy.sidecar.sidecar_in_folder` in a distributed
    checkpoint's folder), and record in the
    checkpoint which sidecars belong to it: ``checkpoint_id``, the same on every rank and unique to this save. Returns
    whether there was per-rank state to write."""
    per_rank = checkpoint.pop(PER_RANK_STATE_KEY, None)
    if per_rank is None:
        return False
    meta = {
        "checkpoint_id": checkpoint_id,
        "global_step": checkpoint.get("global_step"),
        "rank": rank,
        "world_size": world_size,
        "topology": None if topology is None else topology.describe(),
    }
    write_sidecar(sidecar_file, meta, per_rank)
    checkpoint[SIDECAR_RECORD_KEY] = {k: meta[k] for k in ("checkpoint_id", "global_step", "world_size")}
    return True


def restore_per_rank_state(checkpoint: dict[str, Any], sidecar_file: str, rank: int, world_size: int) -> None:
    """Put this rank's validated sidecar ``sidecar_file`` (where :func:`save_per_rank_state` wrote it) under
    ``checkpoint[PER_RANK_STATE_KEY]`` and its status under ``checkpoint[PER_RANK_STATUS_KEY]``, with the reason when
    it cannot be restored (never raises)."""
    record = checkpoint.pop(SIDECAR_RECORD_KEY, None)
    path = sidecar_file
    if record is None:
        # "recorded": False lets the owner of the state say why (e.g. saved with error feedback policy "reset")
        detail = f", but {os.path.basename(path)} exists next to it and is ignored" if os.path.exists(path) else ""
        checkpoint[PER_RANK_STATUS_KEY] = {"file": path, "reason": NO_PER_RANK_FILES + detail, "recorded": False,
                                           "detail": detail}
        return
    expected = {"checkpoint_id": record["checkpoint_id"], "rank": rank, "world_size": world_size}
    if record.get("world_size") != world_size:
        state, reason = None, (
            f"the checkpoint was saved with world size {record.get('world_size')} and this run has world size "
            f"{world_size}"
        )
    else:
        state, reason = read_sidecar(path, expected)
    checkpoint[PER_RANK_STATUS_KEY] = {"file": path, "reason": reason}
    if state is not None:
        checkpoint[PER_RANK_STATE_KEY] = state


def owned_sidecar(filepath: Union[str, "os.PathLike[str]"], rank: int) -> Optional[str]:
    """This rank's sidecar of the checkpoint at ``filepath``, to remove with it; ``None`` for a link
    (``save_last="link"``), which does not own the sidecars of the file it points to: only that file's removal does.
    Call it before the checkpoint is removed."""
    return None if os.path.islink(os.fspath(filepath)) else sidecar_path(filepath, rank)


def remove_sidecar(path: Optional[str]) -> None:
    """Remove the sidecar :func:`owned_sidecar` named, if there is one."""
    if path is not None and os.path.exists(path):
        os.remove(path)
