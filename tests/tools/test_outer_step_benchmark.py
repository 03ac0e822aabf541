"""``benchmarks.outer_step`` times real syncs: every rank ends with the same outer parameters, and every phase of
every timed sync is recorded."""

from __future__ import annotations

import torch

from benchmarks.common import launch
from benchmarks.outer_step import PHASES, _syncs


def test_every_rank_ends_with_the_same_parameters_and_every_phase_is_timed():
    for world_size, per_replica in ((2, 1), (4, 2)):
        ranks = launch(_syncs, world_size, per_replica, 2e5, 2)
        assert all(torch.equal(r["outer"], ranks[0]["outer"]) for r in ranks[1:])
        for r in ranks:
            assert r["params"] >= 2e5
            assert all(len(r["times"][phase]) == 2 and min(r["times"][phase]) > 0 for phase in PHASES)
