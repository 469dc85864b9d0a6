"""History: kvobs's EvictionHistory against DESIGN.md's OrderedDict baseline.

Baseline ("seed-style"): an ``OrderedDict`` of key -> ``time.monotonic()``, bounded
by popping the oldest. Both sides get the same pre-generated batches (1..64 keys
of 36 bytes: a 32-byte block hash and a 4-byte group, as vLLM builds them).

Measured at 10k, 100k and 1M keys:

* memory per key: ``tracemalloc`` bytes still held after filling each side to
  capacity and overwriting it once more (keys are created during the fill and
  released by the producer, so keys a side keeps alive count against it, and
  so do request-id strings kvobs keeps per batch); kvobs's ``nbytes()`` too;
* recording throughput: keys/s recording ``capacity`` keys into a full history
  (steady state: the baseline pops, kvobs's rings wrap), pending batches folded
  inside the timed window;
* diagnosis of a 16-key failure: ``Observer.load_failed`` (history stats, the
  16-key history lookup, verdicts, cause, message) at a full history; the
  baseline does its 16 dictionary lookups;
* ``history.stats()`` at a full history whose batch ring has wrapped (it runs
  at most once a second on the scheduler thread).

Run: ``.venv/bin/python -m benchmarks.history [--runs N] [--sizes 10000,100000,1000000]``.
"""

from __future__ import annotations

import gc
import logging
import random
import time
import tracemalloc
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks._common import arg_parser, median, paired_ratios, percentile, print_table, spread, write_json
from kvobs.diagnosis import MISSING
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options

MIB = 2**20
TARGET_BYTES_1M = 16 * MIB
TARGET_SPEEDUP = 2.0
TARGET_DIAGNOSIS_S = 0.010
BATCH_KEYS = (1, 64)


class OrderedDictHistory:
    """DESIGN.md's baseline: key -> time.monotonic(), oldest popped beyond capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.times: OrderedDict[bytes, float] = OrderedDict()

    def record(self, keys: Sequence[bytes]) -> None:
        now = time.monotonic()
        times = self.times
        for key in keys:
            times[key] = now
            times.move_to_end(key)
        while len(times) > self.capacity:
            times.popitem(last=False)

    def ages(self, keys: Sequence[bytes]) -> list[float | None]:
        now = time.monotonic()
        return [None if (t := self.times.get(key)) is None else now - t for key in keys]


def make_key(rng: random.Random) -> bytes:
    return rng.randbytes(32) + rng.randrange(2).to_bytes(4, "big")


def make_batches(total_keys: int, seed: int, batch_keys: tuple[int, int] = BATCH_KEYS) -> list[list[bytes]]:
    rng = random.Random(seed)
    batches: list[list[bytes]] = []
    made = 0
    while made < total_keys:
        n = min(rng.randint(*batch_keys), total_keys - made)
        batches.append([make_key(rng) for _ in range(n)])
        made += n
    return batches


def new_kvobs(size: int) -> Observer:
    """kvobs's side: the recorder's queue folded into the history, as in an observed manager."""
    return Observer(Options(history_size=size))


def fill_kvobs(observer: Observer, batches: Sequence[Sequence[bytes]], req_ids: Sequence[str]) -> None:
    """Record each batch the way the policy hook does (queued; drained into the history when full)."""
    removal = observer.recorder.removal
    now = time.monotonic()
    for i, keys in enumerate(batches):
        removal(list(keys), 0, None, now, path=0, req_id=req_ids[i % len(req_ids)])


def fill_baseline(history: OrderedDictHistory, batches: Sequence[Sequence[bytes]]) -> None:
    record = history.record
    for keys in batches:
        record(keys)


# -- memory ------------------------------------------------------------------------------


def held_bytes(build: Callable[[], Any], fill: Callable[[Any, random.Random], None]) -> tuple[int, Any]:
    """tracemalloc bytes still allocated once ``fill`` is done (the structure is kept)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        obj = build()
        fill(obj, random.Random(7))
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    return held, obj


def _filled(observer: Any, stream: Callable[..., None], fill_one: Callable[[list[bytes], str], None],
            rng: random.Random) -> None:
    """Fill, then apply every capture (kvobs/applier.py does it a few ms later): what stays is the history."""
    stream(fill_one, rng)
    observer.drain()


def memory(size: int) -> dict[str, float]:
    """Bytes per key for both sides, filled to capacity and overwritten once more."""

    def stream(fill_one: Callable[[list[bytes], str], None], rng: random.Random) -> None:
        made, batch_no = 0, 0
        req = f"req-{rng.getrandbits(64):016x}"
        while made < 2 * size:
            keys = [make_key(rng) for _ in range(rng.randint(*BATCH_KEYS))]
            if batch_no % 4 == 0:  # a fresh request-id string every few batches, as vLLM's
                req = f"req-{rng.getrandbits(64):016x}"
            fill_one(keys, req)
            made += len(keys)
            batch_no += 1

    base_bytes, base = held_bytes(
        lambda: OrderedDictHistory(size), lambda h, rng: stream(lambda k, r: h.record(k), rng)
    )
    assert len(base.times) == size
    now = time.monotonic()
    kv_bytes, kv = held_bytes(
        lambda: new_kvobs(size),
        lambda o, rng: _filled(o, stream, lambda k, r: o.recorder.removal(k, 0, None, now, path=0, req_id=r), rng),
    )
    assert kv.history.stats().keys == size
    return {
        "baseline_bytes": base_bytes,
        "kvobs_bytes": kv_bytes,
        "kvobs_nbytes": kv.history.nbytes(),
        "baseline_per_key": base_bytes / size,
        "kvobs_per_key": kv_bytes / size,
    }


# -- recording ---------------------------------------------------------------------------


def recording(size: int, runs: int, min_keys: int = 300_000) -> dict[str, Any]:
    """Seconds to record max(``size``, ``min_keys``) keys into a full history, interleaved runs."""
    warm = make_batches(size, seed=11)
    timed = make_batches(max(size, min_keys), seed=12)  # long enough to time on a noisy machine
    req_ids = [f"req-{i}" for i in range(97)]
    keys = sum(len(b) for b in timed)
    base_s: list[float] = []
    kv_s: list[float] = []
    for run in range(runs):
        for side in ("baseline", "kvobs") if run % 2 == 0 else ("kvobs", "baseline"):
            if side == "baseline":
                base = OrderedDictHistory(size)
                fill_baseline(base, warm)
                gc.collect()
                t0 = time.perf_counter()
                fill_baseline(base, timed)
                base_s.append(time.perf_counter() - t0)
            else:
                kv = new_kvobs(size)
                fill_kvobs(kv, warm, req_ids)
                kv.history.last_removals([])  # fold the warm-up
                gc.collect()
                t0 = time.perf_counter()
                fill_kvobs(kv, timed, req_ids)
                kv.history.last_removals([])  # the queued tail is drained and folded inside the window
                kv_s.append(time.perf_counter() - t0)
    return {
        "keys": keys,
        "batches": len(timed),
        "baseline_s": base_s,
        "kvobs_s": kv_s,
        "baseline_keys_per_s": keys / median(base_s),
        "kvobs_keys_per_s": keys / median(kv_s),
        "speedup": median(paired_ratios(base_s, kv_s)),
    }


# -- diagnosis and stats -------------------------------------------------------------------


def diagnosis(size: int, repeats: int) -> dict[str, Any]:
    """Time a 16-key failed load's diagnosis at a full history (+ the baseline's lookups)."""
    observer = new_kvobs(size)
    fill = make_batches(2 * size, seed=21)  # wraps the key ring once: the history is full
    fill_kvobs(observer, fill, [f"req-{i}" for i in range(97)])
    baseline = OrderedDictHistory(size)
    fill_baseline(baseline, fill)
    rng = random.Random(5)
    recent = [k for b in fill[-(len(fill) // 4) :] for k in b]
    # 16 keys: 12 promised by a lookup and then removed, 4 never promised (coverage mismatch).
    wanted = [*rng.sample(recent, 12), *(make_key(rng) for _ in range(4))]
    for key in wanted[:12]:
        observer.promises.reported("req-failing", key, observer.recorder.next_serial << 1, time.monotonic())
    fill_kvobs(observer, [wanted[:12]], ["req-other"])
    unloadable = [Unloadable(k, 0, 16 * (i + 1), MISSING) for i, k in enumerate(wanted)]
    logger = logging.getLogger("kvobs")
    saved = logger.disabled
    logger.disabled = True  # the real path logs the message once; not this benchmark's output
    kv_s: list[float] = []
    base_s: list[float] = []
    causes: dict[str, int] = {}
    try:
        for _ in range(repeats):
            fill_kvobs(observer, [[make_key(rng)]], ["req-other"])  # a queued batch, as in life
            t0 = time.perf_counter()
            d = observer.load_failed("Chunk b'...' not found in cache", "req-failing", 16, (16, 256), unloadable, 0)
            _ = d.message
            kv_s.append(time.perf_counter() - t0)
            causes = d.causes
            t0 = time.perf_counter()
            baseline.ages(wanted)
            base_s.append(time.perf_counter() - t0)
    finally:
        logger.disabled = saved
    return {
        "kvobs_s": kv_s,
        "baseline_s": base_s,
        "kvobs_median_s": median(kv_s),
        "kvobs_p95_s": percentile(kv_s, 95),
        "baseline_median_s": median(base_s),
        "causes": causes,
    }


def stats_cost(size: int, repeats: int) -> dict[str, Any]:
    """history.stats() at a full history; small batches make the batch ring wrap first."""
    out: dict[str, Any] = {}
    for label, batch_keys in (("batches 1..64", BATCH_KEYS), ("batches 1..4 (batch ring wrapped)", (1, 4))):
        observer = new_kvobs(size)
        fill_kvobs(observer, make_batches(2 * size, seed=31, batch_keys=batch_keys), ["r"])
        h = observer.history
        h.stats()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            h.stats()
            samples.append(time.perf_counter() - t0)
        out[label] = {"median_s": median(samples), "p95_s": percentile(samples, 95), "keys": h.stats().keys}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated capacities")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 7)
    sizes = [int(s) for s in (args.sizes or ("2000" if args.quick else "10000,100000,1000000")).split(",")]
    diag_repeats = 3 if args.quick else 50
    results: dict[str, Any] = {"runs": runs, "sizes": sizes, "batch_keys": BATCH_KEYS}
    mem_rows, rec_rows, diag_rows, stats_rows = [], [], [], []
    for size in sizes:
        mem = memory(size)
        rec = recording(size, runs, min_keys=size if args.quick else 300_000)
        diag = diagnosis(size, diag_repeats)
        st = stats_cost(size, diag_repeats)
        results[str(size)] = {"memory": mem, "recording": rec, "diagnosis": diag, "stats": st}
        mem_rows.append(
            (size, mem["baseline_per_key"], mem["kvobs_per_key"], mem["kvobs_nbytes"] / size,
             mem["kvobs_bytes"] / MIB, mem["baseline_per_key"] / mem["kvobs_per_key"])
        )
        rec_rows.append(
            (size, rec["baseline_keys_per_s"], rec["kvobs_keys_per_s"], rec["speedup"],
             spread(rec["baseline_s"]), spread(rec["kvobs_s"]))
        )
        diag_rows.append(
            (size, 1e3 * diag["kvobs_median_s"], 1e3 * diag["kvobs_p95_s"], 1e3 * diag["baseline_median_s"],
             ", ".join(f"{c}={n}" for c, n in sorted(diag["causes"].items())))
        )
        for label, s in st.items():
            stats_rows.append((size, label, 1e3 * s["median_s"], 1e3 * s["p95_s"], s["keys"]))
    print_table("History memory (tracemalloc, full history; bytes per key)",
                ("keys", "baseline B/key", "kvobs B/key", "kvobs nbytes/key", "kvobs MiB", "ratio"), mem_rows)
    print_table(f"History recording (keys/s into a full history, batches of {BATCH_KEYS[0]}..{BATCH_KEYS[1]} keys, "
                f"{runs} interleaved runs; speedup = median of paired ratios)",
                ("keys", "baseline keys/s", "kvobs keys/s", "speedup", "baseline spread", "kvobs spread"), rec_rows)
    print_table(f"Diagnosis of a 16-key failed load at a full history ({diag_repeats} repeats)",
                ("keys", "kvobs median ms", "kvobs p95 ms", "baseline ms", "causes"), diag_rows)
    print_table(f"history.stats() at a full history ({diag_repeats} repeats)",
                ("keys", "case", "median ms", "p95 ms", "keys held"), stats_rows)
    big = results[str(max(sizes))]
    verdicts = [
        ("1M keys <= 16 MiB", big["memory"]["kvobs_bytes"] <= TARGET_BYTES_1M,
         f"{big['memory']['kvobs_bytes'] / MIB:.2f} MiB"),
        ("recording >= 2x baseline", all(results[str(s)]["recording"]["speedup"] >= TARGET_SPEEDUP for s in sizes),
         ", ".join(f"{results[str(s)]['recording']['speedup']:.2f}x" for s in sizes)),
        ("16-key diagnosis <= 10 ms", big["diagnosis"]["kvobs_median_s"] <= TARGET_DIAGNOSIS_S,
         f"{1e3 * big['diagnosis']['kvobs_median_s']:.2f} ms median"),
    ]
    print(f"\n  targets at {max(sizes):,} keys:")
    for name, ok, value in verdicts:
        print(f"    {name}: {value} -> {'MET' if ok else 'MISSED'}")
    write_json(args.json, "history", results)
    return results


if __name__ == "__main__":
    main()
