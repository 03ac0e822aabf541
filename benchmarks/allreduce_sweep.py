"""Compressed allreduce vs fp32 allreduce, 2 ranks on loopback, 1M..100M elements.

For each size: median wall time of ``torch.distributed.all_reduce`` of an fp32 buffer (then divided by P, as DDP
does) and of ``compressed_allreduce_`` of the same buffer (one bucket, error feedback on), plus the bytes each rank
sends. Results: ``results/allreduce_sweep_P{world_size}.json``.

    python -m benchmarks.allreduce_sweep                 # 1M, 3M, 10M, 30M, 100M elements
    python -m benchmarks.allreduce_sweep --sizes 1e6 1e7
    python -m benchmarks.allreduce_sweep --backend torch --name allreduce_sweep_P2_torch   # the pure-torch kernels
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import argument_parser, launch, write_results
from lightning_onebit.comm import BucketLayout, CompressedAllreduceState, compressed_allreduce_


def _sweep(rank: int, world_size: int, sizes: list[int], repeats: int, backend: str = "auto") -> list[dict]:
    rows = []
    for n in sizes:
        layout = BucketLayout.build([n], world_size)
        data = torch.randn(layout.padded_numel, generator=torch.Generator().manual_seed(rank))
        data[n:] = 0
        plain, compressed = data[:n].clone(), data.clone()
        state = CompressedAllreduceState(backend=backend)
        fp32_times, onebit_times = [], []
        for _ in range(repeats + 1):  # the first call of each warms up buffers and connections
            plain.copy_(data[:n])
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(plain)
            plain.div_(world_size)
            fp32_times.append(time.perf_counter() - t0)
            compressed.copy_(data)
            dist.barrier()
            t0 = time.perf_counter()
            compressed_allreduce_(state, 0, compressed, layout)
            onebit_times.append(time.perf_counter() - t0)
        rows.append(
            dict(
                numel=n,
                fp32_s=statistics.median(fp32_times[1:]),
                onebit_s=statistics.median(onebit_times[1:]),
                fp32_bytes=layout.fp32_equivalent_bytes(),
                onebit_bytes=layout.bytes_per_call(),
            )
        )
    return rows


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e6, 3e6, 1e7, 3e7, 1e8], help="elements")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", choices=("auto", "torch", "cpu"), default="auto",
                        help="kernel backend of the compressed allreduce (default auto: the fused C kernels on CPU)")
    parser.add_argument("--name", help="results/<name>.json (default allreduce_sweep_P{world_size})")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes]
    per_rank = launch(_sweep, args.world_size, sizes, args.repeats, args.backend)
    rows = []
    for i, n in enumerate(sizes):
        row = dict(per_rank[0][i])
        row["fp32_s"] = max(r[i]["fp32_s"] for r in per_rank)  # a collective is as slow as its slowest rank
        row["onebit_s"] = max(r[i]["onebit_s"] for r in per_rank)
        rows.append(row)
    print(f"P={args.world_size}, loopback, 1 thread per rank, median of {args.repeats}")
    print(f"{'elements':>12s}{'fp32 allreduce s':>18s}{'compressed s':>14s}{'speed ratio':>13s}"
          f"{'fp32 bytes':>14s}{'1-bit bytes':>13s}{'bytes ratio':>13s}")
    for r in rows:
        print(f"{r['numel']:>12,d}{r['fp32_s']:>18.4f}{r['onebit_s']:>14.4f}{r['fp32_s'] / r['onebit_s']:>13.2f}"
              f"{r['fp32_bytes']:>14,d}{r['onebit_bytes']:>13,d}{r['fp32_bytes'] / r['onebit_bytes']:>13.1f}")
    print(f"written to {write_results(args.name or f'allreduce_sweep_P{args.world_size}', dict(args=vars(args), rows=rows))}")


if __name__ == "__main__":
    main()
