"""phalanx: take a single-device PyTorch training script to many processes, GPUs and machines.

Public API: `from phalanx import Phalanx` (and `phalanx.spawn` to launch from Python). The launcher is the `phalanx` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Phalanx", "declare_optimizer", "seed_everything", "spawn", "__version__"]

if TYPE_CHECKING:
    from phalanx.launch.spawn import spawn
    from phalanx.facade import Phalanx
    from phalanx.runtime.seeding import seed_everything
    from phalanx.strategies.optimizers.optimizer_kinds import declare_optimizer


def __getattr__(name: str):
    # Lazy: `import phalanx` (e.g. by the launcher) must not import torch.
    if name == "Phalanx":
        from phalanx import planning

        if planning.active():  # `phalanx plan` reads the script: a stand-in that stops it at prepare
            return planning.StandIn
        from phalanx.facade import Phalanx

        return Phalanx
    if name == "spawn":  # phalanx.spawn(fn, *args, nprocs=None, **kwargs): N ranks from Python
        from phalanx.launch.spawn import spawn

        return spawn
    if name == "seed_everything":
        from phalanx.runtime.seeding import seed_everything

        return seed_everything
    if name == "declare_optimizer":  # declare_optimizer(MyOpt, elementwise=...): docs/optimizers.md
        from phalanx.strategies.optimizers.optimizer_kinds import declare_optimizer

        return declare_optimizer
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
