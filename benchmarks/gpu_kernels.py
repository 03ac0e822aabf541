"""The compression kernels and a simulated compressed step on one CUDA GPU, against a plain device copy.

For the momentum bucket of a BERT-like model (``--params``, default BERT-base size) that holds the most tensors, laid
out for ``--ranks`` ranks (one scale per tensor and chunk), the median of ``--repeats`` CUDA-event timings of:

  copy                   ``dst.copy_(src)`` of the bucket: reads and writes it once, the memory-bandwidth yardstick
  compress               ``compress_with_error_feedback``: error add, per-segment scales, sign packing, error update
  decompress             ``decompress``: unpack and scale into a buffer
  compress + decompress  the two together: the goal is within 4x of a copy
  server mean            ``add_mean_of_signs_`` over ``--ranks`` sources of one chunk (one server's phase)
  simulated step         ``simulate_compressed_allreduce_`` of the bucket for ``--ranks`` ranks in one process
                         (every rank's compression, serving and decoding: the collectives become device copies),
                         reported per simulated rank

for the torch kernels and, where cupy imports, the cupy ones, side by side. The device name and versions go with the
figures into results/gpu_kernels.json.

    python -m benchmarks.gpu_kernels
"""

from __future__ import annotations

import statistics
import sys
from typing import Callable

import torch

from benchmarks.common import argument_parser, momentum_buckets, write_results
from lightning_onebit import kernels
from lightning_onebit.comm import BucketLayout, simulate_compressed_allreduce_

def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):  # warm: allocator, lazy module loads, cupy compilation
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=110e6, help="BERT-like model size (default 110e6)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks the bucket is laid out for (default 8)")
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per kernel, median kept (default 50)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("python -m benchmarks.gpu_kernels needs a CUDA GPU")
    device = torch.device("cuda")
    # the bucket of encoder-layer tensors with the most segments (the first one holds the word embedding alone)
    layout = BucketLayout.build(max(momentum_buckets(args.params), key=len), args.ranks)
    n, chunk = layout.padded_numel, layout.chunk_numel
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(n, generator=g, device=device)
    error, out = torch.zeros(n, device=device), torch.empty(n, device=device)
    packed = torch.empty(n // 8, dtype=torch.uint8, device=device)
    own = layout.chunk_segments[0]
    server_error = torch.zeros(chunk, device=device)
    copy_ms = _median_ms(lambda: out.copy_(x), args.repeats)

    backends = [b for b in kernels.available_backends() if b in ("torch", "cupy")]
    rows = []
    for backend in backends:
        ws = kernels.Workspace()
        scales, _ = kernels.compress_with_error_feedback(x, error, layout.segments, packed, backend, ws)
        sources = [packed[: chunk // 8]] * args.ranks
        source_scales = [torch.rand(len(own), generator=g, device=device) for _ in range(args.ranks)]
        inputs = [x.clone() for _ in range(args.ranks)]
        states = simulate_compressed_allreduce_(inputs, layout, backend=backend, workspace=ws)

        def both() -> None:
            kernels.compress_with_error_feedback(x, error, layout.segments, packed, backend, ws)
            kernels.decompress(packed, scales, layout.segments, out, False, backend, ws)

        timings = {
            "compress": lambda: kernels.compress_with_error_feedback(x, error, layout.segments, packed, backend, ws),
            "decompress": lambda: kernels.decompress(packed, scales, layout.segments, out, False, backend, ws),
            "compress + decompress": both,
            f"server mean (P={args.ranks})": lambda: kernels.add_mean_of_signs_(
                server_error, sources, source_scales, own, backend, ws),
            "simulated step, per rank": lambda: simulate_compressed_allreduce_(
                inputs, layout, states, backend=backend, workspace=ws),
        }
        for name, fn in timings.items():
            ms = _median_ms(fn, args.repeats)
            if name.startswith("simulated"):
                ms /= args.ranks
            elements = chunk if name.startswith("server") else n
            rows.append(dict(backend=backend, kernel=name, elements=elements, ms=ms,
                             copies=ms / (copy_ms * elements / n)))

    name = torch.cuda.get_device_name(device)
    print(f"{name}; torch {torch.__version__}; bucket of {n:,} float32 elements in {len(layout.segments)} segments "
          f"for {args.ranks} ranks; median of {args.repeats}")
    print(f"plain copy of the bucket: {copy_ms:.3f} ms ({2 * 4 * n / copy_ms / 1e6:.0f} GB/s read + write)")
    print(f"{'kernel':28s}{'backend':>8s}{'elements':>13s}{'ms':>10s}{'x copy':>9s}")
    for r in rows:
        print(f"{r['kernel']:28s}{r['backend']:>8s}{r['elements']:>13,d}{r['ms']:>10.3f}{r['copies']:>9.2f}")
    try:
        import cupy

        cupy_version = cupy.__version__
    except Exception:  # noqa: BLE001 - optional
        cupy_version = None
    path = write_results("gpu_kernels", dict(
        device=name, torch=torch.__version__, cuda=torch.version.cuda, cupy=cupy_version, args=vars(args),
        numel=n, segments=len(layout.segments), copy_ms=copy_ms, rows=rows,
    ))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
