"""The communication core: the only part of fsdpfn that talks to ``torch.distributed`` collectives,
streams and events."""

from fsdpfn.core.agree import agree, every_rank, tally
from fsdpfn.core.comm import Comm, CommStats, Handle
from fsdpfn.core.link import link_of, measure_link
from fsdpfn.core.mesh import MeshGroups, default_mesh, init_mesh, mesh_groups, span_mesh

__all__ = ["agree", "every_rank", "tally", "Comm", "CommStats", "Handle", "MeshGroups", "default_mesh", "init_mesh", "link_of", "measure_link", "mesh_groups", "span_mesh"]
