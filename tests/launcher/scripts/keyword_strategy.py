"""A script that names its strategy in Phalanx(): a keyword beats `phalanx run --strategy`."""

from phalanx import Phalanx

px = Phalanx(strategy="ddp")
px.print(f"strategy {px.strategy_name}")
