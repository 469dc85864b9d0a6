"""Shared pieces of the fault tests: a real failing load on bare and wrapped managers, hostile endpoints."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm.v1.kv_offload.base import OffloadingManager, ReqContext

import kvobs
from kvobs.vllm import ObservedOffloadingManager
from tests.support.vllm_env import cpu_extra, create_manager, key

SLOTS = 4


def evict_after_lookup(manager: OffloadingManager, round_: int = 0) -> tuple[type, str]:
    """Store, look up, evict, load: vLLM's `not found in cache` assertion (#50014's shape).

    Returns the exception's (type, text); fails the test if nothing was raised.
    """
    base = 1000 * (round_ + 1)
    writer, victim = ReqContext(f"writer-{round_}"), ReqContext(f"victim-{round_}")
    with manager.lock:
        for context in (writer, victim):
            manager.on_new_request(context)
        stored = [key(base + i) for i in range(SLOTS)]
        manager.prepare_store(stored, writer)
        manager.complete_store(stored, writer)
        victim.set_offload_key_position(stored[0], 16)
        manager.lookup(stored[0], victim)
        fresh = [key(base + 100 + i) for i in range(SLOTS)]
        manager.prepare_store(fresh, writer)  # evicts every chunk stored above
        manager.complete_store(fresh, writer)
        try:
            manager.prepare_load([stored[0]], victim)
        except Exception as exc:
            return type(exc), str(exc)
    raise AssertionError("the load did not fail")


def same_failure_as_bare(observed: ObservedOffloadingManager, rounds: int = 1) -> list[str]:
    """Run the failing sequence on ``observed`` and on a bare twin; the exceptions must agree."""
    bare = create_manager(cpu_extra(SLOTS))
    texts = []
    try:
        for r in range(rounds):
            bare_type, bare_text = evict_after_lookup(bare, r)
            got_type, got_text = evict_after_lookup(observed, r)
            assert got_type is bare_type is AssertionError
            assert got_text.startswith(bare_text) and "cause: evicted_after_lookup" in got_text, got_text
            texts.append(got_text)
    finally:
        bare.shutdown()
    return texts


def observed_cpu(**options: object) -> ObservedOffloadingManager:
    return kvobs.observe(create_manager(cpu_extra(SLOTS)), **options)


def closed_port() -> int:
    """A port nobody listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def silent_server() -> Iterator[int]:
    """A real TCP server that accepts connections and never answers (a hung collector)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        server.close()


def churn(manager: OffloadingManager, rounds: int, start: int = 0, fail_every: int = 0) -> None:
    """Store rounds of SLOTS chunks: from the second round on each evicts the previous one.

    With ``fail_every``, every n-th round's store fails (complete_store(success=False)).
    """
    writer = ReqContext("churn")
    with manager.lock:
        manager.on_new_request(writer)
        for r in range(start, start + rounds):
            keys = [key(10_000 + SLOTS * r + i) for i in range(SLOTS)]
            manager.prepare_store(keys, writer)
            manager.complete_store(keys, writer, success=not (fail_every and r % fail_every == fail_every - 1))
        manager.on_request_finished(writer)


def engine_totals(directory: Path, engine: str) -> dict[str, dict[str, float]]:
    """What the sidecar's real ingest code makes of a kvobs directory (in-process, one poll)."""
    from kvobs.sidecar.ingest import Ingest

    ingest = Ingest(directory)
    ingest.poll()
    return ingest.state.engines[("", engine)].totals() | {"corrupt": {"lines": sum(ingest.state.skipped.values())}}


@contextmanager
def tmpfs(path: Path, size: str = "1m") -> Iterator[Path]:
    """A real tmpfs mounted at ``path`` (root only).

    Without the privilege (root or CAP_SYS_ADMIN) the test is skipped with the reason, which
    ``-ra`` lists in every run's summary: a machine that cannot mount cannot run this fault for
    real, and failing there would say nothing about kvobs.
    """
    import subprocess

    import pytest

    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, mode: str) -> None:
    import subprocess

    subprocess.run(["mount", "-o", f"remount,{mode}", str(path)], check=True)
