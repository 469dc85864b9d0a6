"""Target ``wire``: journal bytes through kvobs.wire.decode, as the sidecar and ``kvobs explain`` read them.

Contract: nothing escapes. ``decode_line`` gives a record or None for any bytes; ``read_records`` reads any
regular file to its end (None per corrupt line) without passing it; every record read folds into the
sidecar's state (``SidecarState.apply``), the state's checkpoint survives JSON both ways and the /metrics
text renders."""

from __future__ import annotations

import json

from prometheus_client import CollectorRegistry, generate_latest

from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.sidecar.state import SidecarState
from kvobs.wire.decode import JournalPosition, decode_line, read_new_records, read_records
from kvobs.wire.format import Record
from tests.fuzz._scratch import ContractBroken, scratch

_DIR = scratch("wire")
_FILE = _DIR / "journal" / "0-1.000000.jsonl"
_FILE.parent.mkdir()
_INGEST = Ingest(_DIR)
_REGISTRY = CollectorRegistry(auto_describe=False)
_REGISTRY.register(KvobsCollector(_INGEST))


def TestOneInput(data: bytes) -> None:
    state = SidecarState()
    for line in data.split(b"\n")[:256]:
        record = decode_line(line)
        if record is not None and not isinstance(record, Record):
            raise ContractBroken(f"decode_line gave {type(record).__name__}")
        state.apply(record, "0-1.000000")
    _FILE.write_bytes(data)
    whole = JournalPosition()
    read = list(read_records(_FILE, whole, len(data) + 1))
    if whole.offset > len(data):
        raise ContractBroken(f"read past the end: {whole.offset} > {len(data)}")
    split = JournalPosition()  # the same bytes arriving in two appends: a writer mid-line
    _FILE.write_bytes(data[: len(data) // 2])
    first = list(read_new_records(_FILE, split))
    _FILE.write_bytes(data)
    rest = list(read_records(_FILE, split, len(data) + 1))
    if len(read) <= 256 and sum(r is not None for r in first + rest) > sum(r is not None for r in read) + 1:
        raise ContractBroken("a split read found more records than a whole one")
    for record in read:
        state.apply(record, "0-1.000000")
    saved = json.loads(json.dumps(state.to_json()))
    SidecarState.from_json(saved)
    _INGEST.state = state
    generate_latest(_REGISTRY)
