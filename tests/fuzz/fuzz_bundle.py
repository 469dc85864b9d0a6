"""Target ``bundle``: a replay bundle file through ``kvobs.vllm.bundle_replay.load`` (``kvobs replay``'s reader),
and through the sidecar's listing of bundles (``kvobs.sidecar.replay_endpoints.listing``, GET /api/v1/replays).

The input is read three times: as the whole bundle file; as the window of a bundle whose header is a real
replayable one's (corpus/bundle/bundle-2) zipped around it, so that mutations reach the window's decoder
past the zip's CRC and the header's checks; and as a state blob (kvobs.state_codec, the manager a replay
rebuilds: ``kvobs.vllm.compat.rebuild_state``). A bundle that loads is replayed.

Contract: ``load`` and ``replay`` raise only ``kvobs.vllm.bundle_replay.ReplayError``, ``rebuild_state`` only
``kvobs.state_codec.StateError``; ``listing`` raises nothing (a bundle it cannot read is left out). The
target goes through these public functions only (format 1 bundles held a pickle and are refused; format 2
is MessagePack of plain values)."""

from __future__ import annotations

import contextlib
import io
import json
import zipfile
from pathlib import Path

from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX, HEADER, WINDOW
from kvobs.sidecar.replay_endpoints import listing
from kvobs.state_codec import StateError
from kvobs.vllm.bundle_replay import ReplayError, load, replay
from kvobs.vllm.compat import rebuild_state
from tests.fuzz._scratch import scratch

_DIR = scratch("bundle")
_PATH = _DIR / BUNDLE_DIR / f"001796583651390-0-5514-1{BUNDLE_SUFFIX}"
_PATH.parent.mkdir()
with zipfile.ZipFile(Path(__file__).parent / "corpus" / "bundle" / "bundle-2") as _real:
    _HEADER = _real.read(HEADER)


def _around(window: bytes) -> bytes:
    """A bundle of the real header and ``window``."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_STORED) as bundle:
        bundle.writestr(HEADER, _HEADER)
        bundle.writestr(WINDOW, window)
    return buffer.getvalue()


def TestOneInput(data: bytes) -> None:
    for content in (data, _around(data)):
        _PATH.write_bytes(content)
        json.dumps(listing(_DIR))
        with contextlib.suppress(ReplayError):  # the one exception load and replay may raise
            replay(load(str(_PATH)))
    with contextlib.suppress(StateError):
        rebuild_state(data)
