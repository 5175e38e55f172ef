"""The process mesh, collectives by axis name, partition specs, and the observer hook
(`mesh.observer`, numesh/mesh/hook.py; the observers are in `numesh.observe`)."""

from numesh.mesh.collectives import (
    Handle,
    all_gather,
    all_gather_inplace,
    all_gather_v,
    all_to_all,
    all_to_all_v,
    broadcast,
    ipsum,
    ipsum_scatter,
    irecv,
    isend,
    pmax,
    psum,
    psum_scalar,
    psum_scatter,
    psum_tree,
    recv,
    send,
    sendrecv,
)
from numesh.mesh.hook import Observer, SkipCall
from numesh.mesh.mesh import AXES, BATCH_AXES, ByteCounter, Group, Mesh, MeshError, parse_mesh
from numesh.mesh.spec import P, local_shape, local_slices, replicated_axes, shard, unshard

__all__ = [
    "AXES", "BATCH_AXES", "ByteCounter", "Group", "Handle", "Mesh", "MeshError", "Observer", "P", "SkipCall",
    "all_gather", "all_gather_inplace", "all_gather_v", "all_to_all", "all_to_all_v", "broadcast", "ipsum",
    "ipsum_scatter", "irecv", "isend", "local_shape", "local_slices", "parse_mesh", "pmax", "psum", "psum_scalar",
    "psum_tree", "psum_scatter", "recv", "replicated_axes", "send", "sendrecv", "shard", "unshard",
]
