"""The GPU suite: everything a single CUDA device can check (``python -m pytest -m gpu tests``).

NCCL refuses two ranks on one GPU, so multi-rank checks here use two gloo processes sharing the GPU (gloo moves CUDA
tensors through host memory, so the data are real and the exchange is the real one) or one process as rank 0 of a
torch *fake* process group (no data move; for stream-ordering and host-sync checks). NCCL itself is exercised by
``tests/gpu/test_nccl.py``, which needs two GPUs.

* kernels (torch and cupy) bitwise against the CPU computation, on the default and on a side stream;
* OnebitAdam's and ZeroOneAdam's warmup bitwise against ``torch.optim.AdamW(fused=True)`` (fp32, bf16 autocast);
  1-bit LAMB on CUDA against the same run on the CPU;
* a single-process simulation of P ranks through compress / serve / decode, bitwise against the CPU;
* compressed steps of every optimizer under ``torch.cuda.set_sync_debug_mode("error")`` and under
  ``TORCH_CUDA_SANITIZER=1`` (the overlap hook's side stream);
* 2 ranks on the GPU: the overlapped exchange gives the in-step bits with a ``compress=False`` embedding bucket that
  starts no exchange; resume with the error feedback kept continues the uninterrupted run bit for bit;
* local steps' outer step (streamed, overlapped) on 2 and 3 ranks on the GPU with every compressor: the replicas'
  outer values the same bits after every sync, the state on the GPU, and the same values as the same run on the CPU.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lightning_onebit import kernels
from lightning_onebit.comm import BucketLayout, simulate_compressed_allreduce_
from lightning_onebit.kernels import Segments, cupy_kernels, torch_kernels
from tests.distributed import run_distributed
from tests.gpu_scenarios import (
    lamb_run,
    outer_steps_scenario,
    overlap_scenario,
    resume_scenario,
    warmup_against_fused_adamw,
)
from tests.paths import ASSETS, ROOT, script_env

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BACKENDS = ["torch", pytest.param("cupy", marks=pytest.mark.skipif(
    not cupy_kernels.is_available(), reason="needs cupy"))]


@pytest.fixture
def float64_norms_on_cpu(monkeypatch):
    """CUDA accumulates the norms of the scales in float64; the CPU reference does the same here."""
    monkeypatch.setitem(torch_kernels.NORM_ACCUMULATE_DTYPE, "cpu", torch.float64)


def _segments_and_data(n_segments: int, seed: int) -> tuple[Segments, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = (torch.randint(1, 200_000, (n_segments,), generator=g)).tolist()
    total = sum(lengths)
    lengths[-1] += -total % 8
    segments = Segments.from_lengths(lengths)
    magnitudes = torch.repeat_interleave(10.0 ** torch.randint(-3, 3, (n_segments,), generator=g).double(),
                                         torch.tensor(lengths))
    return segments, (torch.randn(segments.total, generator=g, dtype=torch.float64) * magnitudes).float()


def _bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
        differ = (a.view(-1) != b.view(-1)).nonzero().flatten()
        raise AssertionError(f"{what}: {differ.numel()} element(s) differ, first at {differ[:5].tolist()}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("side_stream", [False, True], ids=["default_stream", "side_stream"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_bitwise_against_cpu(backend, side_stream, dtype, float64_norms_on_cpu):
    segments, x = _segments_and_data(40, seed=1)
    x = x.to(dtype)
    error = (torch.randn(segments.total, generator=torch.Generator().manual_seed(2)) * 1e-2).to(dtype)
    sources = 3
    stream = torch.cuda.Stream() if side_stream else torch.cuda.current_stream()
    cuda_x, cuda_error = x.cuda(), error.cuda()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ws = kernels.Workspace()
        scales, packed = kernels.compress_with_error_feedback(cuda_x, cuda_error, segments, backend=backend,
                                                              workspace=ws)
        decoded = kernels.decompress(packed, scales, segments, torch.empty_like(cuda_x), backend=backend,
                                     workspace=ws)
        target = torch.ones_like(cuda_x)
        kernels.add_mean_of_signs_(target, [packed] * sources, [scales * (j + 1) for j in range(sources)],
                                   segments, backend=backend, workspace=ws)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    cpu_error = error.clone()
    cpu_scales, cpu_packed = kernels.compress_with_error_feedback(x, cpu_error, segments, backend="torch")
    _bits_equal(scales, cpu_scales, "scales")
    _bits_equal(packed, cpu_packed, "packed signs")
    _bits_equal(cuda_error, cpu_error, "error feedback")
    _bits_equal(decoded, kernels.decompress(cpu_packed, cpu_scales, segments, torch.empty_like(x), backend="torch"),
                "decoded")
    cpu_target = torch.ones_like(x)
    kernels.add_mean_of_signs_(cpu_target, [cpu_packed] * sources, [cpu_scales * (j + 1) for j in range(sources)],
                               segments, backend="torch")
    _bits_equal(target, cpu_target, "mean of signs")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 5])
def test_simulated_exchange_bitwise_against_cpu(backend, world_size, float64_norms_on_cpu):
    layout = BucketLayout.build([300_001, 17, 4096, 1_000_000], world_size)
    g = torch.Generator().manual_seed(world_size)

    def inputs(step: int) -> list[torch.Tensor]:
        out = []
        for r in range(world_size):
            x = torch.zeros(layout.padded_numel)
            x[: layout.numel] = torch.randn(layout.numel, generator=g) * (1 + r + step)
            out.append(x)
        return out

    cpu_states = cuda_states = None
    for step in range(3):  # error feedback carried from step to step
        xs = inputs(step)
        cpu, cuda = [x.clone() for x in xs], [x.cuda() for x in xs]
        cpu_states = simulate_compressed_allreduce_(cpu, layout, cpu_states, backend="torch")
        cuda_states = simulate_compressed_allreduce_(cuda, layout, cuda_states, backend=backend)
        for r in range(world_size):
            _bits_equal(cuda[r], cpu[r], f"step {step} rank {r}: average")
            _bits_equal(cuda_states[r].worker_error, cpu_states[r].worker_error, f"step {step} rank {r}: e_w")
            _bits_equal(cuda_states[r].server_error, cpu_states[r].server_error, f"step {step} rank {r}: e_s")


@pytest.mark.parametrize("optimizer", ["onebit_adam", "zeroone_adam"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-mixed"])
def test_warmup_is_fused_adamw_bitwise(optimizer, autocast):
    ours, reference = warmup_against_fused_adamw(optimizer, "cuda", autocast)
    for a, b in zip(ours, reference):
        _bits_equal(a, b, f"{optimizer} warmup parameter")


def test_lamb_on_cuda_follows_the_cpu_run():
    cuda, cpu = lamb_run("cuda"), lamb_run("cpu")
    for a, b in zip(cuda, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-5)


def _run_asset(*args: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [sys.executable, str(ASSETS / "cuda_fake_group.py"), *args],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=script_env(**(env or {})),
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def test_compressed_steps_never_synchronise_the_host():
    output = _run_asset("--sync-debug")
    assert output.count("OK ") == 12, output[-3000:]


def test_overlap_side_stream_is_clean_under_the_cuda_sanitizer():
    output = _run_asset(env={"TORCH_CUDA_SANITIZER": "1"})
    assert "CSAN detected a possible data race" not in output, output[-6000:]
    assert output.count("OK ") == 12, output[-3000:]


def test_two_ranks_on_one_gpu_overlap_gives_the_in_step_bits():
    results = run_distributed(overlap_scenario, 2, "cuda", timeout_s=300)
    for rank, r in enumerate(results):
        assert r["started"] > 0 and r["side_stream"], f"rank {rank}: the overlap never started on CUDA"
        for a, b in zip(r["overlapped"], r["in_step"]):
            _bits_equal(a, b, f"rank {rank}: overlapped vs in-step parameter")
    for a, b in zip(results[0]["overlapped"], results[1]["overlapped"]):
        _bits_equal(a, b, "replicas")


def test_two_ranks_on_one_gpu_keep_resume_continues_bitwise(tmp_path):
    results = run_distributed(resume_scenario, 2, "cuda", str(tmp_path), timeout_s=300)
    for rank, r in enumerate(results):
        assert r["restored_device"] == "cuda", f"rank {rank}: error feedback restored on {r['restored_device']}"
        assert r["restored_norm"] > 0
        for name in ("worker_error", "server_error"):
            for a, b in zip(r["resumed"][name], r["uninterrupted"][name]):
                _bits_equal(a, b, f"rank {rank}: {name} after the first resumed step")
        for a, b in zip(r["resumed"]["params"], r["uninterrupted"]["params"]):
            _bits_equal(a, b, f"rank {rank}: parameters after the first resumed step")


@pytest.mark.parametrize("kind, world_size", [("onebit", 2), ("onebit", 3), ("topk", 2), ("none", 2), ("bf16", 3)])
def test_outer_steps_on_the_gpu_agree_across_replicas_and_with_the_cpu(kind, world_size):
    cuda = run_distributed(outer_steps_scenario, world_size, "cuda", kind, timeout_s=300)
    cpu = run_distributed(outer_steps_scenario, world_size, "cpu", kind, timeout_s=300)
    assert len(cuda[0]["syncs"]) == len(cpu[0]["syncs"]) > 0
    for rank, r in enumerate(cuda):
        assert r["outer_devices"] == {"cuda"}, f"rank {rank}: outer values on {r['outer_devices']}"
        if kind != "none":
            assert r["errors"] > 0 and r["error_devices"] == {"cuda"}, f"rank {rank}: error feedback {r}"
        for i, (values, reference) in enumerate(zip(r["syncs"], cuda[0]["syncs"])):
            for a, b in zip(values, reference):
                _bits_equal(a, b, f"sync {i}: rank {rank} against rank 0")
        for a, b in zip(r["final"], cuda[0]["final"]):
            _bits_equal(a, b, f"rank {rank}: parameters after the flush")
    for i, (values, reference) in enumerate(zip(cuda[0]["syncs"], cpu[0]["syncs"])):
        for a, b in zip(values, reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"sync {i}, CUDA against CPU: {m}")
