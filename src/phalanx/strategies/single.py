"""One process, one device: the model as the user wrote it."""
from __future__ import annotations

from phalanx.strategies.base import LocalStrategy


class SingleDeviceStrategy(LocalStrategy):
    name = "single"
