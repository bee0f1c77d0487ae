"""Reading an offline W&B run back: the records of its ``run-*.wandb`` file (W&B's LevelDB-style
log of ``wandb_internal_pb2.Record`` protobufs; wandb ships no Python reader for it)."""

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32768, 7  # log blocks; a chunk's header: crc32 (4), length (2), type (1)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    pos, parts = HEADER, b""  # the file starts with ":W&B", a 2-byte magic and a version byte
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is zero padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            parts = chunk
        elif kind == MIDDLE:
            parts += chunk
        elif kind == LAST:
            yield parts + chunk


def read_records(path):
    """Every record of the ``.wandb`` file at ``path``, as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records = []
    for raw in _chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def history(path) -> dict[int, dict]:
    """The run's history rows by step (``wandb.log``'s values, W&B's own ``_step``... keys included)."""
    rows = {}
    for record in read_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows[record.history.step.num] = row
    return rows


def run_name(path) -> str:
    """The run's display name (``wandb.init(name=...)``)."""
    for record in read_records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run.display_name
    raise AssertionError(f"{path}: no run record")
