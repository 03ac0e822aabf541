"""Single-thread time of each compression kernel against a plain copy of the same buffer, per backend.

For one flat float32 buffer cut into BERT-like tensor segments (the momentum bucket of
``benchmarks.common.bert_like_shapes(--params)`` that holds the most tensors, padded for 2 ranks), the best of
``--repeats`` runs of:

  copy                  ``dst.copy_(src)``: reads and writes the buffer once, the memory-bandwidth yardstick
  compress              ``compress_with_error_feedback``: error add, per-segment scales, sign packing, error update
  decompress            ``decompress``: unpack and scale into a buffer
  decompress+accumulate ``decompress(accumulate=True)``
  server mean           ``add_mean_of_signs_`` over 2 sources of half the buffer each (the server phase at P = 2)
  frozen Adam update    ``frozen_adam_update_`` of all parameters (one pass over p, m, v per tensor): 1-bit Adam's
                        compression-stage update pass, recomputing ``sqrt(v) / sqrt(bc2) + eps`` every step
  frozen Adam update, cached denominator
                        the same with ``frozen=True`` (what ``OnebitAdam`` passes in its compression stage): the torch
                        path reuses the frozen variance's denominator (computed once, before the timed runs) and makes
                        two passes, ``p *= decay`` and ``p += step m / d``, instead of five with a temporary. The C
                        kernel ignores ``frozen`` (its row is its plain pass again): its one fused pass reads ``v``
                        where it would read the cached denominator, the same memory traffic; a C variant reading a
                        cached denominator was measured 0-10% faster, within this machine's noise, for 4 bytes per
                        parameter more memory, and not adopted
  frozen Adam update, cached denominator, clipped
                        the same with the clip of ``cap_update`` (``limit``, OnebitAdam's default): the torch path
                        divides into one temporary per run of tensors, clamps it and adds it (five passes); the C
                        kernel clips inside its one pass
  1-bit LAMB update     ``OnebitLamb``'s compression-stage update of all parameters after the exchange (fresh
                        variance, ratios, the update and its norms, trust factor, step): about thirteen torch passes,
                        or one fused C pass per tensor plus the step

for every available CPU backend (``torch``, and ``cpu`` where the C kernels build). Results: results/kernels.json.

    python -m benchmarks.kernels
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from benchmarks.common import argument_parser, bert_like_shapes, momentum_buckets, write_results
from lightning_onebit import kernels
from lightning_onebit.comm import BucketLayout
from lightning_onebit.optim.functional import adam_step_bound



def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: page faults, lazy builds
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def _lamb_update(numels: list[int], backend: str) -> Callable[[], object]:
    """``OnebitLamb``'s compression-stage update of all parameters (after the exchange: fresh variance, ratios, the
    update and its norms, the trust factor, the step), weight decay on, with a frozen variance whose cached
    denominators the untimed first call computes."""
    from lightning_onebit import OnebitLamb

    g = torch.Generator().manual_seed(1)
    params = [torch.randn(k, generator=g) * 0.02 for k in numels]
    opt = OnebitLamb(params, lr=1e-3, weight_decay=0.01, freeze_step=2, kernel_backend=backend,
                     dead_coordinates="ignore")
    for p in params:
        opt.state[p].update(exp_avg=torch.randn(p.numel(), generator=g) * 1e-3,
                            exp_avg_sq=torch.rand(p.numel(), generator=g) * 1e-6,
                            exp_avg_last=torch.randn(p.numel(), generator=g) * 1e-3,
                            lamb_coeff=torch.tensor(1.0, dtype=torch.float64))
    return lambda: opt._compressed_update_(opt.param_groups[0], params, 10, 2)


def main() -> None:
    parser = argument_parser(__spec__.name, __doc__)
    parser.add_argument("--params", type=float, default=22.7e6, help="BERT-like model size (default 22.7e6)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per kernel, best kept (default 7)")
    args = parser.parse_args()
    torch.set_num_threads(1)

    numels = [int(torch.Size(s).numel()) for s in bert_like_shapes(args.params)]
    # the bucket of encoder-layer tensors with the most segments (the first one holds the word embedding alone)
    layout = BucketLayout.build(max(momentum_buckets(args.params), key=len), 2)
    n = layout.padded_numel
    g = torch.Generator().manual_seed(0)
    x, error, out = torch.randn(n, generator=g), torch.zeros(n), torch.empty(n)
    packed = torch.empty(n // 8, dtype=torch.uint8)
    chunk, own = layout.chunk_numel, layout.chunk_segments[0]
    server_error = torch.zeros(chunk)
    params = [torch.randn(k, generator=g) for k in numels]
    exp_avgs = [torch.randn(k, generator=g) for k in numels]
    exp_avg_sqs = [torch.rand(k, generator=g) for k in numels]

    backends = [b for b in kernels.available_backends() if b in ("torch", "cpu")]
    copy_ms = _best_ms(lambda: out.copy_(x), args.repeats)
    rows = []
    for backend in backends:
        workspace = kernels.Workspace()
        scales, _ = kernels.compress_with_error_feedback(x, error, layout.segments, packed, backend, workspace)
        halves = [packed[: chunk // 8], packed[chunk // 8 :]]
        half_scales = [torch.rand(len(own), generator=g), torch.rand(len(own), generator=g)]
        timings = {
            "compress": lambda: kernels.compress_with_error_feedback(
                x, error, layout.segments, packed, backend, workspace),
            "decompress": lambda: kernels.decompress(packed, scales, layout.segments, out, False, backend, workspace),
            "decompress+accumulate": lambda: kernels.decompress(
                packed, scales, layout.segments, out, True, backend, workspace),
            "server mean (P=2)": lambda: kernels.add_mean_of_signs_(
                server_error, halves, half_scales, own, backend, workspace),
            "frozen Adam update": lambda: kernels.frozen_adam_update_(
                params, exp_avgs, exp_avg_sqs, 0.999, 0.9, 1e-8, -1e-4, backend),
        }
        # OnebitAdam's compression stage passes frozen=True: the torch path then caches the denominators (computed by
        # _best_ms's untimed first call); the C kernel ignores it, so its row is its plain pass measured again
        timings["frozen Adam update, cached denominator"] = lambda: kernels.frozen_adam_update_(
            params, exp_avgs, exp_avg_sqs, 0.999, 0.9, 1e-8, -1e-4, backend, frozen=True)
        timings["frozen Adam update, cached denominator, clipped"] = lambda: kernels.frozen_adam_update_(
            params, exp_avgs, exp_avg_sqs, 0.999, 0.9, 1e-8, -1e-4, backend, frozen=True,
            limit=adam_step_bound((0.9, 0.999)))
        timings["1-bit LAMB update"] = _lamb_update(numels, backend)
        for name, fn in timings.items():
            ms = _best_ms(fn, args.repeats)
            elements = sum(numels) if name.startswith(("frozen Adam update", "1-bit LAMB")) else n
            rows.append(dict(backend=backend, kernel=name, elements=elements, ms=ms,
                             copies=ms / (copy_ms * elements / n)))

    print(f"buffer: {n:,} float32 elements in {len(layout.segments)} segments; 1 thread; best of {args.repeats}")
    print(f"plain copy of the buffer: {copy_ms:.2f} ms")
    print(f"{'kernel':40s}{'backend':>8s}{'elements':>13s}{'ms':>10s}{'x copy':>9s}")
    for r in rows:
        print(f"{r['kernel']:40s}{r['backend']:>8s}{r['elements']:>13,d}{r['ms']:>10.2f}{r['copies']:>9.2f}")
    path = write_results("kernels", dict(args=vars(args), numel=n, segments=len(layout.segments), copy_ms=copy_ms,
                                         rows=rows))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
