"""Simulated 2 nodes x 2 ranks on one host: flat vs topology-aware ("hierarchical") 1-bit compression, shaped link.

For each ``--rates`` entry the benchmark (as root) builds a two-node "cluster" out of two network namespaces joined
by a veth pair (``benchmarks.netns.VethPair``): node k is namespace ``mn<pid>r<i>n<k>`` with the veth end ``v<k>`` at
10.77.<i>.<k+1>/24 and ``lo`` up; both veth ends are shaped with ``tc qdisc add dev v<k> root tbf rate RATE burst
256kb latency 50ms``. Traffic between the two ranks of a node goes over that namespace's (unshaped) loopback; only
inter-node traffic crosses the veth. In each namespace it runs ``python -m torch.distributed.run --nnodes 2
--nproc-per-node 2 --node-rank k --master-addr 10.77.<i>.1 ... -m benchmarks.multinode --worker ...`` from the
repository root, with ``GLOO_SOCKET_IFNAME=v<k>`` and ``OMP_NUM_THREADS=1``. ``--ranks-per-node 1`` runs one
process per node instead (the flat layout: each process has a core of its own on a 2-core host, and the local steps'
replica is that one rank, with no DDP inside it; ``onebit_flat`` is then the 1-bit Adam to compare with). Namespaces and links are removed
afterwards, with anything still running in them, also on errors, Ctrl-C and SIGTERM (a SIGKILL of the benchmark
cannot be caught: then ``ip netns list`` shows the ``mn<pid>...`` names to delete by hand).

The workers train the BERT of ``benchmarks.slow_link`` (``build_model``, ``RandomBatches``, its optimizer settings,
and its model settings with their defaults, ``slow_link.model_config``: ``--model minilm``, 6 layers / hidden 384,
batch 16 x seq 64 per rank) with plain ``torch.nn.parallel.DistributedDataParallel`` (gloo, one torch thread per
rank, ``broadcast_buffers=False``: BERT's buffers are constant position / token-type ids), per method:

  ddp_fp32             DDP's own fp32 allreduce + torch.optim.AdamW (slow_link's implementation, fused)
  onebit_flat          DDP + switchable_allreduce_hook + OnebitAdam(freeze_step=W, topology=Topology.build(...,
                       mode="flat")); W warmup steps untimed, timed in the compression stage only
  onebit_hierarchical  the same with mode="hierarchical"
  fsdp_adamw           FSDP2 (``fully_shard`` of every encoder layer, then the model) over each node's 2 ranks, the
                       replica all-reduce hook (``lightning_onebit.hooks.fsdp``) averaging each gradient shard across
                       nodes in fp32 every step, torch.optim.AdamW (foreach) on the shards
  fsdp_onebit          the same sharding, OnebitAdam(freeze_step=W) over the replicate group with one momentum bucket
                       per FSDP group (``onebit_fsdp``'s layout): the replica all-reduce in warmup only, then the 1-bit
                       exchange of each rank's momentum shard across nodes, in ``step``; W warmup steps untimed
  fsdp_onebit_overlap  the same, each FSDP group's exchange started during backward
                       (``lightning_onebit.hooks.fsdp.ShardedOverlapState``, ``onebit_fsdp``'s default)
  ddp_powersgd         DDP + torch's PowerSGD (rank 4, start_powerSGD_iter=W, its buckets compressed in order:
                       ``lightning_onebit.hooks.ordered_powersgd_hook``) + AdamW; W plain steps untimed
  local_steps          ``onebit_diloco``'s engine with its defaults: each node is a replica whose 2 ranks average
                       gradients by DDP over the node's group (loopback), AdamW inner steps, and every
                       ``--sync-every`` (its default) inner steps ``lightning_onebit.optim.outer_step.OuterStep``
                       (the 1-bit outer step, outer SGD at its default lr): rank l of each node exchanges shard l
                       across nodes, the new shards are all-gathered in the node. Its figure is the MEAN step over a
                       whole number of periods (the median would hide the syncs): ``--steps`` is rounded up to a
                       multiple of ``--sync-every``
  local_steps_overlap  the same with ``--overlap-steps`` (1) inner steps running while each exchange is in flight
                       and ``--fragments`` (1) fragments (``OnebitDiLoCoStrategy(overlap_steps=, fragments=)``)
  local_4proc          every process trains its own replica, no communication (compute reference under the same
                       4-process load on this host's cores: the no-communication floor)

Per method: ``--untimed`` steps, then ``--steps`` timed steps, each after a barrier; a step's time is the slowest
rank's, the figure is the median over the timed steps.

Bytes that cross the link per node per step (inter-node, each direction; "node k" = what leaves it on v<k>):
  * counters: the sum over the node's two ranks of ``CommunicationCounters.bytes_sent_inter_node`` over the timed
    steps (OnebitAdam.communication plus the GradientSyncState hook's counters, which stay at 0 in the compression
    stage), divided by the step count. For ddp_fp32 it is analytic: gloo's ring allreduce over ranks 0..3 (ranks of a
    node are consecutive) crosses each node boundary once per direction, so one rank per node sends its whole ring
    share off the node: ``2 (P-1)/P * 4N`` (``ring_allreduce_bytes``);
  * veth: the kernel's counters of the veth end, read by this (parent) process before and after each method's timed
    steps while the workers wait (global rank 0 writes a marker file into a shared temporary directory and waits for
    the parent's acknowledgement; all ranks are held by a barrier around that). Two figures: the tbf qdisc's "Sent"
    bytes (``tc -s qdisc show dev v<k>``: IP packets with TCP/IP headers, each GSO segment's headers counted) and the
    link's tx bytes (``ip -s link show v<k>``: with Ethernet headers, but a GSO super-packet's headers only once).
    Both include the TCP ACKs a node sends for the data it receives and the gloo barriers inside the window
    (``steps + 2`` of them). A calibration window of ``--calibration-barriers`` bare barriers at the start of every
    launch measures one barrier's bytes; the "corrected" figure subtracts the window's barriers.
  * formula (N = parameter count, P = M nodes x L ranks): fp32 ring ``2(P-1)/P 4N``; flat 1-bit
    ``L(P-L)N/(8P) + (P-1)N/(8P)`` (all_to_all + ring all_gather); hierarchical 1-bit ``2(M-1)/M N/8``; also tabulated
    at 2, 4 and 16 nodes x 8 ranks.

Results go to results/<--name>.json (default results/multinode.json); ``python -m benchmarks.result_tables``
renders them. Run from the repository root, as root:

    python -m benchmarks.multinode                                   # 200mbit and 50mbit, the full model
    python -m benchmarks.multinode --rates 200mbit --layers 1 --hidden 64 --steps 3 --name multinode_small
    python -m benchmarks.multinode --methods ddp_fp32 local_4proc    # without the 1-bit methods
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from benchmarks import netns
from benchmarks.common import ROOT, argument_parser, module_command

METHODS = ("ddp_fp32", "onebit_flat", "onebit_hierarchical", "fsdp_adamw", "fsdp_onebit", "fsdp_onebit_overlap",
           "ddp_powersgd", "local_steps", "local_steps_overlap", "local_4proc")
FSDP_METHODS = ("fsdp_adamw", "fsdp_onebit", "fsdp_onebit_overlap")
FSDP_ONEBIT = ("fsdp_onebit", "fsdp_onebit_overlap")
ONEBIT_MODES = {"onebit_flat": "flat", "onebit_hierarchical": "hierarchical"}
NODES, RANKS_PER_NODE = netns.VETH_NODES, 2
MASTER_PORT = 29611
FORMULA_NODES, FORMULA_RANKS_PER_NODE = (2, 4, 16), 8
MODEL_FLAGS = ("model", "layers", "hidden", "heads", "batch", "seq", "vocab", "adamw")  # slow_link.model_config's


# ---------------------------------------------------------------------------------------------------- formulas
def formula_bytes_per_node(n: int, nodes: int, ranks_per_node: int) -> dict[str, float]:
    """Payload bytes leaving each node per step for N = ``n`` parameters (``lightning_onebit.comm.bytes_leaving_node``;
    ``fp32_hierarchical``, Horovod's hierarchical fp32 allreduce, ``2(M-1)/M 4N``, for reference)."""
    from lightning_onebit.comm import bytes_leaving_node

    return dict(
        fp32_ring=bytes_leaving_node(n, nodes, ranks_per_node, "fp32_ring"),
        fp32_hierarchical=2 * (nodes - 1) / nodes * 4 * n,
        onebit_flat=bytes_leaving_node(n, nodes, ranks_per_node, "flat"),
        onebit_hierarchical=bytes_leaving_node(n, nodes, ranks_per_node, "hierarchical"),
    )


METHOD_FORMULA = dict(ddp_fp32="fp32_ring", onebit_flat="onebit_flat", onebit_hierarchical="onebit_hierarchical",
                      fsdp_adamw="fp32_hierarchical", fsdp_onebit="onebit_hierarchical",
                      fsdp_onebit_overlap="onebit_hierarchical")
#: the methods whose step time is the mean over the timed steps (their communication is not the same every step)
MEAN_METHODS = ("local_steps", "local_steps_overlap")


def formula_table(n: int) -> list[dict[str, Any]]:
    rows = []
    for m in FORMULA_NODES:
        f = formula_bytes_per_node(n, m, FORMULA_RANKS_PER_NODE)
        rows.append(dict(nodes=m, ranks_per_node=FORMULA_RANKS_PER_NODE, bytes=f,
                         per_parameter={k: v / n for k, v in f.items()}))
    return rows


# ---------------------------------------------------------------------------------------------------- worker side
class Windows:
    """Measurement windows: the parent reads the veth counters at each window's begin and end while all ranks wait.

    Global rank 0 writes ``<seq>_<name>_<phase>.mark`` (JSON) into the shared directory and waits for the parent's
    ``.ok``; the other ranks wait in a barrier. Inside a window there are ``2 + (barriers issued by the caller)``
    barriers: the one after the begin handshake and the one before the end handshake."""

    def __init__(self, sync_dir: Path, rank: int, parent_pid: int, timeout: float) -> None:
        self.sync_dir, self.rank, self.parent_pid, self.timeout = sync_dir, rank, parent_pid, timeout
        self.seq = 0

    def _handshake(self, name: str, phase: str, info: dict) -> None:
        import torch.distributed as dist

        dist.barrier()
        if self.rank == 0:
            stem = f"{self.seq:03d}_{name}_{phase}"
            self.seq += 1
            tmp = self.sync_dir / f"{stem}.tmp"
            tmp.write_text(json.dumps(dict(window=name, phase=phase, info=info)))
            tmp.rename(self.sync_dir / f"{stem}.mark")
            ok = self.sync_dir / f"{stem}.ok"
            deadline = time.monotonic() + self.timeout
            while not ok.exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no acknowledgement of {stem} from the parent in {self.timeout:.0f} s")
                try:
                    os.kill(self.parent_pid, 0)
                except ProcessLookupError:
                    raise RuntimeError("the parent process is gone") from None
                time.sleep(0.005)
        dist.barrier()

    @contextlib.contextmanager
    def __call__(self, name: str, end_info: Optional[dict] = None) -> Iterator[dict]:
        info = {} if end_info is None else end_info
        self._handshake(name, "begin", {})
        yield info  # the caller may fill ``info`` (sent with the end marker, printed by the parent)
        self._handshake(name, "end", info)


def _counter_dict(c: Any) -> dict[str, float]:
    return {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}


def _sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a[k] - b[k] for k in a}


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.slow_link import LR, WEIGHT_DECAY, RandomBatches, build_model, make_adamw, model_config_of
    from lightning_onebit import OnebitAdam, Topology
    from lightning_onebit.hooks import GradientSyncState, switchable_allreduce_hook

    torch.set_num_threads(1)
    sync_dir = Path(args.sync_dir)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    node_rank, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    (sync_dir / f"pid.{rank}").write_text(str(os.getpid()))
    cfg = model_config_of(args)
    W, U, N = args.warmup_steps, args.untimed, args.steps
    windows = Windows(sync_dir, rank, args.parent_pid, args.collective_timeout)
    out: dict[str, Any] = dict(rank=rank, node_rank=node_rank, local_rank=local_rank, world_size=world_size,
                               pid=os.getpid(), methods={})

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.strftime('%H:%M:%S')}] rank 0: {msg}", flush=True)

    with windows("barriers"):
        for _ in range(args.calibration_barriers):
            dist.barrier()

    def steps(model, opt, batches, n: int, meter=None, before_backward=None) -> dict[str, Any]:
        times, losses = [], []
        before = meter() if meter else None
        for _ in range(n):
            batch = batches()
            dist.barrier()
            t0 = time.perf_counter()
            loss = model(**batch).loss
            if before_backward is not None:
                before_backward()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t0)
            losses.append(float(loss.detach()))
        counters = {k: _sub(v, before[k]) for k, v in meter().items()} if meter else {}
        return dict(times_s=times, losses=losses, counters=counters)

    for method in args.methods:
        started = time.perf_counter()
        batches = RandomBatches(cfg, rank)
        model = build_model(cfg)
        if "model" not in out:
            out["model"] = dict(params=sum(p.numel() for p in model.parameters() if p.requires_grad),
                                tensors=sum(1 for p in model.parameters() if p.requires_grad))
        extra: dict[str, Any] = {}
        meter: Optional[Any] = None
        before_backward: Optional[Any] = None
        if method == "local_4proc":
            opt = make_adamw(model.parameters(), cfg)
        elif method == "ddp_fp32":
            model = DDP(model, broadcast_buffers=False)
            opt = make_adamw(model.parameters(), cfg)
        elif method in ONEBIT_MODES:
            topo = Topology.build(node_rank=node_rank, local_rank=local_rank, mode=ONEBIT_MODES[method])
            extra["topology"] = dict(mode=str(topo.mode), num_nodes=topo.num_nodes, ranks_per_node=topo.ranks_per_node)
            model = DDP(model, broadcast_buffers=False)
            opt = OnebitAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, freeze_step=W, topology=topo)
            sync = GradientSyncState(None, sync_predicate=lambda opt=opt: opt.needs_gradient_allreduce)
            model.register_comm_hook(sync, switchable_allreduce_hook)
            meter = lambda opt=opt, sync=sync: dict(  # noqa: E731
                optimizer=_counter_dict(opt.communication), hook=_counter_dict(sync.counters))
            warm = steps(model, opt, batches, W)
            extra["warmup_times_s"] = warm["times_s"]
        elif method == "ddp_powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

            from lightning_onebit.hooks import OrderedPowerSGDState, ordered_powersgd_hook

            model = DDP(model, broadcast_buffers=False)
            state = OrderedPowerSGDState(PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=W))
            model.register_comm_hook(state, ordered_powersgd_hook)
            opt = make_adamw(model.parameters(), cfg)
            steps(model, opt, batches, W)
        elif method in MEAN_METHODS:
            streaming = (args.fragments, args.overlap_steps) if method == "local_steps_overlap" else (1, 0)
            opt, extra["local_steps"] = _local_steps(model, cfg, node_rank, local_rank, args.sync_every, *streaming)
            model = opt.model
            meter = lambda opt=opt: dict(  # noqa: E731
                optimizer=_counter_dict(opt.outer.communication), hook=dict(bytes_sent_inter_node=0.0))
        elif method in FSDP_METHODS:
            model, opt, sync, extra["mesh"], overlap = _fsdp_method(method, model, node_rank, local_rank, W)
            before_backward = None if overlap is None else overlap.new_backward
            meter = lambda opt=opt, sync=sync: dict(  # noqa: E731
                optimizer=_counter_dict(opt.communication) if hasattr(opt, "communication") else {},
                hook=_counter_dict(sync.counters))
            if method in FSDP_ONEBIT:
                warm = steps(model, opt, batches, W, before_backward=before_backward)
                extra["warmup_times_s"] = warm["times_s"]
        else:  # pragma: no cover
            raise ValueError(method)
        untimed = steps(model, opt, batches, U, before_backward=before_backward)
        if (method in ONEBIT_MODES or method in FSDP_ONEBIT) and opt.needs_gradient_allreduce:
            raise RuntimeError(f"{method}: still in warmup after {W + U} steps")
        warmed = W if method in ONEBIT_MODES or method in FSDP_ONEBIT else 0
        log(f"{method}: {warmed} warmup + {U} untimed steps done "
            f"({time.perf_counter() - started:.0f} s); timing {N} steps")
        timed_steps = -(-N // args.sync_every) * args.sync_every if method in MEAN_METHODS else N
        with windows(method) as info:
            timed = steps(model, opt, batches, timed_steps, meter, before_backward)
            info["median_step_s_rank0"] = statistics.median(timed["times_s"])
        if method in ONEBIT_MODES:
            extra["skipped_grad_buckets"] = sync.skipped_buckets
            extra["stage"] = str(opt.stage)
        if method in FSDP_ONEBIT:
            extra["skipped_grad_buckets"] = sync.skipped
            extra["stage"] = str(opt.stage)
            if overlap is not None:
                extra["buckets_started_in_backward"] = overlap.buckets_started
        out["methods"][method] = dict(untimed_times_s=untimed["times_s"], wall_s=time.perf_counter() - started,
                                      loadavg_1min_after=os.getloadavg()[0], **timed, **extra)
        del model, opt
        gc.collect()
    (sync_dir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


class _LocalSteps:
    """The inner AdamW (on a DDP over the node) and the streaming outer step after every inner step, as
    ``OnebitDiLoCoStrategy.optimizer_step`` runs them; ``step`` and ``zero_grad`` as an optimizer's."""

    def __init__(self, model: Any, inner: Any, outer: Any) -> None:
        self.model, self.inner, self.outer, self.inner_steps = model, inner, outer, 0

    def step(self) -> None:
        self.inner.step()
        self.inner_steps += 1
        self.outer.after_inner_step(self.inner_steps)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def _local_steps(model: Any, cfg: Any, node_rank: int, local_rank: int, sync_every: int, fragments: int = 1,
                 overlap_steps: int = 0) -> tuple[_LocalSteps, dict[str, Any]]:
    """``onebit_diloco``'s parts with its defaults (but streaming's) over this host's 2 simulated nodes (see the module
    docstring)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.slow_link import make_adamw
    from lightning_onebit import Topology
    from lightning_onebit.comm.outer import make_outer_compressor
    from lightning_onebit.optim.streaming import StreamingOuterStep
    from lightning_onebit.strategy.local_steps import DEFAULTS, OUTER_LR

    params = [p for p in model.parameters() if p.requires_grad]
    if int(os.environ["LOCAL_WORLD_SIZE"]) == 1:  # a replica of one rank: the outer exchange over every rank
        replica_group, node_group = None, None
    else:
        topo = Topology.build(node_rank=node_rank, local_rank=local_rank, mode="hierarchical")
        replica_group, node_group = topo.inter_group, topo.intra_group
    outer = StreamingOuterStep.build(
        params, lambda: make_outer_compressor(DEFAULTS.compressor, replica_group), fragments=fragments,
        sync_every=sync_every, overlap_steps=overlap_steps, bucket_cap_mb=DEFAULTS.bucket_cap_mb,
        optimizer=DEFAULTS.outer_optimizer, lr=OUTER_LR[DEFAULTS.outer_optimizer], momentum=DEFAULTS.outer_momentum,
        shard_group=node_group)
    ddp = model if node_group is None else DDP(model, process_group=node_group, broadcast_buffers=False)
    info = dict(sync_every=sync_every, fragments=fragments, overlap_steps=overlap_steps,
                compressor=DEFAULTS.compressor, outer_optimizer=DEFAULTS.outer_optimizer,
                exchange=type(outer.fragments[0].compressor).__name__)
    return _LocalSteps(ddp, make_adamw(ddp.parameters(), cfg), outer), info


def _fsdp_method(method: str, model: Any, node_rank: int, local_rank: int, warmup: int
                 ) -> tuple[Any, Any, Any, list[int], Any]:
    """``model`` sharded with FSDP2 inside each node (every encoder layer, then the model), its optimizer, the replica
    all-reduce hook's state, the mesh's shape and the overlapped exchange's state (``None`` without): see the module
    docstring's fsdp_* methods."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from benchmarks.slow_link import LR, WEIGHT_DECAY
    from lightning_onebit import OnebitAdam
    from lightning_onebit.hooks.fsdp import ReplicaAllReduceState, ShardedOverlapState, register_replica_allreduce_hook
    from lightning_onebit.strategy.fsdp import node_mesh_ranks
    from lightning_onebit.strategy.sharding import fsdp_buckets

    placements: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(placements, (node_rank, local_rank))
    grid = node_mesh_ranks(placements, None)
    mesh = DeviceMesh("cpu", torch.tensor(grid), mesh_dim_names=("replicate", "shard"))
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    replicate = mesh["replicate"].get_group()
    overlap = None
    if method == "fsdp_adamw":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=True)
        sync = ReplicaAllReduceState(replicate)
    else:
        opt = OnebitAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, freeze_step=warmup,
                         process_group=replicate)
        opt.set_bucket_plan(fsdp_buckets(model, opt))  # one momentum bucket per FSDP group, as onebit_fsdp
        sync = ReplicaAllReduceState(replicate, lambda: opt.needs_gradient_allreduce)
        if method == "fsdp_onebit_overlap":
            overlap = ShardedOverlapState(opt)
            overlap.register()
    register_replica_allreduce_hook(model, sync)
    return model, opt, sync, [len(grid), len(grid[0])], overlap


# ---------------------------------------------------------------------------------------------------- parent side
def _launch(cluster: netns.VethPair, k: int, worker_args: list[str], log: Path,
            ranks_per_node: int) -> subprocess.Popen:
    """torchrun of the workers of node ``k`` inside its namespace, from the repository root; output to ``log``."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=cluster.devices[k], OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1")
    cmd = module_command("torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(ranks_per_node),
                         "--node-rank", str(k), "--master-addr", cluster.addresses[0],
                         "--master-port", str(MASTER_PORT), "-m", __spec__.name, "--worker", *worker_args)
    with open(log, "wb") as f:
        return cluster.popen(cmd, cluster.namespaces[k], env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"


def _worker_args(args: argparse.Namespace, sync_dir: str) -> list[str]:
    out = ["--sync-dir", sync_dir, "--parent-pid", str(os.getpid())]
    for flag in (*MODEL_FLAGS, "warmup_steps", "steps", "untimed", "sync_every", "fragments", "overlap_steps",
                 "calibration_barriers", "collective_timeout"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out + ["--methods", *args.methods]


def run_rate(index: int, rate: str, args: argparse.Namespace) -> dict[str, Any]:
    """One launch pair on a fresh cluster shaped at ``rate``; per-rank results and the veth readings per window."""
    with tempfile.TemporaryDirectory(prefix="multinode_") as tmp:
        sync_dir = Path(tmp)
        with netns.VethPair(index, rate, args.burst, args.latency) as cluster:
            logs = [sync_dir / f"node{k}.log" for k in range(NODES)]
            readings: dict[str, dict[str, Any]] = {}
            initial = cluster.wire()
            procs = [_launch(cluster, k, _worker_args(args, tmp), logs[k], args.ranks_per_node) for k in range(NODES)]
            started = time.monotonic()
            seen: set[str] = set()
            failure = None
            while True:
                for mark in sorted(sync_dir.glob("*.mark")):
                    if mark.name in seen:
                        continue
                    seen.add(mark.name)
                    wire = cluster.wire()
                    (sync_dir / f"{mark.stem}.ok").write_text("")
                    msg = json.loads(mark.read_text())
                    readings.setdefault(msg["window"], {})[msg["phase"]] = wire
                    if msg["phase"] == "end":
                        readings[msg["window"]]["info"] = msg["info"]
                        med = msg["info"].get("median_step_s_rank0")
                        note = f", median {med:.3f} s/step on rank 0" if med is not None else ""
                        print(f"  [{time.strftime('%H:%M:%S')}] {rate}: {msg['window']} measured{note}", flush=True)
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes):
                    failure = f"a launcher failed (exit codes {codes})"
                elif all(c == 0 for c in codes):
                    break
                elif time.monotonic() - started > args.timeout:
                    failure = f"timed out after {args.timeout:.0f} s"
                if failure:
                    break
                time.sleep(0.02)
            if failure:
                for k in range(NODES):
                    print(f"----- node {k} launcher output (last lines) -----\n{_tail(logs[k])}", file=sys.stderr)
                raise RuntimeError(f"{rate}: {failure}")
            per_rank = [json.loads((sync_dir / f"rank{r}.json").read_text())
                        for r in range(NODES * args.ranks_per_node)]
            final = cluster.wire()
    return dict(per_rank=per_rank, wire=readings, wire_initial=initial, wire_final=final,
                namespaces=cluster.namespaces, addresses=cluster.addresses)


# ---------------------------------------------------------------------------------------------------- summary
def _onebit_reference(args: argparse.Namespace) -> str:
    """The 1-bit Adam method the others are compared with: the topology-aware one, or the flat one with one rank per
    node (where the two are the same exchange)."""
    return "onebit_hierarchical" if args.ranks_per_node > 1 else "onebit_flat"


def slowest_median(per_rank: list[dict], method: str) -> float:
    series = [r["methods"][method]["times_s"] for r in per_rank]
    return statistics.median(max(step) for step in zip(*series))


def slowest_mean(per_rank: list[dict], method: str) -> float:
    series = [r["methods"][method]["times_s"] for r in per_rank]
    return statistics.fmean(max(step) for step in zip(*series))


def _delta(readings: dict, window: str, node: int, key: str) -> int:
    return readings[window]["end"][node][key] - readings[window]["begin"][node][key]


def summarise(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from lightning_onebit.comm import ring_allreduce_bytes

    per_rank, wire = run["per_rank"], run["wire"]
    n_params = per_rank[0]["model"]["params"]
    world = NODES * args.ranks_per_node
    barrier_count = args.calibration_barriers + 2
    barrier = [{key: _delta(wire, "barriers", k, key) / barrier_count for key in ("qdisc_bytes", "tx_bytes")}
               for k in range(NODES)]
    formulas = formula_bytes_per_node(n_params, NODES, args.ranks_per_node)
    rows: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        steps = len(per_rank[0]["methods"][method]["times_s"])  # local_steps: rounded up to whole periods
        if method == "ddp_fp32":
            counters = [float(ring_allreduce_bytes(n_params, 4, world))] * NODES
            source = "analytic: gloo ring allreduce, one rank per node sends 2(P-1)/P 4N off the node"
        elif method in ONEBIT_MODES or method in FSDP_METHODS or method in MEAN_METHODS:
            counters = [0.0] * NODES
            for r in per_rank:
                c = r["methods"][method]["counters"]
                counters[r["node_rank"]] += (c["optimizer"].get("bytes_sent_inter_node", 0.0)
                                             + c["hook"]["bytes_sent_inter_node"]) / steps
            source = ("measured: OnebitAdam.communication (local steps: the outer step's) + the warmup hook's "
                      "counters (GradientSyncState, or ReplicaAllReduceState under FSDP), bytes_sent_inter_node; "
                      "FSDP's intra-node traffic uncounted")
        elif method == "ddp_powersgd":
            counters = [0.0] * NODES
            source = "not counted per node: the veth's bytes"
        else:
            counters = [0.0] * NODES
            source = "no communication"
        nodes = []
        for k in range(NODES):
            qdisc, tx = _delta(wire, method, k, "qdisc_bytes"), _delta(wire, method, k, "tx_bytes")
            in_window = (steps + 2) * barrier[k]["qdisc_bytes"]
            corrected = (qdisc - in_window) / steps
            nodes.append(dict(
                counters=counters[k],
                veth_qdisc_raw=qdisc / steps,
                veth_qdisc=corrected,
                veth_tx_raw=tx / steps,
                veth_tx=(tx - (steps + 2) * barrier[k]["tx_bytes"]) / steps,
                barrier_bytes_in_window_per_step=in_window / steps,
                qdisc_packets=_delta(wire, method, k, "qdisc_packets") / steps,
                qdisc_drops=_delta(wire, method, k, "qdisc_drops"),
                rel_diff=corrected / counters[k] - 1 if counters[k] else None,
            ))
        diffs = [d["rel_diff"] for d in nodes if d["rel_diff"] is not None]
        worst = max(diffs, key=abs) if diffs else None
        row = dict(
            step_s=slowest_mean(per_rank, method) if method in MEAN_METHODS else slowest_median(per_rank, method),
            step_statistic="mean" if method in MEAN_METHODS else "median",
            mean_step_s=slowest_mean(per_rank, method),
            counters_bytes_per_node=statistics.fmean(counters),
            counters_source=source,
            veth_bytes_per_node=statistics.fmean(d["veth_qdisc"] for d in nodes),
            veth_tx_bytes_per_node=statistics.fmean(d["veth_tx"] for d in nodes),
            rel_diff=worst,
            agree_within_10pct=None if worst is None else abs(worst) <= 0.10,
            formula=METHOD_FORMULA.get(method),
            formula_bytes_per_node=(formulas[METHOD_FORMULA[method]] if method in METHOD_FORMULA
                                    else formulas["onebit_hierarchical"] / args.sync_every if method in MEAN_METHODS
                                    else 0.0),
            nodes=nodes,
            final_loss=[r["methods"][method]["losses"][-1] for r in per_rank],
        )
        for key in ("topology", "skipped_grad_buckets", "stage", "mesh", "buckets_started_in_backward", "local_steps"):
            if key in per_rank[0]["methods"][method]:
                row[key] = per_rank[0]["methods"][method][key]
        rows[method] = row
    ref = rows.get(_onebit_reference(args), {}).get("step_s")
    for row in rows.values():
        row["ratio_to_hierarchical"] = row["step_s"] / ref if ref else None
    for name in FSDP_ONEBIT:
        if "fsdp_adamw" in rows and name in rows:
            rows[name]["speedup_over_fsdp_adamw"] = rows["fsdp_adamw"]["step_s"] / rows[name]["step_s"]
    return dict(rows=rows, barrier_bytes_per_node=barrier, barriers_per_window="timed steps + 2")


def _mb(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / 1e6:,.3f}"


def print_rate(rate: str, summary: dict, args: argparse.Namespace) -> None:
    rows = summary["rows"]
    print(f"\n=== {NODES} nodes x {args.ranks_per_node} rank(s), veth shaped at {rate} (tbf burst {args.burst}, "
          f"latency {args.latency}) ===")
    header = (f"{'method':21s}{'step (s)':>9s}{'/ 1-bit':>8s}   {'MB leaving each node per step:':31s}"
              f"{'counters':>9s}{'veth tc':>10s}{'diff':>8s}{'veth tx':>10s}{'formula':>10s}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        ratio = f"{r['ratio_to_hierarchical']:.2f}x" if r["ratio_to_hierarchical"] else "-"
        diff = f"{r['rel_diff']:+.1%}" if r["rel_diff"] is not None else "-"
        print(f"{name:21s}{r['step_s']:>9.3f}{ratio:>8s}   {'':31s}{_mb(r['counters_bytes_per_node']):>9s}"
              f"{_mb(r['veth_bytes_per_node']):>10s}{diff:>8s}{_mb(r['veth_tx_bytes_per_node']):>10s}"
              f"{_mb(r['formula_bytes_per_node']):>10s}")
    b = summary["barrier_bytes_per_node"]
    one = ", ".join(f"node {k} {x['qdisc_bytes']:.0f} B (tc)" for k, x in enumerate(b))
    print(f"  veth figures: timed-window bytes minus its {summary['barriers_per_window']} barriers "
          f"(one barrier: {one}), "
          f"per step; 'veth tc' = tbf qdisc Sent bytes (IP packets, headers per segment), 'veth tx' = link tx bytes.")
    print("  counters: ddp_fp32 analytic (ring allreduce); onebit_* and fsdp_* measured bytes_sent_inter_node, summed "
          "per node; diff = veth tc / counters - 1, worst node")
    for method in (m for m in MEAN_METHODS if m in rows and "local_4proc" in rows):
        local = rows[method]["mean_step_s"]
        floor = rows["local_4proc"]["mean_step_s"]
        others = ", ".join(f"{name} {rows[name]['mean_step_s']:.3f} s"
                           for name in ("ddp_powersgd", _onebit_reference(args), "ddp_fp32") if name in rows)
        print(f"  means of the timed steps: {method} (an outer sync every {args.sync_every}) {local:.3f} s, "
              f"{local / floor:.2f}x the no-communication floor (local_4proc, {floor:.3f} s)"
              + (f"; {others}" if others else ""))
    for name in FSDP_ONEBIT:
        if "speedup_over_fsdp_adamw" in rows.get(name, {}):
            print(f"  {name} compression-stage step: {rows[name]['speedup_over_fsdp_adamw']:.2f}x faster than "
                  "fsdp_adamw")
    drops = {name: sum(d["qdisc_drops"] for d in r["nodes"]) for name, r in rows.items()}
    if any(drops.values()):
        print(f"  tbf drops during the timed steps (TCP retransmits add to the veth figures): {drops}")


def print_formulas(n_params: int) -> None:
    print(f"\nBytes leaving each node per step by formula, N = {n_params:,} parameters, "
          f"{FORMULA_RANKS_PER_NODE} ranks per node:")
    header = f"{'nodes':>6s}{'fp32 ring':>18s}{'flat 1-bit':>18s}{'hierarchical 1-bit':>22s}"
    print(header)
    for row in formula_table(n_params):
        f, p = row["bytes"], row["per_parameter"]
        cells = [f"{f[k] / 1e6:,.1f} MB ({p[k]:.3g}N)" for k in ("fp32_ring", "onebit_flat", "onebit_hierarchical")]
        print(f"{row['nodes']:>6d}{cells[0]:>18s}{cells[1]:>18s}{cells[2]:>22s}")


# ---------------------------------------------------------------------------------------------------- command line
def parse_args() -> argparse.Namespace:
    argv = sys.argv[1:]
    if "--worker" not in argv and not {"-h", "--help"} & set(argv):
        problems = netns.problems()  # before the slow imports (torch, transformers)
        if problems:
            sys.exit(f"python -m {__spec__.name}: error: {'; '.join(problems)}")
    from benchmarks.slow_link import add_model_arguments

    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--rates", default="200mbit,50mbit",
                        help="comma-separated tbf rates, one cluster each, run in turn (default 200mbit,50mbit)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                        help="subset of methods, run in this order (default all)")
    add_model_arguments(parser)  # slow_link's model settings and their defaults
    parser.add_argument("--warmup-steps", type=int, default=2,
                        help="W: OnebitAdam freeze_step; its warmup steps are untimed (default 2)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per method (default 8)")
    parser.add_argument("--untimed", type=int, default=2, help="untimed steps before the timed ones (default 2)")
    parser.add_argument("--ranks-per-node", type=int, default=RANKS_PER_NODE, choices=(1, 2),
                        help="processes per simulated node (default 2); 1: every node one rank, each process a core of "
                             "its own on a 2-core host (the flat layout: no onebit_hierarchical, no fsdp_* methods)")
    parser.add_argument("--sync-every", type=int, default=None,
                        help="local_steps: inner steps per outer sync (default onebit_diloco's)")
    parser.add_argument("--fragments", type=int, default=1, help="local_steps_overlap: fragments (default 1)")
    parser.add_argument("--overlap-steps", type=int, default=1,
                        help="local_steps_overlap: inner steps overlapping each exchange (default 1)")
    parser.add_argument("--calibration-barriers", type=int, default=20,
                        help="bare barriers in the calibration window that measures a barrier's bytes (default 20)")
    parser.add_argument("--burst", default=netns.BURST, help=f"tbf burst (default {netns.BURST})")
    parser.add_argument("--latency", default=netns.LATENCY, help=f"tbf latency (default {netns.LATENCY})")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per rate before the run is killed")
    parser.add_argument("--collective-timeout", type=float, default=1800, help=argparse.SUPPRESS)
    parser.add_argument("--name", default="multinode", help="results/<name>.json (default multinode)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sync-dir", help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup_steps < 1 or args.steps < 1 or args.untimed < 1 or args.calibration_barriers < 1:
        parser.error("--warmup-steps, --steps, --untimed and --calibration-barriers must be >= 1")
    if args.sync_every is None:
        from lightning_onebit.strategy.local_steps_run import DEFAULTS

        args.sync_every = DEFAULTS.sync_every
    if args.sync_every < 1:
        parser.error("--sync-every must be >= 1")
    if args.worker:
        return args
    if args.ranks_per_node == 1 and {"onebit_hierarchical", *FSDP_METHODS} & set(args.methods):
        parser.error("--ranks-per-node 1: onebit_hierarchical and the fsdp_* methods need 2 ranks per node")
    problems = netns.problems()
    if problems:
        parser.error("; ".join(problems))
    args.rate_list = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not args.rate_list or any(not re.fullmatch(r"[0-9.]+[a-zA-Z]*", r) for r in args.rate_list):
        parser.error(f"--rates: expected tc rates such as 200mbit,50mbit, got {args.rates!r}")
    return args


def main() -> None:
    args = parse_args()
    if args.worker:
        _worker(args)
        return

    import torch

    from benchmarks.common import write_results
    from benchmarks.slow_link import model_config_of

    started = time.perf_counter()
    cfg = dict(model_config_of(args),  # the --model preset's layers and vocabulary, unless given
               **{k: getattr(args, k) for k in ("warmup_steps", "steps", "untimed", "sync_every", "fragments",
                                                "overlap_steps", "calibration_barriers")})
    payload: dict[str, Any] = dict(
        args={k: v for k, v in vars(args).items() if k not in ("worker", "sync_dir", "parent_pid")},
        config=dict(cfg, methods=list(args.methods)),
        environment=dict(torch=torch.__version__, python=platform.python_version(), cpus=os.cpu_count(),
                         nodes=NODES, ranks_per_node=args.ranks_per_node, threads_per_rank=1, backend="gloo",
                         tbf=dict(burst=args.burst, latency=args.latency), loadavg_at_start=os.getloadavg(),
                         ddp_broadcast_buffers=False),
        caveat=(f"one host simulates both nodes: {NODES * args.ranks_per_node} processes share its CPU cores (intra-node phases are CPU-bound "
                "here, unlike a real node) and other work may have used them at the same time"),
        rates={},
    )
    try:
        for index, rate in enumerate(args.rate_list):
            print(f"[{time.strftime('%H:%M:%S')}] {rate}: {NODES} namespaces joined by a veth pair shaped at {rate}; "
                  f"methods {', '.join(args.methods)}", flush=True)
            run = run_rate(index, rate, args)
            summary = summarise(run, args)
            payload.setdefault("model", run["per_rank"][0]["model"])
            payload["rates"][rate] = dict(**summary, per_rank=run["per_rank"], wire=run["wire"],
                                          wire_initial=run["wire_initial"], wire_final=run["wire_final"])
            print_rate(rate, summary, args)
    finally:
        netns.close_all()  # each rate's cluster is closed when its run ends; this is for an interrupted one
    n_params = payload["model"]["params"]
    payload["formulas"] = dict(this_run=formula_bytes_per_node(n_params, NODES, args.ranks_per_node),
                               table=formula_table(n_params))
    print_formulas(n_params)
    payload["total_wall_s"] = time.perf_counter() - started
    print(f"\nmodel: {n_params / 1e6:.2f}M parameters; {args.layers} layers, hidden {args.hidden}, batch "
          f"{args.batch} x seq {args.seq} per rank; W={args.warmup_steps}, {args.untimed} untimed + {args.steps} "
          f"timed steps per method. Timings: one shared host, {NODES * args.ranks_per_node} processes on "
          f"{os.cpu_count()} cores.")
    path = write_results(args.name, payload)
    print(f"written to {path} in {payload['total_wall_s']:.0f} s")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("\ninterrupted; the namespaces and links of this run were removed", file=sys.stderr)
        sys.exit(130)
