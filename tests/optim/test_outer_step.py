"""The outer step of local-steps training (``lightning_onebit.optim.outer_step.OuterStep``): the pseudo-gradient, the
outer optimizers (Nesterov SGD, DiLoCo's; plain SGD, SparseLoCo's error-feedback-only form) and the parameters every
replica holds afterwards, against a hand reference: in one process with simulated replicas, and on 2, 3 and 4 gloo
ranks, flat and as 2 replicas of 2 ranks (each rank stepping its shard)."""

from __future__ import annotations

from typing import Hashable, Sequence

import pytest
import torch
from torch import nn

from lightning_onebit.comm import OuterBucket, OuterCompression, OuterCompressor, Topology, make_outer_compressor
from lightning_onebit.optim import OuterStep
from tests.distributed import run_distributed
from tests.tensors import same_bits, seed_of

SYNCS = 3
LR, MOMENTUM = 0.7, 0.9


class Model(nn.Module):
    """Parameters of two dtypes (a flat per dtype) and sizes that do not fill buckets evenly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(7, 5)
        self.b = nn.Parameter(torch.randn(11, dtype=torch.float64))
        self.c = nn.Linear(5, 3)


def local_params(replica: int, sync: int, outer: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """What replica ``replica``'s inner steps leave before sync ``sync``: the outer parameters plus a drift of its
    own."""
    g = torch.Generator().manual_seed(seed_of("drift", replica, sync))
    return [o + 0.1 * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outer]


def hand_outer_steps(first: list[torch.Tensor], replicas: int, optimizer: str) -> list[list[torch.Tensor]]:
    """The outer parameters after each sync, by hand: ``delta_r = outer - local_r``, averaged in replica order, then
    Nesterov SGD (``buf = m buf + g``, the first ``buf = g``; ``outer -= lr (g + m buf)``) or plain SGD."""
    outer, buffers, history = [t.clone() for t in first], None, []
    for sync in range(SYNCS):
        locals_ = [local_params(r, sync, outer) for r in range(replicas)]
        grads = []
        for i, o in enumerate(outer):
            total = o - locals_[0][i]
            for r in range(1, replicas):
                total = total + (o - locals_[r][i])
            grads.append(total / replicas)
        if optimizer == "nesterov":
            buffers = [g.clone() for g in grads] if buffers is None else [
                b.mul_(MOMENTUM).add_(g) for b, g in zip(buffers, grads)]
            updates = [g.add(b, alpha=MOMENTUM) for g, b in zip(grads, buffers)]
        else:
            updates = grads
        outer = [o.add(u, alpha=-LR) for o, u in zip(outer, updates)]
        history.append([o.clone() for o in outer])
    return history


class SimulatedReplicas(OuterCompressor):
    """The other replicas simulated in one process: their pseudo-gradients for the coming sync are set before it, and
    the average adds them in replica order (this one is replica 0), as the fp32 ``all_reduce`` of two ranks does."""

    def __init__(self, replicas: int) -> None:
        super().__init__(OuterCompression("none"))
        self._replicas = replicas
        self.others: dict[Hashable, list[torch.Tensor]] = {}

    @property
    def replicas(self) -> int:
        return self._replicas

    def average_(self, buckets: Sequence[OuterBucket]) -> None:
        for bucket in buckets:
            total = bucket.values.clone()
            for other in self.others[bucket.key]:
                total = total + other
            bucket.values.copy_(total / self._replicas)

    def bytes_per_call(self, bucket: OuterBucket) -> int:
        return 0


def _flat_pieces(step: OuterStep, tensors: Sequence[torch.Tensor]) -> dict[Hashable, torch.Tensor]:
    """The bucket values ``tensors`` (in the step's parameter order) would give: flat per dtype, padded, cut."""
    out = {}
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        flat = torch.cat([t.reshape(-1) for t in tensors if t.dtype == dtype])
        buckets = [b for b in step.buckets if b.key[0] == str(dtype)]
        flat = torch.cat([flat, flat.new_zeros(sum(b.values.numel() for b in buckets) - flat.numel())])
        offset = 0
        for b in buckets:
            out[b.key] = flat[offset : offset + b.values.numel()]
            offset += b.values.numel()
    return out


@pytest.mark.parametrize("optimizer", ["nesterov", "sgd"])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_outer_steps_against_the_hand_reference_with_simulated_replicas(optimizer, replicas):
    model = Model()
    params = list(model.parameters())
    first = [p.detach().clone() for p in params]
    compressor = SimulatedReplicas(replicas)
    step = OuterStep(params, compressor, optimizer, LR, MOMENTUM, bucket_numel=16)
    # by dtype in order of first appearance: b (float64, the module's own) first, then the float32 ones
    assert [tuple(p.shape) for p in step.params] == [(11,), (5, 7), (5,), (3, 5), (3,)]
    assert all(a is b for a, b in zip(step.params, params))
    expected = hand_outer_steps(first, replicas, optimizer)
    outer = [t.clone() for t in first]
    for sync in range(SYNCS):
        locals_ = [local_params(r, sync, outer) for r in range(replicas)]
        with torch.no_grad():
            for p, value in zip(params, locals_[0]):
                p.copy_(value)
        deltas = [_flat_pieces(step, [o - v for o, v in zip(outer, locals_[r])]) for r in range(1, replicas)]
        compressor.others = {key: [d[key] for d in deltas] for key in deltas[0]} if deltas else {
            b.key: [] for b in step.buckets}
        step.sync()
        for (name, p), want in zip(model.named_parameters(), expected[sync]):
            assert same_bits(p.detach(), want), f"sync {sync}: {name}"
        outer = [p.detach().clone() for p in params]
    assert step.syncs == SYNCS
    momentum = step.optimizer.state_dict()["state"]
    assert (len(momentum) == 2) == (optimizer == "nesterov")  # a momentum buffer per dtype, or none


def test_buckets_cut_the_flat_parameters_into_pieces():
    model = Model()
    step = OuterStep(list(model.parameters()), SimulatedReplicas(2), bucket_numel=16)
    float32 = [b for b in step.buckets if b.key[0] == "torch.float32"]
    # a.weight 35, a.bias 5, c.weight 15, c.bias 3: 58 values, buckets of 16 (one replica: no shards)
    assert [b.values.numel() for b in float32] == [16, 16, 16, 10]
    assert [b.pieces for b in float32] == [(16,), (16,), (3, 5, 8), (7, 3)]
    assert [b.real for b in float32] == [16, 16, 16, 10]
    (float64,) = [b for b in step.buckets if b.key[0] == "torch.float64"]
    assert float64.pieces == (11,)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_pseudo_gradient_stops_the_sync_before_anything_changes(bad, dtype):
    params = [torch.randn(5, dtype=dtype), torch.randn(3, 4, dtype=dtype)]
    step = OuterStep(params, SimulatedReplicas(2), "sgd", 1.0)
    (bucket,) = step.buckets
    step.compressor.others[bucket.key] = [torch.zeros(bucket.values.numel(), dtype=dtype)]
    outer = {k: v.clone() for k, v in step.outer_values().items()}
    with torch.no_grad():
        params[1][2, 1] = bad
    with pytest.raises(RuntimeError, match="holds inf or NaN on at least one replica"):
        step.start()
    assert not step.in_flight and step.syncs == 0
    assert all(torch.equal(outer[k], v) for k, v in step.outer_values().items())
    with torch.no_grad():
        params[1][2, 1] = 1.0
    step.sync()  # finite again: the sync runs
    assert step.syncs == 1


def test_bad_outer_optimizer_is_refused():
    with pytest.raises(ValueError, match="outer_optimizer must be one of"):
        OuterStep(list(Model().parameters()), SimulatedReplicas(2), "adam")
    with pytest.raises(ValueError, match="at least one trainable parameter"):
        OuterStep([], SimulatedReplicas(2))


# ======================================================================================== gloo ranks
def _outer_steps_on_ranks(rank: int, world_size: int, per_replica: int, optimizer: str, kind: str) -> dict:
    replica, replicas = rank // per_replica, world_size // per_replica
    shard_group = replica_group = None
    topology = None
    if per_replica > 1:
        topology = Topology.build(0, rank, mode="hierarchical", ranks_per_node=per_replica)
        shard_group, replica_group = topology.intra_group, topology.inter_group
    model = Model()
    params = list(model.parameters())
    step = OuterStep(params, make_outer_compressor(kind, replica_group), optimizer, LR, MOMENTUM,
                     shard_group=shard_group, bucket_numel=16)
    outer = [p.detach().clone() for p in params]
    after, saved = [], None
    for sync in range(SYNCS):
        if sync == 1:  # a step made afresh from this state must continue as this one
            saved = ([o.clone() for o in outer], step.state_dict())
        with torch.no_grad():
            for p, value in zip(params, local_params(replica, sync, outer)):
                p.copy_(value)
        step.sync()
        outer = [p.detach().clone() for p in params]
        after.append(outer)
    outer_then, state = saved
    fresh = Model()
    with torch.no_grad():
        for p, value in zip(fresh.parameters(), outer_then):
            p.copy_(value)
    resumed = OuterStep(list(fresh.parameters()), make_outer_compressor(kind, replica_group), optimizer, LR, MOMENTUM,
                        shard_group=shard_group, bucket_numel=16)
    resumed.load_state_dict(state)
    for sync in range(1, SYNCS):
        with torch.no_grad():
            now = [p.detach().clone() for p in fresh.parameters()]
            for p, value in zip(fresh.parameters(), local_params(replica, sync, now)):
                p.copy_(value)
        resumed.sync()
    return {"after": after, "resumed": [p.detach().clone() for p in fresh.parameters()],
            "gathered": step.gather_counters, "exchanged": step.compressor.counters,
            "shard": [b.values.numel() for b in step.buckets],
            "shard_bytes": sum(b.values.numel() * b.values.element_size() for b in step.buckets)}


@pytest.mark.parametrize("world_size, per_replica", [(2, 1), (3, 1), (4, 1), (4, 2)])
def test_outer_steps_on_gloo_ranks_match_the_hand_reference(world_size, per_replica):
    replicas = world_size // per_replica
    results = run_distributed(_outer_steps_on_ranks, world_size, per_replica, "nesterov", "none")
    expected = hand_outer_steps([p.detach().clone() for p in Model().parameters()], replicas, "nesterov")
    for sync in range(SYNCS):
        for r in range(1, world_size):  # every rank the same bits
            assert all(same_bits(a, b) for a, b in zip(results[0]["after"][sync], results[r]["after"][sync]))
        for got, want in zip(results[0]["after"][sync], expected[sync]):
            if replicas == 2:  # a + b in any order, and the same Nesterov ops
                assert same_bits(got, want)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for r in range(world_size):  # resumed from its state, the step continued bit for bit
        assert all(same_bits(a, b) for a, b in zip(results[r]["resumed"], results[r]["after"][-1]))
    # bytes: each rank exchanges its shard with its replica peers, then gathers the shards inside the replica
    shard = sum(results[0]["shard"])  # float32 and float64 values of this rank's shard
    for r in range(world_size):
        exchanged, gathered = results[r]["exchanged"], results[r]["gathered"]
        assert sum(results[r]["shard"]) == shard
        if per_replica == 1:
            assert gathered.bytes_sent == 0
        else:
            shard_bytes = results[r]["shard_bytes"]
            assert shard_bytes == 8 * 6 + 4 * 29  # float64: 11 values padded to 12; float32: 58, halved
            assert gathered.bytes_sent == gathered.bytes_sent_intra_node == SYNCS * (per_replica - 1) * shard_bytes
        assert exchanged.bytes_sent_inter_node == exchanged.bytes_sent > 0
        assert exchanged.calls == SYNCS * len(results[r]["shard"])


def _payload_gather_against_shard_gather(rank: int, world_size: int, kind: str, lr: float) -> dict:
    """2 replicas of 2 ranks, outer SGD: the outer step as it runs (the gathered payloads all-gathered inside the
    replica, every shard decoded on every rank) and with the new fp32 shards all-gathered instead."""
    topology = Topology.build(0, rank, mode="hierarchical", ranks_per_node=2)
    runs = {}
    for gathers_payloads in (True, False):
        model = Model()
        params = list(model.parameters())
        step = OuterStep(params, make_outer_compressor(kind, topology.inter_group), "sgd", lr,
                         shard_group=topology.intra_group, bucket_numel=16)
        assert step.gathers_payloads
        step.gathers_payloads = gathers_payloads
        after = []
        for sync in range(SYNCS):
            with torch.no_grad():
                outer = [p.detach().clone() for p in params]
                for p, value in zip(params, local_params(rank // 2, sync, outer)):
                    p.copy_(value)
            step.sync()
            after.append([p.detach().clone() for p in params])
        runs[gathers_payloads] = {"after": after, "gathered": step.gather_counters.bytes_sent_intra_node,
                                  "exchanged": step.compressor.counters.bytes_sent_inter_node}
    return runs


@pytest.mark.parametrize("kind, lr", [("onebit", 1.0), ("topk", 0.7)])
def test_gathering_the_payloads_inside_the_replica_gives_the_bits_of_gathering_the_shards(kind, lr):
    results = run_distributed(_payload_gather_against_shard_gather, 4, kind, lr)
    for r in range(4):
        by_payloads, by_shards = results[r][True], results[r][False]
        for sync in range(SYNCS):
            assert all(same_bits(a, b) for a, b in zip(by_payloads["after"][sync], by_shards["after"][sync])), \
                f"rank {r}, sync {sync}"
            assert all(same_bits(a, b) for a, b in zip(by_payloads["after"][sync], results[0][True]["after"][sync]))
        assert by_payloads["exchanged"] == by_shards["exchanged"] > 0  # the same bytes across replicas
        assert 0 < by_payloads["gathered"] < by_shards["gathered"]  # fewer inside the replica


class RoundingReplicas(SimulatedReplicas):
    """:class:`SimulatedReplicas` whose own values go through bf16 with error feedback (an elementwise compressor:
    its result does not depend on how the values are cut into buckets)."""

    def average_(self, buckets: Sequence[OuterBucket]) -> None:
        for bucket in buckets:
            accumulated = self._accumulate(bucket)
            wire = accumulated.to(torch.bfloat16).float()
            accumulated.sub_(wire)
            bucket.values.copy_(wire)
        super().average_(buckets)


def test_the_per_parameter_state_restores_at_another_bucket_layout_and_continues_alike():
    """Outer values, error feedback and Nesterov momentum saved by parameter from one bucket layout and loaded into an
    outer step of another (as a sharded checkpoint resumed at another layout): both continue bit for bit."""
    generator = torch.Generator().manual_seed(3)
    shapes = [(5, 3), (7,), (2, 2, 3)]
    first = [torch.randn(s, generator=generator) for s in shapes]
    steps = {}
    for name, numel in (("wide", 1 << 20), ("narrow", 8)):
        params = [t.clone() for t in first]
        steps[name] = (OuterStep(params, RoundingReplicas(2), "nesterov", LR, MOMENTUM, bucket_numel=numel), params)
    assert len(steps["wide"][0].buckets) == 1 and len(steps["narrow"][0].buckets) > 3

    def sync(name: str, drift: list[torch.Tensor], other: list[torch.Tensor]) -> None:
        step, params = steps[name]
        with torch.no_grad():
            for p, d in zip(params, drift):
                p.add_(d)
        step.compressor.others = {key: [value] for key, value in _flat_pieces(step, other).items()}
        step.sync()

    def random_like() -> list[torch.Tensor]:
        return [torch.randn(s, generator=generator) * 0.1 for s in shapes]

    for _ in range(3):  # only the wide one trains, then hands its state over
        sync("wide", random_like(), random_like())
    state = steps["wide"][0].per_parameter_state()
    assert all(e.abs().sum() > 0 for e in state["error_feedback"]) and all(m is not None for m in state["momentum"])
    steps["narrow"][0].load_per_parameter_state(state)
    steps["narrow"][0].copy_outer_to_params()
    for _ in range(3):
        drift, other = random_like(), random_like()
        for name in steps:
            sync(name, drift, other)
    wide, narrow = (steps[name][0].per_parameter_state() for name in ("wide", "narrow"))
    for key in ("outer", "error_feedback", "momentum"):
        assert all(torch.equal(a, b) for a, b in zip(wide[key], narrow[key])), key
    with pytest.raises(ValueError, match=r"outer state 'outer' of parameter 0: saved with shape \(3, 5\)"):
        steps["narrow"][0].load_per_parameter_state(dict(state, outer=[state["outer"][0].t()] + state["outer"][1:]))
