"""When the library makes its process groups with one ``dist.split_group`` and when with ``dist.new_group``.

The split route needs an accelerator with a device bound to the default group, which this CPU machine lacks, so the
CUDA state torch checks is stood in for here; what is tested is the library's decision on it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_onebit.comm import groups


@pytest.fixture
def cuda_bound_default_group(monkeypatch):
    """A default group bound to ``cuda:0`` whose backend says it supports splitting; returns a setter for the name
    ``dist.get_backend`` reports and for the bound device."""
    backend = SimpleNamespace(supports_splitting=True)
    default = SimpleNamespace(bound_device_id=torch.device("cuda", 0), _get_backend=lambda device: backend)
    state = {"name": "nccl"}
    monkeypatch.setattr(groups, "is_distributed", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: state["name"])
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))

    def set_state(name: str, *, bound: bool = True, splits: bool = True) -> None:
        state["name"] = name
        default.bound_device_id = torch.device("cuda", 0) if bound else None
        backend.supports_splitting = splits

    return set_state


@pytest.mark.parametrize(
    "name, expected",
    [("nccl", True), ("cpu:gloo,cuda:nccl", True), ("gloo", False), ("cpu:gloo,cuda:gloo", False)],
)
def test_split_group_only_on_nccl(cuda_bound_default_group, name, expected):
    # gloo with CUDA tensors says it supports splitting, but torch 2.11's split_group then fails on it (an H200 run)
    cuda_bound_default_group(name)
    assert groups.split_group_supported() is expected


def test_no_split_without_a_bound_device_or_backend_support(cuda_bound_default_group):
    cuda_bound_default_group("nccl", bound=False)
    assert not groups.split_group_supported()
    cuda_bound_default_group("nccl", splits=False)
    assert not groups.split_group_supported()



@pytest.mark.parametrize("name, unbound", [("gloo", True), ("cpu:gloo,cuda:gloo", True), ("nccl", False)])
def test_groups_on_gloo_are_made_with_the_default_group_unbound(cuda_bound_default_group, monkeypatch, name,
                                                                 unbound):
    # torch 2.11 splits new groups from a default group bound to a device; a gloo rank outside the new group then
    # fails (ProcessGroupGloo has no perform_nocolor_split; an H200 run, 4 processes sharing the GPU over gloo)
    cuda_bound_default_group(name, splits=False)  # nccl: the new_group route too
    default = dist.distributed_c10d._get_default_group()
    seen = []
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "new_group", lambda ranks, timeout=None: seen.append(default.bound_device_id) or ranks)
    assert groups.new_group_family([[0, 1], [2, 3]], timeout=1) == [2, 3]
    assert seen == [None, None] if unbound else seen == [torch.device("cuda", 0)] * 2
    assert default.bound_device_id == torch.device("cuda", 0)  # bound again afterwards
