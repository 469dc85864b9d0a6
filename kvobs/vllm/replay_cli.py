"""What ``kvobs replay`` prints (kvobs/cli.py parses its arguments; kvobs.vllm.bundle_replay does the work)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvobs.vllm.bundle_replay import ReplayError, load, minimize, replay
from kvobs.vllm.emit import render


def run(path: str, *, minimize_calls: bool = False, budget_s: float = 120.0, emit_test: str | None = None,
        as_json: bool = False) -> int:
    """0: vLLM's assertion reproduced at the same call (a bundle without a failure: every call answered as
    recorded); 1: not; 2: the bundle cannot be replayed here."""
    shrink = minimize_calls
    try:
        bundle = load(path)
        outcome = replay(bundle)
        reproduced = outcome.reproduces(bundle)
        kept = list(range(len(bundle.calls)))
        if reproduced and shrink:
            kept = minimize(bundle, budget_s)
        if emit_test is not None:
            if not reproduced:
                raise ReplayError("no test emitted: the replay does not reproduce the failure")
            Path(emit_test).write_text(render(bundle, kept), encoding="utf-8")
    except (ReplayError, OSError) as exc:
        print(f"kvobs replay: {exc}", file=sys.stderr)
        return 2
    failure = bundle.failure or {}
    # a bundle without a failure (asked for on demand) succeeds when every call answers as recorded
    as_recorded = outcome.raised_at is None and not outcome.diverged
    result = {
        "bundle": path,
        "vllm_version": bundle.header.get("vllm_version"),
        "calls": len(bundle.calls),
        "reproduced": reproduced,
        "as_recorded": as_recorded,
        "raised_at": outcome.raised_at,
        "exception": outcome.exception,
        "message": outcome.message,
        "recorded": failure.get("vllm_message"),
        "cause": failure.get("cause"),
        "diverged": [{"call": i, "what": what} for i, what in outcome.diverged[:20]],
        "minimized_calls": len(kept) if shrink and reproduced else None,
        "test": emit_test,
    }
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        print(f"bundle: {path} (vLLM {result['vllm_version']}, {len(bundle.calls)} calls)")
        if not failure:
            print("recorded: no failed load (an on-demand bundle)")
        else:
            print(f"recorded: {failure.get('vllm_message')} (kvobs's cause: {failure.get('cause')})")
        if outcome.raised_at is None:
            print("replayed: every call returned")
        else:
            print(f"replayed: call {outcome.raised_at + 1} of {len(bundle.calls)} raised {outcome.exception}: "
                  f"{outcome.message}")
        for i, what in outcome.diverged[:20]:
            print(f"  diverged at call {i + 1}: {what}")
        if failure:
            print(f"result: {'reproduced' if reproduced else 'NOT reproduced'}")
        else:
            print(f"result: {'replayed as recorded' if as_recorded else 'NOT as recorded'}")
        if shrink and reproduced:
            print(f"minimised: {len(kept)} of {len(bundle.calls)} calls still fail the same way")
        if emit_test is not None:
            print(f"test: {emit_test} (fails with vLLM's assertion while the bug is there; needs vLLM alone)")
    return 0 if (reproduced if failure else as_recorded) else 1

