"""Feed an EvictionHistory one batch at a time, as the recorder would hand it a run of one batch."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvobs.codes import pack_flags
from kvobs.history import EvictionHistory


def record_batch(
    history: EvictionHistory, keys: Sequence[bytes], reason: int, path: int, req_id: str | None, now: float
) -> int:
    """Record one removal batch; its serial."""
    serial = history.next_serial
    history.record_columns(
        serial, array("q", map(hash, keys)), array("q", [len(keys)]), array("d", [now]),
        array("B", [pack_flags(reason, path)]), [req_id],
    )
    return serial
