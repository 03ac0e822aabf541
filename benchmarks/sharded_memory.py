"""Memory per rank under sharding: 1-bit Adam on DDP (flat and hierarchical exchange) against 1-bit Adam on FSDP2
(``onebit_fsdp``'s layout) and AdamW on FSDP2, 4 ranks on loopback as 2 simulated nodes x 2.

The model is a stack of ``Linear(W, W)`` layers with about ``--params`` fp32 parameters, each layer sharded with
``fully_shard`` over its node's 2 ranks under FSDP (a ``("replicate", "shard")`` mesh), and whole on every rank under
DDP. Each method runs a few steps of forward, backward and optimizer step, past the freeze for 1-bit Adam, with
gradients averaged as its strategy does (DDP: an all-reduce over all ranks before the freeze; FSDP: reduce-scatter in
the node and the replica all-reduce hook across nodes).

Reported per rank (rank 0), counted once per storage: parameters, gradients, optimizer state (momentum, variance),
compression error feedback (worker + server), communication buffers and workspaces; their total (the training state
a rank holds between steps); the process's peak resident memory (``ru_maxrss``, which also holds FSDP's unsharded
layer during compute, activations and the interpreter); and the formula for the training state at ``L`` ranks per
node and ``M`` nodes. Results: ``results/sharded_memory.json``.

    python -m benchmarks.sharded_memory --params 25e6
"""

from __future__ import annotations

import resource
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import argument_parser, launch, write_results
from lightning_onebit import OnebitAdam, Topology

NODES, PER_NODE = 2, 2
METHODS = ("ddp_onebit_flat", "ddp_onebit_hierarchical", "fsdp_onebit", "fsdp_adamw")


def _storage_bytes(tensors: list[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _model(n_params: float, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers = max(1, round(n_params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _run(rank: int, world_size: int, method: str, n_params: float, width: int, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_onebit.hooks.fsdp import ReplicaAllReduceState, register_replica_allreduce_hook

    model = _model(n_params, width)
    mesh = DeviceMesh("cpu", torch.arange(world_size).reshape(NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    topology = None
    if method.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer, mesh=mesh["shard"])
        fully_shard(model, mesh=mesh["shard"])
        replicate = mesh["replicate"].get_group()
        if method == "fsdp_adamw":
            optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            register_replica_allreduce_hook(model, ReplicaAllReduceState(replicate))
        else:
            optimizer = OnebitAdam(model.parameters(), lr=1e-4, freeze_step=1, process_group=replicate,
                                   dead_coordinates="ignore")
            register_replica_allreduce_hook(
                model, ReplicaAllReduceState(replicate, lambda: optimizer.needs_gradient_allreduce)
            )
    else:
        if method == "ddp_onebit_hierarchical":
            topology = Topology.build(node_rank=rank // PER_NODE, local_rank=rank % PER_NODE, mode="hierarchical",
                                      ranks_per_node=PER_NODE)
        optimizer = OnebitAdam(model.parameters(), lr=1e-4, freeze_step=1, topology=topology,
                               dead_coordinates="ignore")
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        if method.startswith("ddp") and optimizer.needs_gradient_allreduce:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world_size)
        optimizer.step()
    params = list(model.parameters())
    seen: set[int] = set()
    breakdown = {
        "parameters": _storage_bytes([_local(p) for p in params], seen),
        "gradients": _storage_bytes([_local(p.grad) for p in params if p.grad is not None], seen),
    }
    if isinstance(optimizer, OnebitAdam):
        for stand_in in (p for group in optimizer.param_groups for p in group["params"]):
            if stand_in.grad is not None:
                seen.add(stand_in.grad.untyped_storage().data_ptr())
    breakdown["optimizer state (momentum, variance)"] = _storage_bytes(
        [_local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)], seen
    )
    if isinstance(optimizer, OnebitAdam):
        buckets = list(optimizer.compression._buckets.values())
        breakdown["error feedback (worker + server)"] = _storage_bytes(
            [t for b in buckets for t in (b.worker_error, b.server_error) if t is not None], seen
        )
        breakdown["communication buffers and workspaces"] = _storage_bytes(
            [t for b in buckets for t in (b.send, b.recv, b.gather_send, b.gather_recv) if t is not None]
            + list(optimizer.compression.workspace._buffers.values()),
            seen,
        )
    total_params = sum(p.numel() for p in params)
    if topology is not None:
        from lightning_onebit.comm.topology import destroy_groups

        del optimizer
        destroy_groups(topology.groups)
    return dict(method=method, numel=total_params, breakdown=breakdown, total_bytes=sum(breakdown.values()),
                peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def formula(method: str, ranks_per_node: int, nodes: int) -> float:
    """The training state per rank, in units of ``N`` fp32 numbers: parameters, gradients, momentum, variance,
    worker and server error (communication buffers left out)."""
    L, M = ranks_per_node, nodes  # noqa: N806
    return {
        "ddp_onebit_flat": 5 + 1 / (L * M),
        "ddp_onebit_hierarchical": 4 + 1 / L + 1 / (L * M),
        "fsdp_onebit": 5 / L + 1 / (L * M),
        "fsdp_adamw": 4 / L,
    }[method]


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--width", type=int, default=1024, help="width of the Linear layers")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = {m: launch(_run, NODES * PER_NODE, m, args.params, args.width, args.steps) for m in METHODS}
    mb = 2.0**20
    first = results[METHODS[0]][0]
    print(f"{first['numel'] / 1e6:.1f}M fp32 parameters ({first['numel'] * 4 / mb:.0f} MiB), "
          f"{NODES} nodes x {PER_NODE} ranks, rank 0, MiB")
    print(f"{'':42s}" + "".join(f"{m:>24s}" for m in METHODS))
    keys = list(dict.fromkeys(k for m in METHODS for k in results[m][0]["breakdown"]))
    for key in keys:
        print(f"{'  ' + key:42s}" + "".join(f"{results[m][0]['breakdown'].get(key, 0) / mb:>24.1f}" for m in METHODS))
    print(f"{'training state per rank':42s}" + "".join(f"{results[m][0]['total_bytes'] / mb:>24.1f}" for m in METHODS))
    print(f"{'peak resident memory (slowest rank)':42s}"
          + "".join(f"{max(r['peak_rss_bytes'] for r in results[m]) / mb:>24.1f}" for m in METHODS))
    ratios = {}
    for name, a, b in (("fsdp_onebit / ddp_onebit_flat", "fsdp_onebit", "ddp_onebit_flat"),
                       ("fsdp_onebit / ddp_onebit_hierarchical", "fsdp_onebit", "ddp_onebit_hierarchical"),
                       ("fsdp_onebit / fsdp_adamw", "fsdp_onebit", "fsdp_adamw")):
        measured = results[a][0]["total_bytes"] / results[b][0]["total_bytes"]
        at_2 = formula(a, PER_NODE, NODES) / formula(b, PER_NODE, NODES)
        at_8 = formula(a, 8, NODES) / formula(b, 8, NODES)
        ratios[name] = dict(measured=measured, formula_2x2=at_2, formula_8_per_node=at_8)
        print(f"{name:42s} measured {measured:.3f}, formula {at_2:.3f} at 2 x 2, {at_8:.3f} at 8 ranks per node")
    path = write_results("sharded_memory", dict(args=vars(args), per_rank=results, ratios=ratios))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
