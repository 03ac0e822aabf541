"""Per-rank checkpoint files ("sidecars") that cannot lie about what they hold.

Lightning writes only rank 0's checkpoint under DDP, but compression error feedback differs per rank. The
``onebit_adam`` strategy therefore writes one sidecar per rank next to the checkpoint,
``<checkpoint>.onebit-rank<r>`` (``onebit_fsdp``: inside its checkpoint's folder, ``<folder>/onebit-rank<r>``), and
records in the main checkpoint which sidecars belong to it. A sidecar holds:

* ``checkpoint_id``: the id the main checkpoint records (``<run id>/<save index>``; ``onebit_fsdp``: the save's id),
  so a sidecar of another checkpoint of the same run (an older save under the same name) or of another run is
  recognised as stale;
* ``global_step``, ``rank``, ``world_size`` and the ``topology`` description, for messages and checks;
* the per-rank state, serialised, with its SHA-256, so truncation and corruption are detected before unpickling.
  The serialised state is stored as a ``uint8`` tensor (format 3), which ``torch.save`` writes as raw bytes: format 2
  stored it as a ``bytes`` object, which pickle protocol 2 (``torch.save``'s) writes as text with every byte above
  ``0x7f`` taking two, about 1.5 times the state's size. Both formats are read.

Writing is atomic (a temporary file in the same directory, then ``os.replace``): a crash mid-write leaves the previous
sidecar or none, never half a file. The file gets the permission bits a plain ``open(path, "wb")`` would give it
(``0666`` less the process umask), as ``torch.save`` gives the checkpoint itself, so whoever can read the checkpoint in
a shared directory can read its sidecars too. :func:`read_sidecar` never raises for a bad file: it returns the reason
(a file this process may not read says so, with its mode and owner), so that the ranks can agree on what to do (see
:class:`~lightning_onebit.ErrorFeedbackCheckpoint`).
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from typing import Any, Optional, Union

import torch

SIDECAR_FORMAT = 3
#: Formats :func:`read_sidecar` reads: 2 (the state's bytes as ``bytes``) and 3 (as a ``uint8`` tensor).
READABLE_FORMATS = (2, 3)
#: Key of the main checkpoint under which the strategy records its sidecars' identity.
SIDECAR_RECORD_KEY = "onebit_sidecars"


def sidecar_path(checkpoint_path: Union[str, "os.PathLike[str]"], rank: int) -> str:
    """Path of rank ``rank``'s sidecar for the checkpoint at ``checkpoint_path``. A symbolic link (e.g. Lightning's
    ``save_last="link"``) is followed: the sidecars live next to the file it points to."""
    return f"{os.path.realpath(os.fspath(checkpoint_path))}.onebit-rank{rank}"


def sidecar_in_folder(folder: Union[str, "os.PathLike[str]"], rank: int) -> str:
    """Path of rank ``rank``'s sidecar inside a distributed checkpoint's ``folder`` (``onebit_fsdp``), where it is
    written, put in place and removed with the rest of the save."""
    return os.path.join(os.fspath(folder), f"onebit-rank{rank}")


def write_sidecar(path: str, meta: dict[str, Any], state: Any) -> None:
    """Write ``state`` with ``meta`` (checkpoint id, step, rank, world size, topology) to ``path`` atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    # a uint8 tensor over the bytes, which torch.save writes as they are (a bytes object would cost 1.5 times them)
    payload = dict(meta, format=SIDECAR_FORMAT, sha256=hashlib.sha256(data).hexdigest(),
                   state_bytes=torch.frombuffer(data, dtype=torch.uint8))
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        # mkstemp makes the file 0600: give it the bits of a plain open(path, "wb"), as the checkpoint has
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def read_sidecar(path: str, expected: dict[str, Any]) -> tuple[Optional[Any], Optional[str]]:
    """Read and validate a sidecar: ``(state, None)``, or ``(None, reason)`` when it is missing, unreadable, corrupt,
    stale, foreign or mismatched. ``expected`` holds the ``checkpoint_id``, ``rank`` and ``world_size`` it must carry.
    Never raises for a bad file."""
    if not os.path.exists(path):
        return None, "the file does not exist"
    try:
        with open(path, "rb") as f:
            payload = torch.load(f, map_location="cpu", weights_only=True)
    except PermissionError:
        return None, _permission_reason(path)
    except Exception as err:  # noqa: BLE001 - any unreadable file is a reason, not a crash
        return None, f"the file is unreadable ({type(err).__name__}: {_first_line(err)})"
    if not isinstance(payload, dict) or payload.get("format") not in READABLE_FORMATS:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        return None, f"the file is not a lightning_onebit sidecar of format {SIDECAR_FORMAT} (found {found!r})"
    data = _state_bytes(payload.get("state_bytes"))
    if data is None or hashlib.sha256(data).hexdigest() != payload.get("sha256"):
        return None, "the file is corrupt (its checksum does not match its contents)"
    if (payload.get("rank"), payload.get("world_size")) != (expected["rank"], expected["world_size"]):
        return None, (
            f"the file was written by rank {payload.get('rank')} of {payload.get('world_size')}, this is rank "
            f"{expected['rank']} of {expected['world_size']}"
        )
    if payload.get("checkpoint_id") != expected["checkpoint_id"]:
        return None, (
            f"the file belongs to another checkpoint (written at step {payload.get('global_step')} with id "
            f"{payload.get('checkpoint_id')!r}; this checkpoint's id is {expected['checkpoint_id']!r}): stale or "
            "copied from elsewhere"
        )
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001
        return None, f"the file's state cannot be loaded ({type(err).__name__}: {_first_line(err)})"
    return state, None


def _state_bytes(stored: Any) -> Optional[bytes]:
    """The serialised state a sidecar holds: a ``uint8`` tensor (format 3) or ``bytes`` (format 2); ``None`` for
    anything else."""
    if isinstance(stored, bytes):
        return stored
    if isinstance(stored, torch.Tensor) and stored.dtype == torch.uint8 and stored.dim() == 1:
        return stored.numpy().tobytes()
    return None


def _umask() -> int:
    """The process umask, read without changing it where Linux says it (``/proc/self/status``), else set and
    restored at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _permission_reason(path: str) -> str:
    """Why a sidecar that exists cannot be opened: its mode and owner, this process's user, and the fix."""
    try:
        st = os.stat(path)
        owner = f"mode {st.st_mode & 0o777:04o}, owner uid {st.st_uid}"
    except OSError:
        owner = "mode unknown"
    uid = os.getuid() if hasattr(os, "getuid") else "?"
    return (
        f"the file exists but this process (uid {uid}) may not read it: permission denied ({owner}); make it "
        f"readable as the checkpoint is (`chmod a+r {path}`)"
    )


def _first_line(err: BaseException) -> str:
    # the first sentence: torch's own advice that follows (e.g. "re-run with weights_only=False") does not apply here
    text = str(err).strip().splitlines()
    return text[0].split(". ")[0][:160] if text else ""
