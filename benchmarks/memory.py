"""Memory of OnebitAdam vs AdamW: optimizer-held bytes and peak process memory, 2 ranks on loopback.

For a BERT-like model of ``--params`` parameters (fp32), each method runs a few steps in its own pair of processes:

* ``torch.optim.AdamW``: gradients averaged by allreduce (as DDP does).
* ``OnebitAdam`` past ``freeze_step``: local gradients, compressed momentum allreduce.

Reported per rank: bytes of every tensor the optimizer holds (counted once per storage: state, flat momentum
buckets, error-feedback buffers, communication workspaces), broken down for OnebitAdam, and the process's peak
resident memory (``ru_maxrss``), and what one more steady-state OnebitAdam step allocates (torch profiler).
Results: ``results/memory.json``.

    python -m benchmarks.memory --params 25e6
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from benchmarks.common import argument_parser, bert_like_shapes, launch, write_results
from lightning_onebit import OnebitAdam


def _storage_bytes(tensors, seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _step_allocations(optimizer: torch.optim.Optimizer) -> dict:
    """Allocations of one more steady-state step, from the torch profiler: ``aten::empty*`` events (every tensor
    allocation ends in one), split into those made inside a c10d collective or on gloo's threads (gloo's own copies)
    and the rest (this package's)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    own, collective, own_sources = [], [], {}
    events = prof.events()
    step_threads = {e.thread for e in events if e.name.startswith("Optimizer.step")}
    for event in events:
        if not event.name.startswith("aten::empty") or event.cpu_memory_usage <= 0:
            continue
        # gloo runs asynchronous collectives on its own threads
        parent, inside = event.cpu_parent, event.thread not in step_threads
        while parent is not None:
            inside = inside or any(k in parent.name for k in ("c10d", "all_gather", "all_to_all", "allgather", "alltoall"))
            parent = parent.cpu_parent
        (collective if inside else own).append(event.cpu_memory_usage)
        if not inside and event.cpu_parent is not None:
            top = event
            while top.cpu_parent is not None:
                top = top.cpu_parent
            own_sources[top.name] = own_sources.get(top.name, 0) + event.cpu_memory_usage
    return dict(own_count=len(own), own_bytes=sum(own), own_largest_bytes=max(own, default=0), own_sources=own_sources,
                collective_count=len(collective), collective_bytes=sum(collective))


def _run(rank: int, world_size: int, method: str, n_params: float, steps: int) -> dict:
    torch.manual_seed(rank)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in bert_like_shapes(n_params)]
    if method == "adamw":
        optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=True)
    else:
        optimizer = OnebitAdam(params, lr=1e-4, freeze_step=1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
            if method == "adamw" or optimizer.needs_gradient_allreduce:
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        optimizer.step()
    seen = {p.untyped_storage().data_ptr() for p in params} | {p.grad.untyped_storage().data_ptr() for p in params}
    state = _storage_bytes([v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)], seen)
    breakdown = {"state (momentum, variance)": state}
    if method == "onebit":
        buckets = optimizer.compression._buckets.values()
        breakdown["error feedback (worker + server)"] = _storage_bytes(
            [t for b in buckets for t in (b.worker_error, b.server_error)], seen
        )
        breakdown["communication buffers and workspaces"] = _storage_bytes(
            [t for b in buckets for t in (b.send, b.recv, b.gather_send, b.gather_recv)]
            + list(optimizer.compression.workspace._buffers.values()),
            seen,
        )
    allocations = _step_allocations(optimizer) if method == "onebit" else None
    return dict(
        method=method,
        step_allocations=allocations,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        optimizer_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = {m: launch(_run, args.world_size, m, args.params, args.steps) for m in ("adamw", "onebit")}
    mb = 2.0**20
    adamw, onebit = results["adamw"][0], results["onebit"][0]
    print(f"{args.params / 1e6:.1f}M fp32 parameters ({adamw['param_bytes'] / mb:.1f} MiB), P={args.world_size}, rank 0")
    print(f"{'':44s}{'AdamW':>12s}{'OnebitAdam':>12s}")
    print(f"{'optimizer-held memory (MiB)':44s}{adamw['optimizer_bytes'] / mb:>12.1f}{onebit['optimizer_bytes'] / mb:>12.1f}")
    for key, value in onebit["breakdown"].items():
        print(f"{'  ' + key:44s}{adamw['breakdown'].get(key, 0) / mb:>12.1f}{value / mb:>12.1f}")
    print(f"{'peak resident memory of the process (MiB)':44s}"
          f"{max(r['peak_rss_bytes'] for r in results['adamw']) / mb:>12.1f}"
          f"{max(r['peak_rss_bytes'] for r in results['onebit']) / mb:>12.1f}")
    a = onebit["step_allocations"]
    print(f"one steady-state OnebitAdam step allocates {a['own_count']} tensors, {a['own_bytes'] / 1024:.1f} KiB in "
          f"all (largest {a['own_largest_bytes'] / 1024:.1f} KiB), plus {a['collective_bytes'] / mb:.1f} MiB inside "
          f"gloo's collectives ({a['collective_count']} allocations)")
    print(f"written to {write_results('memory', dict(args=vars(args), per_rank=results))}")


if __name__ == "__main__":
    main()
