"""Moved to :mod:`lightning_onebit.comm.topology`: import from there. This shim only re-exports what was imported
from ``lightning_onebit.topology`` until its last importer is updated; it will be removed."""

# moved to lightning_onebit.comm.topology
from lightning_onebit.comm.topology import (
    Topology,
    TopologyMode,
    destroy_groups,
    group_timeout,
    is_registered,
    new_gather_groups,
    new_group_family,
    split_group_supported,
)

__all__ = [
    "Topology",
    "TopologyMode",
    "destroy_groups",
    "group_timeout",
    "is_registered",
    "new_gather_groups",
    "new_group_family",
    "split_group_supported",
]
