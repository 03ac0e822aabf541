"""Which strategy wrote a checkpoint, and why another cannot resume from it: the messages that name the strategy to
resume with (a single file of ``onebit_adam``, ``onebit_diloco`` or ``ddp``, a folder of ``onebit_fsdp`` or
``onebit_diloco_fsdp``). Reads files, never communicates."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lightning_onebit.optim.checkpoint import CHECKPOINT_KEY
from lightning_onebit.strategy.sidecar import SIDECAR_RECORD_KEY

__all__ = ["DCP_METADATA", "LOCAL_STEPS_RECORD_KEY", "ddp_folder_problem", "first_line", "fsdp_file_problem"]

#: The file ``torch.distributed.checkpoint`` writes in every checkpoint folder.
DCP_METADATA = ".metadata"


def first_line(err: BaseException) -> str:
    """The first line of an exception's message, at most 200 characters (torch's advice that follows does not
    apply to a damaged file)."""
    lines = str(err).strip().splitlines()
    return lines[0][:200] if lines else ""



def _peek(path: Path, weights_only: Optional[bool]) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The checkpoint in the file at ``path`` (its tensors mapped, not read), or the reason it cannot be read."""
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
    except Exception as err:  # noqa: BLE001 - a reason for the message, not a crash
        return None, f"{type(err).__name__}: {first_line(err)}"
    return (checkpoint, None) if isinstance(checkpoint, dict) else (None, f"it holds a {type(checkpoint).__name__}")


def _file_writer(checkpoint: dict[str, Any]) -> Optional[tuple[str, str]]:
    """``(strategy name, class)`` of this package that wrote the single-file ``checkpoint``, or ``None``: a compressed
    optimizer's record is ``onebit_adam``'s; per-rank sidecars without one are ``onebit_diloco``'s."""
    states = checkpoint.get("optimizer_states") or []
    if any(isinstance(s, dict) and CHECKPOINT_KEY in s for s in states):
        return "onebit_adam", "OnebitStrategy"
    return ("onebit_diloco", "OnebitDiLoCoStrategy") if SIDECAR_RECORD_KEY in checkpoint else None


def fsdp_file_problem(path: Path, weights_only: Optional[bool] = None, strategy: str = "onebit_fsdp") -> str:
    """Why ``strategy`` (``onebit_fsdp``, ``onebit_diloco_fsdp``) cannot resume training from the single file at
    ``path``, and what to do instead."""
    checkpoint, unreadable = _peek(path, weights_only)
    from_weights = (f"to start {strategy} from its weights, load them into the model before fit "
                    f"(model.load_state_dict(torch.load({str(path)!r})['state_dict'])) and fit without ckpt_path: the "
                    "optimizer state and error feedback start afresh")
    if checkpoint is None:
        return (f"{path} is a file that is not a readable checkpoint ({unreadable}); strategy='{strategy}' resumes "
                "from its own distributed checkpoints, which are folders")
    writer = _file_writer(checkpoint)
    if writer is not None:
        return (f"{path} is a {writer[0]} checkpoint (one file, written by {writer[1]}), and strategy='{strategy}' "
                f"resumes only from its own distributed checkpoints (folders): resume it with strategy='{writer[0]}', "
                f"or {from_weights}")
    if "optimizer_states" not in checkpoint:
        return (f"{path} holds model weights only (one file, as OnebitFSDPStrategy(save_distributed_checkpoint=False) "
                f"writes), nothing to resume training from: {from_weights}")
    return (f"{path} is a single-file checkpoint (as strategy='ddp' writes), and strategy='{strategy}' resumes only "
            f"from its own distributed checkpoints (folders): resume it with the strategy that wrote it, or "
            f"{from_weights}")


#: the key of ``onebit_diloco_fsdp``'s record in a distributed checkpoint's ``meta.pt``
LOCAL_STEPS_RECORD_KEY = "onebit_diloco_fsdp"


def ddp_folder_problem(path: Path, strategy: str = "onebit_adam") -> Optional[str]:
    """Why the folder at ``path`` is not a checkpoint ``strategy`` (``onebit_adam``, ``onebit_diloco``) can load
    (``None`` if it is not a folder)."""
    if not path.is_dir():
        return None
    if (path / DCP_METADATA).is_file():
        meta, _ = _peek(path / "meta.pt", True) if (path / "meta.pt").is_file() else (None, None)
        local_steps = meta is not None and LOCAL_STEPS_RECORD_KEY in meta
        writer, where = (("onebit_diloco_fsdp", "at any number of ranks per replica, with as many replicas")
                         if local_steps else ("onebit_fsdp", "at any world size"))
        return (f"{path} is a {writer} checkpoint (a folder of shards), and strategy='{strategy}' loads one file: "
                f"resume it with strategy='{writer}' ({where}: it is resharded); to take its weights elsewhere, "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(folder, file) writes them to one file")
    return f"{path} is a folder, not a checkpoint file"
