"""The device mesh of a layout: :class:`ParallelDims` is :class:`titanlike.layout.Degrees` plus the mesh.

One 5-D mesh with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` (tp innermost, see
``titanlike.layout.degrees`` for the rank grid). Every dim is kept, size-1 ones included, so ``mesh["tp"]`` or
``mesh["pp"]`` always exists and code never branches on which dims happen to be active (a size-1 group costs
nothing at run time and ~1 ms to create). The flattened dims ``"dp"`` (data loading, token-count and loss
all-reduces), ``"dp_shard_cp"`` (what FSDP shards over) and ``"dp_cp"`` (the loss group under cp) are built
with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titanlike.errors import ConfigError
from titanlike.layout import FLATTENED, MESH_DIMS, Degrees

__all__ = ["ParallelDims"]

_BUILT: dict[tuple, dict] = {}  # (shape, device type, default process group) -> meshes, see build_mesh


@dataclass
class ParallelDims(Degrees):
    """Parallel degrees whose product is the world size (``dp_shard=-1`` takes whatever is left), and their mesh."""

    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def build_mesh(self, device_type: str):
        """The 5-D mesh, with the flattened ``dp`` and ``dp_shard_cp`` dims.

        Needs an initialised default process group of ``world_size`` ranks. Collective: every rank must call it.
        Take submeshes with :meth:`get_mesh` (it keeps the flattened meshes: slicing a flattened dim from the
        root mesh, ``mesh["dp"]``, still works but is deprecated since torch 2.11). Building the same shape again
        in the same process group returns the same meshes (no new process groups).
        """
        if dist.get_world_size() != self.world_size:
            raise ConfigError(
                f"ParallelDims: built for world size {self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        key = (self.shape, device_type, dist.group.WORLD)
        if key not in _BUILT:
            mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
            meshes = {"world": mesh, **{name: mesh[parts]._flatten(name) for name, parts in FLATTENED.items()}}
            if self.cp > 1 and self.dp_replicate > 1:  # HSDP under cp: (dp_replicate, dp_shard x cp), 2-D
                meshes[("dp_replicate", "dp_shard_cp")] = meshes["dp_cp"]._unflatten(
                    0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp")
                )
            _BUILT[key] = meshes
        self._meshes = _BUILT[key]
        return self._meshes["world"]

    @property
    def world_mesh(self):
        """The mesh :meth:`build_mesh` returned."""
        if not self._meshes:
            raise RuntimeError("ParallelDims.world_mesh: call build_mesh(device_type) first")
        return self._meshes["world"]

    def get_mesh(self, names: str | tuple[str, ...]):
        """A submesh of :meth:`build_mesh`'s mesh: one dim or flattened dim (``"tp"``, ``"dp"``, ``"dp_shard_cp"``)
        or several plain dims in mesh order (``("dp_replicate", "dp_shard")``). ``"dp_shard_cp"`` is ``"dp_shard"``
        while cp is 1, so ``("dp_replicate", "dp_shard_cp")`` (the HSDP mesh) works then too."""
        world = self.world_mesh
        names = (names,) if isinstance(names, str) else tuple(names)
        if self.cp == 1:
            names = tuple("dp_shard" if n == "dp_shard_cp" else n for n in names)
        if len(names) == 1 and names[0] in FLATTENED:
            return self._meshes[names[0]]
        if names in self._meshes:  # ("dp_replicate", "dp_shard_cp") under cp: HSDP's mesh
            return self._meshes[names]
        if any(n not in MESH_DIMS for n in names):
            raise ValueError(f"ParallelDims.get_mesh: {names} must be one of {tuple(FLATTENED)} or dims of {MESH_DIMS}")
        return world[names]
