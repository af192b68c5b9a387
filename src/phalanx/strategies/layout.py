"""`Layout`: a plan laid over this job's ranks, built once per worker: the one DeviceMesh with the
plan's named dims (`MESH_DIMS`, outermost first) and every group derived from it, asked by name.

torchtitan's `ParallelDims` in phalanx's words: nothing else in phalanx makes a process group or
flattens a sub-mesh (tests/unit/test_layout.py finds any other). A derived group is one entry of
`SPANS` (the mesh dims it spans), so a new mesh dimension adds its name to `MESH_DIMS` and, where a
derived group spans it, to that entry here. Every derived mesh and group the plan needs is built in
`build`, in one fixed order on every rank (as torchtitan's ParallelDims builds its meshes): torch's
collectives need every rank to build each group together, and a group made on first request would
hang a job whose ranks asked in different orders. Afterwards `mesh` and `group` only look up.

torch 2.13 has no public way to flatten, unflatten or concatenate a DeviceMesh's dims
(`DeviceMesh._flatten`, `_unflatten`, `_concatenate`; torchtitan uses the same three): this module is
the one place that calls them, and tests/unit/test_layout.py pins them to the installed torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from phalanx.strategies.plan.parallel_plan import MESH_DIMS, ParallelPlan


@dataclass(frozen=True)
class Span:
    """A derived group: the ranks along `dims` (those of degree > 1 flattened into one mesh dim);
    `alone` stands for it when none of them is > 1 (a group of this rank only)."""

    dims: tuple[str, ...]
    alone: str
    doc: str


SPANS: dict[str, Span] = {
    "dp": Span(
        ("dp_replicate", "dp_shard"),
        "dp_shard",
        "the ranks that read different data: loaders, px.reduce/gather, SyncBatchNorm",
    ),
    "grad": Span(
        ("dp_replicate", "dp_shard", "cp"),
        "dp_replicate",
        "the ranks gradients are averaged over (data-parallel x cp): DDP, zero1, num_items",
    ),
    "dp_shard_cp": Span(
        ("dp_shard", "cp"), "dp_shard", "FSDP2's shard dim: parameters are sharded over the cp ranks too (torchtitan's)"
    ),
    "stage_holders": Span(
        tuple(d for d in MESH_DIMS if d != "pp"), "tp", "the ranks that hold the same parameters: one pipeline stage's"
    ),
}

# Groups cut out of a derived group instead of flattened from dims, each sized by the plan's field of
# its name: expert parallel's ranks are the innermost `plan.ep` of the gradient ranks (neighbours in
# the mesh, as torchtitan borrows ep from dp_shard x cp), and the ranks holding the same experts are
# the rest of them (`plan.ep_replicate`). Both are one mesh, "grad" unflattened (ep_replicate, ep).
PARTS: dict[str, str] = {
    "ep": "the ranks one MoE layer's experts are split over: tokens go to their expert's rank (all-to-all)",
    "ep_replicate": "the ranks that hold the same experts: their gradients are averaged over them",
}
# Meshes made of two named ones side by side (torch's `_concatenate`: no new group): under ep x tp, an
# expert weight is split over the ep ranks (dim 0) and, within each, over the tp ranks as tp's plan says.
JOINED: dict[str, tuple[str, str]] = {"ep_tp": ("ep", "tp")}


class Layout:
    """The mesh and its named groups for `plan` on this rank (a world of one: no mesh, no groups)."""

    def __init__(self, plan: ParallelPlan, root: Any):
        self.plan = plan
        self.root = root  # the DeviceMesh with MESH_DIMS' names; None in a world of one
        self._flat: dict[tuple[str, ...], Any] = {}  # dims flattened -> their mesh (one per set of ranks)
        self._pipelines: dict[tuple[int, ...], Any] = {}  # pipeline ranks -> this rank's group of them
        self._groups: dict[str, Any] = {}  # name -> its group: px.reduce asks on every call
        self._parts: dict[str, Any] = {}  # "experts" -> "grad" unflattened into PARTS' dims; JOINED's meshes

    @classmethod
    def build(cls, plan: ParallelPlan, device_type: str) -> "Layout":
        """Every rank together: `init_device_mesh` over the plan's degrees (one group per dim)."""
        if not plan.is_distributed:
            return cls(plan, None)
        from torch.distributed.device_mesh import init_device_mesh

        degrees = plan.degrees()
        layout = cls(plan, init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=tuple(degrees)))
        for name in layout.derived():
            layout.mesh(name)
            if name in SPANS or name in PARTS:
                layout.group(name)
        return layout

    def derived(self) -> tuple[str, ...]:
        """The derived meshes this plan needs, in the order `build` makes them (the same on every rank):
        every span, FSDP2's mesh where it shards, and expert parallel's parts where ep > 1."""
        names: tuple[str, ...] = tuple(SPANS)
        if self.plan.uses_fsdp:
            names += ("fully_shard",)
        if self.plan.ep > 1:
            names += tuple(PARTS) + (tuple(JOINED) if self.plan.tp > 1 else ())
        return names

    def mesh(self, name: str) -> Any:
        """The 1-D mesh of a dim of `MESH_DIMS`, of a derived group of `SPANS` or of `PARTS`; the 2-D mesh of
        a `JOINED` entry; "fully_shard": the mesh
        FSDP2 works over (dp_shard_cp alone, or dp_replicate x dp_shard_cp for replicas)."""
        if name in MESH_DIMS:
            return self.root[name]
        if name in PARTS:
            if "experts" not in self._parts:
                sizes = tuple(getattr(self.plan, part) for part in PARTS)
                self._parts["experts"] = self.mesh("grad")._unflatten(0, sizes, tuple(PARTS))
            return self._parts["experts"][name]
        if name in JOINED:
            if name not in self._parts:
                from torch.distributed.device_mesh import DeviceMesh

                self._parts[name] = DeviceMesh._concatenate([self.mesh(part) for part in JOINED[name]])
            return self._parts[name]
        if name == "fully_shard":
            shard = self._flatten(self._dims("dp_shard_cp", keep="dp_shard"))
            return self.root["dp_replicate", shard] if self.plan.dp_replicate > 1 else self.root[shard]
        dims = self._dims(name)
        if len(dims) == 1:
            return self.root[dims[0]]
        self._flatten(dims)
        return self._flat[dims]  # kept, not sliced from the root by name (torch deprecates that)

    def group(self, name: str) -> Any:
        """The process group of `mesh(name)`; None when it holds every rank (torch's default group:
        e.g. "stage_holders" without pp), and in a world of one."""
        if self.root is None or self._size(name) == self.plan.world_size:
            return None
        if name not in self._groups:
            self._groups[name] = self.mesh(name).get_group()
        return self._groups[name]

    def pipeline_group(self, pp_ranks: tuple[int, ...]) -> Any:
        """This rank's group of the pipeline ranks `pp_ranks` of its own pipeline (None when it is not
        one of them); every rank builds every pipeline's group together, once per `pp_ranks`."""
        if len(pp_ranks) == self.plan.pp:
            return self.root["pp"].get_group()
        if pp_ranks not in self._pipelines:
            import torch.distributed as dist

            grid = self.root.mesh.reshape(self.plan.pp, -1)
            lists = [[int(grid[r, c]) for r in pp_ranks] for c in range(grid.shape[1])]
            mine, _ = dist.new_subgroups_by_enumeration(lists)
            self._pipelines[pp_ranks] = mine if self.root["pp"].get_local_rank() in pp_ranks else None
        return self._pipelines[pp_ranks]

    def _dims(self, name: str, keep: str | None = None) -> tuple[str, ...]:
        """The dims of `name`'s span that are > 1 (and `keep`, the first of the span, always)."""
        span = SPANS[name]
        dims = tuple(d for d in span.dims if d == keep or getattr(self.plan, d) > 1)
        return dims or (span.alone,)

    def _size(self, name: str) -> int:
        if name in PARTS:
            return getattr(self.plan, name)
        dims = (name,) if name in MESH_DIMS else SPANS[name].dims
        size = 1
        for d in dims:
            size *= getattr(self.plan, d)
        return size

    def _flatten(self, dims: tuple[str, ...]) -> str:
        """The mesh dim name of `dims` flattened into one (a single dim: itself)."""
        if len(dims) == 1:
            return dims[0]
        if dims not in self._flat:
            self._flat[dims] = self.root[dims]._flatten("_".join(dims))
        return "_".join(dims)
