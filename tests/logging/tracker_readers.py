"""Read back what each tracker wrote, with the library's own readers and record types.

W&B 0.31 no longer ships a Python reader for its offline `.wandb` files (wandb-core, in Go, reads
them): the framing is LevelDB's log format (32 KiB blocks of CRC/length/type-headed chunks after a
7-byte `:W&B` header), read here in a few lines; the records are decoded by wandb's own protobuf
classes. SwanLab's offline `.swanlab` file is read by SwanLab's own `DataStoreReader`.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pos, pending = [], _HEADER, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # the rest of a block too short for a header: padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        pos += _HEADER
        if kind == 0:
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(path: Path) -> dict[str, dict[int, float]]:
    """metric -> {step: value} from the history records."""
    import json

    history: dict[str, dict[int, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    history.setdefault(key, {})[step] = json.loads(item.value_json)
    return history


def wandb_run(path: Path) -> tuple[str, dict[str, Any]]:
    """(display name, config) from the run record and config updates."""
    import json

    name, config = "", {}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        items = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        if kind == "run":
            name = record.run.display_name
        for item in items:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                config[key] = json.loads(item.value_json)
    return name, config


def swanlab_scalars(path: Path) -> tuple[str, dict[str, dict[int, float]]]:
    """(experiment name, metric -> {step: value}) from a SwanLab run file."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    reader = DataStoreReader()
    reader.open(path)
    name, scalars = "", {}
    try:
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                name = record.start.name
            elif kind == "scalar":
                scalars.setdefault(record.scalar.key, {})[record.scalar.step] = record.scalar.value.number
    finally:
        reader.close()
    return name, scalars
