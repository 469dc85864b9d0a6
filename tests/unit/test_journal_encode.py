"""The journal writer's fast key references are exactly ``key_ref``'s."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvobs.journal import _key_ref, key_ref


@pytest.mark.parametrize("length", [5, 6, 11, 12, 13, 36, 68])
def test_fast_key_ref_matches_key_ref(length: int) -> None:
    rng = random.Random(length)
    for _ in range(100):
        key = rng.randbytes(length - 4) + rng.randrange(2**32).to_bytes(4, "big")
        assert _key_ref(key) == key_ref(key)


def test_too_short_key_is_refused_like_key_ref() -> None:
    with pytest.raises(ValueError):
        _key_ref(b"abcd")


def test_direct_batch_line_is_the_json_encoders_text(tmp_path: Any) -> None:
    """The writer's direct batch lines are byte for byte what the dict + json.dumps path writes."""
    from kvobs.journal import JournalSink
    from kvobs.observer import Observer, RemovalBatch
    from kvobs.options import Options

    sink = JournalSink(tmp_path, Observer(Options(engine='dp"0\\é')))
    rng = random.Random(7)
    try:
        for i in range(2_000):
            groups = [rng.randrange(2**32).to_bytes(4, "big") for _ in range(rng.randint(1, 3))]
            keys = [rng.randbytes(rng.choice([8, 32, 64])) + rng.choice(groups) for _ in range(rng.randint(0, 300))]
            residency = rng.choice([None, [], [rng.random() * 10**rng.randint(-3, 4) for _ in keys]])
            req = rng.choice([None, f"req-{i}", 'q"uo\\te\n', "ünï"])
            batch = RemovalBatch(i, rng.random() * 1e5, rng.choice(["capacity", "reset"]), "store", req, keys,
                                 residency)
            direct = sink._encode_batch(i, batch.time, batch.reason, batch.path, req, keys, residency)
            assert direct == sink._encode(("batch", batch))
    finally:
        sink.close()
