"""Engine -> sidecar records: a per-engine append-only JSON-lines journal in ``KVOBS_DIR``.

Why a journal: the engine must never block on the sidecar (or on anything), one
sidecar must serve every DP rank of a node, and the evidence must outlive the
EngineCore that the failed assertion kills. So:

* the scheduler thread only appends a tuple to a bounded deque (full: the record
  is dropped and counted, never waited for); a daemon thread writes the deque
  out every ``FLUSH_EVERY_S`` with cumulative ``totals`` (exact counters even if
  batches were dropped, and nothing double counted by a restarted sidecar);
* a failed load writes its report file synchronously (temp file, fsync, rename,
  fsync of the directory) and drains the journal before the exception leaves
  kvobs: the process is about to die;
* files are bounded: segments roll at ``SEGMENT_BYTES`` and only ``KEEP_SEGMENTS``
  are kept per engine process; at most ``KEEP_REPORTS`` failure reports.

Layout: ``DIR/journal/<engine>-<pid>.<seq>.jsonl`` (``<engine>-<pid>_<n>.<seq>.jsonl`` for the
n-th other writer of the same engine in the same process and directory) and ``DIR/failures/*.json``,
directories 0700 and files 0600 (keys are hashes; no prompt text is written).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvobs.diagnosis import Diagnosis
from kvobs.history import PATHS, REASONS
from kvobs.keys import decode_key, key_group
from kvobs.observer import RemovalBatch, Sink
from kvobs.recorder import Record
from kvobs.verdicts import NearMiss

if TYPE_CHECKING:
    from kvobs.observer import Observer

FORMAT_VERSION = 1
FLUSH_EVERY_S = 0.25
QUEUE_RECORDS = 65_536
SEGMENT_BYTES = 16 * 2**20
KEEP_SEGMENTS = 4
KEEP_PROCESSES = 8  # earlier processes of an engine whose segments are kept (restarts must not fill the disk)

_stems_in_use: set[tuple[str, str]] = set()  # (journal dir, file stem) of this process's live writers
_stems_lock = threading.Lock()


def _claim_stem(journal_dir: Path, engine: str) -> str:
    """A file stem no other live writer of this process uses in this directory.

    Two observed managers with one engine name in one process (``observe()`` twice, with the
    default ``engine=pid<pid>``) would otherwise write, and rotate away, each other's segments.
    """
    base = f"{engine}-{os.getpid()}"
    with _stems_lock:
        stem, n = base, 0
        while (str(journal_dir), stem) in _stems_in_use:
            n += 1
            stem = f"{base}_{n}"
        _stems_in_use.add((str(journal_dir), stem))
    return stem


def _stem_pid(stem_pid: str) -> int | None:
    """The pid in the ``<pid>`` or ``<pid>_<n>`` part of a journal file name."""
    pid = stem_pid.partition("_")[0]
    return int(pid) if pid.isdigit() else None
KEEP_REPORTS = 1_000
MAX_REPORT_BYTES = 4 * 2**20
MAX_REPORT_KEYS = 1_000  # keys a report details (~350 bytes each); its missing_summary counts every key
RESIDENCIES_PER_RECORD = 16_384  # ages per batch line (~200 KB): a 1M-chunk reset is ~62 lines, not one of 10 MB
KEYS_PER_RECORD = 256  # key prefixes listed per batch record (for `kvobs explain`)
FAILURE_FLUSH_TIMEOUT_S = 2.0
MAX_LINE_BYTES = 8 * 2**20  # far above any record kvobs writes (batch records list <= 256 keys)


def private_dir(path: Path) -> Path:
    """Create ``path`` (0700) if needed; kvobs writes only inside its directory."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def write_durably(path: Path, data: bytes) -> None:
    """Write a whole file so that it survives a crash right after this returns."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk must not also collect half-written temp files
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is out (a nearly full disk writes short before it fails)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def key_ref(key: bytes) -> str:
    """A key as journaled: the first 8 bytes of its block hash in hex, then its group."""
    decoded = decode_key(key)
    return f"{decoded.hash_prefix}/{decoded.group}"


def _key_ref(key: bytes) -> str:
    """``key_ref`` without building a DecodedKey, for keys with at least 8 hash bytes (the writer's loop)."""
    if len(key) < 12:
        return key_ref(key)
    return f"{key[:8].hex()}/{int.from_bytes(key[-4:], 'big')}"


def failure_report(diagnosis: Diagnosis, exc: BaseException, engine: str, wall_time: float) -> dict[str, Any]:
    """Every field of the message as structured data (GET /api/v1/failures serves these)."""
    failure = diagnosis.failure
    return {
        "kind": "failure",
        "format": FORMAT_VERSION,
        "engine": engine,
        "pid": os.getpid(),
        "time": wall_time,
        "exception_type": type(exc).__name__,
        "vllm_message": failure.vllm_message,
        "message": diagnosis.message,
        "req_id": failure.req_id,
        "group": failure.failing_group,
        "cause": diagnosis.cause,
        "causes": diagnosis.causes,
        "num_keys": failure.num_keys,
        "num_missing": len(diagnosis.keys),
        "end_token_range": list(failure.end_token_range) if failure.end_token_range else None,
        "history_keys": failure.history_keys,
        "history_window_s": failure.history_window_s,
        "missing_not_listed": max(0, len(diagnosis.keys) - MAX_REPORT_KEYS),
        "missing_summary": missing_summary(diagnosis),
        "missing": [
            {
                "key": key_ref(k.facts.key),
                "group": k.facts.group,
                "end_token": k.facts.end_token,
                "state": k.facts.state,
                "cause": k.cause,
                "seconds_since_eviction": k.age_s,
                "reported": None if k.facts.verdict is None else ("HIT_PENDING" if k.facts.verdict.pending else "HIT"),
                "last_removal": None
                if k.facts.last_removal is None
                else {
                    "reason": k.facts.last_removal.reason,
                    "path": k.facts.last_removal.path,
                    "req_id": k.facts.last_removal.req_id,
                },
                "evidence": k.evidence,
            }
            for k in diagnosis.keys[:MAX_REPORT_KEYS]
        ],
    }


def missing_summary(diagnosis: Diagnosis) -> dict[str, Any]:
    """Every missing key, aggregated: counts by (cause, group) and eviction ages bucketed per group.

    A load can ask for tens of thousands of keys (a long prompt, several KV groups); listing each
    would outgrow what the sidecar reads (MAX_REPORT_BYTES), so the sidecar's metrics come from here.
    """
    from kvobs.sidecar.state import Histogram

    counts = Counter((k.cause, k.facts.group) for k in diagnosis.keys)
    ages: dict[int, Histogram] = {}
    for k in diagnosis.keys:
        if k.age_s is not None:
            ages.setdefault(k.facts.group, Histogram()).observe(k.age_s)
    return {
        "counts": [[cause, group, n] for (cause, group), n in counts.items()],
        "ages": {str(group): {"counts": h.counts, "sum": h.total} for group, h in ages.items()},
    }


def read_report(path: Path) -> dict[str, Any]:
    """A failure report file; ValueError if it is too large, not JSON or not an object."""
    if path.stat().st_size > MAX_REPORT_BYTES:
        raise ValueError(f"report larger than {MAX_REPORT_BYTES} bytes")
    report = json.loads(path.read_bytes())
    if not isinstance(report, dict):
        raise ValueError("report is not a JSON object")
    return report


def iter_reports(failures_dir: Path) -> Iterator[dict[str, Any]]:
    """Readable failure reports, newest first (file names start with the millisecond wall time),
    each with its ``id`` (the file's stem); unreadable ones are skipped."""
    if not failures_dir.is_dir():
        return
    for path in sorted(failures_dir.glob("*.json"), reverse=True):
        try:
            report = read_report(path)
        except (OSError, ValueError):
            continue
        report["id"] = path.stem
        yield report


class JournalSink(Sink):
    """Writes an engine's records for the sidecar; see the module docstring."""

    stage = "journal"

    def __init__(self, directory: str | os.PathLike[str], observer: Observer, vllm_version: str = "") -> None:
        self.root = private_dir(Path(directory))
        self.journal_dir = private_dir(self.root / "journal")
        self.failures_dir = private_dir(self.root / "failures")
        self.observer = observer
        self.engine = observer.options.engine or f"pid{os.getpid()}"
        self._engine_json = json.dumps(self.engine)
        self._group_names: dict[bytes, str] = {}  # 4-byte group suffix -> its decimal text
        self._pid = os.getpid()
        self._last_req: str | None = None  # the request id of the last batch line, and its JSON
        self._last_req_json = "null"
        self._queue: deque[tuple[Any, ...]] = deque()
        self._queued = 0  # records in the queue (a run of batches counts each)
        self.dropped = 0
        self._write_lock = threading.Lock()
        self._seq = 0
        self._segment_bytes = 0
        self._fd: int | None = None
        self._wall_offset = time.time() - time.monotonic()
        self._reports = 0
        # Tells this writer's cumulative totals apart from any other's with the same engine and
        # pid: a restarted container reuses pids; two observed managers may share one process.
        self.run = os.urandom(6).hex()
        self._closed = threading.Event()
        self._stem = _claim_stem(self.journal_dir, self.engine)
        self._prune_earlier_processes()
        self._enqueue(("hello", vllm_version))
        self._thread = threading.Thread(target=self._run, name="kvobs-journal", daemon=True)
        self._thread.start()

    # -- scheduler thread: O(1), never blocks ---------------------------------------

    def _enqueue(self, record: tuple[Any, ...], batches: int = 1) -> None:
        if self._queued + batches > QUEUE_RECORDS:
            self.dropped += batches
            return
        self._queued += batches
        self._queue.append(record)

    def on_removals(self, records: Sequence[Record]) -> None:
        """A drained run of batches, queued as one item: turned into lines on the writer thread."""
        self._enqueue(("records", records), len(records))

    def on_near_miss(self, near_misses: Sequence[NearMiss], reason: str) -> None:
        self._enqueue(("near_miss", reason, len(near_misses)))

    def on_failure(self, diagnosis: Diagnosis, exc: BaseException) -> None:
        """Durable report, then a bounded synchronous drain of the journal."""
        report = failure_report(diagnosis, exc, self.engine, time.time())
        name = f"{int(report['time'] * 1000):015d}-{self.engine}-{os.getpid()}-{self._reports}.json"
        self._reports += 1
        try:
            write_durably(self.failures_dir / name, json.dumps(report, sort_keys=True).encode())
            self._prune_reports()
            self._enqueue(("failure", name, report["cause"]))
        except Exception as fault:  # the journal (with the failure in its totals) still gets flushed
            self.observer.internal_error("report", fault)
        try:
            self.flush(timeout=FAILURE_FLUSH_TIMEOUT_S, durable=True)
        except Exception as fault:
            self.observer.internal_error("journal", fault)

    # -- writer ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.wait(FLUSH_EVERY_S):
            try:
                self.flush()
            except Exception as exc:  # never kill the thread; counted
                self.observer.internal_error("journal", exc)

    def flush(self, timeout: float = -1, durable: bool = False) -> bool:
        """Write out what is queued plus current totals; False if the lock was not had in time.

        The observer's removal queue is drained first (skipped if another thread is
        draining it), and the totals are read before the write lock is taken: a
        writer holding the write lock never waits for the drain lock.
        """
        self.observer.drain(block=False)
        totals = self._encode(("totals",))
        if not self._write_lock.acquire(timeout=timeout):
            return False
        try:
            lines: list[str] = []
            while self._queue:
                item = self._queue.popleft()
                if item[0] == "records":
                    self._queued -= len(item[1])
                    encode = self._encode_batch
                    lines.extend(encode(serial, now, REASONS[reason], PATHS[path], req, keys, residency)
                                 for serial, now, reason, path, req, keys, residency, _ in item[1])
                else:
                    self._queued -= 1
                    lines.append(self._encode(item))
            lines.append(totals)
            try:
                self._write(("\n".join(lines) + "\n").encode())
            except OSError:
                # Lost, and said so: counted as dropped (the next totals carry the count;
                # the counters themselves are cumulative, so they recover exactly).
                self.dropped += len(lines) - 1
                raise
            if durable and self._fd is not None:
                os.fsync(self._fd)
            return True
        finally:
            self._write_lock.release()

    def close(self) -> None:
        """Flush and close, bounded: a writer stuck in a hung write must not hang the engine's shutdown."""
        self._closed.set()
        self._thread.join(timeout=FAILURE_FLUSH_TIMEOUT_S)
        if not self.flush(timeout=FAILURE_FLUSH_TIMEOUT_S, durable=True):
            raise TimeoutError(f"journal writer stuck for over {FAILURE_FLUSH_TIMEOUT_S}s; not flushed at close")
        if not self._write_lock.acquire(timeout=FAILURE_FLUSH_TIMEOUT_S):
            raise TimeoutError("journal writer stuck; file left open at close")
        try:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        finally:
            self._write_lock.release()
        with _stems_lock:
            _stems_in_use.discard((str(self.journal_dir), self._stem))

    def _write(self, data: bytes) -> None:
        if self._fd is None or self._segment_bytes + len(data) > SEGMENT_BYTES:
            self._roll()
        assert self._fd is not None
        try:
            write_all(self._fd, data)
        except OSError:
            # Keep the file line-aligned: cut a partial append back off (disk full, EIO).
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._segment_bytes)
            raise
        self._segment_bytes += len(data)

    def _roll(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None  # never keep a closed descriptor number (it gets reused)
            os.close(fd)
            self._seq += 1
        path = self.journal_dir / f"{self._stem}.{self._seq:06d}.jsonl"
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segment_bytes = 0
        old = self._seq - KEEP_SEGMENTS
        if old >= 0:
            with contextlib.suppress(FileNotFoundError):
                (self.journal_dir / f"{self._stem}.{old:06d}.jsonl").unlink()

    def _prune_earlier_processes(self) -> None:
        """Delete the segments of this engine's earlier processes but the newest KEEP_PROCESSES'.

        Each process bounds its own segments; without this a crash-looping engine would leave
        up to KEEP_SEGMENTS segments per restart, forever. Newest by last write, so a live
        writer (touching its file every FLUSH_EVERY_S) is never among the deleted.
        """
        mine = os.getpid()
        by_pid: dict[int, list[Path]] = {}
        for path in self.journal_dir.glob("*.jsonl"):
            engine, _, stem_pid = path.name[: -len(".jsonl")].rpartition(".")[0].rpartition("-")
            pid = _stem_pid(stem_pid)
            if engine == self.engine and pid is not None and pid != mine:
                by_pid.setdefault(pid, []).append(path)
        if len(by_pid) <= KEEP_PROCESSES:
            return

        def last_write(paths: list[Path]) -> float:
            newest = 0.0
            for path in paths:
                with contextlib.suppress(OSError):
                    newest = max(newest, path.stat().st_mtime)
            return newest

        by_age = sorted(by_pid.values(), key=last_write)
        for paths in by_age[: len(by_age) - KEEP_PROCESSES]:
            for path in paths:
                with contextlib.suppress(OSError):
                    path.unlink()

    def _prune_reports(self) -> None:
        reports = sorted(self.failures_dir.glob("*.json"))
        for stale in reports[: max(0, len(reports) - KEEP_REPORTS)]:
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()

    @staticmethod
    def _encode_large_batch(base: dict[str, Any], residency_s: Sequence[float]) -> str:
        """A huge batch (a reset of a big CPU tier) as several lines, each far below the
        sidecar's line limit: the first carries the batch, the others only more ages."""
        lines = [json.dumps(base, separators=(",", ":"))]
        rest = {**base, "n": 0, "g": {}, "keys": []}
        for start in range(RESIDENCIES_PER_RECORD, len(residency_s), RESIDENCIES_PER_RECORD):
            rest["res"] = [round(a, 6) for a in residency_s[start : start + RESIDENCIES_PER_RECORD]]
            lines.append(json.dumps(rest, separators=(",", ":")))
        return "\n".join(lines)

    def _encode_batch(
        self, serial: int, now: float, reason: str, path: str, req_id: str | None, keys: Sequence[bytes],
        residency_s: Sequence[float] | None,
    ) -> str:
        """One batch line, the same text ``_encode(("batch", ...))`` writes, built directly.

        The writer encodes every removal batch (about 13 us each through a dict and
        ``json.dumps``, about 4 us this way); only the request id needs JSON escaping.
        """
        if (residency_s and len(residency_s) > RESIDENCIES_PER_RECORD) or any(len(k) < 12 for k in keys):
            return self._encode(("batch", RemovalBatch(serial, now, reason, path, req_id, keys, residency_s)))
        groups: dict[bytes, int] = {}
        for key in keys:
            suffix = key[-4:]
            groups[suffix] = groups.get(suffix, 0) + 1
        names = self._group_names
        for suffix in groups:
            if suffix not in names:
                names[suffix] = str(int.from_bytes(suffix, "big"))
        g = ",".join(f'"{names[suffix]}":{n}' for suffix, n in groups.items())
        # A finite float's repr is its JSON text (as json.dumps writes it).
        res = ",".join([repr(round(a, 6)) for a in residency_s]) if residency_s else ""
        refs = '","'.join([f"{k[:8].hex()}/{names[k[-4:]]}" for k in keys[:KEYS_PER_RECORD]])
        if req_id != self._last_req:
            self._last_req, self._last_req_json = req_id, json.dumps(req_id)
        return (
            f'{{"k":"batch","e":{self._engine_json},"pid":{self._pid},"t":{now + self._wall_offset!r},'
            f'"s":{serial},"r":"{reason}","p":"{path}","req":{self._last_req_json},"n":{len(keys)},'
            f'"g":{{{g}}},"res":[{res}],"keys":{f"[{chr(34)}{refs}{chr(34)}]" if keys else "[]"}}}'
        )

    def _encode(self, record: tuple[Any, ...]) -> str:
        kind = record[0]
        obs = self.observer
        base: dict[str, Any] = {"k": kind, "e": self.engine, "pid": os.getpid()}
        if kind == "batch":
            batch: RemovalBatch = record[1]
            # Counted by the 4-byte group suffix in C, decoded once per group (same order as before).
            groups = {key_group(suffix): n for suffix, n in Counter(k[-4:] for k in batch.keys).items()}
            base.update(
                t=batch.time + self._wall_offset,
                s=batch.serial,
                r=batch.reason,
                p=batch.path,
                req=batch.req_id,
                n=len(batch.keys),
                g={str(g): n for g, n in groups.items()},
                res=[round(a, 6) for a in batch.residency_s[:RESIDENCIES_PER_RECORD]] if batch.residency_s else [],
                keys=[_key_ref(k) for k in batch.keys[:KEYS_PER_RECORD]],
            )
            if batch.residency_s and len(batch.residency_s) > RESIDENCIES_PER_RECORD:
                return self._encode_large_batch(base, batch.residency_s)
        elif kind == "near_miss":
            base.update(t=time.time(), r=record[1], n=record[2])
        elif kind == "failure":
            base.update(t=time.time(), file=record[1], cause=record[2])
        elif kind == "hello":
            from kvobs import __version__

            base.update(t=time.time(), version=__version__, vllm_version=record[1],
                        history_size=obs.options.history_size, format=FORMAT_VERSION, run=self.run)
        else:  # totals: cumulative, so a reader never double counts
            stats = obs.history_stats
            base.update(
                t=time.time(),
                run=self.run,
                evicted=dict(obs.evicted),
                batches=dict(obs.batches),
                near=dict(obs.near_misses),
                failures=dict(obs.failures),
                errors=dict(obs.internal_errors),
                dropped={"journal": self.dropped, "verdicts": obs.verdicts.dropped},
                hist_keys=stats.keys,
                hist_window=stats.window(time.monotonic()),
            )
        return json.dumps(base, separators=(",", ":"))


@dataclass
class JournalPosition:
    """How far a reader got in one journal file."""

    offset: int = 0


def read_new_records(
    path: Path, position: JournalPosition, max_bytes: int = 8 * 2**20
) -> Iterator[dict[str, Any] | None]:
    """Complete records appended since ``position`` (None for a corrupt line); advances it.

    A partial last line (the writer is mid-append, or died mid-append) is left for
    the next call; a corrupt line is reported as None and skipped. A "line" of
    ``MAX_LINE_BYTES`` or more is no record kvobs writes: it is skipped as corrupt
    rather than waited on forever (which would stop this file's ingest).
    """
    with open(path, "rb") as f:
        f.seek(position.offset)
        data = f.read(max_bytes)
    end = data.rfind(b"\n")
    if end < 0:
        if len(data) >= MAX_LINE_BYTES:
            position.offset += len(data)
            yield None
        return
    position.offset += end + 1
    for line in data[: end + 1].splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            yield None
            continue
        yield record if isinstance(record, dict) else None
