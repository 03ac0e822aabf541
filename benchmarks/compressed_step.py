"""One optimizer step of OnebitAdam's compression stage vs. an fp32 allreduce + AdamW step, on loopback ranks.

Prints, for a BERT-like model of ``--params`` parameters on ``--world-size`` gloo CPU processes:
  * bytes each rank sends per compressed step, and their ratio to an fp32 ring allreduce of the gradients,
  * collectives per compressed step,
  * median wall time of: (a) DDP-style fp32 allreduce of gradient buckets + torch.optim.AdamW (foreach) step,
    (b) an OnebitAdam compressed step (momentum update, compressed allreduce, update).
Results go to results/compressed_step_P{world_size}_{params}.json.

    python -m benchmarks.compressed_step --params 25e6 --world-size 2
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import argument_parser, bert_like_shapes, launch, write_results
from lightning_onebit import OnebitAdam
from lightning_onebit.comm import ring_allreduce_bytes

BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def _grad_buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    buckets, size = [[]], 0
    for p in params:
        if buckets[-1] and size + p.numel() * 4 > BUCKET_BYTES:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * 4
    return buckets


def _allreduce_grads(buckets: list[list[torch.Tensor]], world_size: int) -> None:
    # As DDP does: gradients of a bucket live in one flat buffer, averaged by one allreduce.
    for bucket in buckets:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        flat.div_(world_size)
        dist.all_reduce(flat)
        offset = 0
        for p in bucket:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _bench(rank: int, world_size: int, n_params: float, steps: int, bucket_cap_mb: float = 25.0) -> dict:
    torch.manual_seed(rank)
    shapes = bert_like_shapes(n_params)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    numel = sum(p.numel() for p in params)

    adamw = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, foreach=True)
    buckets = _grad_buckets(params)
    baseline = []
    for _ in range(steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        _allreduce_grads(buckets, world_size)
        adamw.step()
        baseline.append(time.perf_counter() - t0)

    onebit = OnebitAdam(params, lr=1e-4, weight_decay=0.01, freeze_step=1, bucket_cap_mb=bucket_cap_mb)
    _allreduce_grads(buckets, world_size)
    onebit.step()  # the one warmup step
    compressed, sent, collectives = [], [], []
    for _ in range(steps + 1):
        before = onebit.communication.snapshot()
        dist.barrier()
        t0 = time.perf_counter()
        onebit.step()
        compressed.append(time.perf_counter() - t0)
        delta = onebit.communication - before
        sent.append(delta.bytes_sent)
        collectives.append(delta.collectives)
    return dict(
        numel=numel,
        tensors=len(params),
        buckets=len(onebit.bucket_layouts()),
        baseline_s=statistics.median(baseline[1:]),
        compressed_s=statistics.median(compressed[1:]),
        bytes_sent_per_step=sent[-1],
        fp32_allreduce_bytes=ring_allreduce_bytes(numel, 4, world_size),
        collectives_per_step=collectives[-1],
    )


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=25e6, help="model size in parameters (default 25e6)")
    parser.add_argument("--world-size", type=int, default=2, help="number of loopback ranks (default 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per method (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="OnebitAdam bucket_cap_mb (default 25)")
    parser.add_argument("--name", help="results/<name>.json (default compressed_step_P{world_size}_{params})")
    args = parser.parse_args()
    results = launch(_bench, args.world_size, args.params, args.steps, args.bucket_cap_mb, threads=args.threads)
    r = results[0]
    slowest = {k: max(res[k] for res in results) for k in ("baseline_s", "compressed_s")}
    ratio = r["bytes_sent_per_step"] / r["fp32_allreduce_bytes"]
    print(f"model: {r['numel'] / 1e6:.2f}M parameters in {r['tensors']} tensors, {r['buckets']} compressed bucket(s), "
          f"P={args.world_size}, {args.threads} thread(s) per rank")
    print(f"{'':40s}{'value':>16s}")
    print(f"{'bytes sent per compressed step':40s}{r['bytes_sent_per_step']:>16,d}")
    print(f"{'bytes of an fp32 ring allreduce':40s}{r['fp32_allreduce_bytes']:>16,d}")
    print(f"{'ratio (goal <= 1/30 = 0.0333)':40s}{ratio:>16.5f}  (1/{1 / ratio:.1f})")
    print(f"{'collectives per compressed step':40s}{r['collectives_per_step']:>16d}")
    print(f"{'fp32 allreduce + AdamW step (s)':40s}{slowest['baseline_s']:>16.4f}")
    print(f"{'OnebitAdam compressed step (s)':40s}{slowest['compressed_s']:>16.4f}")
    print(f"{'speed ratio (baseline / compressed)':40s}{slowest['baseline_s'] / slowest['compressed_s']:>16.2f}")
    path = write_results(
        args.name or f"compressed_step_P{args.world_size}_{int(args.params)}",
        dict(args=vars(args), per_rank=results, bytes_ratio=ratio, **{f"max_{k}": v for k, v in slowest.items()}),
    )
    print(f"written to {path}")


if __name__ == "__main__":
    main()
