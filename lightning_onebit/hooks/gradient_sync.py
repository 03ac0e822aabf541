"""A DDP communication hook that averages gradients during warmup and sends nothing afterwards.

1-bit Adam needs DDP's gradient allreduce only during warmup; in the compression stage each rank keeps its local
gradient and the optimizer averages compressed momenta instead. The switch is a predicate consulted for every
bucket of every backward, so it follows the optimizer's own step, including right after a checkpoint is restored.

Used by :class:`lightning_onebit.OnebitStrategy`, and usable with plain DDP::

    state = GradientSyncState(process_group=None, sync_predicate=lambda: optimizer.needs_gradient_allreduce)
    ddp_model.register_comm_hook(state, switchable_allreduce_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import threading
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from lightning_onebit.comm.accounting import CommunicationCounters, add_traffic, count_ring_allreduce
from lightning_onebit.comm.topology import Topology
from lightning_onebit.streams import DeviceTimings

_Mark = Union[float, "torch.cuda.Event"]  # host seconds, or a CUDA event


class GradientSyncState:
    """State of :func:`switchable_allreduce_hook`.

    Args:
        process_group: group to average over; ``None`` means WORLD.
        sync_predicate: called once per bucket per backward; ``True`` averages the bucket across ranks, ``False``
            leaves the local gradient untouched (no communication). Defaults to always averaging.
        topology: which ranks share a node (a :class:`~lightning_onebit.Topology` over ``process_group``), to split
            ``bytes_sent`` into intra- and inter-node bytes: a ring allreduce sends everything to the next rank, so a
            rank's bytes cross the node boundary when that rank is on another node. ``None``: all count as inter-node.
        averaging_hook: a DDP comm hook that averages the buckets instead of the plain ``mean`` allreduce, called as
            ``averaging_hook(averaging_hook_state, bucket)`` (e.g. torch's ``bf16_compress_hook`` with its process
            group as state: gradients sent in bf16, half the bytes). Its bytes: when ``averaging_hook_state`` counts
            its own (a ``counters`` attribute that is a :class:`~lightning_onebit.comm.CommunicationCounters`,
            counted when the hook is called, as :class:`~lightning_onebit.hooks.OrderedPowerSGDState` and
            :class:`~lightning_onebit.hooks.Int8AllreduceState` do), what it counted during the call is added to
            :attr:`counters`; otherwise a ring allreduce in bf16/fp16 for torch's
            ``bf16_compress_hook``/``fp16_compress_hook`` and in the gradient's dtype for any other hook (this state
            cannot see what another hook sends). Default ``None``: the ``mean`` allreduce.
        averaging_hook_state: the state passed to ``averaging_hook``.

    Attributes:
        counters: bytes and time of the warmup allreduces on this rank (``bytes_sent`` counts a ring allreduce in the
            gradient's dtype; ``time_s`` sums each bucket's launch-to-completion time, which overlaps the backward
            pass; ``exposed_s`` is, per backward, the time from the launch of the allreduce of DDP's last bucket,
            when backward has no gradient left to compute, to the completion of every bucket's allreduce: what the
            step waited for the link).
        span_s: per backward, the time from the first bucket's launch to the completion of every allreduce
            (cumulative seconds): the link was in use at most this long.
        skipped_buckets: buckets left local because ``sync_predicate`` returned ``False``.

    On CUDA, ``time_s``, ``exposed_s`` and ``span_s`` are device times measured with CUDA events (NCCL completes a
    future when the collective is enqueued, so host time would only be the launch), read back without waiting for
    the device when :meth:`settle_timings` is called (:attr:`OnebitStrategy.communication` does), at most a
    bounded number kept unread; elsewhere they are host wall-clock times.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        sync_predicate: Optional[Callable[[], bool]] = None,
        topology: Optional[Topology] = None,
        averaging_hook: Optional[Callable[[Any, dist.GradBucket], torch.futures.Future]] = None,
        averaging_hook_state: Any = None,
    ) -> None:
        self.process_group = process_group
        self.sync_predicate = sync_predicate or (lambda: True)
        self.topology = topology
        self.averaging_hook = averaging_hook
        self.averaging_hook_state = averaging_hook_state
        self.counters = CommunicationCounters()
        self.span_s = 0.0
        self.skipped_buckets = 0
        # One backward's allreduces: launch marks and how many are still in flight. Futures complete on the
        # backend's threads, hence the lock.
        self._lock = threading.Lock()
        self._in_flight = 0
        self._first_mark: Optional[_Mark] = None
        self._last_mark: Optional[_Mark] = None
        #: Device-time spans not read back yet on CUDA (bounded; see :class:`~lightning_onebit.streams.DeviceTimings`).
        self.timings = DeviceTimings()

    def _launched(self, device: torch.device, is_last_bucket: bool) -> _Mark:
        mark = self.timings.mark(device)
        with self._lock:
            self._in_flight += 1
            if self._first_mark is None:
                self._first_mark = mark
            if is_last_bucket:
                self._last_mark = mark
        return mark

    def _completed(self, device: torch.device, launched: _Mark) -> None:
        # on a callback thread whose current stream has waited for the collective: this mark is its completion
        mark = self.timings.mark(device)
        self.timings.add(self.counters, "time_s", launched, mark)
        with self._lock:
            self._in_flight -= 1
            if self._in_flight or self._last_mark is None:
                return  # more to come in this backward (or its last bucket has not been launched yet)
            first, last = self._first_mark, self._last_mark
            self._first_mark = self._last_mark = None
        self.timings.add(self.counters, "exposed_s", last, mark)
        self.timings.add(self, "span_s", first, mark)

    def settle_timings(self) -> None:
        """Add the CUDA-event timings that have completed to ``counters`` (``time_s``, ``exposed_s``) and ``span_s``,
        without waiting for the device (no-op off CUDA, where they are added as the allreduces complete)."""
        self.timings.settle()


def switchable_allreduce_hook(state: GradientSyncState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: when ``state.sync_predicate()``, the bucket averaged across ranks (a ``mean`` allreduce, or
    ``state.averaging_hook``), else the local bucket as is."""
    tensor = bucket.buffer()
    if not state.sync_predicate():
        state.skipped_buckets += 1
        local = torch.futures.Future()
        local.set_result(tensor)
        return local

    world_size = dist.get_world_size(state.process_group)
    rank = dist.get_rank(state.process_group)
    if state.averaging_hook is not None:
        own = _own_counters(state.averaging_hook_state)
        if own is None:
            count_ring_allreduce(
                state.counters, tensor, world_size, rank, state.topology, _wire_element_size(state.averaging_hook)
            )
        before = None if own is None else own.snapshot()
        launched = state._launched(tensor.device, bucket.is_last())
        averaged = state.averaging_hook(state.averaging_hook_state, bucket)
        if own is not None:
            add_traffic(state.counters, own - before)

        def finish_hook(done: torch.futures.Future) -> torch.Tensor:
            state._completed(tensor.device, launched)
            return done.value()

        return averaged.then(finish_hook)
    count_ring_allreduce(state.counters, tensor, world_size, rank, state.topology)
    tensor.div_(world_size)
    launched = state._launched(tensor.device, bucket.is_last())
    future = dist.all_reduce(tensor, group=state.process_group, async_op=True).get_future()

    def finish(done: torch.futures.Future) -> torch.Tensor:
        # NCCL completes the future at enqueue: on CUDA the time is read from events, not from this host call
        state._completed(tensor.device, launched)
        return tensor  # reduced in place (also what the future holds)

    return future.then(finish)


def _own_counters(hook_state: Any) -> Optional[CommunicationCounters]:
    """The counters of a hook state that counts its own bytes, else ``None``."""
    counters = getattr(hook_state, "counters", None)
    return counters if isinstance(counters, CommunicationCounters) else None


def _wire_element_size(hook: Callable[..., Any]) -> Optional[int]:
    """Bytes per element that ``hook`` sends, where known (torch's bf16/fp16 compression hooks); ``None``: the
    gradient's."""
    return 2 if hook in (default_hooks.bf16_compress_hook, default_hooks.fp16_compress_hook) else None
