"""What the warmup exchanges that keep state between calls share: that state keyed by parameter, not by DDP bucket.

DDP's buckets in the first iteration of a process differ from the ones it uses after (it rebuilds them in the order
gradients became ready), so state keyed by bucket index cannot be restored into a resumed run. The int8 and PowerSGD
exchanges (:mod:`~lightning_onebit.hooks.int8`, :mod:`~lightning_onebit.hooks.powersgd_exchange`) key every tensor
they keep by the parameter's index in the DDP module (``module.parameters()`` order, the same on every rank and in
every run of the same model), which :meth:`ParameterKeyedState.bind` learns, and lay each bucket out on the wire as a
function of its parameters alone. Their per-rank state (:meth:`~ParameterKeyedState.state_dict`) is what the
strategy saves next to each checkpoint, one file per rank; restored, a resumed run continues bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.topology import Topology


class ParameterKeyedState:
    """The base of a DDP hook state whose tensors are kept per parameter (by index in the DDP module).

    Args:
        exchange: the exchange's name, recorded in :meth:`state_dict` (``"int8"``, ``"powersgd"``).
        process_group: the group to average over; ``None``: WORLD.
        topology: which ranks share a node, to split ``bytes_sent`` into intra- and inter-node bytes; ``None``:
            every peer counts as another node.

    Attributes:
        counters: this rank's bytes (:class:`~lightning_onebit.comm.CommunicationCounters`), counted when the hook is
            called; :class:`~lightning_onebit.hooks.GradientSyncState` adds them to the warmup's counters.
        iteration: the backward passes whose gradients the hook averaged (calls of DDP's last bucket).
        parameters: per parameter index, the tensors this rank keeps for it (name -> tensor).
    """

    #: The names of the kept tensors that are error feedback (what :meth:`error_feedback_norm` measures).
    error_feedback_names: tuple[str, ...] = ()

    def __init__(self, exchange: str, process_group: Optional[dist.ProcessGroup],
                 topology: Optional[Topology]) -> None:
        self.exchange = exchange
        self.process_group = process_group
        self.topology = topology
        self.counters = CommunicationCounters()
        self.iteration = 0
        self.parameters: dict[int, dict[str, torch.Tensor]] = {}
        self._index_of: dict[int, int] = {}  # id(parameter) -> index in the module
        self._shapes: list[torch.Size] = []

    # ------------------------------------------------------------------ parameters
    def bind(self, module: nn.Module) -> None:
        """Learn the index of every parameter of ``module`` (the DDP-wrapped module, or the DDP model itself: the
        same parameters in the same order). Call it before the first backward; the strategy does."""
        module = module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
        params = list(module.parameters())
        self._index_of = {id(p): i for i, p in enumerate(params)}
        self._shapes = [p.shape for p in params]

    def parameter_indices(self, bucket: dist.GradBucket) -> tuple[int, ...]:
        """The indices of ``bucket``'s parameters, in bucket order; ``RuntimeError`` naming the fix when the state
        was not bound to the module."""
        try:
            return tuple(self._index_of[id(p)] for p in bucket.parameters())
        except KeyError:
            raise RuntimeError(
                f"{type(self).__name__}: a bucket holds a parameter this state does not know; call "
                "state.bind(ddp_model) before training (OnebitStrategy does it for its warmup_exchange)"
            ) from None

    def expected_shapes(self, index: int) -> dict[str, tuple[int, ...]]:
        """The shape of every tensor kept for parameter ``index``, by name (for :meth:`mismatch`)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        """The arguments a saved state must have been made with to be restored (they decide its tensors)."""
        raise NotImplementedError

    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the exchange, its config, the iteration and every parameter's tensors (copies)."""
        return {
            "exchange": self.exchange,
            "config": self.config(),
            "iteration": self.iteration,
            "parameters": {i: {k: t.detach().clone() for k, t in kept.items()} for i, kept in self.parameters.items()},
        }

    def mismatch(self, state: Any) -> Optional[str]:
        """Why ``state`` (a :meth:`state_dict`) cannot be restored into this state, or ``None``."""
        if not isinstance(state, dict) or not isinstance(state.get("parameters"), dict):
            return "the per-rank file holds no warmup exchange state"
        if state.get("exchange") != self.exchange:
            return (f"it holds the state of the {state.get('exchange')!r} warmup exchange, this run's is "
                    f"{self.exchange!r}")
        if state.get("config") != self.config():
            return f"it was saved with {state.get('config')}, this run's exchange has {self.config()}"
        for index, kept in state["parameters"].items():
            if not isinstance(index, int) or not 0 <= index < len(self._shapes):
                return f"it holds state for parameter {index!r}, the model has {len(self._shapes)} parameters"
            expected = self.expected_shapes(index)
            shapes = {k: tuple(t.shape) for k, t in kept.items() if isinstance(t, torch.Tensor)}
            if not set(shapes) <= set(expected) or any(shapes[k] != expected[k] for k in shapes):
                return f"parameter {index}'s saved tensors {shapes} do not fit its shapes {expected}"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (check it with :meth:`mismatch` first)."""
        self.iteration = int(state["iteration"])
        self.parameters = {int(i): dict(kept) for i, kept in state["parameters"].items()}
        self._state_replaced()

    def reset(self, iteration: int = 0) -> None:
        """Drop every parameter's tensors (error feedback from zero, fresh random state) and set :attr:`iteration`."""
        self.iteration = iteration
        self.parameters = {}
        self._state_replaced()

    def _state_replaced(self) -> None:
        """Called when :attr:`parameters` was replaced: forget what was derived from it."""

    def error_feedback_norm(self) -> float:
        """The L2 norm of this rank's error feedback tensors (0 when there are none)."""
        total = 0.0
        for kept in self.parameters.values():
            for name, tensor in kept.items():
                if name in self.error_feedback_names:
                    total += float(tensor.double().pow(2).sum())
        return total**0.5
