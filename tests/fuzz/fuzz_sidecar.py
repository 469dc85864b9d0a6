"""Target ``sidecar``: raw bytes as what a client sends on one connection to ``kvobs serve``: request lines,
paths, query strings, headers and bodies, pipelined, handled by the sidecar's real request handler
(``kvobs.sidecar.server.Handler``, on a real ``SidecarServer`` that is bound but not serving) over a
socketpair, over a directory holding a real journal, failure report and bundle (the seeds of the other
targets). The first byte says whether the server has a bearer token (``kvobs serve --token-file``).

Contract: handling a connection raises nothing, whatever arrives, and never answers 500; the answer, if
any, to a request line of HTTP/1.x, is HTTP/1.x (http.server answers any other first line, ``GET /path`` or
a garbled one, as HTTP/0.9 does: the body alone, no status line; tests/reliability/test_reliability_http.py
accepts that too)."""

from __future__ import annotations

import re
import shutil
import socket
import threading
from pathlib import Path

from kvobs.bundles import BUNDLE_DIR, BUNDLE_SUFFIX
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.server import Handler, SidecarServer
from kvobs.wire.format import FAILURES_DIR
from tests.fuzz._scratch import ContractBroken, scratch

CORPUS = Path(__file__).parent / "corpus"
REPORT_ID = "001796583651389-0-5514-0"
BUNDLE_ID = "001796583651390-0-5514-1"
TOKEN = b"fuzz-token"
_DIR = scratch("sidecar")
for folder in ("journal", FAILURES_DIR, BUNDLE_DIR):
    (_DIR / folder).mkdir()
shutil.copy(CORPUS / "wire" / "journal", _DIR / "journal" / "0-5514.000000.jsonl")
shutil.copy(CORPUS / "report" / "report-0", _DIR / FAILURES_DIR / f"{REPORT_ID}.json")
shutil.copy(CORPUS / "bundle" / "bundle-0", _DIR / BUNDLE_DIR / f"{BUNDLE_ID}{BUNDLE_SUFFIX}")
_INGEST = Ingest(_DIR)
_INGEST.poll()
_SERVERS = {token: SidecarServer(("127.0.0.1", 0), _INGEST, token) for token in (None, TOKEN)}


def _client(sock: socket.socket, request: bytes, answer: bytearray) -> None:
    """Send the request, end the sending side, read the answer until the server closes."""
    try:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
    except OSError:  # the server closed first (a refused body): its answer is still there to read
        pass
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except OSError:
        pass


def TestOneInput(data: bytes) -> None:
    if not data:
        return
    server = _SERVERS[TOKEN if data[0] & 1 else None]
    client, served = socket.socketpair()
    answer = bytearray()
    reader = threading.Thread(target=_client, args=(client, data[1:], answer), daemon=True)
    reader.start()
    try:
        Handler(served, ("127.0.0.1", 40000), server)  # handles every request on the connection, then returns
    finally:
        served.close()
        reader.join(timeout=10)
        client.close()
    if reader.is_alive():
        raise ContractBroken("the connection's answer never ended")
    words = data[1:].split(b"\n", 1)[0].decode("iso-8859-1").rstrip("\r\n").split()  # as http.server splits it
    versioned = len(words) == 3 and re.fullmatch(r"HTTP/1\.[0-9]", words[2]) is not None
    if answer and versioned and not answer.startswith(b"HTTP/1."):
        raise ContractBroken(f"not an HTTP answer: {bytes(answer[:80])!r}")
    if b"HTTP/1.1 500 " in answer or b"HTTP/1.0 500 " in answer:
        raise ContractBroken(f"a 500: {bytes(answer[:300])!r}")
