"""The rule kvobs reasons with (lookup promises), and the state the hot path keeps for it.

The rule, used alike by the near-miss counter and the diagnosis:

    A lookup that answers HIT or HIT_PENDING makes a *promise*: request R may load key K
    (a later lookup by R replaces it on a HIT and voids it otherwise; R finishing forgets
    it). A removal of K after the promise *breaks* it, and the first such removal is the
    one that made it false. A load by R that asks for K is a *near miss* when K's last
    removal came after the promise (and after the last load that counted it); it counts
    under the reason of the first removal after the promise. A missing key's cause is the
    reason of that same first removal.

Here, on the hot path: promises per request, and the serial of each recently removed key's
last removal (:class:`RecentRemovals`), so a load tells a near miss from a plain hit with a
dictionary lookup per key. That memory is short, so it answers only for promises it reaches
back to (``RecentRemovals.exact_from``), where its answer is exactly the history's; a load's
older promises are handed to the observer undecided, and the eviction history decides them,
as it decides the cause (issue 21: the two disagreed once the short memory had forgotten).
Which removal came first after a promise is always asked of the eviction history, only for
near misses and at a failed load; where the history no longer holds it, the cause says
``unknown`` and no near miss is counted: the evidence is gone for both alike.

Also here: :class:`RemovalRun`, the removal queue's batches as ``Recorder.take_run`` hands them over.
Part of the hot path (kvobs/hot_path_modules.py): compiled with it, loaded with it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import NamedTuple


class Verdict(NamedTuple):
    """One promise: when the lookup answered (removal serial and monotonic time), and whether pending."""

    serial: int
    time: float
    pending: bool


class Breach(NamedTuple):
    """The removal that broke a promise: its batch serial and reason code (``kvobs.codes.REASONS``)."""

    serial: int
    reason: int


class NearMiss(NamedTuple):
    """A load asked for a key whose promise a removal broke (``breach``: the first such removal,
    None when the history no longer holds it)."""

    req_id: str
    key: bytes
    verdict: Verdict
    breach: Breach | None


class RemovalRun(NamedTuple):
    """Queued removal batches, column by column (native int64 / float64 / uint8 arrays).

    Batch ``i`` has serial ``first_serial + i``, ``counts[i]`` keys (in ``keys``, their ``hash()``
    in ``hashes``), time ``times[i]``, flags ``flags[i]`` (``kvobs.codes.pack_flags``) and request
    ``reqs[i]``. ``residency``, kept only while a sink needs it, has each key's store-to-removal
    seconds, NaN where unknown.
    """

    first_serial: int
    hashes: array
    counts: array
    times: array
    flags: array
    reqs: list[str | None]
    keys: list[bytes]
    residency: array | None


class _Request:
    """One request's promises.

    A promise is stored as one int, ``serial << 1 | pending``: the same int object for every key
    a lookup pass promises (no allocation per hit, nothing for the GC, little to free at finish).
    Its time is the request's latest lookup time.
    """

    def __init__(self) -> None:
        self.verdicts: dict[bytes, int] = {}
        self.time = 0.0  # monotonic time of the request's latest positive lookup
        self.counted: dict[bytes, int] | None = None  # key -> serial up to which its near miss was counted
        self.incomplete = False  # a promise did not fit (max_entries): a missing one proves nothing

    def verdict(self, code: int) -> Verdict:
        return Verdict(code >> 1, self.time, bool(code & 1))


class RecentRemovals:
    """The serial of the last removal of each recently removed key.

    Two generations of ``size`` keys each: a key is remembered for at least ``size`` and at
    most ``2 * size`` removed keys after its removal (the observer sizes this below the
    history, so the history still holds every removal this remembers). ``exact_from`` is the
    first serial from which every removal is remembered: for a promise at or after it, "removed
    since the promise" is answered exactly; an older promise it cannot answer. A reset whose
    keys could not be listed counts as a removal of every key.
    """

    def __init__(self, size: int) -> None:
        self._size = max(1, size)
        # Keyed by the key's hash, not the key: vLLM's key objects are freed when vLLM drops them
        # (64-bit hashes of a few ten thousand keys collide with odds near 1e-10).
        self._new: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._new_first = 0  # serial of the first batch the current new generation holds
        self.exact_from = 0
        self.unlisted_reset = -1  # serial of the last reset that removed keys nobody could list

    def add(self, keys: list[bytes], serial: int) -> None:
        new = self._new
        for key in keys:
            new[hash(key)] = serial
        if len(new) >= self._size:
            self._old = new  # the generation dropped held only removals before this one's first
            self.exact_from = self._new_first
            self._new_first = serial + 1
            self._new = {}

    def last(self, key: bytes) -> int:
        """Serial of the key's last removal remembered here, -1 if none."""
        fingerprint = hash(key)
        serial = self._new.get(fingerprint)
        if serial is None:
            serial = self._old.get(fingerprint, -1)
        return serial if serial > self.unlisted_reset else self.unlisted_reset

    def __len__(self) -> int:
        return len(self._new) + len(self._old)


class Promises:
    """The promises of every live request (see the module docstring).

    Bounded: at most ``max_entries`` promises across all requests; one that does not fit is
    dropped and counted (``dropped``: ``counts["verdicts"]``, the engine's ``dropped`` counter when the recorder
    hands it in, kvobs/metric_catalogue.py), and its request is marked ``incomplete``. Not
    thread-safe by itself: vLLM calls the manager under its lock.
    """

    def __init__(self, max_entries: int, counts: dict[str, int] | None = None) -> None:
        self.max_entries = max_entries
        self._counts: dict[str, int] = {"verdicts": 0} if counts is None else counts
        self._entries = 0
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return self._entries

    @property
    def dropped(self) -> int:
        """Promises dropped to stay within ``max_entries``."""
        return self._counts["verdicts"]

    def reported(self, req_id: str, key: bytes, code: int, now: float) -> None:
        """A lookup by ``req_id`` answered HIT / HIT_PENDING for ``key`` at ``now``: a fresh promise.

        ``code`` is ``serial << 1 | pending``: the serial the next removal gets, and whether the
        answer was HIT_PENDING.
        """
        req = self._requests.get(req_id)
        if req is None:
            req = self._requests[req_id] = _Request()
        verdicts = req.verdicts
        if key not in verdicts:
            if self._entries >= self.max_entries:
                self._counts["verdicts"] += 1
                req.incomplete = True
                return
            self._entries += 1
        verdicts[key] = code
        req.time = now

    def not_reported(self, req_id: str, key: bytes) -> None:
        """A later lookup by ``req_id`` answered MISS / RETRY for ``key``: its promise is void."""
        req = self._requests.get(req_id)
        if req is None or req.verdicts.pop(key, None) is None:
            return
        self._entries -= 1
        if not req.verdicts and not req.incomplete:
            del self._requests[req_id]

    def redeemed(
        self, req_id: str, keys: Iterable[bytes], recent: RecentRemovals, now_serial: int
    ) -> list[tuple[bytes, Verdict, bool]]:
        """A load by ``req_id`` asks for ``keys``: its near misses, ``(key, promise, True)``, and the
        promises ``recent`` cannot judge (older than its memory), ``(key, promise, False)``, for the
        observer to decide from the eviction history with :meth:`settle`.

        ``now_serial`` is the serial the next removal will get: a near miss is counted once,
        until the key is removed again.
        """
        req = self._requests.get(req_id)
        if req is None:
            return []
        verdicts = req.verdicts
        exact_from = recent.exact_from
        found: list[tuple[bytes, Verdict, bool]] = []
        for key in keys:
            code = verdicts.get(key)
            if code is None:
                continue
            since = code >> 1
            if since < exact_from:  # older than the short memory: the history decides
                found.append((key, req.verdict(code), False))
                continue
            last = recent.last(key)
            if last < since:
                continue
            if _count_once(req, key, last, now_serial):
                found.append((key, req.verdict(code), True))
        return found

    def settle(self, req_id: str, key: bytes, last: int, now_serial: int) -> bool:
        """A promise :meth:`redeemed` left undecided, whose key's last removal (serial ``last``) came
        after the promise: True if it is a near miss not counted yet (and now counted)."""
        req = self._requests.get(req_id)
        return req is not None and _count_once(req, key, last, now_serial)

    def finished(self, req_id: str) -> None:
        """The request is gone: forget its promises."""
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._entries -= len(req.verdicts)

    def verdict(self, req_id: str, key: bytes) -> Verdict | None:
        req = self._requests.get(req_id)
        code = None if req is None else req.verdicts.get(key)
        return None if req is None or code is None else req.verdict(code)

    def incomplete(self, req_id: str) -> bool:
        """True if a promise of this request was dropped (a missing promise then proves nothing)."""
        req = self._requests.get(req_id)
        return req is not None and req.incomplete

    def clear(self) -> None:
        self._requests.clear()
        self._entries = 0


def _count_once(req: _Request, key: bytes, last: int, now_serial: int) -> bool:
    """The one count-once rule: a broken promise counts at the first load after its key's last
    removal (serial ``last``), and again only after another removal."""
    counted = req.counted
    if counted is None:
        counted = req.counted = {}
    elif counted.get(key, -1) > last:
        return False
    counted[key] = now_serial
    return True
