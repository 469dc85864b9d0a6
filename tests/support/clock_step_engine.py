"""An engine's failed loads, one after another, with the wall clock stepped between them.

Run under libfaketime (``tests.support.clock_step_engine.faked_env``): the process's wall clock is
what the file named by ``FAKETIME_TIMESTAMP_FILE`` says, an offset from the real time read at each
call (``FAKETIME_NO_CACHE``), the monotonic clock left alone, as an NTP step leaves it. Each STEP
writes that file, as ``date -s`` or NTP would set the clock, then makes one failed load through a
real observed CPU manager (the plugin's, ``max_reports`` as given), whose report kvobs writes.

Usage: python -m tests.support.clock_step_engine KVOBS_DIR MAX_REPORTS OFFSET_S...
Output: one line per failure: ``<req_id> <time.time()>``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from vllm.v1.kv_offload.base import ReqContext

from tests.support.vllm_env import cpu_extra, create_manager, key, observed_extra


def faked_env(clock_file: Path) -> dict[str, str]:
    """The environment that runs a child under libfaketime with its wall clock read from ``clock_file``
    (the vendored library of the ``libfaketime`` package)."""
    import libfaketime

    _, env = libfaketime.get_reload_information()
    return {**os.environ, **env, "FAKETIME_TIMESTAMP_FILE": str(clock_file), "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


def main() -> None:
    directory, max_reports, offsets = sys.argv[1], int(sys.argv[2]), [float(o) for o in sys.argv[3:]]
    clock = Path(os.environ["FAKETIME_TIMESTAMP_FILE"])
    manager = create_manager(observed_extra(cpu_extra(2), dir=directory, engine="0", max_reports=max_reports))
    writer = ReqContext("req-writer")
    manager.on_new_request(writer)
    try:
        for n, offset in enumerate(offsets):
            clock.write_text(f"{offset:+.3f}\n")  # the clock steps: every later wall time is off by this much
            victim = ReqContext(f"req-{n}")
            manager.on_new_request(victim)
            chunk = key((n + 1) << 192 | 1)  # each failure's own hash prefix, as real block hashes have
            manager.prepare_store([chunk], writer)
            manager.complete_store([chunk], writer)
            assert manager.lookup(chunk, victim).name == "HIT"
            fillers = [key((n + 1) << 192 | 2), key((n + 1) << 192 | 3)]  # a 2-chunk tier: evict the chunk
            manager.prepare_store(fillers, writer)
            manager.complete_store(fillers, writer)
            try:
                manager.prepare_load([chunk], victim)
            except AssertionError:
                print(victim.req_id, time.time(), flush=True)
            else:
                raise SystemExit(f"{victim.req_id}: the load did not fail")
    finally:
        manager.shutdown()


if __name__ == "__main__":
    main()
