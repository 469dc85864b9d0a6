"""The flight recorder's segment (kvobs.hot_captures.FlightSegment) keeps every call exactly, in its columns.

Its integer columns take each call in a short list and move it into their arrays every ``_SETTLE_CALLS``
calls and whenever a reader settles them (kvobs.flight.FlightWindow.view): whatever the points at which that
happens, the columns read back every call as it was added. `make test` runs this on the compiled form and
on the Python form of the hot path.
"""

from __future__ import annotations

import random

from kvobs.hot_path_loader import LOOKUP, FlightSegment

KEYS = [i.to_bytes(36, "big") for i in range(300)]
METHODS = ("prepare_store", "complete_store", "complete_load", "on_new_request")


def test_the_columns_read_back_every_call_whatever_the_settling() -> None:
    rng = random.Random(7)
    segment = FlightSegment(b"state", 0.0, {}, 1 << 60, lambda value: repr(value).encode())
    expected: list[tuple[str, str | None, object, list[bytes], bool | None]] = []
    for _ in range(5_000):  # several times _SETTLE_CALLS, settled at random points as well
        if rng.random() < 0.3:
            key, req = KEYS[rng.randrange(len(KEYS))], f"req-{rng.randrange(50)}"
            segment.add_fields(LOOKUP, key, req, rng.choice((True, False)), None)
            expected.append(("lookup", req, None, [key], None))
        else:
            keys = rng.sample(KEYS, rng.randrange(4))
            req_id = None if rng.random() < 0.1 else f"req-{rng.randrange(50)}"
            outcome = rng.choice((None, True, "spec"))
            flag = rng.choice((None, True, False))
            segment.add_flat(rng.choice(METHODS), req_id, outcome, keys, flag)
            expected.append(("flat", req_id, outcome, keys, flag))
        if rng.random() < 0.002:
            segment.settle()
    segment.settle()
    assert len(segment) == len(expected) == len(segment.reqs) == len(segment.outcomes) == len(segment.key_ends)
    extras = segment.extras_of(len(segment))
    start = 0
    for i, (kind, req_id, outcome, keys, flag) in enumerate(expected):
        end = segment.key_ends[i]
        assert [segment.keys[r] for r in segment.key_refs[start:end]] == keys, i
        start = end
        assert (None if segment.reqs[i] < 0 else segment.req_ids[segment.reqs[i]]) == req_id, i
        if kind == "flat":
            code = segment.outcomes[i]
            assert (None if code < 0 else segment.outcome_values[code]) == outcome, i
            assert extras.get(i, []) == ([] if flag is None else [(2, flag)]), i
    assert len(segment.key_refs) == start
