"""The files of a checkpoint: written whole or not at all, verified before use, and recognised for what they are.

``onebit_fsdp`` writes a distributed checkpoint, a folder: ``torch.distributed.checkpoint``'s shard files and its
``.metadata``, Lightning's ``meta.pt`` (loops, callbacks, ...) and one sidecar per rank (per-rank state,
:mod:`~lightning_onebit.strategy.sidecar`). A save (:class:`FolderSave`):

1. writes everything into a temporary sibling folder ``<name>.onebit-partial-<save id>``, each rank its own files;
2. each rank computes the size and SHA-256 of the files it wrote, and the ranks gather them (one ``agree``);
3. rank 0 writes ``meta.pt`` and the manifest (:data:`MANIFEST_NAME`: the save id, and every file's size and digest,
   the sidecars' aside: they carry their own digest and the save id, and a bad one follows the ``error_feedback``
   policy), then puts the folder in place (:func:`put_in_place`: an atomic exchange with what was there, then removes
   it), and every rank learns whether it succeeded (one more ``agree``): every rank returns, or every rank raises.

A save that dies before the exchange leaves the previous checkpoint under that name as it was, and its partial
folder, which the next save to that name removes. On load, every rank checks what the path holds (a folder of this
kind, not one file or a missing path) and a share of the files against the manifest, the ranks agree (one
``agree``), and every rank raises the same :class:`CheckpointIntegrityError` (or ``ValueError`` for a
checkpoint of the other strategy) before any tensor is read, or none does.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit.comm.agreement import agree
from lightning_onebit.strategy.checkpoint_kinds import DCP_METADATA, first_line, fsdp_file_problem

__all__ = [
    "MANIFEST_NAME",
    "SAVE_RECORD_KEY",
    "CheckpointIntegrityError",
    "FolderSave",
    "LoadProblems",
    "agree_on_problems",
    "file_digest",
    "first_line",
    "folder_problems",
    "put_in_place",
]

#: The manifest of a distributed checkpoint's files (JSON), written last into the folder.
MANIFEST_NAME = "onebit-manifest.json"
MANIFEST_FORMAT = 1
#: ``meta.pt`` key of ``{"save_id": ..., "manifest": MANIFEST_NAME}``: the save that wrote the folder.
SAVE_RECORD_KEY = "onebit_save"
#: DCP's metadata file and Lightning's file in a distributed checkpoint.
LIGHTNING_METADATA = "meta.pt"
_PARTIAL = ".onebit-partial-"
_PREVIOUS = ".onebit-previous-"


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint whose files are damaged, incomplete, or not those of one save (raised on every rank)."""


# ---------------------------------------------------------------------------------------------------------- digests
def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path``."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        size = f.tell()
    return {"bytes": size, "sha256": digest}


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new file in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------------------- saving
def _remove(path: Path) -> None:
    """Remove a file, link or folder that is no longer needed (what is left, the next save to the name removes)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the system or
    filesystem cannot (NFS, macOS), for the caller to fall back on."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def put_in_place(new: Path, target: Path) -> None:
    """Move the finished folder ``new`` to ``target``, replacing whatever is there (a folder, a file or a link): an
    atomic exchange where the filesystem can (Linux), so that ``target`` is always the old or the new checkpoint;
    elsewhere the old one is first renamed to ``<target>.onebit-previous-<...>``, which a crash in between leaves
    for the user (:func:`folder_problems` names it). Then the old one is removed and the parent directory synced."""
    if not os.path.lexists(target):
        os.rename(new, target)
    elif _exchange(new, target):
        _remove(new)  # now the old checkpoint
    else:
        aside = target.with_name(target.name + _PREVIOUS + new.name.rsplit(_PARTIAL, 1)[-1])
        os.rename(target, aside)
        os.rename(new, target)
        _remove(aside)
    _fsync_dir(target.parent)



def _leftovers(target: Path) -> list[Path]:
    """Partial and set-aside folders of earlier saves to ``target`` that did not finish."""
    prefixes = (target.name + _PARTIAL, target.name + _PREVIOUS)
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    return sorted(target.parent / name for name in names if name.startswith(prefixes))


class FolderSave:
    """One save of a distributed checkpoint to ``target`` by every rank (see the module docstring).

    Args:
        target: the checkpoint's path (a folder once saved).
        save_id: the same string on every rank, unique to this save (rank 0's, broadcast with the path).
        rank, world_size: this rank's global rank and the world size.
    """

    def __init__(self, target: Path, save_id: str, rank: int, world_size: int) -> None:
        self.target, self.save_id, self.rank, self.world_size = target, save_id, rank, world_size
        self.folder = target.with_name(target.name + _PARTIAL + save_id)

    def begin(self, write_own_files: Callable[[Path], None]) -> None:
        """Create the partial folder and call ``write_own_files(folder)`` (this rank's sidecar); rank 0 first
        removes what earlier saves to this name left, once the name holds a checkpoint again (a partial folder is then
        never the only copy of one). One ``all_gather_object``: if any rank failed, every rank raises before DCP's
        collectives (the same ``RuntimeError``)."""
        failure = None
        try:
            if self.rank == 0 and os.path.lexists(self.target):
                for leftover in _leftovers(self.target):
                    if leftover != self.folder:
                        _remove(leftover)
            self.folder.mkdir(parents=True, exist_ok=True)
            write_own_files(self.folder)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, then raise
            failure = f"rank {self.rank} could not write its files ({type(err).__name__}: {err})"
        self._raise_if_failed(agree(failure))

    def _raise_if_failed(self, failures: list[Optional[str]]) -> None:
        found = "; ".join(f for f in failures if f is not None)
        if found:
            self.abandon()
            raise RuntimeError(f"the checkpoint {self.target} was not saved: {found}. A checkpoint that was already "
                               "under this name is untouched")

    def storage_writer(self) -> Any:
        """DCP's file writer into the partial folder, recording what this rank wrote and the save id in
        ``.metadata`` (its ``storage_meta``)."""
        return _recording_writer_class()(self.folder, self.save_id, str(self.target))

    def finish(self, writer: Any, checkpoint: Optional[dict[str, Any]]) -> None:
        """After ``torch.distributed.checkpoint.save`` returned on every rank: digests gathered on rank 0, which
        writes ``checkpoint`` (rank 0's; the others pass theirs, unused) as ``meta.pt`` and the manifest and puts the
        folder in place. Collectives: two :func:`~lightning_onebit.comm.agree` (the digests, then rank 0's outcome).
        Raises the same ``RuntimeError`` on every rank if any rank failed (the partial folder is removed; the previous
        checkpoint under the name is untouched)."""
        mine: dict[str, Any] = {}
        failure = None
        try:
            names = list(writer.files_written) + ([DCP_METADATA] if self.rank == 0 else [])
            mine = {name: file_digest(self.folder / name) for name in names}
        except OSError as err:
            failure = f"rank {self.rank} could not read back what it wrote ({type(err).__name__}: {err})"
        everyone = agree((mine, failure))
        status: list[Optional[str]] = [None]
        if self.rank == 0:
            failures = [f for _, f in everyone if f is not None]
            if not failures:
                try:
                    self._write_and_place(checkpoint or {}, {k: v for files, _ in everyone for k, v in files.items()})
                except Exception as err:  # noqa: BLE001 - every rank must hear of it, then raise
                    failures.append(f"rank 0 could not finish it ({type(err).__name__}: {err})")
            status[0] = "; ".join(failures) or None
        self._raise_if_failed(agree(status[0])[:1])  # rank 0's outcome

    def abandon(self) -> None:
        """Rank 0 removes the partial folder after a save that failed on every rank (DCP's own errors are)."""
        if self.rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)

    def _write_and_place(self, checkpoint: dict[str, Any], files: dict[str, Any]) -> None:
        checkpoint[SAVE_RECORD_KEY] = {"save_id": self.save_id, "manifest": MANIFEST_NAME}
        meta = self.folder / LIGHTNING_METADATA
        with open(meta, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        files[LIGHTNING_METADATA] = file_digest(meta)
        manifest = {"format": MANIFEST_FORMAT, "save_id": self.save_id, "world_size": self.world_size,
                    "files": dict(sorted(files.items()))}
        path = self.folder / MANIFEST_NAME
        path.write_text(json.dumps(manifest, indent=1))
        _fsync_file(path)
        _fsync_dir(self.folder)
        put_in_place(self.folder, self.target)


@functools.cache
def _recording_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.metadata import StorageMeta

    class RecordingWriter(FileSystemWriter):
        """``FileSystemWriter`` that records the files this rank wrote and puts the save id in ``.metadata``."""

        def __init__(self, path: Path, save_id: str, checkpoint_id: str) -> None:
            super().__init__(path)
            self.onebit_save_id, self.onebit_checkpoint_id = save_id, checkpoint_id
            self.files_written: list[str] = []

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            self.files_written = sorted({result.storage_data.relative_path for result in future.wait()})
            return future

        def storage_meta(self) -> Any:
            return StorageMeta(checkpoint_id=self.onebit_checkpoint_id, save_id=self.onebit_save_id)

    return RecordingWriter


# ---------------------------------------------------------------------------------------------------------- loading
def _interrupted_saves(path: Path) -> str:
    left = _leftovers(path)
    if not left:
        return ""
    return (f"; an interrupted save to this name left {', '.join(p.name for p in left)} next to it (a folder with "
            f"{MANIFEST_NAME} and {LIGHTNING_METADATA} in it is complete: rename it to {path.name} to resume from it)")


def _share(names: Sequence[str], sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files rank ``rank`` verifies: the largest first, each to the rank with the fewest bytes so far (the same
    split on every rank)."""
    load = [0] * world_size
    mine = []
    for name in sorted(names, key=lambda n: (-sizes[n], n)):
        who = min(range(world_size), key=lambda r: (load[r], r))
        load[who] += sizes[name]
        if who == rank:
            mine.append(name)
    return mine


def _check_file(folder: Path, name: str, recorded: dict[str, Any]) -> Optional[str]:
    """Why the file ``name`` of ``folder`` is not the one the manifest records, or ``None``."""
    path = folder / name
    try:
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != recorded.get("bytes"):
            return (f"{name} has {size} bytes where the manifest records {recorded.get('bytes')} (truncated, "
                    "extended, or written by another save)")
        if file_digest(path)["sha256"] != recorded.get("sha256"):
            return (f"{name} does not match the SHA-256 the manifest records (altered or damaged, or written by "
                    "another save)")
    except OSError as err:
        return f"{name} cannot be read ({type(err).__name__}: {err})"
    return None


def read_manifest(folder: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """``(manifest, None)``, ``(None, None)`` for a folder without one (written before manifests), or
    ``(None, reason)`` for one that cannot be read."""
    path = folder / MANIFEST_NAME
    if not path.exists():
        return None, None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict) or not isinstance(
                manifest.get("save_id"), str):
            raise ValueError(f"format {manifest.get('format')!r}")
        for entry in files.values():
            int(entry["bytes"]), str(entry["sha256"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{MANIFEST_NAME} cannot be read ({type(err).__name__}: {err}): it is damaged"
    return manifest, None


@dataclass
class LoadProblems:
    """What one rank finds wrong with loading a checkpoint, before anything is read from it."""

    #: The path holds no checkpoint of the kind the strategy loads (another strategy's, or nothing): ``ValueError``.
    wrong_kind: list[str] = field(default_factory=list)
    #: The checkpoint is damaged, incomplete, or mixes saves: :class:`CheckpointIntegrityError`.
    damaged: list[str] = field(default_factory=list)
    #: Whether the folder's files were verified against a manifest (``False``: written before manifests).
    verified: bool = False


def folder_problems(path: Path, rank: int, world_size: int, resuming: bool,
                    weights_only: Optional[bool] = None, strategy: str = "onebit_fsdp") -> LoadProblems:
    """What this rank finds wrong with loading the checkpoint at ``path`` under ``onebit_fsdp`` (``resuming``: a
    fit that restores the optimizer, which needs a distributed checkpoint), having verified its share of the
    folder's files against the manifest. Reads files, never communicates (and never raises for a file it cannot
    read): pass the result to :func:`agree_on_problems`."""
    try:
        return _folder_problems(path, rank, world_size, resuming, weights_only, strategy)
    except OSError as err:
        return LoadProblems(damaged=[f"{path} cannot be read ({type(err).__name__}: {err})"])


def _folder_problems(path: Path, rank: int, world_size: int, resuming: bool,
                     weights_only: Optional[bool], strategy: str) -> LoadProblems:
    if not os.path.lexists(path):
        return LoadProblems(wrong_kind=[f"there is no checkpoint at {path}{_interrupted_saves(path)}"])
    if path.is_file():
        return LoadProblems(wrong_kind=[fsdp_file_problem(path, weights_only, strategy)] if resuming else [])
    if not (path / DCP_METADATA).is_file():
        return LoadProblems(wrong_kind=[
            f"{path} is a folder but not a distributed checkpoint (it has no {DCP_METADATA}){_interrupted_saves(path)}"
        ])
    manifest, unreadable = read_manifest(path)
    if unreadable is not None:
        return LoadProblems(damaged=[unreadable])
    if manifest is None:
        if not (path / LIGHTNING_METADATA).is_file():
            return LoadProblems(damaged=[f"{LIGHTNING_METADATA} is missing: the save did not finish"])
        return LoadProblems()
    files = manifest["files"]
    missing = [name for name in (DCP_METADATA, LIGHTNING_METADATA) if name not in files]
    if missing:
        return LoadProblems(damaged=[f"the manifest lists no {' or '.join(missing)}: it is not that of a whole save"])
    sizes = {name: int(entry["bytes"]) for name, entry in files.items()}
    share = _share(list(files), sizes, rank, world_size)
    return LoadProblems(damaged=[p for p in (_check_file(path, n, files[n]) for n in share) if p], verified=True)


def agree_on_problems(problems: LoadProblems, path: Any, strategy_name: str) -> bool:
    """Every rank's ``problems`` gathered (one ``all_gather_object`` when a process group exists): if any rank found
    one, every rank raises the same error with all of them (each once, in rank order) so that no rank goes on into a
    collective that another left: ``ValueError`` if any rank found the wrong kind of checkpoint, else
    :class:`CheckpointIntegrityError`. Returns whether every rank verified its files."""
    everyone = agree(problems)

    def found(kind: str) -> list[str]:
        texts: list[str] = []
        for rank_problems in everyone:
            texts.extend(p for p in getattr(rank_problems, kind) if p not in texts)
        return texts

    wrong_kind, damaged = found("wrong_kind"), found("damaged")
    if wrong_kind:
        raise ValueError(f"strategy={strategy_name!r} cannot load the checkpoint: {'; '.join(wrong_kind)}")
    if damaged:
        raise CheckpointIntegrityError(
            f"the checkpoint {path} cannot be loaded: {'; '.join(damaged)}. Its files are not those of one intact save "
            "(a file was damaged or altered, or files of two saves were put together): resume from another checkpoint"
        )
    return all(rank_problems.verified for rank_problems in everyone)
