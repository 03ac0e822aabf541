"""The behaviour record's cases: what runs, and what each rank records (shared by ``record.py`` and the replay test).

Every case is one ``lightning.Trainer.fit`` with :class:`~lightning_onebit.OnebitStrategy` on CPU ranks joined by
gloo (``tests/distributed.py``): a small three-layer MLP, each rank on its own data, ``FREEZE`` warmup steps, then
compression-stage steps. One rank's record (:func:`run_case`) holds CPU tensors and plain Python values only:

* ``tensors``: every parameter after the fit (``param/<name>``, flattened, in ``named_parameters()`` order), this
  rank's error feedback (``error_feedback/<stream>/<bucket>/worker_error`` and ``.../server_error``, from the
  optimizer's public ``error_feedback_state_dict()``: the buffers ``ErrorFeedbackCheckpoint`` saves), and every
  tensor of the optimizer's ``state_dict()["state"]`` (``optimizer_state/<param name>/<key>``: moments, 1-bit LAMB's
  coefficients, 0/1 Adam's sync state);
* ``values``: the optimizer's step count, the per-step training losses (Python floats), a fingerprint of the
  parameters' bits after every optimizer step (``param_bits_by_step``: SHA-256 of the flattened parameters, so the
  first step that differs can be named without storing every step's parameters), the steps taken by kind, the
  compressed bucket layouts, the optimizer state's non-tensor entries, and per mode: the overlap hook's bucket count
  and the fallback reason (overlapped), the forced syncs (0/1 Adam).

The ranks run with the CPU pinned to ISA-independent code paths (:func:`deterministic_cpu_env`), and the library takes
correctly rounded square roots (torch's own CPU ``sqrt`` is neither correctly rounded nor the same bits on every CPU:
:mod:`lightning_onebit.kernels.native`), so that a record made on one x86 machine replays bit for bit on another: an
emulated Intel Haswell (``qemu-x86_64 -cpu Haswell-noTSX``: no AVX-512, another vendor) replays the record of an
AVX-512 AMD EPYC bit for bit (``tests/strategy/test_behaviour_replay.py``). The record names the processor it was made
on (:func:`cpu_description`); a replay on a processor with other instruction-set features cannot be held to every bit
(some library a dependency uses may still choose its code by processor), and compares what is portable instead (the
replay test's module docstring says what).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import os
import platform
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning_onebit import OnebitAdam, OnebitStrategy, OnebitLamb, ZeroOneAdam

# ======================================================================================== the CPU environment
#: What the spawned ranks must run under, so that a record made on one x86 CPU replays bit for bit on another. Why
#: each one:
#:
#: * ``ATEN_CPU_CAPABILITY=default``: torch's CPU kernels (elementwise ops, reductions, foreach ops, its own bf16 gemm)
#:   are compiled for several ISAs (default, AVX2, AVX512) and picked from the CPU at run time; the vectorised ones
#:   round differently (sqrt, tanh, exp, the summation order of reductions). ``default`` runs the same code on every
#:   x86 CPU. (Without it, on the AVX512 machine that made the record, every case differs.)
#: * ``MKL_CBWR=COMPATIBLE``: MKL, which runs the fp32 matmuls of ``32-true``, otherwise picks its code (blocking, FMA)
#:   by CPU generation; its "conditional numerical reproducibility" mode gives the same bits on every x86 CPU. (Without
#:   it every ``32-true`` case differs; with it, restricting MKL to SSE4.2, as on an old CPU, changes nothing.)
#: * ``ONEDNN_MAX_CPU_ISA=AVX2``: torch may hand bf16 matmuls (``bf16-mixed``) to oneDNN where oneDNN reports native
#:   bf16 (AVX512-BF16, AMX, AVX2-VNNI-2), and oneDNN's kernels differ by ISA. Capped at AVX2, oneDNN reports none on
#:   any CPU (``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False), so every machine takes torch's own gemm.
#: * ``OMP_NUM_THREADS=1`` (and ``torch.set_num_threads(1)``, which ``tests/distributed.py`` calls in every rank): a
#:   parallel reduction's partial sums depend on the thread count, i.e. on the machine's core count.
#:
#: torch, MKL and oneDNN read them when they initialise in the rank, so they must be in ``os.environ`` before the
#: ranks are spawned (a spawned process inherits it); setting them inside a rank would be too late for some.
#:
#: Not an environment variable: the package's own C kernels (``KERNEL_BACKEND``) choose AVX2 or scalar loops at run
#: time. They are written to give the same bits either way (1-bit LAMB's fused pass sums squares in float64 in another
#: order under AVX2, which could in principle change a trust ratio); a build with the AVX2 paths switched off replayed
#: every case of the record bit for bit.
DETERMINISTIC_CPU_ENV = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "OMP_NUM_THREADS": "1",
}


@contextlib.contextmanager
def deterministic_cpu_env(environment: Optional[dict[str, str]] = None) -> Iterator[None]:
    """Put ``environment`` (default :data:`DETERMINISTIC_CPU_ENV`) into ``os.environ`` (overriding what the shell set)
    for the ranks spawned inside the block; the caller's environment is restored after it."""
    environment = DETERMINISTIC_CPU_ENV if environment is None else environment
    saved = {key: os.environ.get(key) for key in environment}
    os.environ.update(environment)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cpu_description() -> dict[str, Any]:
    """The processor this process runs on, as the record keeps it: ``features``, the instruction-set extensions the
    process sees (numpy's CPUID probe, sorted: under an emulator the emulated processor's), which decide whether a
    replay can be held to every bit; and, for the reader, ``vendor`` and ``model`` and the ``flags`` that
    ``/proc/cpuinfo`` lists (Linux; under a user-mode emulator the host's), the machine and the C library."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as probed
    except ImportError:  # numpy < 2
        from numpy.core._multiarray_umath import __cpu_features__ as probed
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return dict(
        features=sorted(name for name, present in probed.items() if present),
        vendor=info.get("vendor_id", ""),
        model=info.get("model name", ""),
        flags=sorted(info.get("flags", "").split()),
        machine=platform.machine(),
        libc=" ".join(platform.libc_ver()),
    )


def processor_features(rank: int, world_size: int, workdir: str) -> list[str]:
    """A ``run_scenarios`` scenario: the instruction-set features this rank's process sees."""
    return cpu_description()["features"]


def _check_rank_environment(environment: dict[str, str]) -> None:
    """In a rank: fail the case if it does not run under ``environment`` (spawned outside
    :func:`deterministic_cpu_env`): its numbers would not be comparable with the record."""
    wrong = {k: os.environ.get(k) for k, v in environment.items() if os.environ.get(k) != v}
    capability = torch.backends.cpu.get_cpu_capability()
    wanted = environment["ATEN_CPU_CAPABILITY"].upper()
    if wrong or capability != wanted or torch.get_num_threads() != 1:
        raise RuntimeError(
            f"behaviour cases must run under tests.behaviour.cases.deterministic_cpu_env(): environment {wrong}, "
            f"torch CPU capability {capability!r} (wanted {wanted!r}), {torch.get_num_threads()} threads"
        )


# ======================================================================================== the case table
FREEZE = 3  # warmup steps (ZeroOneAdam: var_update_scaler, the all-variance-step start)
ADAM_STEPS = 7  # OnebitAdam, OnebitLamb: 3 warmup + 4 compression-stage steps
# ZeroOneAdam: 3 warmup (variance) steps, variance steps 4 and 6 (var_interval 2), compressed steps 5 and 7, then local
# steps from 8 (var_freeze_step 7): step 8 syncs (local_step_interval 1, doubling to 2 after each local step, clipped
# at 2), step 9 is local only, and the strategy's end-of-fit sync (on_train_end) syncs again
ZEROONE_STEPS = 9
ZEROONE_SCHEDULE = dict(var_freeze_step=7, var_update_scaler=FREEZE, local_step_scaler=1, local_step_clipper=2)
LR = 1e-2
WEIGHT_DECAY = 0.01
#: The package's fused C kernels (what ``kernel_backend="auto"`` runs on CPU float32 wherever ``cc`` builds them),
#: named explicitly: the torch kernels give other bits (the C Adam update and LAMB pass round differently in the last
#: bit; every case differs with ``"torch"``), so a machine without a C compiler must fail the cases ("the native
#: kernels could not be built") rather than replay them with the torch kernels.
KERNEL_BACKEND = "cpu"
# DDP closes a gradient bucket once it holds >= 40 bytes, in the order the gradients become ready: three buckets,
# (l3.bias, l3.weight, l2.bias), (l2.weight), (l1.bias, l1.weight) in 32-true (bf16 autocast readies them in another
# order), so the overlapped exchange starts three per backward. The overlapped momenta are laid out like them.
DDP_BUCKET_CAP_MB = 40 / 2**20
# The optimizer's own momentum buckets (flat and hierarchical modes, and ZeroOneAdam's overlap fallback: packed in
# parameter order by size), 256 bytes: three buckets, (l1.weight, l1.bias), (l2.weight), (l2.bias, l3.weight, l3.bias).
OPT_BUCKET_CAP_MB = 256 / 2**20

OPTIMIZERS = ("OnebitAdam", "ZeroOneAdam", "OnebitLamb")
PRECISIONS = ("32-true", "bf16-mixed")
#: mode -> world size. hierarchical: 2 simulated nodes x 2 ranks (ranks_per_node=2).
MODE_WORLD_SIZE = {"flat": 2, "hierarchical": 4, "overlapped": 2}
RANKS_PER_NODE = 2


@dataclasses.dataclass(frozen=True)
class Case:
    optimizer: str
    mode: str
    precision: str

    @property
    def name(self) -> str:
        return f"{self.optimizer}-{self.mode}-{self.precision}"

    @property
    def world_size(self) -> int:
        return MODE_WORLD_SIZE[self.mode]

    @property
    def steps(self) -> int:
        return ZEROONE_STEPS if self.optimizer == "ZeroOneAdam" else ADAM_STEPS

    @property
    def overlap(self) -> Any:
        """The strategy's ``overlap`` argument. ZeroOneAdam cannot overlap (its ``overlap_unsupported_reason``: it
        decides in ``step`` what each step exchanges) and the strategy refuses ``overlap=True`` with it at setup: its
        "overlapped" case runs ``overlap="auto"``, i.e. what the strategy does with it, the fallback to the in-step
        exchange (momenta packed by ``bucket_cap_mb``); the record holds the fallback's cause."""
        if self.mode != "overlapped":
            return False
        return "auto" if self.optimizer == "ZeroOneAdam" else True


CASES: tuple[Case, ...] = tuple(
    Case(optimizer, mode, precision) for optimizer in OPTIMIZERS for mode in MODE_WORLD_SIZE for precision in PRECISIONS
)
CASES_BY_NAME = {case.name: case for case in CASES}


def world_sizes() -> list[int]:
    return sorted({case.world_size for case in CASES})


def cases_at(world_size: int) -> list[Case]:
    return [case for case in CASES if case.world_size == world_size]


# ======================================================================================== model and data
N_IN, HIDDEN, BATCH = 6, 8, 8


def _data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, N_IN, generator=torch.Generator().manual_seed(seed))
    a = torch.randn(N_IN, 3, generator=torch.Generator().manual_seed(123))
    return x, torch.tanh(x @ a).sum(-1, keepdim=True) * 0.7 + 0.3


def rank_loader(rank: int, steps: int) -> DataLoader:
    """``steps`` batches of this rank's own regression data (no shuffling: batch ``i`` is fixed)."""
    x, y = _data(1000 + rank, steps * BATCH)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class BehaviourNet(pl.LightningModule):
    """A 6 -> 8 -> 8 -> 1 tanh MLP (137 parameters, identical initialisation on every rank) with the case's
    optimizer; records the loss of every step."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(N_IN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.l3 = nn.Linear(HIDDEN, 1)
        self.optimizer_name = optimizer
        self.losses: list[float] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        common = dict(lr=LR, weight_decay=WEIGHT_DECAY, bucket_cap_mb=OPT_BUCKET_CAP_MB, kernel_backend=KERNEL_BACKEND)
        if self.optimizer_name == "OnebitAdam":
            return OnebitAdam(self.parameters(), freeze_step=FREEZE, **common)
        if self.optimizer_name == "OnebitLamb":
            # the record predates the compression stage's trust-ratio cap: it holds DeepSpeed's update (the cap is
            # checked bit for bit against a per-tensor version in tests/optim/test_onebit_lamb.py)
            return OnebitLamb(self.parameters(), freeze_step=FREEZE, cap_trust_ratio=False, **common)
        if self.optimizer_name == "ZeroOneAdam":
            return ZeroOneAdam(self.parameters(), **ZEROONE_SCHEDULE, **common)
        raise ValueError(self.optimizer_name)


class ParamBitsEveryStep(pl.Callback):
    """A fingerprint of the parameters' bits after every optimizer step (one per training batch: no accumulation)."""

    def __init__(self) -> None:
        self.fingerprints: list[str] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.fingerprints.append(fingerprint(torch.cat([p.detach().reshape(-1) for p in pl_module.parameters()])))


def fingerprint(tensor: torch.Tensor) -> str:
    """SHA-256 (first 16 hex digits) of a tensor's dtype, shape and bytes: equal iff bitwise equal (barring a
    collision)."""
    digest = hashlib.sha256(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def _strategy(case: Case) -> OnebitStrategy:
    if case.mode == "hierarchical":
        return OnebitStrategy(
            topology="hierarchical", ranks_per_node=RANKS_PER_NODE, overlap=False, ddp_bucket_cap_mb=DDP_BUCKET_CAP_MB
        )
    return OnebitStrategy(topology="flat", overlap=case.overlap, ddp_bucket_cap_mb=DDP_BUCKET_CAP_MB)


# ======================================================================================== one rank's record
def _feedback_name(key: Any) -> str:
    """``<stream>/<bucket>`` for an error-feedback key of ``error_feedback_state_dict()``: a bare bucket key is the
    momentum stream's, ``(stream, bucket)`` another stream's (0/1 Adam's ``update``, ``gradient``)."""
    if isinstance(key, tuple):
        return "/".join(str(k) for k in key)
    return f"momentum/{key}"


def _optimizer_state(optimizer: torch.optim.Optimizer, names: list[str]) -> tuple[dict, dict]:
    """The tensors and the other entries of ``optimizer.state_dict()["state"]``, keyed ``<param name>/<key>``
    (state_dict numbers the parameters in param-group order: here ``named_parameters()`` order)."""
    tensors, values = {}, {}
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            name = f"{names[index]}/{key}"
            if isinstance(value, torch.Tensor):
                tensors[name] = value.detach().clone()  # clone: the moments are views of whole bucket buffers
            else:
                values[name] = value
    return tensors, values


def run_case(
    case_name: str, rank: int, world_size: int, workdir: str, environment: Optional[dict[str, str]] = None
) -> dict[str, Any]:
    """Run one case on this rank (every rank calls it) and return this rank's record; ``environment``: the one the
    ranks were spawned under (default :data:`DETERMINISTIC_CPU_ENV`), checked."""
    _check_rank_environment(DETERMINISTIC_CPU_ENV if environment is None else environment)
    case = CASES_BY_NAME[case_name]
    if world_size != case.world_size:
        raise ValueError(f"{case_name} runs at world size {case.world_size}, not {world_size}")
    model = BehaviourNet(case.optimizer)
    every_step = ParamBitsEveryStep()
    strategy = _strategy(case)
    # spelled out rather than tests.lightning_models.trainer_kwargs: the record must not move when a shared helper does
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        precision=case.precision,
        max_steps=case.steps,
        callbacks=[every_step],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, rank_loader(rank, case.steps))

    optimizer = strategy.onebit_optimizer
    names = [name for name, _ in model.named_parameters()]
    tensors: dict[str, torch.Tensor] = {
        f"param/{name}": p.detach().reshape(-1).clone() for name, p in model.named_parameters()
    }
    feedback = optimizer.error_feedback_state_dict()
    for key, buffers in feedback["buckets"].items():
        for which in ("worker_error", "server_error"):
            tensors[f"error_feedback/{_feedback_name(key)}/{which}"] = buffers[which].detach().clone()
    state_tensors, state_values = _optimizer_state(optimizer, names)
    tensors.update({f"optimizer_state/{k}": v for k, v in state_tensors.items()})

    values: dict[str, Any] = dict(
        step_count=optimizer.step_count,
        losses=list(model.losses),
        param_bits_by_step=every_step.fingerprints,
        # plain strings (StepKind is a str enum): the records load with torch.load(weights_only=True)
        steps_by_kind={str(getattr(kind, "value", kind)): n for kind, n in sorted(optimizer.steps_by_kind.items())},
        bucket_layouts={k: tuple(layout.tensor_numels) for k, layout in sorted(optimizer.bucket_layouts().items())},
        optimizer_state_values=state_values,
    )
    if case.mode == "overlapped":
        overlap = strategy.overlap_state
        values["overlap_buckets_started"] = None if overlap is None else overlap.buckets_started
        reason = strategy.overlap_fallback_reason
        values["overlap_fallback_cause"] = None if reason is None else getattr(reason, "cause", str(reason))
    if case.optimizer == "ZeroOneAdam":
        values["forced_syncs"] = optimizer.forced_syncs
    return dict(tensors=tensors, values=values)


def scenarios(
    world_size: int, environment: Optional[dict[str, str]] = None
) -> tuple[tuple[str, Callable[[int, int, str], dict]], ...]:
    """``run_scenarios`` entries for every case at ``world_size`` (one spawn runs them all, one after another), for
    ranks spawned under ``environment`` (default :data:`DETERMINISTIC_CPU_ENV`)."""
    return tuple(
        (case.name, functools.partial(run_case, case.name, environment=environment)) for case in cases_at(world_size)
    )


# ======================================================================================== on-disk form
# torch.save stores every tensor as a zip entry of its own (a few hundred bytes of headers and alignment each, more
# than these small tensors hold): a record is saved with its tensors packed into one flat tensor per dtype.
def pack_record(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with ``tensors`` replaced by ``packed``: ``{"blobs": {dtype name: flat tensor}, "index": [(name,
    dtype name, offset, shape), ...]}`` (the inverse is :func:`unpack_record`)."""
    parts: dict[str, list[torch.Tensor]] = {}
    offsets: dict[str, int] = {}
    index = []
    for name, tensor in record["tensors"].items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        index.append((name, dtype, offsets.get(dtype, 0), tuple(tensor.shape)))
        parts.setdefault(dtype, []).append(tensor.detach().reshape(-1))
        offsets[dtype] = offsets.get(dtype, 0) + tensor.numel()
    blobs = {dtype: torch.cat(tensors).clone() for dtype, tensors in parts.items()}
    return dict(packed=dict(blobs=blobs, index=index), values=record["values"])


def unpack_record(saved: dict[str, Any]) -> dict[str, Any]:
    """A record as :func:`run_case` returns it, from :func:`pack_record`'s form."""
    blobs = saved["packed"]["blobs"]
    tensors = {}
    for name, dtype, offset, shape in saved["packed"]["index"]:
        numel = 1
        for n in shape:
            numel *= n
        tensors[name] = blobs[dtype][offset : offset + numel].reshape(shape)
    return dict(tensors=tensors, values=saved["values"])
