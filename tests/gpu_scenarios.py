"""Device-generic scenarios of the GPU suite (``tests/gpu/test_gpu.py``), module level so that spawned ranks can run
them.

Each takes the device as an argument: the GPU suite runs them on ``cuda``; they also run on ``cpu``, which is how their
logic is checked on machines without a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from lightning_onebit import OnebitAdam, OnebitLamb, ZeroOneAdam
from lightning_onebit.hooks import GradientSyncState, OverlapState, overlapped_exchange_hook, switchable_allreduce_hook
from tests.optim_models import EmbeddingNet, Net, rank_batch, token_batch

FREEZE = 3


def _device_ids(device: str) -> list[int] | None:
    """DDP's ``device_ids`` for a model on ``device`` ("cuda" is the current device, one per rank under NCCL)."""
    return [torch.cuda.current_device()] if torch.device(device).type == "cuda" else None


def _batches(rank: int, steps: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [tuple(t.to(device) for t in rank_batch(rank, step)) for step in range(steps)]


def warmup_against_fused_adamw(optimizer: str, device: str, autocast: bool, steps: int = 6):
    """The same network trained ``steps`` warmup steps by ``optimizer`` and by ``torch.optim.AdamW(fused=True)``."""
    params = []
    for make in ("ours", "reference"):
        net = Net().to(device)
        if make == "reference":
            opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
        elif optimizer == "onebit_adam":
            opt = OnebitAdam(net.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=100)
        else:  # its first var_update_scaler steps are variance steps: AdamW on averaged gradients
            opt = ZeroOneAdam(net.parameters(), lr=1e-2, weight_decay=0.01, var_freeze_step=100)
        for x, y in _batches(0, steps, device):
            with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.mse_loss(net(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        params.append([p.detach().cpu() for p in net.parameters()])
    return params


def lamb_run(device: str, steps: int = 8) -> list[torch.Tensor]:
    """1-bit LAMB on one rank through its warmup and compression stage (the exchange of one rank is the identity)."""
    net = Net().to(device)
    opt = OnebitLamb(net.parameters(), lr=1e-2, weight_decay=0.01, freeze_step=FREEZE, dead_coordinates="ignore")
    for x, y in _batches(0, steps, device):
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().cpu() for p in net.parameters()]


def overlap_scenario(rank: int, world_size: int, device: str, steps: int = 9) -> dict[str, Any]:
    """Overlapped vs in-step exchange, same momentum layout; the embedding (DDP's last bucket) is ``compress=False``,
    so its hook starts no exchange and only advances the others (on the side stream)."""
    out: dict[str, Any] = {}
    for enabled in (True, False):
        net = EmbeddingNet().to(device)
        ddp = DDP(net, device_ids=_device_ids(device), bucket_cap_mb=0.002)
        groups = [{"params": [net.emb.weight], "compress": False},
                  {"params": [p for n, p in net.named_parameters() if not n.startswith("emb")]}]
        opt = OnebitAdam(groups, lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
        state = OverlapState(ddp, opt, enabled=enabled)
        ddp.register_comm_hook(state, overlapped_exchange_hook)
        for step in range(steps):
            x, y = (t.to(device) for t in token_batch(rank, step))
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        out["overlapped" if enabled else "in_step"] = [p.detach().cpu() for p in net.parameters()]
        if enabled:
            out["started"] = state.buckets_started
            out["side_stream"] = opt.exchange.side_stream is not None
    return out


def _train(rank: int, device: str, steps: int, start: int = 0, net=None, opt=None):
    if net is None:
        net = Net().to(device)
        opt = OnebitAdam(net.parameters(), lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
    ddp = DDP(net, device_ids=_device_ids(device))
    ddp.register_comm_hook(GradientSyncState(sync_predicate=lambda: opt.needs_gradient_allreduce),
                           switchable_allreduce_hook)
    for x, y in _batches(rank, start + steps, device)[start:]:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _snapshot(net, opt) -> dict[str, Any]:
    buckets = [opt.compression._buckets[k] for k in sorted(opt.compression._buckets)]
    return dict(
        params=[p.detach().cpu().clone() for p in net.parameters()],
        worker_error=[b.worker_error.cpu().clone() for b in buckets],
        server_error=[b.server_error.cpu().clone() for b in buckets],
    )


def resume_scenario(rank: int, world_size: int, device: str, workdir: str, saved_at: int = 6) -> dict[str, Any]:
    """Train ``saved_at + 1`` steps in one go, and ``saved_at`` steps, save (error feedback included, per rank),
    reload as a new process would (``map_location="cpu"``) and take one more step: the same bits either way."""
    uninterrupted = _snapshot(*_train(rank, device, saved_at + 1))
    net, opt = _train(rank, device, saved_at)
    path = os.path.join(workdir, f"rank{rank}.pt")
    torch.save(dict(model=net.state_dict(), optimizer=opt.state_dict(), error=opt.error_feedback_state_dict()), path)
    saved = torch.load(path, map_location="cpu", weights_only=False)
    net = Net().to(device)
    net.load_state_dict(saved["model"])
    opt = OnebitAdam(net.parameters(), lr=1e-2, freeze_step=FREEZE, dead_coordinates="ignore")
    opt.load_state_dict(saved["optimizer"])
    opt.load_error_feedback_state_dict(saved["error"])
    restored = next(iter(opt.compression._buckets.values())).worker_error
    restored_device, restored_norm = restored.device.type, float(restored.norm())
    net, opt = _train(rank, device, 1, start=saved_at, net=net, opt=opt)
    return dict(uninterrupted=uninterrupted, resumed=_snapshot(net, opt), restored_device=restored_device,
                restored_norm=restored_norm)


def outer_steps_scenario(rank: int, world_size: int, device: str, kind: str, inner_steps: int = 12) -> dict[str, Any]:
    """Local steps without Lightning, each rank a replica: a model on ``device`` takes ``inner_steps`` drifts of its
    own (made on the CPU from the rank and step, so every device sees the same values), and a
    :class:`~lightning_onebit.optim.StreamingOuterStep` of compressor ``kind`` (2 fragments, every 4 steps, the
    exchange overlapped with 1 inner step, outer SGD at lr 1: every operation exact or a kernel the GPU suite checks
    bitwise) syncs it, then flushes. The CPU accumulates the 1-bit scales' norms in float64, as CUDA does. Returns
    the outer values after every sync and the parameters after the flush (on the CPU), and the devices that the outer
    values and the error feedback live on."""
    from lightning_onebit.comm import make_outer_compressor
    from lightning_onebit.kernels import torch_kernels
    from lightning_onebit.optim.streaming import StreamingOuterStep

    torch_kernels.NORM_ACCUMULATE_DTYPE["cpu"] = torch.float64
    net = Net().to(device)  # Net seeds itself: the same first values on every rank
    params = list(net.parameters())
    step = StreamingOuterStep.build(params, lambda: make_outer_compressor(kind), fragments=2, sync_every=4,
                                    overlap_steps=1, optimizer="sgd", lr=1.0, bucket_cap_mb=0.0005)
    syncs: list[list[torch.Tensor]] = []
    step.on_sync = lambda fragment, sent: syncs.append(
        [v.cpu().clone() for f in step.fragments for v in f.outer_values().values()])
    g = torch.Generator().manual_seed(1000 + rank)
    for inner in range(1, inner_steps + 1):
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=g).mul_(0.01).to(device))
        step.after_inner_step(inner)
    step.flush(inner_steps)
    errors = [f.compressor.error_feedback(b.key) for f in step.fragments for b in f.buckets]
    return dict(syncs=syncs, final=[p.detach().cpu().clone() for p in params],
                outer_devices={v.device.type for f in step.fragments for v in f.outer_values().values()},
                error_devices={e.device.type for e in errors if e is not None},
                errors=sum(e is not None for e in errors))
