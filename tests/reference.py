"""Reference oracles of the 1-bit compressed collective, written from the formulas and shared by the kernel and comm
tests: the per-segment compression ``C(y) = ||y_s|| / sqrt(n_s) * sgn(y_s)`` (``sgn(0) = +1``) in two precisions, and
single-process simulations of every rank of the flat and the hierarchical compressed allreduce.

* :func:`reference_compress`: naive, in float64, with the error feedback (the kernels, ``tests/kernels``);
* :func:`compress_reference`: in the input's dtype (the flat allreduce below);
* :func:`reference_allreduce`: the flat two-phase allreduce on all P ranks (``tests/comm/test_comm.py``,
  ``tests/comm/test_comm_pipeline.py``);
* :func:`reference_hierarchical`: one hierarchical call on every rank, with the project's kernels (torch backend)
  (``tests/comm/test_topology.py``).

The optimizer references (1-bit Adam, LAMB, 0/1 Adam from their papers' formulas) are each used by one test module
and stay there, next to the model and batches they are written for.
"""

from __future__ import annotations

import math

import torch

from lightning_onebit import kernels
from lightning_onebit.comm import BucketLayout


# ------------------------------------------------------------------------------------------------ compression
def reference_compress(x: torch.Tensor, error: torch.Tensor, offsets: list[int]):
    """Naive per-segment error-feedback compression, in float64 (scales) from ``y = x + error`` in x's dtype."""
    y = x + error  # same elementwise addition as the kernel, so the signs agree exactly
    y64 = y.double()
    scales, q = [], torch.empty_like(y64)
    for a, b in zip(offsets[:-1], offsets[1:]):
        seg = y64[a:b]
        scale = math.sqrt(float((seg * seg).sum())) / math.sqrt(b - a)
        scales.append(scale)
        q[a:b] = scale * torch.where(seg >= 0, 1.0, -1.0)
    return torch.tensor(scales, dtype=torch.float64), q, y64 - q, y64


def compress_reference(y: torch.Tensor, offsets) -> torch.Tensor:
    """``C(y)`` per segment: ``||y_s|| / sqrt(n_s) * sgn(y_s)`` with ``sgn(0) = +1``."""
    q = torch.empty_like(y)
    for a, b in zip(offsets[:-1], offsets[1:]):
        scale = torch.linalg.vector_norm(y[a:b]) / math.sqrt(b - a)
        q[a:b] = scale * torch.where(y[a:b] >= 0, 1.0, -1.0)
    return q


# ------------------------------------------------------------------------------------------------ allreduce
def reference_allreduce(inputs, worker_errors, server_errors, layout: BucketLayout):
    """Simulate one compressed allreduce on all P ranks; returns (output, new worker errors, new server errors)."""
    P, c = layout.world_size, layout.padded_numel // layout.world_size
    offsets = list(layout.segments.offsets)
    # worker phase, every rank
    sent, new_worker_errors = [], []
    for x, e in zip(inputs, worker_errors):
        y = x + e
        q = compress_reference(y, offsets)
        sent.append(q)
        new_worker_errors.append(y - q)
    # server phase: rank r averages chunk r of every worker, adds its error, compresses per chunk segment
    chunks, new_server_errors = [], []
    for r in range(P):
        lo, hi = r * c, (r + 1) * c
        mean = sent[0][lo:hi].clone()
        for j in range(1, P):
            mean = mean + sent[j][lo:hi]
        mean = mean / P
        z = server_errors[r] + mean
        chunk_offsets = [o - lo for o in offsets if lo <= o <= hi]
        qs = compress_reference(z, chunk_offsets)
        chunks.append(qs)
        new_server_errors.append(z - qs)
    return torch.cat(chunks), new_worker_errors, new_server_errors


def reference_hierarchical(inputs: list[torch.Tensor], node_of, layout: BucketLayout, worker_errors, server_errors):
    """One hierarchical call on every rank, in one process, with the project's kernels (torch backend): the node
    mean of each shard (sum in local order, then divide), the 1-bit exchange of each shard between the nodes, and
    the decoded server chunks. Errors are updated in place; returns the output every rank must hold."""
    world = len(inputs)
    nodes = sorted(set(node_of))
    members = {n: [r for r in range(world) if node_of[r] == n] for n in nodes}  # group-rank order
    per_node, num_nodes = len(members[nodes[0]]), len(nodes)
    local_of = {r: members[node_of[r]].index(r) for r in range(world)}
    inter = {l: [r for r in range(world) if local_of[r] == l] for l in range(per_node)}
    shard, c = layout.padded_numel // per_node, layout.chunk_numel
    blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (worker rank, chunk) -> scales, packed
    for r in range(world):
        l = local_of[r]
        node_mean = inputs[members[node_of[r]][0]][l * shard : (l + 1) * shard].clone()
        for j in members[node_of[r]][1:]:
            node_mean.add_(inputs[j][l * shard : (l + 1) * shard])
        node_mean.div_(per_node)
        for i in range(num_nodes):
            chunk = l * num_nodes + i
            blocks[r, chunk] = kernels.compress_with_error_feedback(
                node_mean[i * c : (i + 1) * c].clone(), worker_errors[r][i * c : (i + 1) * c],
                layout.chunk_segments[chunk], backend="torch",
            )
    output = torch.empty(layout.padded_numel)
    for l, servers in inter.items():
        for k, r in enumerate(servers):
            chunk, segments = l * num_nodes + k, layout.chunk_segments[l * num_nodes + k]
            sources = [blocks[j, chunk] for j in servers]
            kernels.add_mean_of_signs_(server_errors[r], [p for _, p in sources], [s for s, _ in sources], segments,
                                       backend="torch")
            scales, packed = kernels.compress_in_place(server_errors[r], segments, backend="torch")
            kernels.decompress(packed, scales, segments, output[chunk * c : (chunk + 1) * c], backend="torch")
    return output
