"""How a failed collective of the compressed exchange is reported: :class:`CollectiveFailedError`, raised by
``_naming_the_group`` around a collective, with a message (``_collective_failure``) that names the collective, the
global ranks of its process group and the group's timeout.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch.distributed as dist

from lightning_onebit.comm.groups import group_timeout


class CollectiveFailedError(RuntimeError):
    """A collective of the compressed exchange failed on this rank. The message names the collective, the global
    ranks of its process group and the group's timeout; the backend's own error is the ``__cause__``. On gloo a peer
    that stalled (stopped, swapped out, stuck in I/O or a debugger) makes it time out after the group's timeout, one
    that died makes it fail at once; neither error says which peer."""


@contextlib.contextmanager
def _naming_the_group(what: str, group: Optional[dist.ProcessGroup]) -> Iterator[None]:
    """Re-raise a backend error of the collective(s) inside as a :class:`CollectiveFailedError` naming ``group``."""
    try:
        yield
    except CollectiveFailedError:
        raise
    except RuntimeError as error:  # gloo and NCCL raise RuntimeError (DistBackendError is one) for a failed peer
        raise CollectiveFailedError(_collective_failure(what, group, error)) from error


def _collective_failure(what: str, group: Optional[dist.ProcessGroup], error: BaseException) -> str:
    try:
        ranks: Any = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    except (RuntimeError, ValueError):
        ranks = "unknown"
    timeout = group_timeout(group)
    waited = f"with a timeout of {timeout.total_seconds():g} s" if timeout is not None else "(timeout unknown)"
    return (
        f"lightning_onebit: the compressed exchange's {what} in the process group of global ranks {ranks} {waited} "
        f"failed: {error}. A rank of that group that stalled (stopped, swapped out, stuck in I/O or a debugger) "
        "makes this collective time out; one that died makes it fail at once. Look for the rank whose log stops "
        "before this step; the timeout is the strategy's (or init_process_group's) timeout"
    )
