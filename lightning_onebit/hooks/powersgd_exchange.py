"""PowerSGD as a DDP comm hook of the library's own: its state kept per parameter (resumable), one allreduce per phase
per step, no host synchronisation.

The math is Vogels et al. (arXiv 1905.13727) as torch's ``powerSGD_hook`` computes it. Each gradient is viewed as a
matrix ``M`` (``n x m``: its first dimension by the rest). A matrix worth compressing at rank ``r' = min(n, m, r)``,
``(n + m) r' min_compression_rate < n m``, is sent as two thin matrices; every other tensor (vectors, small matrices)
is averaged uncompressed. Per step, after ``vanilla_steps`` steps of plain averaging:

1. ``M <- M + e`` (error feedback); ``Q`` orthonormalised (Gram-Schmidt up to ``r' = 2``, QR beyond, as torch);
   ``P = M Q``.
2. One allreduce (sum) of the uncompressed tensors and every ``P``; the uncompressed tensors divided by the world
   size; each ``P`` orthonormalised.
3. ``Q = M^T P``; one allreduce (sum) of every ``Q``, divided by the world size.
4. ``M_hat = P Q^T`` replaces the gradient; ``e <- M - M_hat`` (what this rank's gradient lost, sent with its next one).

``Q`` is drawn once per parameter from a normal distribution seeded by ``(seed, parameter index, step)``, the same on
every rank, and with ``warm_start`` (default) kept from step to step (the averaged ``Q`` of step ``t`` starts step
``t + 1``); without it a fresh ``Q`` is drawn every step. Every rank ends with the same ``M_hat``: replicas stay
identical (on ranks with the same kind of processor: the orthonormalisation runs on every rank).

How it differs from torch's hook, and why:

* Its state (``e`` and ``Q`` per parameter, the step count) is keyed by the parameter's index in the DDP module, not
  by DDP bucket (:class:`~lightning_onebit.hooks.parameter_state.ParameterKeyedState`): DDP's buckets in the first
  iteration of a process differ from the rebuilt ones it uses after, so bucket-keyed state cannot be restored into a
  resumed run. ``OnebitStrategy`` saves it with each checkpoint (one file per rank); a resumed run continues bit for
  bit. It also makes ``vanilla_steps = 0`` possible (torch needs 2 to outlast the rebuild).
* The compressed steps' two allreduces cover the whole model, in parameter order, once DDP's last bucket is ready
  (each earlier bucket's ``P = M Q`` is computed as it arrives, during backward): the wire layout, and so the
  result, does not depend on DDP's buckets (an allreduce's sums depend on where an element sits in the buffer on
  three ranks or more), and a step is two collectives however many buckets there are (torch: three per bucket). The
  ``P`` and ``Q`` are small; what no longer overlaps backward is their two exchanges and the orthonormalisation.
* No error feedback for the uncompressed tensors: their average is exact, and the difference torch keeps for them
  sums to zero over the ranks.
* No ``torch.cuda.synchronize`` (torch calls it per bucket); no collective launched on one rank's timing: the
  vanilla steps' allreduces follow the bucket order, the compressed steps' come from the last bucket's call.

Bytes (:attr:`PowerSGDExchangeState.counters`, counted when the hook is called, as ring allreduces in the gradient's
dtype): a vanilla step, one allreduce per bucket of its elements; a compressed step, at its last bucket, one of the
uncompressed elements plus ``sum n r'`` and one of ``sum m r'`` elements. ``bytes_fp32_equivalent`` is each bucket's
fp32 ring allreduce.

Usage, as the warmup exchange of 1-bit Adam (``OnebitStrategy(warmup_exchange="powersgd", powersgd_rank=4)``) or
with plain DDP::

    state = PowerSGDExchangeState(rank=4, vanilla_steps=10)
    state.bind(ddp_model)
    ddp_model.register_comm_hook(state, powersgd_exchange_hook)
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations as real objects.
import dataclasses
import weakref
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_onebit._checks import check_flag, check_integer, check_real
from lightning_onebit.comm.accounting import count_ring_bytes, ring_allreduce_bytes
from lightning_onebit.comm.topology import Topology
from lightning_onebit.hooks.parameter_state import ParameterKeyedState

#: Up to this rank the orthonormalisation is Gram-Schmidt, above it QR (torch's choice: QR is faster from rank 3).
GRAM_SCHMIDT_MAX_RANK = 2


def matrix_view_shape(shape: torch.Size) -> tuple[int, int]:
    """``(n, m)``: a gradient of ``shape`` viewed as a matrix, its first dimension by the rest (a scalar: ``1 x 1``)."""
    numel = shape.numel()
    n = int(shape[0]) if len(shape) else 1
    return n, (numel // n if n else 0)


def compressed_rank(shape: torch.Size, rank: int, min_compression_rate: float) -> int:
    """The rank ``r' = min(n, m, rank)`` a gradient of ``shape`` is compressed at, or 0 when it goes uncompressed
    (``(n + m) r' min_compression_rate >= n m``: torch's rule)."""
    n, m = matrix_view_shape(shape)
    r = min(n, m, rank)
    return r if (n + m) * r * min_compression_rate < n * m else 0


def orthonormalize_(matrix: torch.Tensor) -> None:
    """Orthonormalise the columns of ``matrix`` (``1 x k x r``) in place, as torch's PowerSGD does (epsilon 0):
    Gram-Schmidt up to rank :data:`GRAM_SCHMIDT_MAX_RANK` or in half precision, else QR."""
    rank = matrix.shape[2]
    if rank > GRAM_SCHMIDT_MAX_RANK and matrix.dtype not in (torch.float16, torch.bfloat16):
        torch.linalg.qr(matrix, out=(matrix, matrix.new_empty(1, rank, rank)))
        return
    for i in range(rank):
        column = matrix[:, :, i:i + 1]
        column /= torch.norm(column, dim=1, keepdim=True)
        if i + 1 < rank:
            rest = matrix[:, :, i + 1:]
            rest -= torch.sum(column * rest, dim=1, keepdim=True) * column


@dataclasses.dataclass
class _Gradient:
    """One parameter's gradient in a compressed step: its index, its view in DDP's bucket and its rank (0: sent
    uncompressed)."""

    index: int
    grad: torch.Tensor
    rank: int


class PowerSGDExchangeState(ParameterKeyedState):
    """State of :func:`powersgd_exchange_hook`.

    Args:
        process_group: the group to average over; ``None`` (default): WORLD.
        rank: the rank ``r`` of the approximation, an integer >= 1 (elements sent per ``n x m`` matrix: ``(n + m) r``
            instead of ``n m``). Default 4.
        vanilla_steps: the first steps (backward passes whose gradients the hook averages) are averaged uncompressed,
            an integer >= 0. Default 10.
        min_compression_rate: a matrix is compressed when its ``n m`` elements exceed ``(n + m) r`` times this, a
            number >= 1. Default 2 (torch's).
        error_feedback: add what compression lost to the next gradient. Default ``True``.
        warm_start: keep each ``Q`` from one step to the next (else drawn afresh every step). Default ``True``.
        seed: seeds the draws of ``Q`` (with the parameter's index and the step), an integer >= 0. Default 0.
        topology: which ranks share a node, to split ``bytes_sent`` into intra- and inter-node bytes; ``None``
            (default): all inter-node.

    Attributes:
        counters: this rank's bytes (module docstring); :class:`~lightning_onebit.hooks.GradientSyncState` adds them
            to the warmup's counters.
        iteration: the steps averaged so far (vanilla and compressed).
        parameters: per parameter index, its ``error`` (``n x m``) and ``q`` (``m x r'``), kept on this rank.
        vanilla_buckets, compressed_buckets: bucket calls averaged uncompressed and compressed.
    """

    error_feedback_names = ("error",)

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        rank: int = 4,
        vanilla_steps: int = 10,
        min_compression_rate: float = 2.0,
        error_feedback: bool = True,
        warm_start: bool = True,
        seed: int = 0,
        topology: Optional[Topology] = None,
    ) -> None:
        super().__init__("powersgd", process_group, topology)
        self.rank = check_integer(rank, "PowerSGDExchangeState rank")
        self.vanilla_steps = check_integer(vanilla_steps, "PowerSGDExchangeState vanilla_steps", at_least=0)
        self.min_compression_rate = check_real(min_compression_rate, "PowerSGDExchangeState min_compression_rate",
                                               at_least=1)
        self.error_feedback = check_flag(error_feedback, "PowerSGDExchangeState error_feedback")
        self.warm_start = check_flag(warm_start, "PowerSGDExchangeState warm_start")
        self.seed = check_integer(seed, "PowerSGDExchangeState seed", at_least=0)
        self.vanilla_buckets = 0
        self.compressed_buckets = 0
        self._pending: list[tuple[list[_Gradient], torch.Tensor, torch.futures.Future]] = []

    def config(self) -> dict[str, Any]:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate,
                "error_feedback": self.error_feedback, "warm_start": self.warm_start, "seed": self.seed}

    def expected_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        shape = self._shapes[index]
        n, m = matrix_view_shape(shape)
        return {"error": (n, m), "q": (m, min(n, m, self.rank))}

    def compressed_rank(self, shape: torch.Size) -> int:
        """:func:`compressed_rank` with this state's rank and ``min_compression_rate``."""
        return compressed_rank(shape, self.rank, self.min_compression_rate)

    def initial_q(self, index: int, m: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        """A fresh ``Q`` (``m x rank``, not orthonormalised) for parameter ``index`` at this step: normal draws from a
        generator of ``like``'s device seeded by ``(seed, index, iteration)``, the same on every rank."""
        generator = torch.Generator(device=like.device)
        generator.manual_seed((self.seed * 1_000_003 + index) * 1_000_033 + self.iteration)
        return torch.randn(m, rank, generator=generator, device=like.device, dtype=like.dtype)

    def _count_vanilla(self, tensor: torch.Tensor, world_size: int, rank: int) -> None:
        count_ring_bytes(self.counters, ring_allreduce_bytes(tensor.numel(), tensor.element_size(), world_size),
                         world_size, rank, self.topology)
        self.counters.collectives += 1

    def _count_compressed(self, numels: tuple[int, int], element_size: int, world_size: int, rank: int) -> None:
        for numel in numels:
            count_ring_bytes(self.counters, ring_allreduce_bytes(numel, element_size, world_size), world_size, rank,
                             self.topology)
        self.counters.collectives += len(numels)


def powersgd_exchange_hook(state: PowerSGDExchangeState,
                           bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the bucket averaged over ``state.process_group``, uncompressed for the first
    ``state.vanilla_steps`` steps and by PowerSGD after (the module docstring has the math). In a compressed step
    every bucket's future completes once the last bucket's exchange has."""
    tensor = bucket.buffer()
    group = state.process_group
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    last = bucket.is_last()
    state.counters.calls += 1
    state.counters.bytes_fp32_equivalent += ring_allreduce_bytes(tensor.numel(), 4, world_size)
    if world_size == 1 or state.iteration < state.vanilla_steps:
        state.vanilla_buckets += 1
        if last:
            state.iteration += 1
        if world_size == 1:
            alone: torch.futures.Future = torch.futures.Future()
            alone.set_result(tensor)
            return alone
        state._count_vanilla(tensor, world_size, rank)
        tensor.div_(world_size)
        averaged = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        return averaged.then(lambda done: done.value()[0])
    state.compressed_buckets += 1
    gradients = [_Gradient(i, g, state.compressed_rank(g.shape))
                 for i, g in zip(state.parameter_indices(bucket), bucket.gradients())]
    for gradient in gradients:
        if gradient.rank:
            _fold_error_and_orthonormalize_q(state, gradient)
    future: torch.futures.Future = torch.futures.Future()
    if bucket.index() == 0:
        state._pending = []  # a step's first bucket: nothing is left of an earlier step (one that failed in backward)
    state._pending.append((gradients, tensor, future))
    if last:
        pending, state._pending = state._pending, []
        _exchange(state, pending, world_size, rank)
        state.iteration += 1
    return future


def _fold_error_and_orthonormalize_q(state: PowerSGDExchangeState, gradient: _Gradient) -> None:
    """Step 1 before ``P = M Q``: the error feedback added to the gradient, its ``Q`` (drawn if it has none)
    orthonormalised."""
    kept = state.parameters.setdefault(gradient.index, {})
    n, m = matrix_view_shape(gradient.grad.shape)
    matrix = gradient.grad.view(n, m)
    if state.error_feedback and "error" in kept:
        kept["error"] = kept["error"].to(matrix.device)  # restored from a checkpoint onto the CPU: moved once
        matrix.add_(kept["error"])
    q = kept.get("q")
    if q is None or not state.warm_start:
        q = state.initial_q(gradient.index, m, gradient.rank, matrix)
    kept["q"] = q.to(matrix.device)
    orthonormalize_(kept["q"].unsqueeze(0))


def _exchange(state: PowerSGDExchangeState, pending: list[tuple[list[_Gradient], torch.Tensor, torch.futures.Future]],
              world_size: int, rank: int) -> None:
    """Steps 1-4 over every bucket of the step, in parameter order; completes every pending bucket's future."""
    gradients = sorted((g for grads, _, _ in pending for g in grads), key=lambda g: g.index)
    plain = [g for g in gradients if not g.rank]
    compressed = [g for g in gradients if g.rank]
    like = gradients[0].grad
    uncompressed_numel = sum(g.grad.numel() for g in plain)
    p_numel = sum(matrix_view_shape(g.grad.shape)[0] * g.rank for g in compressed)
    q_numel = sum(matrix_view_shape(g.grad.shape)[1] * g.rank for g in compressed)
    first = like.new_empty(uncompressed_numel + p_numel)
    second = like.new_empty(q_numel)
    if plain:
        torch.cat([g.grad.reshape(-1) for g in plain], out=first[:uncompressed_numel])
    matrices, ps, qs = [], [], []
    p_at, q_at = uncompressed_numel, 0
    for g in compressed:
        n, m = matrix_view_shape(g.grad.shape)
        matrices.append(g.grad.view(1, n, m))
        ps.append(first[p_at:p_at + n * g.rank].view(1, n, g.rank))
        qs.append(second[q_at:q_at + m * g.rank].view(1, m, g.rank))
        p_at, q_at = p_at + n * g.rank, q_at + m * g.rank
        torch.bmm(matrices[-1], state.parameters[g.index]["q"].unsqueeze(0), out=ps[-1])
    state._count_compressed((first.numel(), second.numel()), like.element_size(), world_size, rank)
    # The callbacks run on the backend's threads and are freed there: they reach the process group through the
    # state, held weakly (gloo aborts when the last reference to a group goes on its own worker thread).
    state_ref = weakref.ref(state)

    def project(done: torch.futures.Future) -> torch.Tensor:
        done.wait()
        held = state_ref()
        if held is None:
            raise RuntimeError("powersgd_exchange_hook: its PowerSGDExchangeState was freed during the exchange")
        averaged = first[:uncompressed_numel].div_(world_size)
        at = 0
        for g in plain:
            g.grad.copy_(averaged[at:at + g.grad.numel()].view_as(g.grad))
            at += g.grad.numel()
        for matrix, p, q in zip(matrices, ps, qs):
            orthonormalize_(p)
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        return dist.all_reduce(second, group=held.process_group, async_op=True).get_future().wait()[0]

    def decompress(done: torch.futures.Future) -> None:
        done.wait()
        second.div_(world_size)
        held = state_ref()
        if held is None:
            raise RuntimeError("powersgd_exchange_hook: its PowerSGDExchangeState was freed during the exchange")
        for g, matrix, p, q in zip(compressed, matrices, ps, qs):
            kept = held.parameters[g.index]
            if held.error_feedback:
                error = kept.get("error")
                if error is None:
                    error = kept["error"] = torch.empty_like(matrix[0])
                error.copy_(matrix[0])  # M + e, before M_hat replaces it
            torch.bmm(p, q.transpose(1, 2), out=matrix)
            if held.error_feedback:
                kept["error"].sub_(matrix[0])
            if held.warm_start:
                kept["q"] = q[0].clone()
            else:
                kept.pop("q", None)

    def complete(done: torch.futures.Future) -> None:
        # every bucket's future, with the averaged bucket or the exchange's error (DDP waits on each of them)
        try:
            done.wait()
        except Exception as err:  # noqa: BLE001
            for _, _, future in pending:
                future.set_exception(err)
            return
        for _, bucket_tensor, future in pending:
            future.set_result(bucket_tensor)

    group = state.process_group
    phase_one = dist.all_reduce(first, group=group, async_op=True).get_future()
    phase_one.then(project).then(decompress).add_done_callback(complete)
