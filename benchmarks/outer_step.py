"""The local-steps outer sync's own work: one :class:`~lightning_onebit.optim.outer_step.OuterStep` sync (1-bit
compressor, outer SGD at lr 0.7: ``onebit_diloco``'s defaults) over a BERT-like parameter list on loopback gloo, one
thread per process, timed by phase:

* ``start``: the pseudo-gradient (outer minus local parameters) on this rank's shard, the finiteness check, the error
  feedback and the compression, and the start of the exchange;
* ``finish``: the rest of the exchange, decoding (of every shard, inside a replica of several ranks) and the outer
  update;
* ``copy``: the new outer values copied into the parameters.

Layouts (``--layouts``): ``2x1`` (two replicas of one rank) and ``2x2`` (two replicas of two ranks: 4 processes,
which share the cores of a small host). Each figure is the median over ``--syncs`` syncs after 2 untimed ones, on
rank 0, in seconds; between two syncs every parameter moves by a small random step, as the inner steps would move it.
Writes ``results/NAME.json`` (``--name``, default ``outer_step``) with the library's commit.

    python -m benchmarks.outer_step                     # 22.7M parameters (MiniLM's size), both layouts
    python -m benchmarks.outer_step --params 5e6 --layouts 2x1 --syncs 3
"""

from __future__ import annotations

import platform
import statistics
import time
from typing import Any

from benchmarks.common import argument_parser, bert_like_shapes, launch, write_results

PHASES = ("start", "finish", "copy")


def _syncs(rank: int, world_size: int, per_replica: int, n_params: float, syncs: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_onebit.comm.groups import new_group_family
    from lightning_onebit.comm.outer import make_outer_compressor
    from lightning_onebit.optim.outer_step import OuterStep

    replicas = world_size // per_replica
    # the ranks l of every replica (the exchange), and the ranks of each replica (the shards)
    replica_group = new_group_family([[k * per_replica + s for k in range(replicas)] for s in range(per_replica)])
    shard_group = new_group_family([list(range(k * per_replica, (k + 1) * per_replica)) for k in range(replicas)])
    generator = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=generator) * 0.02 for shape in bert_like_shapes(n_params)]
    step = OuterStep(params, make_outer_compressor("onebit", replica_group), optimizer="sgd", lr=0.7,
                     shard_group=shard_group if per_replica > 1 else None)
    moves = torch.Generator().manual_seed(1 + rank // per_replica)  # the replicas' inner steps differ
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for sync in range(syncs + 2):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=moves), alpha=1e-3)
        dist.barrier()
        t0 = time.perf_counter()
        step.start()
        t1 = time.perf_counter()
        step.finish()
        t2 = time.perf_counter()
        step.copy_outer_to_params()
        t3 = time.perf_counter()
        if sync >= 2:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                times[phase].append(seconds)
    # after a sync every rank holds the same outer parameters (the test checks it)
    return {"params": sum(p.numel() for p in params), "times": times,
            "outer": torch.cat([p.detach().reshape(-1) for p in params])[:: max(1, int(n_params) // 4096)].clone()}


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=22.7e6, help="parameters (default 22.7e6)")
    parser.add_argument("--layouts", nargs="+", default=["2x1", "2x2"], choices=["2x1", "2x2"])
    parser.add_argument("--syncs", type=int, default=5, help="timed syncs per layout (default 5)")
    parser.add_argument("--name", default="outer_step", help="results/NAME.json (default outer_step)")
    args = parser.parse_args()
    import torch

    from benchmarks.freeze_sweep import library_version

    rows = {}
    for layout in args.layouts:
        replicas, per_replica = (int(x) for x in layout.split("x"))
        result = launch(_syncs, replicas * per_replica, per_replica, args.params, args.syncs)[0]
        medians = {phase: statistics.median(v) for phase, v in result["times"].items()}
        rows[layout] = dict(medians, total=sum(medians.values()), params=result["params"], times=result["times"])
        print(f"{layout}: {result['params'] / 1e6:.1f}M parameters, "
              + ", ".join(f"{phase} {medians[phase] * 1e3:.1f} ms" for phase in PHASES)
              + f", total {rows[layout]['total'] * 1e3:.1f} ms")
    path = write_results(args.name, {"params": args.params, "syncs": args.syncs, "layouts": rows,
                                     "library": library_version(),
                                     "torch": torch.__version__, "machine": platform.machine(),
                                     "processor": platform.processor()})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
