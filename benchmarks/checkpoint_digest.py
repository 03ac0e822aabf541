"""What ``onebit_fsdp``'s whole-or-nothing, verified checkpoints cost: save and load time of a distributed checkpoint
as Lightning wrote it before (``torch.distributed.checkpoint`` straight into the folder, then ``meta.pt``: over the
previous save of the name, as ``last.ckpt`` was, and to a new name, as ``epoch=N.ckpt`` is) and as the strategy writes
it now (a temporary folder, every file's SHA-256 gathered into the manifest, the folder exchanged into
place; on load, the files verified against the manifest before DCP reads them), 4 gloo ranks as 2 simulated nodes x 2.

The state is what the strategy saves: a stack of ``Linear(W, W)`` layers of about ``--params`` fp32 parameters
(default 25e6: about 100 MB), each sharded with ``fully_shard`` over its node's 2 ranks, with two optimizer moments
per parameter as ``DTensor`` s (the checkpoint holds about 3x the model). Each variant is saved and loaded
``--repeats`` times after an untimed first pass, each repeat starting at another variant (median reported; the
files are in the page cache, as right after a save). Also reported: the time the digests themselves take (the
slowest rank's hashing at save, its verification at load), the time rank 0 takes to put the folder in place (the
exchange and the removal of the previous folder), and the checkpoint's bytes. Results:
``results/checkpoint_digest.json``.

    python -m benchmarks.checkpoint_digest --params 25e6
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import argument_parser, launch, write_results

NODES, PER_NODE, WIDTH = 2, 2, 1024


def _state(n_params: float) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (NODES, PER_NODE), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    layers = max(1, round(n_params / (WIDTH * WIDTH + WIDTH)))
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh["shard"])
    moments = {
        name: {key: DTensor.from_local(torch.randn_like(p.to_local()), p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride()) for key in ("exp_avg", "exp_avg_sq")}
        for name, p in model.named_parameters()
    }
    return {"state_dict": get_model_state_dict(model), "optimizer_0": {"state": moments}}


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _slowest(seconds: float) -> float:
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seconds)
    return max(everyone)


def _rank(rank: int, world_size: int, n_params: float, repeats: int, workdir: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    from lightning_onebit.strategy import checkpoint_files
    from lightning_onebit.strategy.checkpoint_files import FolderSave, agree_on_problems, folder_problems

    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # the in-place re-save says so
    state = _state(n_params)
    before, now = Path(workdir) / "before.ckpt", Path(workdir) / "now.ckpt"
    meta = {"epoch": 0, "global_step": 100, "loops": {}, "callbacks": {}}
    hashing: list[float] = []
    digest = checkpoint_files.file_digest

    def timed_digest(path: Path) -> dict[str, Any]:
        start = time.perf_counter()
        try:
            return digest(path)
        finally:
            hashing[-1] += time.perf_counter() - start

    checkpoint_files.file_digest = timed_digest  # type: ignore[assignment]
    placing: list[float] = []
    place = checkpoint_files.put_in_place

    def timed_place(new: Path, target: Path) -> None:
        start = time.perf_counter()
        place(new, target)
        placing.append(time.perf_counter() - start)

    checkpoint_files.put_in_place = timed_place  # type: ignore[assignment]

    def save_before(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=str(folder))
        if rank == 0:
            torch.save(meta, folder / "meta.pt")

    def save_before_new_name() -> None:
        save_before(Path(workdir) / f"before-{len(hashing)}.ckpt")

    def drop_new_names() -> None:
        dist.barrier()
        if rank == 0:
            for name in os.listdir(workdir):
                if name.startswith("before-"):
                    shutil.rmtree(Path(workdir) / name)
        dist.barrier()

    def save_now() -> None:
        save = FolderSave(now, f"bench-{len(hashing)}", rank, world_size)
        save.begin(lambda folder: None)
        writer = save.storage_writer()
        dcp.save(state, storage_writer=writer)
        save.finish(writer, dict(meta))

    def load_before() -> None:
        dcp.load(state, checkpoint_id=str(before))

    def load_now() -> None:
        agree_on_problems(folder_problems(now, rank, world_size, True), now, "onebit_fsdp")
        dcp.load(state, checkpoint_id=str(now))

    variants = (("save_before", lambda: save_before(before)), ("save_before_new_name", save_before_new_name),
                ("save_now", save_now), ("load_before", load_before), ("load_now", load_now))
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    hashes: dict[str, list[float]] = {"save_now": [], "load_now": []}
    for _, fn in variants:  # a first pass, not timed: every folder exists, the code paths are warm
        hashing.append(0.0)
        _timed(fn)
    drop_new_names()
    for repeat in range(repeats):
        # each repeat starts at another variant: on a shared machine, the writeback one save leaves behind slows the
        # next one, whichever it is
        for name, fn in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
            hashing.append(0.0)
            times[name].append(_timed(fn))
            if name in hashes:
                hashes[name].append(_slowest(hashing[-1]))
        drop_new_names()
    checkpoint_files.file_digest, checkpoint_files.put_in_place = digest, place  # type: ignore[assignment]
    files = sorted(os.listdir(now))
    return dict(
        seconds={name: statistics.median(values) for name, values in times.items()},
        all_seconds=times,
        digest_seconds={name: statistics.median(values) for name, values in hashes.items()},
        # rank 0 exchanging the new folder into place and removing the previous one (the first save has none)
        put_in_place_seconds=_slowest(statistics.median(placing) if placing else 0.0),
        model_bytes=sum(p.numel() * p.element_size() for p in state["state_dict"].values()),
        checkpoint_bytes=sum((now / f).stat().st_size for f in files if (now / f).is_file()),
        files=files,
    )


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=25e6)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--name", default="checkpoint_digest")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="checkpoint_digest_")
    try:
        result = launch(_rank, NODES * PER_NODE, args.params, args.repeats, workdir)[0]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    seconds, digests = result["seconds"], result["digest_seconds"]
    payload = dict(
        params=args.params, repeats=args.repeats, ranks=f"{NODES} nodes x {PER_NODE} (gloo, loopback, CPU)",
        torch=torch.__version__, cpu_count=os.cpu_count(), **result,
        save_overhead=seconds["save_now"] / seconds["save_before"] - 1,
        save_overhead_vs_new_name=seconds["save_now"] / seconds["save_before_new_name"] - 1,
        load_overhead=seconds["load_now"] / seconds["load_before"] - 1,
    )
    path = write_results(args.name, payload)
    print(f"model {result['model_bytes'] / 1e6:.1f} MB, checkpoint {result['checkpoint_bytes'] / 1e6:.1f} MB")
    print(f"save before: in place {seconds['save_before']:.3f} s, "
          f"to a new name {seconds['save_before_new_name']:.3f} s")
    for what in ("save", "load"):
        print(f"{what}: before {seconds[f'{what}_before']:.3f} s, now {seconds[f'{what}_now']:.3f} s "
              f"(of which digests {digests[f'{what}_now']:.3f} s on the slowest rank)")
    print(f"putting the folder in place (exchange, previous folder removed): {result['put_in_place_seconds']:.3f} s")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
