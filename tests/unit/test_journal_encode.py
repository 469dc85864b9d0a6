"""The journal writer's fast key references are exactly ``key_ref``'s."""

from __future__ import annotations

import random

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
