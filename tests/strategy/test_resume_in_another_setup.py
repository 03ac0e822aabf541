"""Checkpoints resumed in another setup (issue 25, faults 6 and 7, and the sidecars' file mode), on 2 gloo ranks.

* Fault 6: a checkpoint saved with ``overlap=False`` (momenta packed by ``bucket_cap_mb``: one bucket here) resumed with
  ``overlap=True``: the error feedback is restored from the sidecars in the packed layout, and one step later the
  overlap hook lays the momenta out like DDP's buckets (two here). That used to reset the error feedback (logged at
  info level only) after the log had said "restored on every rank", under ``keep`` and ``require`` alike. Now the
  worker and server errors are carried into the new layout coordinate by coordinate: the test compares, per
  parameter element, every rank's worker error and the servers' errors (their chunks put together) just before and
  just after the layout change.
* Fault 7: a OnebitAdam checkpoint resumed with OnebitLamb logged "restored on every rank" and died at the first step
  with a bare ``KeyError: 'lamb_coeff'``. Now loading the optimizer state raises ``ValueError`` on every rank, before
  any step, naming both optimizers. A OnebitAdam checkpoint resumed with ZeroOneAdam trains on, with a warning naming
  both.
* Sidecars were written with mode 0600 next to a 0644 checkpoint; now with the checkpoint's bits, and a sidecar that
  exists but cannot be read says so (permission, mode, owner, fix).
"""

from __future__ import annotations

import builtins
import os
from typing import Any

import pytest
import torch
from torch import nn

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning_onebit import ErrorFeedbackCheckpoint, OnebitAdam, OnebitStrategy, OnebitLamb, ZeroOneAdam
from lightning_onebit.strategy import sidecar
from lightning_onebit.optim.base import CompressedOptimizer
from lightning_onebit.strategy.sidecar import read_sidecar, sidecar_path, write_sidecar
from tests.capture import capture_logs, capture_warnings
from tests.distributed import run_distributed, run_scenarios, scenario_results
from tests.lightning_models import Regressor, flat_params, loader, trainer_kwargs

WORLD_SIZE = 2
FREEZE, BATCHES = 3, 3  # the epoch-1 checkpoint is after 3 compressed steps (4, 5, 6)
BUCKET_CAP_MB = 40 / 2**20  # two DDP gradient buckets for the Regressor; overlap=False packs it into one
_RESTORED = "restored on every rank"


class LambRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return OnebitLamb(self.parameters(), lr=self.lr, freeze_step=self.freeze_step)


class ZeroOneRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return ZeroOneAdam(self.parameters(), lr=self.lr, var_freeze_step=4, var_update_scaler=2)


def _fit(rank: int, model: pl.LightningModule, overlap: Any, callbacks: list, max_epochs: int,
         ckpt_path: Any = None, **trainer: Any) -> dict[str, Any]:
    strategy = OnebitStrategy(overlap=overlap, ddp_bucket_cap_mb=BUCKET_CAP_MB)
    t = pl.Trainer(**trainer_kwargs(WORLD_SIZE, -1, max_epochs=max_epochs, strategy=strategy, callbacks=callbacks,
                                    **trainer))
    error = None
    with capture_logs() as logs, capture_warnings() as warned:
        try:
            t.fit(model, loader(rank, BATCHES), ckpt_path=ckpt_path)
        except Exception as err:  # noqa: BLE001 - the tests check the type and the text
            error = (type(err).__name__, str(err))
    return dict(error=error, logs=logs, warnings=warned, losses=list(model.losses), final=flat_params(model))


def _snapshot(opt: CompressedOptimizer) -> dict[str, Any]:
    """This rank's error buffers and the buckets they belong to (parameters as indices in the optimizer's order)."""
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    built = opt.momentum_buckets.built
    buckets = [] if built is None else [(b.key, [index[id(p)] for p in b.params]) for b in built]
    state = opt.error_feedback_state_dict()
    return dict(
        buckets=buckets,
        errors={key: (e["worker_error"].clone(), e["server_error"].clone()) for key, e in state["buckets"].items()},
        step=opt.step_count,
    )


def scenario_checkpoints(rank: int, world_size: int, workdir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = os.path.join(workdir, "base")
    checkpoint = ModelCheckpoint(dirpath=base, filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    out["base"] = _fit(rank, Regressor(freeze_step=FREEZE, data_seed=5), False,
                       [ErrorFeedbackCheckpoint("keep"), checkpoint], max_epochs=2, enable_checkpointing=True)
    path = os.path.join(base, "epoch=1.ckpt")
    torch.distributed.barrier()
    out["modes"] = dict(checkpoint=os.stat(path).st_mode & 0o777,
                        sidecars=[os.stat(sidecar_path(path, r)).st_mode & 0o777 for r in range(world_size)])

    # ---- fault 6: resumed with overlap=True; every layout change recorded around the optimizer's plan install
    original = CompressedOptimizer._install_plan

    def recording(self: CompressedOptimizer, plan: Any) -> None:
        before = _snapshot(self)
        original(self, plan)
        self._relayouts.append(dict(before=before, after=_snapshot(self)))

    for policy in ("require", "keep"):
        callback = ErrorFeedbackCheckpoint(policy)
        model = Regressor(freeze_step=FREEZE, data_seed=5, seed=99)
        CompressedOptimizer._install_plan = recording
        CompressedOptimizer._relayouts = []
        try:
            result = _fit(rank, model, True, [callback], max_epochs=3, ckpt_path=path)
        finally:
            CompressedOptimizer._install_plan = original
            result["relayouts"] = CompressedOptimizer.__dict__.get("_relayouts", [])
            del CompressedOptimizer._relayouts
        result["restored"] = callback.restored
        out[policy] = result

    # ---- fault 7: the OnebitAdam checkpoint resumed with OnebitLamb, then with ZeroOneAdam
    out["lamb"] = _fit(rank, LambRegressor(freeze_step=FREEZE, data_seed=5), False, [ErrorFeedbackCheckpoint("keep")],
                       max_epochs=3, ckpt_path=path)
    out["zeroone"] = _fit(rank, ZeroOneRegressor(freeze_step=FREEZE, data_seed=5), False, [], max_epochs=3,
                          ckpt_path=path)
    return out


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    workdir = str(tmp_path_factory.mktemp("hostile"))
    return run_distributed(run_scenarios, WORLD_SIZE, (("checkpoints", scenario_checkpoints),), workdir,
                           timeout_s=300)


def _per_parameter(snapshots: list[dict[str, Any]]) -> tuple[list[dict[int, torch.Tensor]], dict[int, torch.Tensor]]:
    """Per rank, each parameter's worker error; and each parameter's server error, the ranks' chunks put together
    (flat exchange: rank r serves chunk r of each bucket's padded buffer)."""
    workers: list[dict[int, torch.Tensor]] = []
    servers: dict[int, torch.Tensor] = {}
    for snap in snapshots:
        worker_of: dict[int, torch.Tensor] = {}
        for key, params in snap["buckets"]:
            worker = snap["errors"][key][0]
            servers_full = torch.cat([s["errors"][key][1] for s in snapshots])
            offset = 0
            for i in params:
                n = _NUMELS[i]
                worker_of[i] = worker[offset : offset + n]
                servers[i] = servers_full[offset : offset + n]
                offset += n
        workers.append(worker_of)
    return workers, servers


_NUMELS = [p.numel() for p in Regressor().parameters()]


# ------------------------------------------------------------------------------------------------ fault 6
@pytest.mark.parametrize("policy", ["require", "keep"])
def test_layout_change_after_resume_carries_the_error_feedback_coordinate_by_coordinate(
    session: list[dict[str, Any]], policy: str
) -> None:
    results = scenario_results(session, "checkpoints")
    runs = [r[policy] for r in results]
    for rank, run in enumerate(runs):
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert run["restored"] is True
        assert len(run["losses"]) == BATCHES  # the third epoch: steps 7, 8, 9
        assert not any("error feedback reset" in m for m in run["logs"] + run["warnings"]), run["logs"]
    assert any(_RESTORED in m for m in runs[0]["logs"])
    assert torch.equal(runs[0]["final"], runs[1]["final"]), "replicas differ"
    changes = [run["relayouts"] for run in runs]
    assert len(changes[0]) == len(changes[1]) == 1, "expected one layout change (packed -> DDP's buckets)"
    before = [c[0]["before"] for c in changes]
    after = [c[0]["after"] for c in changes]
    assert before[0]["errors"] and after[0]["errors"], "the error feedback was dropped at the layout change"
    assert len(before[0]["buckets"]) == 1 and len(after[0]["buckets"]) == 2, (before[0]["buckets"], after[0]["buckets"])
    assert before[0]["step"] == 2 * BATCHES + 1  # after the first resumed (compressed) step
    workers_before, servers_before = _per_parameter(before)
    workers_after, servers_after = _per_parameter(after)
    assert sorted(servers_before) == sorted(servers_after) == list(range(len(_NUMELS)))
    assert sum(float(t.norm()) for t in servers_before.values()) > 0
    for rank in range(WORLD_SIZE):  # a one-element segment (l2.bias) compresses exactly: its error stays zero
        assert sum(float(t.norm()) for t in workers_before[rank].values()) > 0
    for i in range(len(_NUMELS)):
        for rank in range(WORLD_SIZE):
            assert torch.equal(workers_after[rank][i], workers_before[rank][i]), f"rank {rank}, parameter {i}: worker"
        assert torch.equal(servers_after[i], servers_before[i]), f"parameter {i}: server error not carried"


# ------------------------------------------------------------------------------------------------ fault 7
def test_onebit_adam_checkpoint_resumed_with_lamb_is_a_clear_error_before_any_step(
    session: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(scenario_results(session, "checkpoints")):
        run = result["lamb"]
        assert run["error"] is not None and run["error"][0] == "ValueError", f"rank {rank}: {run['error']}"
        message = run["error"][1]
        assert "written by OnebitAdam" in message and "read by OnebitLamb" in message, message
        assert "lamb_coeff" in message and "Resume with the optimizer that wrote it" in message
        assert run["losses"] == [], f"rank {rank} took a training step"
        assert not any(_RESTORED in m for m in run["logs"])


def test_onebit_adam_checkpoint_resumed_with_zeroone_adam_warns_and_trains(session: list[dict[str, Any]]) -> None:
    results = scenario_results(session, "checkpoints")
    for rank, result in enumerate(results):
        run = result["zeroone"]
        assert run["error"] is None, f"rank {rank}: {run['error']}"
        assert len(run["losses"]) == BATCHES
    warned = [m for m in results[0]["zeroone"]["warnings"] if "written by OnebitAdam and is read by ZeroOneAdam" in m]
    assert len(warned) == 1, results[0]["zeroone"]["warnings"]
    assert torch.equal(results[0]["zeroone"]["final"], results[1]["zeroone"]["final"])


@pytest.mark.parametrize(
    "writer, reader, outcome",
    [
        (OnebitAdam, OnebitLamb, "written by OnebitAdam and is read by OnebitLamb"),
        (ZeroOneAdam, OnebitLamb, "written by ZeroOneAdam and is read by OnebitLamb"),
        (OnebitLamb, OnebitAdam, "written by OnebitLamb and is read by OnebitAdam"),
        (OnebitLamb, ZeroOneAdam, "written by OnebitLamb and is read by ZeroOneAdam"),
        (torch.optim.AdamW, OnebitLamb, "written by a torch.optim optimizer (e.g. AdamW) and is read by OnebitLamb"),
        (OnebitAdam, ZeroOneAdam, None),
        (ZeroOneAdam, OnebitAdam, None),
        (torch.optim.AdamW, OnebitAdam, None),
    ],
)
def test_optimizer_state_names_its_writer_and_reader(writer: type, reader: type, outcome: Any) -> None:
    """Plain ``optimizer.load_state_dict`` (what Lightning calls on every rank): a state the reader cannot continue
    from raises before anything is loaded; OnebitAdam <-> ZeroOneAdam carry the Adam moments with a warning."""

    def make(cls: type, net: nn.Module) -> torch.optim.Optimizer:
        if cls is ZeroOneAdam:
            return cls(net.parameters(), lr=1e-2, var_freeze_step=4, var_update_scaler=2)
        if cls is torch.optim.AdamW:
            return cls(net.parameters(), lr=1e-2)
        return cls(net.parameters(), lr=1e-2, freeze_step=2)

    def train(net: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for i in steps:
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()

    torch.manual_seed(0)
    net = nn.Linear(4, 2)
    train(net, make(writer, net), range(5))
    saved = make(writer, net)
    train(net, saved, range(5))
    state = saved.state_dict()
    opt = make(reader, net)
    if outcome is not None:
        with pytest.raises(ValueError, match=outcome.replace("(", r"\(").replace(")", r"\)")):
            opt.load_state_dict(state)
        assert opt.step_count == 0 and not opt.state  # nothing loaded
        return
    with capture_warnings() as warned:
        opt.load_state_dict(state)
    mixes = [m for m in warned if f"is read by {reader.__name__}" in m]
    assert len(mixes) == (0 if writer is torch.optim.AdamW else 1), warned
    assert opt.step_count == 5
    assert all(set(s) <= {"exp_avg", "exp_avg_sq"} for s in opt.state.values())
    train(net, opt, range(5, 8))  # the compression stage runs on the carried state


def test_old_checkpoints_without_the_writer_are_recognised() -> None:
    """States written before the writer was recorded: recognised from their contents."""
    net = nn.Linear(4, 2)
    lamb = OnebitLamb(net.parameters(), lr=1e-2, freeze_step=2)
    for i in range(4):
        lamb.zero_grad()
        net(torch.randn(8, 4)).pow(2).mean().backward()
        lamb.step()
    state = lamb.state_dict()
    assert state["onebit"].pop("optimizer") == "OnebitLamb"
    OnebitLamb(net.parameters(), lr=1e-2, freeze_step=2).load_state_dict(state)  # its own: fine
    with pytest.raises(ValueError, match="written by OnebitLamb and is read by OnebitAdam"):
        OnebitAdam(net.parameters(), lr=1e-2, freeze_step=2).load_state_dict(state)


# ------------------------------------------------------------------------------------------------ sidecar mode
def test_sidecars_get_the_checkpoints_permission_bits(session: list[dict[str, Any]]) -> None:
    modes = scenario_results(session, "checkpoints")[0]["modes"]
    mask = os.umask(0o022)
    os.umask(mask)
    umask_default = 0o666 & ~mask
    assert modes["checkpoint"] == umask_default
    assert modes["sidecars"] == [modes["checkpoint"]] * WORLD_SIZE, {k: oct(v) if isinstance(v, int) else v
                                                                      for k, v in modes.items()}


def test_write_sidecar_follows_the_umask(tmp_path: Any) -> None:
    old = os.umask(0o027)
    try:
        path = str(tmp_path / "a.ckpt.onebit-rank0")
        write_sidecar(path, {"checkpoint_id": "x", "rank": 0, "world_size": 1}, {"v": torch.ones(2)})
        assert os.stat(path).st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
    state, reason = read_sidecar(path, {"checkpoint_id": "x", "rank": 0, "world_size": 1})
    assert reason is None and torch.equal(state["v"], torch.ones(2))


def test_a_sidecar_present_but_unreadable_says_permission_denied(tmp_path: Any, monkeypatch: Any) -> None:
    path = str(tmp_path / "a.ckpt.onebit-rank0")
    write_sidecar(path, {"checkpoint_id": "x", "rank": 0, "world_size": 1}, {"v": torch.ones(2)})
    os.chmod(path, 0o600)

    def denied(file: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(file) == path:
            raise PermissionError(13, "Permission denied", path)
        return builtins.open(file, *args, **kwargs)

    # as root (where tests often run) a 0600 file is readable: the refusal the colleague's process gets is simulated
    monkeypatch.setattr(sidecar, "open", denied, raising=False)
    state, reason = read_sidecar(path, {"checkpoint_id": "x", "rank": 0, "world_size": 1})
    assert state is None
    assert "permission denied" in reason and "mode 0600" in reason and "chmod a+r" in reason, reason


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() == 0, reason="root reads any file")
def test_a_sidecar_without_read_permission_is_a_reason_not_a_crash(tmp_path: Any) -> None:
    path = str(tmp_path / "a.ckpt.onebit-rank0")
    write_sidecar(path, {"checkpoint_id": "x", "rank": 0, "world_size": 1}, {"v": torch.ones(2)})
    os.chmod(path, 0o000)
    state, reason = read_sidecar(path, {"checkpoint_id": "x", "rank": 0, "world_size": 1})
    assert state is None and "permission denied" in reason


# ------------------------------------------------------------------------------------- fault 6, without Lightning
def _relayout_on_four_ranks(rank: int, world_size: int) -> dict[str, Any]:
    """4 ranks, flat and as 2 nodes x 2: a few compressed steps packed in one bucket, then a bucket plan that moves
    every parameter to another offset, bucket and chunk; the error feedback before and after."""
    from lightning_onebit import Topology

    out: dict[str, Any] = {}
    for mode in ("flat", "hierarchical"):
        topology = Topology.build(rank // 2, rank % 2, mode=mode)
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        opt = OnebitAdam(net.parameters(), lr=1e-2, freeze_step=2, topology=topology)
        for i in range(5):
            x = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 * rank + i))
            opt.zero_grad()
            net(x).pow(2).mean().backward()
            opt.step()
        before = _snapshot(opt)
        w1, b1, w2, b2 = net.parameters()
        opt.set_bucket_plan([[w2, b1], [w1, b2]])
        after = _snapshot(opt)
        # a layer frozen in the compression stage: the step's exchange rebuilds the buckets without w1 first
        w1.requires_grad_(False)
        opt._ensure_buckets(carry=True)
        frozen = _snapshot(opt)
        out[mode] = dict(before=before, after=after, frozen=frozen,
                         local=topology.local_index if mode != "flat" else 0,
                         inter=topology.inter_index if mode != "flat" else rank, hierarchical=topology.is_hierarchical)
    return out


def _full_vectors(snaps: list[dict[str, Any]], key: Any, hierarchical: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per rank, the worker error over the bucket's whole padded buffer (hierarchical: its node's, the node's shards
    put together); the servers' error over the whole buffer (chunk l * M + m is served by local l of node m)."""
    world = len(snaps)
    if not hierarchical:
        return [s["errors"][key][0] for s in snaps], torch.cat([s["errors"][key][1] for s in snaps])
    per_node, nodes = 2, world // 2
    place = {(s["local"], s["inter"]): r for r, s in enumerate(snaps)}
    node_worker = {m: torch.cat([snaps[place[(l, m)]]["errors"][key][0] for l in range(per_node)])
                   for m in range(nodes)}
    server = torch.cat([snaps[place[divmod(k, nodes)]]["errors"][key][1] for k in range(world)])
    return [node_worker[s["inter"]] for s in snaps], server


def test_relayout_carries_the_error_feedback_flat_and_hierarchical() -> None:
    results = run_distributed(_relayout_on_four_ranks, 4, timeout_s=180)
    numels = [30, 5, 15, 3]
    for mode in ("flat", "hierarchical"):
        per_param: dict[str, list] = {"before": [], "after": [], "frozen": []}
        for when in ("before", "after", "frozen"):
            snaps = [dict(r[mode][when], local=r[mode]["local"], inter=r[mode]["inter"]) for r in results]
            assert snaps[0]["errors"], f"{mode} {when}: no error feedback"
            workers_of: list[dict[int, torch.Tensor]] = [{} for _ in results]
            servers_of: dict[int, torch.Tensor] = {}
            for key, params in snaps[0]["buckets"]:
                workers, server = _full_vectors(snaps, key, results[0][mode]["hierarchical"])
                offset = 0
                for i in params:
                    for r in range(len(results)):
                        workers_of[r][i] = workers[r][offset : offset + numels[i]]
                    servers_of[i] = server[offset : offset + numels[i]]
                    offset += numels[i]
            per_param[when] = [workers_of, servers_of]
        assert len(results[0][mode]["before"]["buckets"]) == 1 and len(results[0][mode]["after"]["buckets"]) == 2
        (wb, sb), (wa, sa) = per_param["before"], per_param["after"]
        assert sum(float(t.norm()) for t in sb.values()) > 0 and sum(float(t.norm()) for t in wb[0].values()) > 0
        for i in range(4):
            assert torch.equal(sa[i], sb[i]), f"{mode}: parameter {i}'s server error not carried"
            for r in range(len(results)):
                assert torch.equal(wa[r][i], wb[r][i]), f"{mode}: rank {r}, parameter {i}'s worker error not carried"
        # freezing w1 (parameter 0) keeps the error of the parameters that stay in the buckets
        wf, sf = per_param["frozen"]
        assert 0 not in sf and sorted(sf) == [1, 2, 3], f"{mode}: buckets after the freeze hold {sorted(sf)}"
        for i in (1, 2, 3):
            assert torch.equal(sf[i], sb[i]), f"{mode}: parameter {i}'s server error lost when w1 was frozen"
            for r in range(len(results)):
                assert torch.equal(wf[r][i], wb[r][i]), f"{mode}: rank {r}, parameter {i}'s worker error lost (freeze)"
