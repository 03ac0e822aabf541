"""The intra-node phases of the hierarchical exchange on gloo: which reduce-scatter, and what the final gather costs.

The hierarchical compressed allreduce (``Topology`` mode ``"hierarchical"``) starts with a full-precision
reduce-scatter inside each node, so that local rank ``l`` holds its node's mean of shard ``l``, and ends with an
intra-node all-gather. On ``L`` ranks of one node (loopback, one thread each), for buffers of several sizes, median
of ``--repeats`` calls of the slower rank:

  reduce_scatter_tensor   ``dist.reduce_scatter_tensor`` (sum) of the buffer, then a division by ``L``
  all_to_all + sum        ``dist.all_to_all_single`` of the ``L`` shards, then a sum in local-rank order and a
                          division (what lightning_onebit runs: gloo has no AVG, and a fixed order gives the same bits
                          as a single-process reference)
  gather fp32 shards      ``all_gather`` of the averaged fp32 shards (the alternative final gather)
  gather packed blocks    ``all_gather`` of the packed 1-bit server blocks, 32x smaller, decoded locally afterwards
                          (what lightning_onebit runs)

    python -m benchmarks.intra_reduce                       # 2 ranks, 1M / 6.5M (a 25 MB bucket) / 25M elements
    python -m benchmarks.intra_reduce --world-size 4 --sizes 1e6 4e6
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from benchmarks.common import argument_parser, launch, write_results

# torch 2.13 renamed these (the old names warn)
_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first call warms up connections and buffers
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _measure(rank: int, world_size: int, sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in sizes:
        n -= n % (8 * world_size)
        shard = n // world_size
        data = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        received = torch.empty(n)
        out = torch.empty(shard)

        def reduce_scatter() -> None:
            _reduce_scatter(out, data)
            out.div_(world_size)

        def all_to_all_sum() -> None:
            dist.all_to_all_single(received, data)
            mean = received[:shard]
            for j in range(1, world_size):
                mean.add_(received[j * shard : (j + 1) * shard])
            mean.div_(world_size)

        gathered_fp32 = torch.empty(n)
        packed = torch.zeros(shard // 8, dtype=torch.uint8)
        gathered_packed = torch.empty(n // 8, dtype=torch.uint8)
        rows.append(
            dict(
                numel=n,
                reduce_scatter_tensor_s=_time(reduce_scatter, repeats),
                all_to_all_sum_s=_time(all_to_all_sum, repeats),
                gather_fp32_s=_time(lambda: _gather(gathered_fp32, out), repeats),
                gather_packed_s=_time(lambda: _gather(gathered_packed, packed), repeats),
            )
        )
    return rows


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 6.5e6, 2.5e7], help="elements")
    parser.add_argument("--world-size", type=int, default=2, help="ranks of the node")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    per_rank = launch(_measure, args.world_size, [int(s) for s in args.sizes], args.repeats)
    keys = ("reduce_scatter_tensor_s", "all_to_all_sum_s", "gather_fp32_s", "gather_packed_s")
    rows = []
    for i, row in enumerate(per_rank[0]):
        rows.append(dict(row, **{k: max(r[i][k] for r in per_rank) for k in keys}))  # the slower rank
    print(f"{args.world_size} ranks of one node, loopback, 1 thread per rank, median of {args.repeats}")
    print(f"{'elements':>12s}{'reduce_scatter_tensor':>23s}{'all_to_all + sum':>18s}{'gather fp32':>13s}"
          f"{'gather packed':>15s}")
    for row in rows:
        print(f"{row['numel']:>12,d}" + "".join(f"{row[k]:>{w}.4f}" for k, w in zip(keys, (23, 18, 13, 15))))
    path = write_results(
        f"intra_reduce_P{args.world_size}",
        dict(world_size=args.world_size, repeats=args.repeats, threads_per_rank=1, rows=rows),
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
