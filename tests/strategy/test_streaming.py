"""Streaming outer steps (``lightning_onebit.optim.streaming``, ``OnebitDiLoCoStrategy(fragments=, overlap_steps=)``):
the cut into fragments, the staggered schedule, the overlapped sync and its rebase against a reference written from
the formulas (one process, the other replica simulated), and under Lightning on 2 and 3 gloo ranks (flat) and 2 x 2:
the outer model bitwise the same on every rank after every step, every rank the same at the end of fit, a fragment's
replicas the same right after its unoverlapped sync and only it, resume bitwise from a checkpoint saved while an
exchange was in flight, a short run learns, and every bad setting refused with its reason.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import OnebitDiLoCoStrategy
from lightning_onebit.optim.outer_step import OuterStep
from lightning_onebit.optim.streaming import StreamingOuterStep, fragment_parameters
from tests.distributed import run_sessions, scenario_results
from tests.lightning_models import Regressor, held_out_loss
from tests.optim.test_outer_step import SimulatedReplicas
from tests.strategy.test_local_steps import _fit
from tests.tensors import identical

SYNC_EVERY = 4
STEPS = 10


# ======================================================================================== one process
def test_fragments_are_contiguous_nonempty_and_about_equal():
    sizes = [10, 1000, 10, 10, 1000, 10, 1000, 5]
    params = [torch.zeros(n) for n in sizes]
    for count in range(1, len(sizes) + 1):
        groups = fragment_parameters(params, count)
        assert len(groups) == count and all(groups)
        assert [p for g in groups for p in g] == params  # contiguous, in order, every parameter once
    assert [[p.numel() for p in g] for g in fragment_parameters(params, 3)] == [[10, 1000], [10, 10, 1000],
                                                                                  [10, 1000, 5]]
    with pytest.raises(ValueError, match="fragments=9 is more than the model's 8 trainable parameter tensors"):
        fragment_parameters(params, 9)


def _streaming(count: int, overlap: int, lr: float = 1.0) -> tuple[StreamingOuterStep, list[torch.Tensor]]:
    torch.manual_seed(0)
    params = [torch.randn(n) for n in (6, 5, 7, 4)]
    fragments = [OuterStep(group, SimulatedReplicas(2), "sgd", lr) for group in fragment_parameters(params, count)]
    return StreamingOuterStep(fragments, SYNC_EVERY, overlap), params


def test_fragments_sync_at_staggered_steps():
    streaming, _ = _streaming(2, 0)
    assert streaming.offsets == [0, 2]
    assert [streaming.due(s) for s in range(0, 9)] == [[], [], [1], [], [0], [], [1], [], [0]]
    with pytest.raises(ValueError, match="fragments=5 is more than sync_every=4"):
        StreamingOuterStep(streaming.fragments * 2 + streaming.fragments[:1], SYNC_EVERY)
    with pytest.raises(ValueError, match=r"overlap_steps must be an integer in \[0, sync_every - 1 = 3\]"):
        StreamingOuterStep(streaming.fragments, SYNC_EVERY, overlap_steps=4)


@pytest.mark.parametrize("count, overlap", [(1, 0), (2, 0), (2, 1), (1, 3), (3, 2)])
def test_the_overlapped_sync_and_its_rebase_against_the_formulas(count, overlap):
    """Inner steps add random increments; the other replica's pseudo-gradients are random. Reference: a fragment
    due after step t takes ``d = outer - local(t)``, its new outer is ``outer - lr (d + d_other) / 2``, and after step
    ``t + overlap`` its parameters become ``outer_new + (local(t + overlap) - local(t))``."""
    lr = 0.7
    streaming, params = _streaming(count, overlap, lr)
    groups = [f.params for f in streaming.fragments]
    ref_local = [p.clone() for p in params]
    ref_outer = [p.clone() for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    pending: dict[int, tuple] = {}  # fragment -> (due, local at start, new outer)
    generator = torch.Generator().manual_seed(1)
    for step in range(1, 17):
        for i, p in enumerate(params):
            increment = torch.randn(p.shape, generator=generator) * 0.1
            with torch.no_grad():
                p.add_(increment)
            ref_local[i] = ref_local[i] + increment
        for k, fragment in enumerate(streaming.fragments):
            if step % SYNC_EVERY == streaming.offsets[k]:  # the other replica's pseudo-gradient for this sync
                other = torch.randn(sum(p.numel() for p in groups[k]), generator=generator)
                (bucket,) = fragment.buckets
                fragment.compressor.others[bucket.key] = [other]
                ids = [index[id(p)] for p in groups[k]]
                mine = torch.cat([(ref_outer[i] - ref_local[i]).reshape(-1) for i in ids])
                new = torch.cat([ref_outer[i].reshape(-1) for i in ids]) - lr * ((mine + other) / 2)
                pending[k] = (step + overlap, [ref_local[i].clone() for i in ids], new)
        for k, (due, then, new) in list(pending.items()):
            if due == step:
                ids = [index[id(p)] for p in groups[k]]
                offset = 0
                for i, before in zip(ids, then):
                    n = params[i].numel()
                    ref_outer[i] = new[offset : offset + n].view_as(params[i])
                    ref_local[i] = ref_outer[i] + (ref_local[i] - before) if overlap else ref_outer[i].clone()
                    offset += n
                del pending[k]
        streaming.after_inner_step(step)
        outer = streaming.outer_values()
        for i, p in enumerate(params):
            torch.testing.assert_close(p, ref_local[i], rtol=1e-5, atol=1e-6, msg=f"step {step}: parameter {i}")
            torch.testing.assert_close(outer[id(p)], ref_outer[i], rtol=1e-5, atol=1e-6)  # new only when due
    streaming.flush(16)
    assert streaming.params_are_outer
    for p in params:
        assert torch.equal(p, streaming.outer_values()[id(p)])


def test_an_exchange_finished_early_changes_nothing():
    """Finishing an exchange early (validation, a checkpoint) gives the same parameters as finishing it when due."""
    runs = []
    for early in (False, True):
        streaming, params = _streaming(2, 2)
        for fragment in streaming.fragments:
            (bucket,) = fragment.buckets
            fragment.compressor.others[bucket.key] = [torch.ones(bucket.values.numel())]
        for step in range(1, 12):
            with torch.no_grad():
                for p in params:
                    p.add_(0.01 * step)
            streaming.after_inner_step(step)
            if early:
                streaming.finish_in_flight()
                state = streaming.state_dict()  # allowed once nothing is in flight
                assert len(state["rebases"]) <= 1
        runs.append(torch.cat([p.reshape(-1) for p in params]))
    assert torch.equal(runs[0], runs[1])
    streaming, _ = _streaming(1, 1)
    streaming.after_inner_step(4)
    with pytest.raises(RuntimeError, match="in flight"):
        streaming.state_dict()


# ======================================================================================== Lightning
class OuterRecorder(pl.Callback):
    """After every optimizer step, the outer values of every fragment (flat) and which fragments are in flight."""

    def __init__(self) -> None:
        self.outer: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        streaming = trainer.strategy.outer_step
        self.outer.append(torch.cat([v.reshape(-1).clone() for v in streaming.outer_values().values()]))


def _streamed(rank: int, world_size: int, workdir: str, per_replica: int, compressor: str = "onebit",
              fragments: int = 2, overlap: int = 1) -> dict:
    recorder = OuterRecorder()
    start = held_out_loss(Regressor(optimizer="adamw", seed=0))
    out = _fit(rank, world_size, workdir, max_steps=STEPS, callbacks=[recorder], sync_every=SYNC_EVERY,
               compressor=compressor, ranks_per_node=per_replica, fragments=fragments, overlap_steps=overlap)
    return dict(out, outer=recorder.outer, start=start)


def _resume(rank: int, world_size: int, workdir: str, per_replica: int) -> dict:
    run = os.path.join(workdir, f"streamed-resume-{per_replica}")

    def fit(**kwargs: Any) -> dict:
        return _fit(rank, world_size, workdir, max_steps=STEPS, sync_every=SYNC_EVERY, ranks_per_node=per_replica,
                    fragments=2, overlap_steps=1, outer_optimizer="nesterov", **kwargs)
    # step 4: fragment 0's exchange starts after it, its rebase is due after step 5: in flight at the save
    at_4 = ModelCheckpoint(dirpath=run, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    full = fit(callbacks=[at_4])
    resumed = fit(ckpt_path=os.path.join(run, "step=4.ckpt"))
    return {"full": full["final"], "resumed": resumed["final"], "full_steps": full["steps"],
            "resumed_steps": resumed["steps"]}


def _validated(rank: int, world_size: int, workdir: str) -> dict:
    """Validation every 4 steps, right after fragment 0's exchange started (in flight): it is finished early for the
    validation, which must not change the training."""
    from tests.strategy.test_local_steps import ValidatedRegressor

    def fit(val: bool) -> dict:
        recorder = OuterRecorder()
        model = ValidatedRegressor(optimizer="adamw", seed=0, data_seed=7 + rank)
        out = _fit(rank, world_size, workdir, max_steps=STEPS, model=model, val=val, callbacks=[recorder],
                   sync_every=SYNC_EVERY, ranks_per_node=1, fragments=2, overlap_steps=1)
        return dict(out, outer=recorder.outer)
    return {"with": fit(True), "without": fit(False)}


def _refused(rank: int, world_size: int, workdir: str, **kwargs: Any) -> dict:
    try:
        _fit(rank, world_size, workdir, max_steps=4, **kwargs)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


SCENARIOS = {
    2: (("streamed_onebit", partial(_streamed, per_replica=1)),
        ("staggered_none", partial(_streamed, per_replica=1, compressor="none", overlap=0)),
        ("resume", partial(_resume, per_replica=1)),
        ("validated", _validated),
        ("too_many_fragments", partial(_refused, sync_every=8, fragments=5, ranks_per_node=1))),
    3: (("streamed_onebit_3", partial(_streamed, per_replica=1, overlap=2)),),  # the two-phase 1-bit exchange
    4: (("streamed_topk_2x2", partial(_streamed, per_replica=2, compressor="topk")),
        ("streamed_onebit_2x2", partial(_streamed, per_replica=2, fragments=4, overlap=3)),
        ("resume_2x2", partial(_resume, per_replica=2))),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> dict[int, list[dict]]:
    return run_sessions(SCENARIOS, tmp_path_factory, "streaming")


STREAMED = [(2, "streamed_onebit", 1), (3, "streamed_onebit_3", 1), (4, "streamed_topk_2x2", 2),
            (4, "streamed_onebit_2x2", 2)]


@pytest.mark.parametrize("world_size, name, per_replica", STREAMED)
def test_the_outer_model_is_bitwise_the_same_everywhere_and_every_rank_ends_the_same(sessions, world_size, name,
                                                                                     per_replica):
    results = scenario_results(sessions[world_size], name)
    for step in range(STEPS):
        assert identical([r["outer"][step] for r in results]), f"step {step + 1}: the outer models differ"
        params = [r["steps"][step]["params"] for r in results]
        for replica in range(world_size // per_replica):  # inside a replica: DDP, identical always
            assert identical(params[replica * per_replica : (replica + 1) * per_replica])
    assert not torch.equal(results[0]["outer"][0], results[0]["outer"][-1])  # the outer model moved
    assert identical([r["final"] for r in results])  # the end of fit syncs what is left
    for result in results:
        assert result["held_out"] < result["start"]


def test_a_staggered_fragment_is_the_same_on_every_replica_right_after_its_sync_and_the_other_not(sessions):
    results = scenario_results(sessions[2], "staggered_none")
    first_fragment, _ = fragment_parameters(list(Regressor(optimizer="adamw").parameters()), 2)
    cut = sum(p.numel() for p in first_fragment)  # the flat parameters of fragment 0, then of fragment 1
    assert 0 < cut < results[0]["steps"][0]["params"].numel()
    for step in (2, 6):  # fragment 1 (offset 2) synced after these steps, fragment 0 not
        first, second = (r["steps"][step - 1]["params"] for r in results)
        assert torch.equal(first[cut:], second[cut:]) and not torch.equal(first[:cut], second[:cut])
    for step in (4, 8):
        first, second = (r["steps"][step - 1]["params"] for r in results)
        assert torch.equal(first[:cut], second[:cut]) and not torch.equal(first[cut:], second[cut:])


@pytest.mark.parametrize("world_size, name", [(2, "resume"), (4, "resume_2x2")])
def test_resumed_from_a_checkpoint_saved_with_an_exchange_in_flight_is_bitwise_the_uninterrupted_run(
        sessions, world_size, name):
    for result in scenario_results(sessions[world_size], name):
        assert torch.equal(result["full"], result["resumed"])
        for full, resumed in zip(result["full_steps"][4:], result["resumed_steps"]):
            assert torch.equal(full["params"], resumed["params"]), full["step"]


def test_validation_sees_the_newest_outer_model_and_leaves_the_training_unchanged(sessions):
    results = scenario_results(sessions[2], "validated")
    for result in results:
        assert torch.equal(result["with"]["final"], result["without"]["final"])  # bit for bit
        validated = result["with"]["validated"]
        assert len(validated) == 2  # after steps 4 and 8, with fragment 0's exchange in flight each time
        for at, seen in zip((4, 8), validated):
            # the outer model after fragment 0's exchange started after step `at` and was finished for validation:
            # the outer values recorded after step `at + 1` (the rebase's step; no exchange finished in between)
            assert torch.equal(seen, result["with"]["outer"][at])
            assert not torch.equal(seen, result["with"]["steps"][at - 1]["params"])  # not the local parameters
    assert identical([r["with"]["validated"][0] for r in results])


def test_bad_streaming_settings_are_refused_with_their_reason(sessions):
    with pytest.raises(ValueError, match=r"fragments must be an integer in \[1, sync_every = 4\]"):
        OnebitDiLoCoStrategy(sync_every=4, fragments=5)
    with pytest.raises(ValueError, match=r"overlap_steps must be an integer in \[0, sync_every - 1 = 3\]"):
        OnebitDiLoCoStrategy(sync_every=4, overlap_steps=4)
    with pytest.raises(ValueError, match=r"overlap_steps must be"):
        OnebitDiLoCoStrategy(overlap_steps=-1)
    for result in scenario_results(sessions[2], "too_many_fragments"):  # every rank, before any collective
        assert "fragments=5 is more than the model's 4 trainable parameter tensors" in result["error"]
