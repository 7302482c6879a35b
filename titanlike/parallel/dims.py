"""The device meshes of a layout: :class:`ParallelDims` is :class:`titanlike.layout.Degrees` plus every mesh.

One 5-D mesh with dims ``("pp", "dp_replicate", "dp_shard", "cp", "tp")`` (tp innermost, see
``titanlike.layout.degrees`` for the rank grid). Every dim is kept, size-1 ones included, so ``get_mesh("tp")`` or
``get_mesh("pp")`` always exists and code never branches on which dims happen to be active (a size-1 group costs
nothing at run time and ~1 ms to create). The flattened dims ``"dp"`` (data loading, token-count and loss
all-reduces), ``"dp_shard_cp"`` (what FSDP shards over) and ``"dp_cp"`` (the loss group under cp) are built with
it, and under cp with HSDP the 2-D ``("dp_replicate", "dp_shard_cp")`` mesh.

``ParallelDims`` owns them all: the parallelize functions take the ``dims`` and ask it for the mesh they need
(``dims.get_mesh("tp")``); nothing else holds a mesh beside it, and there is no module-level cache (a caller that
builds many layouts of one shape in one process group, like the numerics gate, keeps its ``ParallelDims``).

Expert parallelism (``ep > 1``) borrows its ranks from ``dp_shard x cp``: the flattened ``dp_cp`` mesh is unflattened
into ``(dp_replicate, dp_shard_mod_ep, ep)`` (ep innermost), giving ``"ep"`` (the routed experts ``Shard(0)`` over
it, tokens by all-to-all) and ``"dp_shard_mod_ep"`` (the ranks holding the same experts: the experts' FSDP group;
``("dp_replicate", "dp_shard_mod_ep")`` under HSDP). Both are slices of one root, as FSDP2 needs for the 2-D expert
weights (docs/moe.md). Under tp with sequence parallelism ep borrows the tp ranks too (each holds other tokens): the
flattened ``dp_cp_tp`` mesh is unflattened instead, and ``dp_shard_cp_tp`` (the MoE blocks' router and shared
experts are FSDP-sharded over it) and ``cp_tp`` (the aux loss's sequence group) are built beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlike.errors import ConfigError
from titanlike.layout import FLATTENED, MESH_DIMS, Degrees

__all__ = ["ParallelDims"]


@dataclass
class ParallelDims(Degrees):
    """Parallel degrees whose product is the world size (``dp_shard=-1`` takes whatever is left), and their meshes."""

    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _device_type: str = field(default="", init=False, repr=False, compare=False)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Build the 5-D mesh and the derived ones (flattened ``dp``, ``dp_shard_cp``, ``dp_cp``, HSDP under cp);
        return the 5-D mesh.

        Needs an initialised default process group of ``world_size`` ranks. Collective: every rank must call it.
        Take submeshes with :meth:`get_mesh` (slicing a flattened dim from the root mesh, ``mesh["dp"]``, still
        works but is deprecated since torch 2.11). Calling it again on the same ``ParallelDims`` returns the same
        meshes (no new process groups).
        """
        if self._meshes:
            if device_type != self._device_type:
                raise ValueError(
                    f"ParallelDims.build_mesh: the meshes are built for {self._device_type}, not {device_type}"
                )
            return self._meshes["world"]
        if dist.get_world_size() != self.world_size:
            raise ConfigError(
                f"ParallelDims: built for world size {self.world_size} but the process group has "
                f"{dist.get_world_size()} ranks"
            )
        world = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIMS)
        self._meshes = {"world": world, **self._derived_meshes(world)}
        self._device_type = device_type
        return world

    def _derived_meshes(self, world: DeviceMesh) -> dict:
        """The meshes made from the 5-D one: the flattened dims, and HSDP's 2-D mesh under cp."""
        meshes = {name: world[parts]._flatten(name) for name, parts in FLATTENED.items()}
        if self.cp > 1 and self.dp_replicate > 1:  # HSDP under cp: (dp_replicate, dp_shard x cp), 2-D
            meshes[("dp_replicate", "dp_shard_cp")] = meshes["dp_cp"]._unflatten(
                0, (self.dp_replicate, self.dp_shard * self.cp), ("dp_replicate", "dp_shard_cp")
            )
        if self.ep > 1:  # (dp_replicate, dp_shard_mod_ep, ep), ep innermost: one root for both expert meshes
            tokens = meshes["dp_cp"]
            if self.ep_tp > 1:  # ep borrows tp: every rank of dp x cp x tp routes tokens of its own
                tokens = world[("dp_replicate", "dp_shard", "cp", "tp")]._flatten("dp_cp_tp")
                meshes["dp_cp_tp"] = tokens
                meshes["cp_tp"] = world[("cp", "tp")]._flatten("cp_tp")
                n = self.dp_shard * self.cp * self.tp
                hsdp = tokens._unflatten(0, (self.dp_replicate, n), ("dp_replicate", "dp_shard_cp_tp"))
                meshes["dp_shard_cp_tp"] = hsdp["dp_shard_cp_tp"]
                meshes[("dp_replicate", "dp_shard_cp_tp")] = hsdp
            experts = tokens._unflatten(
                0, (self.dp_replicate, self.dp_shard_mod_ep, self.ep), ("dp_replicate", "dp_shard_mod_ep", "ep")
            )
            meshes["ep"] = experts["ep"]
            meshes["dp_shard_mod_ep"] = experts["dp_shard_mod_ep"]
            meshes[("dp_replicate", "dp_shard_mod_ep")] = experts[("dp_replicate", "dp_shard_mod_ep")]
        return meshes

    @property
    def built(self) -> bool:
        """Whether :meth:`build_mesh` ran (a single process has no mesh: nothing to communicate)."""
        return bool(self._meshes)

    @property
    def world_mesh(self) -> DeviceMesh:
        """The mesh :meth:`build_mesh` returned."""
        if not self._meshes:
            raise RuntimeError("ParallelDims: no mesh yet; call build_mesh(device_type) first")
        return self._meshes["world"]

    def get_mesh(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """A submesh: one dim or flattened dim (``"tp"``, ``"dp"``, ``"dp_shard_cp"``) or several plain dims in mesh
        order (``("dp_replicate", "dp_shard")``). ``"dp_shard_cp"`` is ``"dp_shard"`` while cp is 1, so
        ``("dp_replicate", "dp_shard_cp")`` (the HSDP mesh) works then too."""
        world = self.world_mesh
        names = (names,) if isinstance(names, str) else tuple(names)
        if self.cp == 1:
            names = tuple("dp_shard" if n == "dp_shard_cp" else n for n in names)
        if len(names) == 1 and names[0] in FLATTENED:
            return self._meshes[names[0]]
        if names in self._meshes:  # ("dp_replicate", "dp_shard_cp") under cp: HSDP's mesh
            return self._meshes[names]
        if len(names) == 1 and names[0] in self._meshes:  # "ep", "dp_shard_mod_ep" (ep > 1), "dp_cp_tp", "cp_tp"
            return self._meshes[names[0]]
        if any(n in ("ep", "dp_shard_mod_ep", "dp_cp_tp", "cp_tp", "dp_shard_cp_tp") for n in names):
            raise ValueError(f"ParallelDims.get_mesh: {names}: the expert meshes exist only with ep > 1 (ep {self.ep})")
        if any(n not in MESH_DIMS for n in names):
            raise ValueError(f"ParallelDims.get_mesh: {names} must be one of {tuple(FLATTENED)} or dims of {MESH_DIMS}")
        return world[names]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """What the routed experts are FSDP-sharded over under ep: ``dp_shard_mod_ep``, with ``dp_replicate`` (HSDP,
        2-D) when it is above 1."""
        return self.get_mesh(("dp_replicate", "dp_shard_mod_ep") if self.dp_replicate_enabled else "dp_shard_mod_ep")

    def moe_token_mesh(self) -> DeviceMesh:
        """What an MoE block's other parameters (router, shared experts) are FSDP-sharded over when ep borrows tp
        (:attr:`ep_tp`): every rank of ``dp_shard x cp x tp`` routes tokens of its own, so their gradients are summed
        over all of them; with ``dp_replicate`` (HSDP, 2-D) when it is above 1."""
        if self.ep_tp == 1:
            raise ValueError("ParallelDims.moe_token_mesh: only when expert parallelism borrows the tp ranks")
        return self.get_mesh(("dp_replicate", "dp_shard_cp_tp") if self.dp_replicate_enabled else "dp_shard_cp_tp")

    def expert_load_group(self):
        """The process group of :attr:`expert_load_dim` (the expert loads are summed over it), or None."""
        return None if self.expert_load_dim is None else self.get_mesh(self.expert_load_dim).get_group()

    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards over: ``dp_shard x cp``, and ``dp_replicate`` (HSDP, 2-D) when it is above 1."""
        return self.get_mesh(("dp_replicate", "dp_shard_cp") if self.dp_replicate_enabled else "dp_shard_cp")
