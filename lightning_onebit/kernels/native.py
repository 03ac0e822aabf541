"""The native CPU library (``cpu_native.c``, compiled on first use) and the correctly rounded square root that every
backend takes from it.

Build: one ``cc -O3 -shared`` call (well under a second) into a cache directory, keyed by a hash of the source, the
compiler and its flags, and written atomically, so concurrent ranks neither rebuild each other's file nor load a half
written one. Environment variables:

* ``LIGHTNING_ONEBIT_NATIVE=0``: never build or load the library (the torch kernels are used, and square roots are
  taken by numpy).
* ``LIGHTNING_ONEBIT_CACHE_DIR``: where the library goes (default ``$XDG_CACHE_HOME/lightning_onebit``, else
  ``~/.cache/lightning_onebit``).
* ``CC``: the C compiler (default ``cc``).

The functions run with the GIL released (ctypes does so for every foreign call).

**Square roots.** torch's own CPU ``sqrt`` (float32 and float64, whatever ``ATEN_CPU_CAPABILITY`` says) is not
correctly rounded (about one float32 element in five is one unit in the last place off) and its bits depend on the
processor: an AVX-512 machine and an AVX2-only one (or an Intel and an AMD one) round differently. Ranks on different
CPUs would then drift apart where the algorithms promise identical replicas, and a record of the library's bits made
on one machine would not replay on another. :func:`sqrt_into` takes the IEEE square root instead, correctly rounded
and so the same bits on every machine: the C loop here (the processor's square-root instruction), or numpy's (the
same instruction) without the library or for strided tensors. CUDA's ``torch.sqrt`` is correctly rounded and runs
there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
from torch.autograd.graph import increment_version

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_native.c")
# No -ffast-math and no contraction: every element must be the same IEEE operation as in the torch reference.
_CFLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno", "-std=c11")
_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_f32 = ctypes.c_float
_SIGNATURES = {
    "onebit_pack_and_subtract": [_p, _i64, _p, _p, _p],
    "onebit_decode": [_p, _i64, _p, _p, _p, ctypes.c_int],
    "onebit_add_mean_of_signs": [_p, _i64, _p, _p, _p, _i64],
    "onebit_frozen_adam_update": [_p, _p, _p, _i64, _f32, ctypes.c_int, _f32, _f32, _f32, _f32, ctypes.c_int],
    "onebit_lamb_prepare": [_p, _p, _p, _p, _p, _p, _i64, _f32, _f32, _f32, _f32, _f32, _f32, _f32, ctypes.c_int, _f32,
                            ctypes.c_int, _p],
    "onebit_lamb_apply": [_p, _p, _i64, _f32],
    "onebit_sqrt_f32": [_p, _i64, _p],
    "onebit_sqrt_f64": [_p, _i64, _p],
}


def cache_dir() -> Path:
    """Directory holding the compiled library."""
    explicit = os.environ.get("LIGHTNING_ONEBIT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lightning_onebit"


def _compiler() -> Optional[list[str]]:
    command = shlex.split(os.environ.get("CC", "cc"))
    if not command or shutil.which(command[0]) is None:
        return None
    return command


def _build(compiler: list[str]) -> Path:
    source = _SOURCE.read_bytes()
    try:
        version = subprocess.run([*compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = b""
    digest = hashlib.sha256(b"\0".join([source, version, " ".join(_CFLAGS).encode()])).hexdigest()[:16]
    target = cache_dir() / f"onebit_cpu_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, scratch = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [*compiler, *_CFLAGS, "-o", scratch, str(_SOURCE), "-lm"], capture_output=True, text=True, timeout=120
        )
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(compiler)} failed:\n{result.stderr.strip()}")
        os.replace(scratch, target)  # atomic: another rank either sees no file or a complete one
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


@functools.lru_cache(maxsize=1)
def library() -> Optional[ctypes.CDLL]:
    if os.environ.get("LIGHTNING_ONEBIT_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        log.debug("native CPU kernels disabled by LIGHTNING_ONEBIT_NATIVE")
        return None
    compiler = _compiler()
    if compiler is None:
        log.info("no C compiler found (set CC); using the torch CPU kernels")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except Exception as error:  # a broken toolchain must not stop training: the torch kernels give the same bits
        log.warning("could not build the native CPU kernels, using the torch kernels instead: %s", error)
        return None
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = None
    return library


def is_available() -> bool:
    """True when the native library is built (or buildable now) and loads."""
    return library() is not None


# ---------------------------------------------------------------------------------------------- square roots
_NATIVE_SQRT = {torch.float32: "onebit_sqrt_f32", torch.float64: "onebit_sqrt_f64"}


def sqrt_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = sqrt(x)`` elementwise, correctly rounded: the same bits on every machine (see the module docstring).
    Returns ``out``, which may be ``x``. CPU float32 and float64 take the IEEE square root (the native library's loop
    for contiguous tensors, else numpy's); other CPU floating dtypes are rounded from the float32 root; other devices
    run ``torch.sqrt``. No host synchronisation on any device."""
    if x.shape != out.shape:
        raise ValueError(f"sqrt_into: x has shape {tuple(x.shape)} but out has {tuple(out.shape)}")
    if x.device.type != "cpu" or out.device.type != "cpu" or not _plain(x) or not _plain(out):
        return torch.sqrt(x, out=out)
    if x.dtype != out.dtype or x.dtype not in _NATIVE_SQRT:
        root = x.detach().to(torch.float32, copy=True)
        return out.copy_(sqrt_into(root, root))
    native = library()
    if native is not None and x.is_contiguous() and out.is_contiguous():
        getattr(native, _NATIVE_SQRT[x.dtype])(x.data_ptr(), x.numel(), out.data_ptr())
    else:
        np.sqrt(x.detach().numpy(), out=out.detach().numpy())
    increment_version(out)  # written behind torch's back: caches keyed by the version counter must see it
    return out


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose memory this process can read: not a subclass (fake, functional or distributed tensors), not on
    the meta device."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta


def foreach_sqrt(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`sqrt_into` of each tensor into a new one (``torch._foreach_sqrt``'s multi-tensor kernel off the CPU)."""
    if tensors and all(t.device.type != "cpu" for t in tensors):
        return list(torch._foreach_sqrt(list(tensors)))
    return [sqrt_into(t, torch.empty_like(t)) for t in tensors]


def foreach_sqrt_(tensors: Sequence[torch.Tensor]) -> None:
    """:func:`sqrt_into` of each tensor, in place."""
    if tensors and all(t.device.type != "cpu" for t in tensors):
        torch._foreach_sqrt_(list(tensors))
        return
    for t in tensors:
        sqrt_into(t, t)
