"""`px.progress(iterable)`: a tqdm bar on the main process when stdout is a terminal, else nothing.

Steps/s and ETA come from tqdm; the latest `px.log()` values show in the bar's postfix (loss...),
with samples/s, tokens/s and MFU refreshed every second (logging/throughput.py).
CI logs stay clean: with stdout redirected the iterable is returned untouched in behaviour and no
byte is written. PHALANX_PROGRESS=on/off forces it either way.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Iterable, Iterator

from phalanx.logging.metrics import postfix

RATE_EVERY_S = 1.0  # how often the bar's samples/s, tokens/s and MFU are refreshed


def bar_enabled(is_main: bool, setting: str | bool | None = None, stream: Any = None) -> bool:
    """Main process only; "auto" (default) means: when the stream is a terminal. True/False = on/off."""
    if isinstance(setting, bool):
        setting = "on" if setting else "off"
    setting = (setting or "auto").lower()
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"progress={setting!r}: use auto, on or off")
    if not is_main or setting == "off":
        return False
    if setting == "on":
        return True
    stream = sys.stdout if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """Iterates like the wrapped iterable; draws a bar only when enabled."""

    def __init__(
        self,
        iterable: Iterable[Any],
        *,
        enabled: bool,
        is_main: bool = True,
        metrics: Any = None,
        total: int | None = None,
        desc: str | None = None,
        **tqdm_kwargs: Any,
    ):
        self.iterable = iterable
        self.is_main = is_main
        self.metrics = metrics
        self.bar = None
        if enabled:
            from tqdm import tqdm

            if total is None and hasattr(iterable, "__len__"):
                total = len(iterable)  # type: ignore[arg-type]
            # shutil falls back to 80x24 where the terminal reports 0x0 (tqdm would then draw nothing)
            columns, rows = shutil.get_terminal_size()
            tqdm_kwargs.setdefault("ncols", columns)
            tqdm_kwargs.setdefault("nrows", rows)
            self.bar = tqdm(total=total, desc=desc, unit="step", file=sys.stdout, leave=True, **tqdm_kwargs)

    def __len__(self) -> int:
        return len(self.iterable)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self.bar is None:
            yield from self.iterable
            return
        if self.metrics is not None:
            self.metrics.progress_bar = self.bar
        shown = time.monotonic()
        try:
            for item in self.iterable:
                yield item
                self.bar.update(1)
                if time.monotonic() - shown >= RATE_EVERY_S:  # live rates between px.log rows
                    shown = time.monotonic()
                    self._show_rates()
        finally:
            if self.metrics is not None and self.metrics.progress_bar is self.bar:
                self.metrics.progress_bar = None
            self.bar.close()

    def _show_rates(self) -> None:
        throughput = getattr(self.metrics, "throughput", None)
        if throughput is not None:
            rates = throughput.current()
            if rates:
                self.bar.set_postfix({**self.metrics.postfix, **postfix(rates)})

    def set_postfix(self, **values: Any) -> None:
        if self.bar is not None:
            self.bar.set_postfix(values)

    def write(self, text: str) -> None:
        """Print a line on the main process without breaking the bar."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        elif self.is_main:
            print(text, flush=True)
