"""What one lookup tap costs vLLM's thread: nanoseconds a call, the tap against the method it wraps.

The tap is kvobs's own (``Recorder.lookup_tap``, the form kvobs.hot_path_loader loads), on two inner
methods: one that does nothing (what the tap itself adds, every part of it: the call into the tap, the
call out, the request id read, the capture) and vLLM's real CPU manager's ``lookup`` (what that is
worth beside the work vLLM does). Each side runs ``--calls`` calls per round on one key set, the captures
applied between rounds outside the timing (as kvobs's applier does off vLLM's thread); best and median of
``--runs`` rounds, the collector on as a serving engine runs it, with everything made before a round frozen
(``gc.freeze()``, as vLLM freezes its start-up heap) so that each side pays only for its own objects.

Run: ``.venv/bin/python -m benchmarks.tap_cost [--runs N] [--calls N] [--json out.json]``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult, ReqContext

from benchmarks._common import arg_parser, median, print_table, write_json
from kvobs.hot_path_loader import HOT_PATH, Promises, Recorder
from tests.support.vllm_env import cpu_extra, create_manager


def _timed(call: Callable[[bytes, Any], Any], keys: list[bytes], context: Any) -> float:
    """Seconds for one call per key."""
    start = time.perf_counter()
    for key in keys:
        call(key, context)
    return time.perf_counter() - start


def _nothing(key: bytes, req_context: Any) -> Any:
    return LookupResult.HIT


def measure(runs: int, calls: int) -> dict[str, dict[str, float]]:
    """ns a call by side: ``bare``/``tap`` on a method doing nothing, ``vllm``/``vllm+tap`` on vLLM's lookup."""
    manager = create_manager(cpu_extra(4_096))
    keys = [i.to_bytes(8, "little") * 4 for i in range(calls)]
    context = ReqContext(req_id="bench")  # type: ignore[call-arg]
    recorder = Recorder(max_verdicts=10_000, num_stamps=0, on_error=lambda stage, exc: None,
                        capture_limit=4 * calls, capture_wake=4 * calls)
    sides: dict[str, Callable[[bytes, Any], Any]] = {
        "bare": _nothing,
        "tap": recorder.lookup_tap(_nothing, path=0, hit=LookupResult.HIT, hit_pending=None, marks_frame=False),
        "vllm": manager.lookup,
        "vllm+tap": recorder.lookup_tap(manager.lookup, path=0, hit=LookupResult.HIT, hit_pending=None,
                                        marks_frame=False),
    }
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    gc.collect()
    try:
        for _ in range(runs):
            for side, call in sides.items():  # interleaved: a drift of the machine is shared
                gc.freeze()  # what exists now is set-up or another side's: no collection in this round walks it
                seconds[side].append(_timed(call, keys, context))  # the collector on, as in a serving engine
                recorder.apply_all()
                recorder.promises = Promises(10_000, recorder.counts["dropped"])  # fresh: each round the same work
    finally:
        gc.unfreeze()
    return {side: {"best_ns": min(s) / calls * 1e9, "median_ns": median(s) / calls * 1e9,
                   "worst_ns": max(s) / calls * 1e9} for side, s in seconds.items()}


def main() -> None:
    parser = arg_parser(__doc__)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    figures = measure(args.runs or 7, args.calls)
    print(f"hot path: {HOT_PATH}; {args.calls} calls a round, best of {args.runs or 7} rounds, "
          "collector on (each round's prior heap frozen)")
    rows = [[side, f"{f['best_ns']:.0f}", f"{f['median_ns']:.0f}", f"{f['worst_ns']:.0f}"]
            for side, f in figures.items()]
    rows.append(["tap adds (nothing)", f"{figures['tap']['best_ns'] - figures['bare']['best_ns']:.0f}",
                 f"{figures['tap']['median_ns'] - figures['bare']['median_ns']:.0f}", ""])
    rows.append(["tap adds (vLLM's lookup)", f"{figures['vllm+tap']['best_ns'] - figures['vllm']['best_ns']:.0f}",
                 f"{figures['vllm+tap']['median_ns'] - figures['vllm']['median_ns']:.0f}", ""])
    print_table("lookup tap", ["side", "best ns/call", "median", "worst"], rows)
    write_json(args.json, "tap_cost", {"hot_path": HOT_PATH, "calls": args.calls, "runs": args.runs, "sides": figures})


if __name__ == "__main__":
    main()
