"""Param groups with ``compress=False``: kept out of 1-bit compression, gradients averaged in full precision.

* OnebitAdam on 2 and 3 gloo ranks with different data: replicas bitwise identical after every step; the
  uncompressed group follows ``torch.optim.AdamW`` on the ranks' averaged gradients (exactly on 2 ranks) and keeps
  updating its variance after the freeze, the compressed one's is frozen; the bytes are the 1-bit buckets plus one
  ring allreduce of the uncompressed group per step; embedding rows first seen after the freeze train with bounded
  steps in an uncompressed group and get the dead-coordinate warning in a compressed one.
* The overlapped exchange gives the in-step bits with an uncompressed group sharing DDP buckets with compressed ones.
* OnebitLamb: the uncompressed group follows the optimizer's own warmup LAMB on averaged gradients; a resume that
  switches it into compression continues with identical replicas.
* ZeroOneAdam: the uncompressed group takes an AdamW step every step (local steps included, which then send exactly
  its bytes), identical on every rank after every step.
* Validation, checkpoints (``compress`` comes from the code), resume switching ``compress`` both ways, MomentumMask.
"""

from __future__ import annotations

import copy
import logging
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_onebit import MomentumMask, OnebitAdam, OnebitStrategy, OnebitLamb, ZeroOneAdam
from lightning_onebit.comm import replica_checksums, ring_allreduce_bytes
from lightning_onebit.hooks import GradientSyncState, OverlapState, overlapped_exchange_hook, switchable_allreduce_hook
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.optim_models import EmbeddingNet, token_batch

VOCAB, SEEN_ROWS, DIM = 12, 8, 4  # rows SEEN_ROWS.. of the embedding are looked up only after the freeze
FREEZE, STEPS, LR, WD = 3, 8, 1e-2, 0.01
EMB_NUMEL = VOCAB * DIM


class EmbNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(ids).mean(1))))


def batch(rank: int, step: int, freeze: int = FREEZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Different on every rank and step; only rows ``< SEEN_ROWS`` up to step ``freeze``."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, SEEN_ROWS if step <= freeze else VOCAB, (8, 3), generator=g)
    return ids, torch.randn(8, 1, generator=g)


def groups(net: EmbNet, emb_compressed: bool = False) -> list[dict[str, Any]]:
    """The embedding in a group of its own (compress=False unless ``emb_compressed``), the rest with lr 2e-2."""
    return [
        {"params": [net.emb.weight], "weight_decay": WD, "compress": emb_compressed},
        {"params": [net.hidden.weight, net.hidden.bias, net.head.weight, net.head.bias], "lr": 2e-2},
    ]


def _ddp_with_switchable_hook(net: nn.Module, opt: Any) -> DDP:
    ddp = DDP(net)
    ddp.register_comm_hook(GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce),
                           switchable_allreduce_hook)
    return ddp


def _train(rank: int, opt_factory: Any, steps: range, emb_compressed: bool = False, state: Any = None,
           save_at: int = -1) -> dict[str, Any]:
    """Train EmbNet with the switchable DDP hook; record per step what the tests compare."""
    net = EmbNet()
    opt = opt_factory(groups(net, emb_compressed))
    ddp = _ddp_with_switchable_hook(net, opt)
    if state is not None:
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    out: dict[str, Any] = {k: [] for k in ("averaged", "grads", "emb", "v_emb", "v_hidden", "checksums",
                                             "emb_checksum", "bytes", "bytes_unc", "kinds")}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for t in steps:
            opt.zero_grad()
            out["averaged"].append(opt.needs_gradient_allreduce)
            ids, y = batch(rank, t)
            nn.functional.mse_loss(ddp(ids), y).backward()
            out["grads"].append(net.emb.weight.grad.clone())
            opt.step()
            out["kinds"].append(opt.last_step_kind)
            out["emb"].append(net.emb.weight.detach().clone())
            out["v_emb"].append(opt.state[net.emb.weight]["exp_avg_sq"].clone())
            out["v_hidden"].append(opt.state[net.hidden.weight]["exp_avg_sq"].clone())
            out["checksums"].append(replica_checksums(list(net.parameters())))
            out["emb_checksum"].append(replica_checksums([net.emb.weight]))
            out["bytes"].append(opt.communication.bytes_sent)
            out["bytes_unc"].append(opt.communication.bytes_sent_uncompressed)
            if t == save_at:
                out["saved"] = dict(model={k: v.clone() for k, v in net.state_dict().items()},
                                    optimizer=copy.deepcopy(opt.state_dict()))
    out["dead_warnings"] = [str(w.message) for w in caught if "had no gradient in warmup" in str(w.message)]
    out["layouts"] = [(layout.numel, layout.bytes_per_call()) for layout in opt.bucket_layouts().values()]
    return out


def _adam(params: Any) -> OnebitAdam:
    return OnebitAdam(params, lr=LR, freeze_step=FREEZE)


def _lamb(params: Any) -> OnebitLamb:
    return OnebitLamb(params, lr=LR, freeze_step=FREEZE, dead_coordinates="ignore")


def _zeroone(params: Any) -> ZeroOneAdam:
    return ZeroOneAdam(params, lr=LR, var_freeze_step=8, var_update_scaler=2, local_step_scaler=2,
                       local_step_clipper=4)


# ------------------------------------------------------------------------------------------------ overlap
DeepNet = EmbeddingNet  # several DDP buckets at a small bucket_cap_mb


def _train_overlap(rank: int, enabled: bool) -> dict[str, Any]:
    net = DeepNet()
    ddp = DDP(net, bucket_cap_mb=0.002)
    # the bias shares its DDP bucket with compressed parameters: the hook must leave it local
    uncompressed = [net.emb.weight, net.layers[1].bias]
    rest = [p for p in net.parameters() if all(p is not q for q in uncompressed)]
    opt = OnebitAdam([{"params": uncompressed, "compress": False}, {"params": rest}], lr=1e-2, freeze_step=FREEZE,
                     dead_coordinates="ignore")
    state = OverlapState(ddp, opt, enabled=enabled)
    ddp.register_comm_hook(state, overlapped_exchange_hook)
    after, in_flight = [], []
    for step in range(STEPS):
        x, y = token_batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        in_flight.append(opt.exchanges_in_flight)
        opt.step()
        opt.zero_grad()
        after.append([p.detach().clone() for p in net.parameters()])
    planned = {id(p) for bucket in opt.bucket_plan or [] for p in bucket}
    return dict(after=after, in_flight=in_flight, started=state.buckets_started,
                planned_uncompressed=any(id(p) in planned for p in uncompressed), planned=len(planned),
                bytes_unc=opt.communication.bytes_sent_uncompressed,
                bucketed_numel=sum(layout.numel for layout in opt.bucket_layouts().values()),
                rest_numel=sum(p.numel() for p in rest))


# ------------------------------------------------------------------------------------------------ scenarios
def scenario_adam(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(uncompressed=_train(rank, _adam, range(1, STEPS + 1)),
                compressed=_train(rank, _adam, range(1, STEPS + 1), emb_compressed=True))


def scenario_overlap(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(overlapped=_train_overlap(rank, True), in_step=_train_overlap(rank, False))


def scenario_lamb(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    full = _train(rank, _lamb, range(1, STEPS + 1), save_at=5)
    # resumed with the embedding group switched into compression (it has no scaling coefficient nor previous momentum)
    switched = _train(rank, _lamb, range(6, STEPS + 1), emb_compressed=True, state=full.pop("saved"))
    return dict(full=full, switched=switched)


def scenario_zeroone(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    return dict(full=_train(rank, _zeroone, range(1, 17)))


def scenario_resume_switch(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    """OnebitAdam saved in the compression stage, resumed with the embedding group's compress switched."""
    out = {}
    for saved_compressed in (True, False):
        first = _train(rank, _adam, range(1, 6), emb_compressed=saved_compressed, save_at=5)
        resumed = _train(rank, _adam, range(6, STEPS + 1), emb_compressed=not saved_compressed,
                         state=first["saved"])
        out[f"saved_compressed={saved_compressed}"] = dict(first=first["checksums"], resumed=resumed)
    return out


SCENARIOS_2 = (("adam", scenario_adam), ("overlap", scenario_overlap), ("lamb", scenario_lamb),
               ("zeroone", scenario_zeroone), ("resume_switch", scenario_resume_switch))


@pytest.fixture(scope="module")
def session2(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 2, SCENARIOS_2, str(tmp_path_factory.mktemp("u2")), timeout_s=300)


@pytest.fixture(scope="module")
def session3(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(run_scenarios, 3, (("adam", scenario_adam),), str(tmp_path_factory.mktemp("u3")),
                           timeout_s=300)


# ------------------------------------------------------------------------------------------------ references
def _averaged_grads(ranks: list[dict[str, Any]]) -> list[torch.Tensor]:
    """The gradient each step averaged over the ranks: DDP's where it averaged, else the mean of the local ones
    (summed in rank order, then divided, as the full-precision allreduce does)."""
    out = []
    for t, averaged in enumerate(ranks[0]["averaged"]):
        if averaged:
            out.append(ranks[0]["grads"][t])
        else:
            total = ranks[0]["grads"][t].clone()
            for r in ranks[1:]:
                total += r["grads"][t]
            out.append(total / len(ranks))
    return out


def _reference(optimizer_factory: Any, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The embedding after each step of ``optimizer_factory([weight])`` fed ``grads``, on this one process."""
    weight = nn.Parameter(EmbNet().emb.weight.detach().clone())
    opt = optimizer_factory(weight)
    after = []
    for g in grads:
        weight.grad = g.clone()
        opt.step()
        after.append(weight.detach().clone())
    return after


def _adamw(weight: torch.Tensor) -> torch.optim.Optimizer:
    # fused: the kernel the optimizers' AdamW steps run for float32 CPU tensors
    return torch.optim.AdamW([weight], lr=LR, weight_decay=WD, fused=True)


def _assert_close(ours: list[torch.Tensor], reference: list[torch.Tensor], exact: bool, what: str) -> None:
    assert len(ours) == len(reference)
    for t, (a, b) in enumerate(zip(ours, reference), start=1):
        if exact:
            assert torch.equal(a, b), f"{what}: step {t} differs by {float((a - b).abs().max())}"
        else:  # 3 ranks: the allreduce sums in its own order, rounding differs in the last bit
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=f"{what}: step {t}")


def _assert_replicas(ranks: list[dict[str, Any]], key: str = "checksums", steps: Any = None) -> None:
    for t in range(len(ranks[0][key])) if steps is None else steps:
        assert all(torch.equal(ranks[0][key][t], r[key][t]) for r in ranks[1:]), f"replicas differ after step {t + 1}"


# ------------------------------------------------------------------------------------------------ OnebitAdam
@pytest.mark.parametrize("world_size", [2, 3])
def test_onebit_adam_uncompressed_group_is_adamw_on_averaged_gradients(
    world_size: int, session2: list[dict[str, Any]], session3: list[dict[str, Any]]
) -> None:
    ranks = [r["uncompressed"] for r in scenario_results(session2 if world_size == 2 else session3, "adam")]
    _assert_replicas(ranks)
    assert ranks[0]["averaged"] == [True] * FREEZE + [False] * (STEPS - FREEZE)
    _assert_close(ranks[0]["emb"], _reference(_adamw, _averaged_grads(ranks)), world_size == 2, "embedding")
    # the uncompressed group's variance stays live; the compressed group's is frozen from the freeze on
    for t in range(FREEZE, STEPS):
        assert not torch.equal(ranks[0]["v_emb"][t], ranks[0]["v_emb"][t - 1]), f"step {t + 1}"
        assert torch.equal(ranks[0]["v_hidden"][t], ranks[0]["v_hidden"][FREEZE - 1]), f"step {t + 1}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_onebit_adam_bytes_are_the_buckets_plus_one_full_precision_allreduce(
    world_size: int, session2: list[dict[str, Any]], session3: list[dict[str, Any]]
) -> None:
    results = scenario_results(session2 if world_size == 2 else session3, "adam")
    fp32 = ring_allreduce_bytes(EMB_NUMEL, 4, world_size)
    compressed_numel = sum(p.numel() for p in EmbNet().parameters()) - EMB_NUMEL
    for r in results:
        ours, everything = r["uncompressed"], r["compressed"]
        # the momentum buckets hold the compressed group only
        assert sum(numel for numel, _ in ours["layouts"]) == compressed_numel
        assert sum(numel for numel, _ in everything["layouts"]) == compressed_numel + EMB_NUMEL
        per_step = sum(nbytes for _, nbytes in ours["layouts"])
        for t in range(STEPS):
            k = max(0, t + 1 - FREEZE)  # compressed steps so far
            assert ours["bytes_unc"][t] == k * fp32
            assert ours["bytes"][t] == k * (per_step + fp32)
            assert everything["bytes_unc"][t] == 0


def test_rows_first_seen_after_the_freeze_train_uncompressed_and_warn_compressed(
    session2: list[dict[str, Any]],
) -> None:
    results = scenario_results(session2, "adam")
    for rank, r in enumerate(results):
        late = [emb[SEEN_ROWS:] for emb in r["uncompressed"]["emb"]]
        # weight decay only while no batch looks them up; then AdamW steps, each at most about lr
        assert torch.allclose(late[FREEZE - 1], EmbNet().emb.weight[SEEN_ROWS:].detach() * (1 - LR * WD) ** FREEZE)
        for t in range(FREEZE, STEPS):
            step = (late[t] - late[t - 1]).abs().max()
            assert torch.isfinite(late[t]).all() and 0 < step <= 2 * LR, (t, step)
        assert r["uncompressed"]["dead_warnings"] == []
        # the same rows in a compressed group: the optimizer warns (rank 0) at the first compressed step
        warned = r["compressed"]["dead_warnings"]
        if rank == 0:
            assert len(warned) == 1 and f"{(VOCAB - SEEN_ROWS) * DIM} of {EMB_NUMEL}" in warned[0], warned
            assert '"compress": False' in warned[0]
        else:
            assert warned == []


def test_overlap_on_and_off_give_the_same_bits_with_an_uncompressed_group(session2: list[dict[str, Any]]) -> None:
    results = scenario_results(session2, "overlap")
    for r in results:
        over, in_step = r["overlapped"], r["in_step"]
        assert over["started"] > 0 and in_step["started"] == 0
        assert max(over["in_flight"]) > 0
        assert not over["planned_uncompressed"] and over["planned"] > 0
        assert over["bucketed_numel"] == over["rest_numel"] == in_step["bucketed_numel"]
        assert over["bytes_unc"] == in_step["bytes_unc"] == (STEPS - FREEZE) * ring_allreduce_bytes(40 * 16 + 16, 4, 2)
        for t, (a, b) in enumerate(zip(over["after"], in_step["after"])):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"overlap on/off differ after step {t + 1}"
    for t in range(STEPS):
        assert all(torch.equal(x, y) for x, y in zip(results[0]["overlapped"]["after"][t],
                                                     results[1]["overlapped"]["after"][t]))


# ------------------------------------------------------------------------------------------------ OnebitLamb
def test_onebit_lamb_uncompressed_group_is_its_warmup_lamb_and_can_switch_on_resume(
    session2: list[dict[str, Any]],
) -> None:
    results = scenario_results(session2, "lamb")
    ranks = [r["full"] for r in results]
    _assert_replicas(ranks)

    def lamb_warmup_only(weight: torch.Tensor) -> OnebitLamb:
        return OnebitLamb([{"params": [weight], "weight_decay": WD}], lr=LR, freeze_step=10**9)

    _assert_close(ranks[0]["emb"], _reference(lamb_warmup_only, _averaged_grads(ranks)), True, "embedding (LAMB)")
    assert ranks[0]["bytes_unc"][-1] == (STEPS - FREEZE) * ring_allreduce_bytes(EMB_NUMEL, 4, 2)
    switched = [r["switched"] for r in results]
    _assert_replicas(switched)
    assert all(b == 0 for b in switched[0]["bytes_unc"])
    assert all(torch.isfinite(e).all() for e in switched[0]["emb"])
    # compressed now: its variance is frozen
    assert all(torch.equal(v, switched[0]["v_emb"][0]) for v in switched[0]["v_emb"])


# ------------------------------------------------------------------------------------------------ ZeroOneAdam
def test_zeroone_adam_uncompressed_group_steps_every_step_and_local_steps_send_its_bytes(
    session2: list[dict[str, Any]],
) -> None:
    ranks = [r["full"] for r in scenario_results(session2, "zeroone")]
    kinds = ranks[0]["kinds"]
    assert {"variance", "compressed", "local", "sync"} <= set(kinds)
    # the embedding is identical on every rank after every step, local steps included
    _assert_replicas(ranks, "emb_checksum")
    _assert_replicas(ranks, steps=[t for t, kind in enumerate(kinds) if kind != "local"])
    assert any(not torch.equal(ranks[0]["checksums"][t], ranks[1]["checksums"][t])
               for t, kind in enumerate(kinds) if kind == "local")
    _assert_close(ranks[0]["emb"], _reference(_adamw, _averaged_grads(ranks)), True, "embedding (0/1 Adam)")
    fp32 = ring_allreduce_bytes(EMB_NUMEL, 4, 2)
    for r in ranks:
        previous_unc = previous = 0
        for t, kind in enumerate(kinds):
            sent_unc, sent = r["bytes_unc"][t] - previous_unc, r["bytes"][t] - previous
            previous_unc, previous = r["bytes_unc"][t], r["bytes"][t]
            # DDP averaged every gradient on variance steps; every other step averages the embedding's itself
            assert sent_unc == (0 if r["averaged"][t] else fp32), (t + 1, kind)
            if kind == "local":
                assert sent == fp32, (t + 1, kind)
            assert r["averaged"][t] == (kind == "variance")


# ------------------------------------------------------------------------------------------------ resume
def test_resume_switching_compress_both_ways_keeps_replicas_identical(session2: list[dict[str, Any]]) -> None:
    results = scenario_results(session2, "resume_switch")
    for name in ("saved_compressed=True", "saved_compressed=False"):
        resumed = [r[name]["resumed"] for r in results]
        _assert_replicas(resumed)
        assert all(torch.isfinite(e).all() for e in resumed[0]["emb"])
        v = resumed[0]["v_emb"]
        if name == "saved_compressed=True":  # now uncompressed: the variance is live again, one allreduce a step
            assert all(not torch.equal(a, b) for a, b in zip(v[1:], v[:-1]))
            assert resumed[0]["bytes_unc"][-1] == (STEPS - 5) * ring_allreduce_bytes(EMB_NUMEL, 4, 2)
        else:  # now compressed: frozen, no full-precision bytes
            assert all(torch.equal(a, v[0]) for a in v) and resumed[0]["bytes_unc"][-1] == 0


# ------------------------------------------------------------------------------------------------ one process
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
@pytest.mark.parametrize("optimizer", [OnebitAdam, OnebitLamb])
def test_compress_must_be_a_bool(optimizer: Any, value: Any) -> None:
    net = EmbNet()
    good = {"params": [net.head.weight]}
    with pytest.raises(ValueError, match=r"compress must be True or False.*\(param group 1\)"):
        optimizer([good, {"params": [net.emb.weight], "compress": value}], freeze_step=2)
    opt = optimizer([good], freeze_step=2)
    with pytest.raises(ValueError, match=r"param group 1"):
        opt.add_param_group({"params": [net.emb.weight], "compress": value})
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["compress"] is True


def test_zeroone_adam_takes_the_group_option_beside_its_own_exchange_argument() -> None:
    net = EmbNet()
    opt = ZeroOneAdam(groups(net), exchange="gradient")
    assert opt.exchange_kind == "gradient" and [g["compress"] for g in opt.param_groups] == [False, True]
    with pytest.raises(ValueError, match=r"compress must be True or False.*\(param group 0\)"):
        ZeroOneAdam([{"params": [net.emb.weight], "compress": "momentum"}])


def test_zeroone_adam_compress_argument_is_the_deprecated_name_of_exchange() -> None:
    net = EmbNet()
    with pytest.warns(FutureWarning, match=r"pass exchange='gradient'") as record:
        opt = ZeroOneAdam(groups(net), compress="gradient")
    assert opt.exchange_kind == "gradient"
    assert record[0].filename == __file__  # the warning points at the caller
    with pytest.raises(ValueError, match=r"pass exchange only"):
        ZeroOneAdam(groups(net), exchange="gradient", compress="momentum")
    with pytest.raises(ValueError, match=r"exchange must be 'momentum' or 'gradient'"):
        ZeroOneAdam(groups(net), exchange="update")


def _single_process_run(emb_compressed: bool, steps: range, state: Any = None) -> tuple[EmbNet, OnebitAdam]:
    net = EmbNet()
    opt = OnebitAdam(groups(net, emb_compressed), lr=LR, freeze_step=2, dead_coordinates="ignore")
    if state is not None:
        net.load_state_dict(state[0])
        opt.load_state_dict(state[1])
    for t in steps:
        opt.zero_grad()
        ids, y = batch(0, t, freeze=2)
        nn.functional.mse_loss(net(ids), y).backward()
        opt.step()
    return net, opt


def test_compress_comes_from_the_code_not_the_checkpoint() -> None:
    net, opt = _single_process_run(False, range(1, 5))
    saved = opt.state_dict()
    assert all("compress" not in g for g in saved["param_groups"])
    assert [g["compress"] for g in opt.param_groups] == [False, True]  # the live groups keep it
    # a checkpoint that does say compress=False (e.g. written by hand) still yields to the code
    forged = copy.deepcopy(saved)
    forged["param_groups"][0]["compress"] = False
    for state_dict in (saved, forged):
        resumed_net, resumed = _single_process_run(
            True, range(5, 7), state=(net.state_dict(), copy.deepcopy(state_dict)))
        assert [g["compress"] for g in resumed.param_groups] == [True, True]
        numel = sum(layout.numel for layout in resumed.bucket_layouts().values())
        assert numel == sum(p.numel() for p in resumed_net.parameters())  # the embedding is bucketed again
    # and the other way: saved compressed, resumed uncompressed
    net, opt = _single_process_run(True, range(1, 5))
    _, resumed = _single_process_run(False, range(5, 7), state=(net.state_dict(), copy.deepcopy(opt.state_dict())))
    assert [g["compress"] for g in resumed.param_groups] == [False, True]
    assert sum(layout.numel for layout in resumed.bucket_layouts().values()) == sum(
        p.numel() for p in net.parameters()) - EMB_NUMEL


def test_describe_phase_mentions_uncompressed_groups() -> None:
    _, opt = _single_process_run(False, range(1, 3))
    assert "compress=False" in opt.describe_phase()[1]
    _, opt = _single_process_run(True, range(1, 3))
    assert "compress=False" not in opt.describe_phase()[1]


# ------------------------------------------------------------------------------------------------ MomentumMask
def test_momentum_mask_auto_skips_uncompressed_groups(caplog: pytest.LogCaptureFixture) -> None:
    net = EmbNet()
    opt = OnebitAdam(groups(net), lr=LR, freeze_step=1)
    strategy = OnebitStrategy()
    strategy._onebit_optimizer = opt
    trainer = types.SimpleNamespace(strategy=strategy)
    callback = MomentumMask(auto=True)
    callback.setup(trainer, net, "fit")
    callback.on_fit_start(trainer, net)
    assert "emb.weight" not in callback._seen_nonzero and "hidden.weight" in callback._seen_nonzero
    assert opt.masks.masked_by == "MomentumMask(auto=True)"  # the optimizer does not warn too
    # a saved auto mask of the embedding (from a run where it was compressed) is not applied now: no mask, no warning
    unseen = torch.ones(VOCAB, DIM)
    unseen[SEEN_ROWS:] = 0
    callback._restored_auto = {"emb.weight": unseen, "head.bias": torch.ones(1)}
    with caplog.at_level(logging.INFO), warnings.catch_warnings():
        warnings.simplefilter("error")
        callback._install(opt, net)
    assert opt.param_groups[0]["exp_avg_mask"] == [None] and callback.masked_coordinates == {}
    assert "emb.weight is not applied: its param group has compress=False" in caplog.text


def test_momentum_mask_warning_names_compress_false_as_the_remedy() -> None:
    net = EmbNet()
    opt = OnebitAdam(groups(net, emb_compressed=True), lr=LR, freeze_step=1)
    callback = MomentumMask(auto=True)
    seen = torch.ones(VOCAB, DIM, dtype=torch.bool)
    seen[SEEN_ROWS:] = False
    callback._seen_nonzero = {"emb.weight": seen}
    with pytest.warns(UserWarning, match=r'a param group with "compress": False') as caught:
        callback._install(opt, net)
    assert '"sparse_rows": True' in str(caught[0].message)  # the cheap exact form for an embedding table
    assert callback.masked_coordinates == {"emb.weight": (VOCAB - SEEN_ROWS) * DIM}


def test_explicit_masks_apply_to_uncompressed_groups_in_the_compression_stage() -> None:
    """An explicit mask zeroes the uncompressed group's momentum after the gradient is folded in (as it zeroes the
    compressed groups' averaged momentum), so masked rows move only by weight decay; warmup ignores masks."""
    net = EmbNet()
    mask = torch.ones(VOCAB, DIM)
    mask[:2] = 0
    opt = OnebitAdam([dict(groups(net)[0], exp_avg_mask=[mask]), groups(net)[1]], lr=LR, freeze_step=2)
    before = None
    for t in range(1, 6):
        opt.zero_grad()
        ids, y = batch(0, t, freeze=0)
        nn.functional.mse_loss(net(ids), y).backward()
        if t == 3:
            before = net.emb.weight.detach()[:2].clone()
        opt.step()
        if t >= 3:
            assert torch.equal(opt.state[net.emb.weight]["exp_avg"][:2], torch.zeros(2, DIM))
    # three compressed steps of pure weight decay (momentum exactly 0 there)
    expected = before
    for _ in range(3):
        expected = expected * (1 - LR * WD)
    torch.testing.assert_close(net.emb.weight.detach()[:2], expected, rtol=1e-6, atol=0)
