"""The launcher's view of the cluster: SLURM defaults for `phalanx run`, and the multi-node setup.

The launcher calls `apply_slurm` on its spec before validating it, and `node_setup_for` once the spec is
valid. Both keep the launcher free of SLURM and network details.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Mapping, TypeVar

from phalanx import envvars
from phalanx.cluster import slurm
from phalanx.cluster.network import NetworkError
from phalanx.launch.rendezvous import NodeSetup, setup_node, split_endpoint

CLUSTER_ERRORS = (slurm.SlurmError, NetworkError)
"""User-facing errors from this package, reported like the launcher's own usage errors."""

Spec = TypeVar("Spec")


def slurm_enabled(env: Mapping[str, str]) -> bool:
    """SLURM detection is on inside an allocation unless PHALANX_SLURM=0."""
    return env.get(envvars.PHALANX_SLURM, "1") != "0" and slurm.in_slurm(env)


def apply_slurm(spec: Spec, env: Mapping[str, str]) -> Spec:
    """Fill nnodes, node rank, master address/port, nproc and run id from a SLURM allocation.

    Only for the static rendezvous and only what the user left at its default; an explicit value
    that contradicts the allocation is a SlurmError with the fix. `--nnodes 1` (the default) cannot
    be told apart from no flag, so it takes the allocation's node count.
    """
    if not slurm_enabled(env) or getattr(spec, "rdzv_backend") != "static" or getattr(spec, "rdzv_endpoint"):
        return spec
    asked_nnodes = spec.nnodes if spec.nnodes != 1 else None  # type: ignore[attr-defined]
    launch = slurm.launch_settings(env, spec.nproc_per_node, asked_nnodes)  # type: ignore[attr-defined]
    changes = {
        "nnodes": launch.nnodes,
        "node_rank": launch.node_rank,
        "master_addr": spec.master_addr or launch.master_addr,  # type: ignore[attr-defined]
        "master_port": spec.master_port or launch.master_port,  # type: ignore[attr-defined]
        "nproc_per_node": launch.nproc_per_node,
        "rdzv_id": spec.rdzv_id or launch.rdzv_id,  # type: ignore[attr-defined]
    }
    if hasattr(spec, "min_nnodes"):
        changes["min_nnodes"] = None
    print(
        f"phalanx: SLURM job {env.get(envvars.SLURM_JOB_ID)}: node {launch.node_rank} of {launch.nnodes}, "
        f"master {changes['master_addr']}:{changes['master_port']}, "
        f"{launch.nproc_per_node or 'default'} process(es) per node",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(spec, **changes)  # type: ignore[type-var]


def store_address(spec: object) -> tuple[str, int | None]:
    """The rendezvous store's host and port as the nodes know it."""
    endpoint = getattr(spec, "rdzv_endpoint")
    if endpoint:
        return split_endpoint(endpoint)
    return getattr(spec, "master_addr"), getattr(spec, "master_port")


def node_setup_for(spec: object, env: Mapping[str, str]) -> NodeSetup | None:
    """The setup of this node in a multi-node run (None on a single node); prints the interface chosen."""
    if getattr(spec, "nnodes") <= 1:
        return None
    host, port = store_address(spec)
    setup = setup_node(host, port or 0, env)
    print(setup.describe(), file=sys.stderr, flush=True)
    return setup
