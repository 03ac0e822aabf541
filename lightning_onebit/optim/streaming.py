"""Streaming outer steps (Streaming DiLoCo, arXiv 2501.18512): the parameters cut into fragments, each an
:class:`~lightning_onebit.optim.outer_step.OuterStep` synced every ``sync_every`` inner steps at its own offset, and
the exchange of a fragment overlapped with the next ``overlap_steps`` inner steps (:class:`StreamingOuterStep`).

**Staggered.** Fragment ``k`` of ``F`` (contiguous parameters, about ``1/F`` of the values each, in the module's
order) syncs after the inner steps ``s`` with ``s % sync_every == k * sync_every // F`` (``s >= 1``): a sync sends
``1/F`` of the bytes, spread evenly over the period, so the link's peak need falls ``F``-fold; the whole-run bytes do
not change.

**Overlapped.** With ``overlap_steps = tau > 0``, a fragment's sync after inner step ``t`` takes the pseudo-gradient
``theta_outer - theta_local(t)`` and starts its exchange (:meth:`OuterStep.start`, asynchronous collectives); the inner
steps ``t + 1 .. t + tau`` run while it is in flight; after step ``t + tau`` it is finished (the outer optimizer
applied: new outer values, the same bits on every rank) and the fragment's parameters are *rebased* on them::

    theta_local <- theta_outer_new + (theta_local(t + tau) - theta_local(t))

so the ``tau`` steps each replica took meanwhile are kept, not thrown away, and enter the next pseudo-gradient of the
fragment (every inner step is counted once). With ``tau = 0`` the fragment's parameters become the outer values
(:meth:`OuterStep.copy_outer_to_params`), bitwise the same on every rank, as unstreamed DiLoCo. With ``tau > 0`` the
outer parameters are bitwise the same on every rank after every sync and the parameters differ by each replica's
last ``tau`` steps; :meth:`StreamingOuterStep.flush` (the end of ``fit``) makes them the same. The rebase keeps
``theta_local(t)`` of the fragment meanwhile (``1/F`` of the parameters).

An exchange in flight can be finished early (:meth:`StreamingOuterStep.finish_in_flight`: for validation on the outer
model and for a checkpoint): the outer values it gives do not depend on when it is finished, and the rebase still
happens after step ``t + tau``, so the training is the same bits whether or not a checkpoint was saved meanwhile.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Optional, Sequence

import torch

from lightning_onebit._checks import check_integer
from lightning_onebit.comm.accounting import CommunicationCounters
from lightning_onebit.comm.outer_base import OuterCompressor
from lightning_onebit.optim.outer_step import OuterStep

__all__ = ["StreamingOuterStep", "fragment_parameters"]


def fragment_parameters(params: Sequence[torch.Tensor], fragments: int,
                        sizes: Optional[Sequence[int]] = None) -> list[list[torch.Tensor]]:
    """Cut ``params`` (in order) into ``fragments`` contiguous, non-empty groups of about equal element counts: cut
    ``k`` falls where the running count is nearest ``k / fragments`` of the total. ``sizes``: the counts to cut by
    (default the parameters' own; local shards pass their whole parameters', so that every layout cuts alike).
    ``ValueError`` when there are fewer parameters than fragments."""
    params = list(params)
    sizes = [p.numel() for p in params] if sizes is None else [int(n) for n in sizes]
    if len(sizes) != len(params):
        raise ValueError(f"{len(sizes)} sizes for {len(params)} parameters")
    check_integer(fragments, "fragments")
    count = len(params)
    if fragments > count:
        raise ValueError(f"fragments={fragments} is more than the model's {count} trainable parameter tensors: "
                         "every fragment needs one; pass fewer fragments")
    prefix = list(itertools.accumulate(sizes, initial=0))
    cuts = [0]
    for k in range(1, fragments):
        target = k * prefix[-1] / fragments
        nearest = min(range(1, count), key=lambda i: abs(prefix[i] - target))
        cuts.append(min(max(nearest, cuts[-1] + 1), count - (fragments - k)))
    cuts.append(count)
    return [params[a:b] for a, b in zip(cuts, cuts[1:])]


@dataclasses.dataclass
class _Rebase:
    """A fragment whose exchange started after inner step ``started``: its parameters then (``local_at_start``), to
    be rebased on the new outer values after inner step ``due``."""

    fragment: int
    started: int
    due: int
    local_at_start: list[torch.Tensor]


class StreamingOuterStep:
    """Fragments synced at staggered inner steps, their exchanges overlapped with ``overlap_steps`` inner steps (see
    the module docstring). With one fragment and no overlap it is :class:`OuterStep` every ``sync_every`` steps.

    Args:
        fragments: one :class:`OuterStep` per fragment (their parameters disjoint), in the order they sync.
        sync_every: inner steps between two syncs of a fragment, >= the number of fragments.
        overlap_steps: inner steps that run while a fragment's exchange is in flight, in ``[0, sync_every)``.
            Default 0 (the exchange blocks).
    """

    def __init__(self, fragments: Sequence[OuterStep], sync_every: int, overlap_steps: int = 0) -> None:
        self.fragments = list(fragments)
        if not self.fragments:
            raise ValueError("the streaming outer step needs at least one fragment")
        self.sync_every = check_integer(sync_every, "sync_every")
        if len(self.fragments) > sync_every:
            raise ValueError(f"fragments={len(self.fragments)} is more than sync_every={sync_every}: each fragment "
                             "syncs once per period, at its own step; pass fragments <= sync_every")
        self.overlap_steps = check_integer(overlap_steps, "overlap_steps", at_least=0, at_most=sync_every - 1,
                                           what=f"an integer in [0, sync_every - 1 = {sync_every - 1}]")
        count = len(self.fragments)
        #: fragment ``k`` syncs after the inner steps ``s >= 1`` with ``s % sync_every == offsets[k]``
        self.offsets = [k * sync_every // count for k in range(count)]
        #: per fragment, the inner step after which its last exchange started (0: never)
        self.last_started = [0] * count
        self._rebases: list[_Rebase] = []  # started, in start order, their rebase not yet done
        #: whether every parameter holds its outer value (after a flush or an unoverlapped sync of every fragment)
        self.params_are_outer = True
        #: called with ``(fragment, bytes of its sync)`` when a fragment's exchange finishes
        self.on_sync: Optional[Callable[[int, CommunicationCounters], None]] = None
        self._before: dict[int, CommunicationCounters] = {}

    @classmethod
    def build(cls, params: Sequence[torch.Tensor], make_compressor: Callable[[], OuterCompressor], *,
              fragments: int = 1, sync_every: int, overlap_steps: int = 0, bucket_cap_mb: float = 16.0,
              sizes: Optional[Sequence[int]] = None, **outer_step: Any) -> "StreamingOuterStep":
        """``params`` cut into ``fragments`` (:func:`fragment_parameters`, by ``sizes``), an :class:`OuterStep` each
        with its own compressor from ``make_compressor()`` (a collective where it agrees on kernels) and
        ``outer_step``'s arguments, buckets of at most ``bucket_cap_mb`` MB; ``ValueError`` when ``params`` is empty."""
        params = list(params)
        if not params:
            raise ValueError("the outer step found no trainable parameter (requires_grad=True) in the model")
        bucket_numel = max(1, int(bucket_cap_mb * 2**20) // params[0].element_size())
        return cls([OuterStep(group, make_compressor(), bucket_numel=bucket_numel, **outer_step)
                    for group in fragment_parameters(params, fragments, sizes)], sync_every, overlap_steps)

    # ------------------------------------------------------------------ the schedule
    def due(self, inner_step: int) -> list[int]:
        """The fragments whose sync falls after inner step ``inner_step``."""
        if inner_step < 1:
            return []
        return [k for k, offset in enumerate(self.offsets) if inner_step % self.sync_every == offset]

    def after_inner_step(self, inner_step: int) -> list[int]:
        """After inner step ``inner_step`` (a collective on the steps that sync): rebase the fragments whose overlap
        ends now, then start (and, without overlap, finish and apply) those due. Returns the fragments started."""
        self.params_are_outer = False
        for rebase in [r for r in self._rebases if r.due == inner_step]:
            self._rebase(rebase)
        started = self.due(inner_step)
        for k in started:
            self._start(k, inner_step, overlapped=self.overlap_steps > 0)
        if started and not self.overlap_steps:
            self.params_are_outer = len(started) == len(self.fragments)
        return started

    def _start(self, k: int, inner_step: int, overlapped: bool) -> None:
        """Start fragment ``k``'s exchange; unless ``overlapped``, finish it and copy its outer values in."""
        fragment = self.fragments[k]
        self._before[k] = fragment.communication
        local = [p.detach().clone() for p in fragment.params] if overlapped else []
        fragment.start()
        self.last_started[k] = inner_step
        if overlapped:
            self._rebases.append(_Rebase(k, inner_step, inner_step + self.overlap_steps, local))
        else:
            self._finish(k)
            fragment.copy_outer_to_params()

    def _finish(self, k: int) -> None:
        fragment = self.fragments[k]
        if not fragment.in_flight:
            return  # finished early (validation, a checkpoint)
        fragment.finish()
        if self.on_sync is not None:
            self.on_sync(k, fragment.communication - self._before.pop(k))

    def _rebase(self, rebase: _Rebase) -> None:
        """Finish the fragment's exchange (unless finished early); its parameters keep the steps taken since the
        exchange started, on the new outer values."""
        self._finish(rebase.fragment)
        self._rebases.remove(rebase)
        outer = self.fragments[rebase.fragment].outer_values()
        with torch.no_grad():
            for p, then in zip(self.fragments[rebase.fragment].params, rebase.local_at_start):
                p.sub_(then).add_(outer[id(p)])

    def finish_in_flight(self) -> None:
        """Finish every exchange in flight, in start order (a collective; the rebases stay due when they were)."""
        for rebase in list(self._rebases):
            self._finish(rebase.fragment)

    def flush(self, inner_step: int) -> None:
        """At the end of training (a collective): finish and rebase what is in flight, then sync, unoverlapped, every
        fragment that took steps since its last exchange started, so that every parameter holds its outer value, the
        same bits on every rank."""
        for rebase in list(self._rebases):
            self._rebase(rebase)
        for k, fragment in enumerate(self.fragments):
            if inner_step > self.last_started[k]:
                self._start(k, inner_step, overlapped=False)
            else:  # also after a rebase of no steps: the outer bits (a -0.0 included)
                fragment.copy_outer_to_params()
        self.params_are_outer = True

    # ------------------------------------------------------------------ the parameters and bytes
    @property
    def params(self) -> list[torch.Tensor]:
        """Every fragment's parameters, in fragment order."""
        return [p for fragment in self.fragments for p in fragment.params]

    def outer_values(self) -> dict[int, torch.Tensor]:
        """``id(parameter) -> its outer value`` over every fragment (views: clone to keep them)."""
        return {key: value for fragment in self.fragments for key, value in fragment.outer_values().items()}

    def copy_outer_to_params(self) -> None:
        """Set every parameter to its outer value (no communication)."""
        for fragment in self.fragments:
            fragment.copy_outer_to_params()

    def replace_params(self, params: Sequence[torch.Tensor]) -> None:
        """Hold ``params`` (in :attr:`params` order) instead (:meth:`OuterStep.replace_params`)."""
        params = list(params)
        if len(params) != len(self.params):
            raise ValueError(f"replace_params needs {len(self.params)} tensors, got {len(params)}")
        for fragment, group in zip(self.fragments, self._split(params)):
            fragment.replace_params(group)

    def _split(self, values: Sequence[Any]) -> list[list[Any]]:
        """``values`` (one per parameter, in :attr:`params` order) cut per fragment."""
        cuts = list(itertools.accumulate((len(f.params) for f in self.fragments), initial=0))
        return [list(values[a:b]) for a, b in zip(cuts, cuts[1:])]

    @property
    def syncs(self) -> int:
        """Fragment syncs finished (each fragment's count summed)."""
        return sum(fragment.syncs for fragment in self.fragments)

    @property
    def communication(self) -> CommunicationCounters:
        """This rank's cumulative bytes of every fragment's syncs."""
        total = CommunicationCounters()
        for fragment in self.fragments:
            total = total + fragment.communication
        return total

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Every fragment's state, the schedule's position and the rebases still due (their parameters at the start
        of the exchange). Finish the exchanges in flight first (:meth:`finish_in_flight`)."""
        return {"fragments": [fragment.state_dict() for fragment in self.fragments],
                "last_started": list(self.last_started), "params_are_outer": self.params_are_outer,
                "rebases": [{"fragment": r.fragment, "started": r.started, "due": r.due,
                             "local_at_start": [t.clone() for t in r.local_at_start]} for r in self._rebases]}

    def per_parameter_state(self) -> dict[str, list[Optional[torch.Tensor]]]:
        """Every fragment's :meth:`OuterStep.per_parameter_state`, in :attr:`params` order, and ``"rebase_start"``:
        each parameter at the start of its fragment's exchange if its rebase is still due (else ``None``). With
        :meth:`schedule_state`, what a checkpoint laid out by parameter holds (finish the exchanges in flight first)."""
        out: dict[str, list[Optional[torch.Tensor]]] = {"outer": [], "error_feedback": [], "momentum": [],
                                                        "rebase_start": []}
        starts = {r.fragment: r.local_at_start for r in self._rebases}
        for k, fragment in enumerate(self.fragments):
            state = fragment.per_parameter_state()
            for key in ("outer", "error_feedback", "momentum"):
                out[key].extend(state[key])
            due = starts.get(k)
            out["rebase_start"].extend([t.clone() for t in due] if due is not None else [None] * len(fragment.params))
        return out

    def schedule_state(self) -> dict[str, Any]:
        """The schedule's position (plain numbers, the same on every rank): each fragment's syncs and the step its
        last exchange started after, whether the parameters are the outer ones, the rebases due."""
        return {"syncs": [f.syncs for f in self.fragments], "last_started": list(self.last_started),
                "params_are_outer": self.params_are_outer,
                "rebases": [(r.fragment, r.started, r.due) for r in self._rebases]}

    def load_per_parameter_state(self, state: dict[str, Sequence[Optional[torch.Tensor]]],
                                 schedule: dict[str, Any]) -> None:
        """Restore :meth:`per_parameter_state` and :meth:`schedule_state` (saved at this layout or another; the
        fragments must be as many: ``ValueError`` otherwise)."""
        if len(schedule["syncs"]) != len(self.fragments):
            raise ValueError(f"the outer state was saved with {len(schedule['syncs'])} fragment(s) and this run has "
                             f"{len(self.fragments)}: resume with the same fragments")
        split = {key: self._split(state[key]) for key in ("outer", "error_feedback", "momentum", "rebase_start")}
        for k, fragment in enumerate(self.fragments):
            fragment.load_per_parameter_state({key: split[key][k] for key in ("outer", "error_feedback", "momentum")})
            fragment.syncs = int(schedule["syncs"][k])
        self.last_started = [int(s) for s in schedule["last_started"]]
        self.params_are_outer = bool(schedule["params_are_outer"])
        self._rebases = []
        for k, started, due in schedule["rebases"]:
            starts = split["rebase_start"][k]
            if any(t is None for t in starts):
                raise ValueError(f"fragment {k}'s rebase is due after step {due} but its parameters at the start of "
                                 "the exchange were not saved")
            self._rebases.append(_Rebase(int(k), int(started), int(due),
                                         [t.to(p).clone() for t, p in zip(starts, self.fragments[k].params)]))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (``ValueError`` naming what differs when it was saved with other fragments)."""
        saved = state["fragments"]
        if len(saved) != len(self.fragments):
            raise ValueError(f"the outer state was saved with {len(saved)} fragment(s) and this run has "
                             f"{len(self.fragments)}: resume with the same fragments")
        for fragment, fragment_state in zip(self.fragments, saved):
            fragment.load_state_dict(fragment_state)
        self.last_started = [int(s) for s in state["last_started"]]
        self.params_are_outer = bool(state["params_are_outer"])
        self._rebases = []
        for r in state["rebases"]:
            params = self.fragments[r["fragment"]].params
            self._rebases.append(_Rebase(int(r["fragment"]), int(r["started"]), int(r["due"]),
                                         [t.to(p).clone() for t, p in zip(r["local_at_start"], params)]))
