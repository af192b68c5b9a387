"""How each kind of setting turns text (a flag, an env variable) or an object (YAML, a keyword
argument) into a typed value, and what to say when it cannot. Pure Python: the launcher imports it.

A kind raises ValueError with the reason only ("choose one of ..."); the caller prefixes the source
and the bad value, so every message reads `SOURCE VALUE: REASON`.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any, Callable

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Kind:
    """A value type: `text` parses a flag/env string, `obj` checks a YAML/keyword value."""

    name: str
    text: Callable[[str], Any]
    obj: Callable[[Any], Any] | None = None  # None: objects must be strings, parsed by `text`
    choices: Callable[[], tuple[str, ...]] | None = None  # the valid names, for choice kinds

    def from_text(self, raw: str) -> Any:
        return self.text(raw)

    def from_object(self, value: Any) -> Any:
        if self.obj is not None:
            return self.obj(value)
        if isinstance(value, str):
            return self.text(value)
        raise ValueError(f"expected {self.name}, got {type(value).__name__}")


def _integer(text: Any, minimum: int | None, what: str) -> int:
    if isinstance(text, bool) or isinstance(text, float):
        raise ValueError(what)
    try:
        number = int(text)
    except (TypeError, ValueError):
        raise ValueError(what) from None
    if minimum is not None and number < minimum:
        raise ValueError(what)
    return number


def integer(minimum: int | None = None, maximum: int | None = None) -> Kind:
    if minimum == 1:
        what = "expected a whole number >= 1"
    elif minimum is not None:
        what = f"expected a whole number >= {minimum}"
    else:
        what = "expected a whole number"
    if maximum is not None:
        what = f"expected a whole number in {minimum}..{maximum}"

    def parse(value: Any) -> int:
        number = _integer(value, minimum, what)
        if maximum is not None and number > maximum:
            raise ValueError(what)
        return number

    return Kind("integer", parse, parse)


def number(unit: str, allow_zero: bool = False) -> Kind:
    """A real number of `unit` > 0 (>= 0 with `allow_zero`, where 0 turns the feature off)."""
    what = f"expected a number of {unit} >= 0 (0 turns it off)" if allow_zero else f"expected a number of {unit} > 0"

    def parse(value: Any) -> float:
        if isinstance(value, bool):
            raise ValueError(what)
        try:
            result = float(value)
        except (TypeError, ValueError):
            raise ValueError(what) from None
        if not (result > 0 or (allow_zero and result == 0)):  # also refuses NaN
            raise ValueError(what)
        return result

    return Kind(unit, parse, parse)


def seconds(allow_zero: bool) -> Kind:
    return number("seconds", allow_zero)


def positive_number(unit: str) -> Kind:
    return number(unit)


def _bool_text(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("expected true or false (also 1/0, yes/no, on/off)")


def _bool_obj(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _bool_text(value)
    raise ValueError("expected true or false")


BOOL = Kind("boolean", _bool_text, _bool_obj)


def choice(
    choices: Callable[[], tuple[str, ...]] | tuple[str, ...], normalize: Callable[[str], str] = str.strip
) -> Kind:
    """One of a list of names; `choices` may be a function so the registry that owns them decides."""

    def names() -> tuple[str, ...]:
        return choices() if callable(choices) else choices

    def parse(value: Any) -> str:
        if isinstance(value, str):
            key = normalize(value)
            if key in names():
                return key
        raise ValueError(f"choose one of {', '.join(names())}")

    return Kind("choice", parse, parse, choices=names)


def _text(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"expected text, got {type(value).__name__}")
    return str(value)


TEXT = Kind("text", _text, _text)
PATH = Kind("path", _text, lambda v: _text(v.__fspath__() if hasattr(v, "__fspath__") else v))
# A local path or a URL of an fsspec filesystem (s3://bucket/prefix): only a path is made absolute.
LOCATION = Kind("location", _text, PATH.obj)


def is_url(text: str) -> bool:
    """`scheme://...` with a scheme of two or more letters (so `C://x` stays a Windows path)."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and len(scheme) > 1 and scheme.replace("+", "").replace("-", "").isalnum()


def names_list(valid: Callable[[], tuple[str, ...]] | None = None) -> Kind:
    """A comma-separated list ("a,b") or a YAML/Python list of names, each checked when `valid` is given."""

    def check(items: list[str]) -> list[str]:
        items = [i.strip() for i in items if i.strip()]
        if valid is not None:
            bad = [i for i in items if i not in valid()]
            if bad:
                raise ValueError(f"unknown name(s) {', '.join(bad)}; choose from {', '.join(valid())}")
        return items

    def parse_obj(value: Any) -> list[str]:
        if isinstance(value, str):
            return check(value.split(","))
        if isinstance(value, (list, tuple)) and all(isinstance(i, str) for i in value):
            return check(list(value))
        raise ValueError("expected a list of names (or a comma-separated string)")

    return Kind("list of names", lambda text: check(text.split(",")), parse_obj)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1024**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1024**4,
    "tib": 1024**4,
}


def parse_bytes(text: Any) -> int:
    """'8GB', '512MiB', '1e9' -> bytes (binary units)."""
    if isinstance(text, bool):
        raise ValueError("expected a size such as 8GB, 512MiB or 1000000")
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError("expected a size such as 8GB, 512MiB or 1000000")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise ValueError("expected a size such as 8GB, 512MiB or 1000000") from None


BYTES = Kind("size", parse_bytes, parse_bytes)


def bytes_at_most(limit: int, why: str) -> Kind:
    """A size of at most `limit` bytes (`why` says where the limit comes from)."""

    def parse(value: Any) -> int:
        n = parse_bytes(value)
        if n < 0 or n > limit:
            raise ValueError(f"expected a size from 0 to {limit} bytes ({why})")
        return n

    return Kind("size", parse, parse)


def size_or_auto(limit: int, why: str) -> Kind:
    """`auto` (resolved later, per plan) or a size of at most `limit` bytes."""
    size = bytes_at_most(limit, why)

    def parse(value: Any) -> int | str:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return size.text(value)
        except ValueError as error:
            raise ValueError(f"{error}, or auto") from None

    return Kind("size or auto", parse, parse)


def _count_or_auto(value: Any) -> int | str:
    if value in ("auto", "gpu", "cpu"):  # torchrun's words for --nproc-per-node
        return value
    return _integer(value, 1, "expected a whole number >= 1, auto, gpu or cpu")


COUNT_OR_AUTO = Kind("count or auto", _count_or_auto, _count_or_auto)


def nnodes_range(text: str) -> tuple[int, int]:
    """ "2" -> (2, 2); "1:4" -> (1, 4); ValueError otherwise."""
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if len(parts) > 2 or not 1 <= low <= high:
        raise ValueError("expected N or MIN:MAX with 1 <= MIN <= MAX (e.g. 2, or 1:4 for an elastic job)")
    return low, high


def _nnodes(value: Any) -> str:
    text = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
    if not isinstance(text, str):
        raise ValueError("expected N or MIN:MAX")
    nnodes_range(text)
    return text


NNODES = Kind("N or MIN:MAX", _nnodes, _nnodes)


def _python_object(value: Any) -> Any:
    return value


def _bool_or_names_text(text: str) -> bool | list[str]:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE or lowered == "":
        return False
    return [name.strip() for name in text.split(",") if name.strip()]


def _bool_or_names_obj(value: Any) -> Any:
    """YAML: true/false or a list of names; a keyword argument may also be classes or a predicate."""
    if isinstance(value, str):
        return _bool_or_names_text(value)
    if isinstance(value, (bool, list, tuple)) or callable(value):
        return list(value) if isinstance(value, tuple) else value
    raise ValueError("expected true, false or a list of module class names")


BOOL_OR_NAMES = Kind("true, false or module class names", _bool_or_names_text, _bool_or_names_obj)


def _bool_or_mapping_obj(value: Any) -> Any:
    if isinstance(value, dict):
        return value
    return _bool_obj(value)


BOOL_OR_OPTIONS = Kind("true, false (or a dict of options)", _bool_text, _bool_or_mapping_obj)


UNCATCHABLE_SIGNALS = ("SIGKILL", "SIGSTOP")


def _signal_name(item: str) -> str:
    """'term', 'SIGTERM', '15' -> 'SIGTERM'; ValueError naming the item when it is no catchable signal."""
    text = item.strip().upper()
    if text.isdigit():
        try:
            text = signal.Signals(int(text)).name
        except ValueError:
            raise ValueError(f"{item.strip()} is not a signal number here; use names such as SIGTERM,SIGUSR1") from None
    name = text if text.startswith("SIG") else "SIG" + text
    if name not in signal.Signals.__members__:
        raise ValueError(f"{item.strip()} is not a signal; use names such as SIGTERM,SIGUSR1,SIGUSR2, or none")
    if name in UNCATCHABLE_SIGNALS:
        raise ValueError(
            f"{name} cannot be caught, so nothing could be saved on it; "
            "use catchable signals such as SIGTERM,SIGUSR1, or none"
        )
    return name


def _signal_list(value: Any) -> str:
    """A comma-separated list (or YAML list) of signal names, canonical ('SIGTERM,SIGUSR1'), or 'none'."""
    if isinstance(value, str):
        items = value.split(",")
    elif isinstance(value, (list, tuple)) and all(isinstance(i, (str, int)) and not isinstance(i, bool) for i in value):
        items = [str(i) for i in value]
    else:
        raise ValueError("expected signal names such as SIGTERM,SIGUSR1, or none")
    items = [i for i in items if i.strip()]
    if [i.strip().lower() for i in items] == ["none"]:
        return "none"
    if not items:
        raise ValueError("expected signal names such as SIGTERM,SIGUSR1, or none")
    names: list[str] = []
    for item in items:
        name = _signal_name(item)
        if name not in names:
            names.append(name)
    return ",".join(names)


SIGNALS = Kind("signal names or none", _signal_list, _signal_list)


def signal_numbers(value: str) -> tuple[signal.Signals, ...]:
    """The signals of a SIGNALS value ('none': none)."""
    if value == "none" or not value:
        return ()
    return tuple(signal.Signals[name] for name in value.split(","))


def python(text: Callable[[str], Any], describe: str) -> Kind:
    """A setting whose keyword argument may be any Python object (a dict, a callable); text parses the rest."""
    return Kind(describe, text, _python_object)


def pattern_map(styles: tuple[str, ...], aliases: dict[str, str], describe: str) -> Kind:
    """{module name pattern: style}: a YAML or Python mapping, or text (JSON, or `pattern=style,...`)."""

    def check(mapping: Any) -> dict[str, str]:
        if not isinstance(mapping, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in mapping.items()
        ):
            raise ValueError(f"expected {describe}")
        out = {}
        for pattern, style in mapping.items():
            key = aliases.get(style.strip().lower(), style.strip().lower())
            if key not in styles:
                raise ValueError(f"{pattern!r}: unknown style {style!r}; choose one of {', '.join(styles)}")
            out[pattern.strip()] = key
        return out

    def parse_text(text: str) -> dict[str, str]:
        import json

        text = text.strip()
        if text.startswith("{"):
            try:
                return check(json.loads(text))
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON ({error.msg})") from None
        pairs = [item.partition("=") for item in text.split(",") if item.strip()]
        if not pairs or any(not sep or not key.strip() for key, sep, _ in pairs):
            raise ValueError(f"expected {describe}")
        return check({key.strip(): value for key, _, value in pairs})

    return Kind(describe, parse_text, lambda value: parse_text(value) if isinstance(value, str) else check(value))
