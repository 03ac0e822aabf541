"""Network namespaces for the link benchmarks (``slow_link``, ``multinode``, ``advisor``), removed whatever happens.

Two simulated links, both shaped by a token bucket filter (``tc qdisc add dev DEV root tbf rate RATE burst BURST
latency LATENCY``; BURST and LATENCY default to ``256kb`` and ``50ms``):

* :class:`ShapedLoopback`: one namespace ``<prefix><pid>_<rate>`` (``ip netns add NAME; ip netns exec NAME ip link
  set lo up``) whose loopback carries the tbf qdisc. Processes run in it with ``ip netns exec NAME`` and talk over
  127.0.0.1, so all their traffic passes the one shaped device: RATE is the *aggregate* bandwidth of the ranks' link.
  Used by ``slow_link`` and ``advisor``.
* :class:`VethPair`: two namespaces (two "nodes") ``mn<pid>r<index>n<k>``, joined by a veth pair whose end ``v<k>``
  in namespace k has the address ``10.77.<index>.<k+1>/24``; both ends carry the tbf qdisc, the loopbacks are up and
  unshaped, IPv6 is off (no neighbour discovery on the veth). Used by ``multinode``.

Both are context managers. Leaving the ``with`` block, normally or on an exception (Ctrl-C included), ends what runs
inside: the processes started with :meth:`Namespaces.popen` / :func:`run` get SIGTERM (10 s to exit; torchrun stops its
workers), then everything still in the namespaces gets SIGKILL; then the namespaces are deleted (which deletes the
veth ends inside them) and so is any veth end not yet moved into one. Creating the first namespace turns SIGTERM and
SIGHUP into ``SystemExit`` (unless something else handles them), so that a killed benchmark unwinds through those
blocks too, and registers an ``atexit`` cleanup of whatever is still open. Only a SIGKILL of the benchmark itself
escapes: ``ip netns list`` then shows the names to delete by hand (each holds the benchmark's pid).

Needs root and the iproute2 tools (:func:`problems` says what is missing).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import Any, ClassVar, Optional, Sequence

BURST, LATENCY = "256kb", "50ms"
VETH_NODES = 2


def problems() -> list[str]:
    """Why this process cannot create namespaces (empty when it can)."""
    found = []
    if os.geteuid() != 0:
        found.append("must run as root (it creates network namespaces, veth links and tc qdiscs)")
    missing = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
    if missing:
        found.append(f"needs the iproute2 tools (ip, tc), not found: {', '.join(missing)}")
    return found


def sh(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    """Run a short command; with ``check``, a failure raises with its stderr."""
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {res.returncode}): {res.stderr.strip()}")
    return res


def qdisc_stats(dev: str, netns: Optional[str] = None) -> dict[str, int]:
    """Counters of the root qdisc of ``dev`` (sent bytes and packets, drops, overlimits) in namespace ``netns``
    (``None``: this process's own, e.g. a worker's inside a :class:`ShapedLoopback`)."""
    where = ["-n", netns] if netns else []
    qdiscs = json.loads(sh(["tc", *where, "-s", "-j", "qdisc", "show", "dev", dev]).stdout)
    root = next(q for q in qdiscs if q.get("root"))
    return dict(bytes=root["bytes"], packets=root["packets"], drops=root["drops"], overlimits=root["overlimits"])


def link_stats(dev: str, netns: Optional[str] = None) -> dict[str, int]:
    """The link counters of ``dev``: tx/rx bytes and packets."""
    where = ["-n", netns] if netns else []
    stats = json.loads(sh(["ip", *where, "-s", "-j", "link", "show", dev]).stdout)[0]["stats64"]
    return dict(tx_bytes=stats["tx"]["bytes"], tx_packets=stats["tx"]["packets"], rx_bytes=stats["rx"]["bytes"],
                rx_packets=stats["rx"]["packets"])


# ---------------------------------------------------------------------------------------------------- teardown
_guarded = False


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the with blocks / finally clauses that remove the namespaces


def _guard() -> None:
    """Once per process: SIGTERM / SIGHUP raise SystemExit (where left at their defaults), atexit closes the rest."""
    global _guarded
    if _guarded:
        return
    _guarded = True
    atexit.register(close_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _exit_on_signal)


@contextlib.contextmanager
def _no_interrupts():
    """A second Ctrl-C must not interrupt a cleanup."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def close_all() -> None:
    """Close every namespace set this process still has open."""
    for spaces in list(Namespaces.opened):
        spaces.close()


class Namespaces:
    """Network namespaces (and veth links) created by this process; :meth:`close` removes them and what runs inside.

    Subclasses name them and set them up in :meth:`_setup`; a failure there closes what was created and raises."""

    opened: ClassVar[list["Namespaces"]] = []
    grace_s: float = 10.0

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self.procs: list[subprocess.Popen] = []
        self.closed = False
        self._created: list[str] = []  # namespaces and root-namespace links this object made: only these are removed
        self._links: list[str] = []
        _guard()
        Namespaces.opened.append(self)
        try:
            for ns in self.names:
                sh(["ip", "netns", "add", ns])
                self._created.append(ns)
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        pass

    def _add_veth(self, a: str, b: str) -> None:
        sh(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        self._links += [a, b]

    def __enter__(self) -> "Namespaces":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def command(self, cmd: Sequence[str], ns: Optional[str] = None) -> list[str]:
        """``cmd`` run inside namespace ``ns`` (default the first)."""
        return ["ip", "netns", "exec", ns or self.names[0], *cmd]

    def popen(self, cmd: Sequence[str], ns: Optional[str] = None, **kwargs: Any) -> subprocess.Popen:
        """Start ``cmd`` inside namespace ``ns`` (default the first) in a session of its own; ended by :meth:`close`
        if still running."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(cmd, ns), **kwargs)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Processes running inside the namespaces (``ip netns pids``)."""
        found = []
        for ns in self._created:
            found += [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).stdout.split()]
        return [p for p in found if p != os.getpid()]

    def close(self) -> None:
        """SIGTERM the processes started here, SIGKILL whatever still runs inside, delete the namespaces and the
        links not moved into them. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        with _no_interrupts():
            try:
                running = [p for p in self.procs if p.poll() is None]
                for p in running:
                    with contextlib.suppress(ProcessLookupError):
                        p.terminate()
                deadline = time.monotonic() + self.grace_s
                for p in running:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=max(0.1, deadline - time.monotonic()))
                for _ in range(3):
                    pids = self.pids()
                    if not pids:
                        break
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                    time.sleep(0.3)
                for p in self.procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=5)
                for ns in self._created:
                    sh(["ip", "netns", "del", ns], check=False)
                for link in self._links:  # a veth end still in this namespace (its move failed)
                    if sh(["ip", "link", "show", link], check=False).returncode == 0:
                        sh(["ip", "link", "del", link], check=False)
            finally:
                with contextlib.suppress(ValueError):
                    Namespaces.opened.remove(self)


def _tbf(dev: str, rate: str, burst: str, latency: str) -> list[str]:
    return ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency", latency]


class ShapedLoopback(Namespaces):
    """One namespace, ``<prefix><pid>_<rate>``, whose loopback is up and shaped at ``rate``."""

    def __init__(self, prefix: str, rate: str, burst: str = BURST, latency: str = LATENCY) -> None:
        self.name = f"{prefix}{os.getpid()}_{re.sub(r'[^A-Za-z0-9]', '', rate)}"
        self.rate, self.burst, self.latency = rate, burst, latency
        super().__init__([self.name])

    def _setup(self) -> None:
        sh(["ip", "netns", "exec", self.name, "ip", "link", "set", "lo", "up"])
        sh(["ip", "netns", "exec", self.name, *_tbf("lo", self.rate, self.burst, self.latency)])


class VethPair(Namespaces):
    """Two namespaces ``mn<pid>r<index>n<k>`` joined by a veth pair shaped at ``rate`` (end ``v<k>``, address
    ``10.77.<index>.<k+1>/24``, in namespace k)."""

    def __init__(self, index: int, rate: str, burst: str = BURST, latency: str = LATENCY) -> None:
        tag = f"{os.getpid()}r{index}"
        self.tmp_links = [f"mv{tag}{'ab'[k]}"[:15] for k in range(VETH_NODES)]  # their names before the move
        self.devices = [f"v{k}" for k in range(VETH_NODES)]
        self.addresses = [f"10.77.{index % 256}.{k + 1}" for k in range(VETH_NODES)]
        self.rate, self.burst, self.latency = rate, burst, latency
        super().__init__([f"mn{tag}n{k}" for k in range(VETH_NODES)])

    @property
    def namespaces(self) -> list[str]:
        return self.names

    def _setup(self) -> None:
        for ns in self.names:
            for key in ("all", "default"):  # no IPv6 neighbour discovery / router solicitations on the veth
                sh(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"], check=False)
        self._add_veth(*self.tmp_links)
        for k, ns in enumerate(self.names):
            sh(["ip", "link", "set", self.tmp_links[k], "netns", ns])
            sh(["ip", "-n", ns, "link", "set", self.tmp_links[k], "name", self.devices[k]])
            sh(["ip", "-n", ns, "addr", "add", f"{self.addresses[k]}/24", "dev", self.devices[k]])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            sh(["ip", "-n", ns, "link", "set", self.devices[k], "up"])
            sh(["ip", "netns", "exec", ns, *_tbf(self.devices[k], self.rate, self.burst, self.latency)])

    def wire(self) -> list[dict[str, int]]:
        """Per node: the tbf qdisc's sent bytes/packets/drops/overlimits and the veth end's tx/rx bytes/packets."""
        readings = []
        for ns, dev in zip(self.names, self.devices):
            q = qdisc_stats(dev, ns)
            readings.append(dict(qdisc_bytes=q["bytes"], qdisc_packets=q["packets"], qdisc_drops=q["drops"],
                                 qdisc_overlimits=q["overlimits"], **link_stats(dev, ns)))
        return readings


# ---------------------------------------------------------------------------------------------------- running
def run(cmd: Sequence[str], *, timeout: Optional[float] = None, inside: Optional[Namespaces] = None,
        ns: Optional[str] = None, **kwargs: Any) -> None:
    """Run ``cmd`` to completion in a session of its own, inside ``inside``'s namespace ``ns`` (default its first)
    or, with ``inside=None``, on the host. On a timeout, an exception or a signal while waiting, its whole process
    group (it and the processes it started) is killed before the error propagates; a non-zero exit raises
    ``CalledProcessError``."""
    kwargs.setdefault("start_new_session", True)
    if inside is None:
        proc = subprocess.Popen(list(cmd), **kwargs)
    else:
        proc = inside.popen(cmd, ns, **kwargs)
    try:
        code = proc.wait(timeout=timeout)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if code != 0:
        raise subprocess.CalledProcessError(code, list(cmd))
