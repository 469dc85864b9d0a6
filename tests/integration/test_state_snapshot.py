"""A snapshot in two halves (kvobs.state_codec ``freeze`` then ``encode_frozen``): the flight recorder freezes
vLLM's manager on the scheduler thread and writes it on kvobs's applier, so what the manager does in between
must change nothing in the blob. On vLLM's real CPU manager, both cache policies, every supported release."""

from __future__ import annotations

import collections
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager
from vllm.v1.kv_offload.cpu.policies.base import ChunkStatus

from kvobs import state_codec
from kvobs.vllm import compat
from tests.support.causes import ctx, store
from tests.support.vllm_env import cpu_extra, create_manager, key

END_OF_STEP = None


def traffic(m: OffloadingManager, first: int, rounds: int) -> list[Any]:
    """Requests that store (evicting, past the tier's size), look up, load (chunks held: ref_cnt > 0) and
    finish; the contexts of those still live."""
    live = []
    for i in range(rounds):
        c = ctx(m, f"r{first + i}")
        keys = [key(first + 3 * i + j) for j in range(3)]
        store(m, keys, c)
        if m.lookup(keys[0], c) is LookupResult.HIT:
            assert m.prepare_load([keys[0]], c) is not None
            if i % 2:
                m.complete_load([keys[0]], c)
        if i % 3:
            m.on_request_finished(c)
        else:
            live.append(c)
    return live


def statuses(m: OffloadingManager) -> dict[bytes, tuple[int, int]]:
    """Every resident chunk's (ref_cnt, chunk_id), whatever the policy keeps them in."""
    out: dict[bytes, tuple[int, int]] = {}
    for container in vars(m._policy).values():
        if isinstance(container, dict):
            out.update({bytes(k): (v.ref_cnt, v.chunk_id) for k, v in container.items() if isinstance(v, ChunkStatus)})
    return out


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_frozen_state_is_written_as_it_was_when_frozen(policy: str) -> None:
    m = create_manager(cpu_extra(48, eviction_policy=policy))
    live = traffic(m, 0, 40)
    then = compat.snapshot_state(m, live)
    before = statuses(m)
    frozen = compat.freeze_state(m, live)

    reader = ctx(m, "reader")  # holds ready chunks resident at the freeze: their ref_cnt changes in place
    ready = [k for k, (ref_cnt, _) in before.items() if ref_cnt >= 0][:8]
    assert ready and m.prepare_load(ready, reader) is not None
    more = traffic(m, 1000, 40)  # evicts what was not held, holds and releases other chunks
    for c in live:
        m.on_request_finished(c)
    assert statuses(m) != before, "the traffic after the freeze changed nothing: the test would prove nothing"

    assert compat.encode_state(frozen) == then
    rebuilt, requests = compat.rebuild_state(compat.encode_state(frozen))
    assert statuses(rebuilt) == before
    assert sorted(requests) == sorted(c.req_id for c in live)
    assert compat.snapshot_state(m, more) != then


def test_freeze_keeps_identity_cycles_and_every_container_as_it_was() -> None:
    table = compat.snapshot_table()
    attributes = compat._snapshot_attributes
    shared = ChunkStatus(7)
    shared.ref_cnt = 2
    other = ChunkStatus(8)
    row = [ChunkStatus(i) for i in range(3)]  # distinct: copied in bulk
    inner = [1, shared]
    m = create_manager(cpu_extra(4))  # an object of the table written attribute by attribute
    value: Any = (
        [shared, shared, other],
        {b"k": shared, b"j": (1, inner)},
        collections.OrderedDict([(b"a", 1), (b"b", 2)]),
        collections.deque([other, 3], maxlen=5),
        {b"x", b"y"},
        frozenset({4}),
        (1, (2, (3, b"z"))),
        m,
        row,
    )
    direct = state_codec.encode(value, table, attributes)
    frozen = state_codec.freeze(value, table, attributes)

    shared.ref_cnt = 99  # everything mutable in it changes after the freeze
    other.chunk_id = 100
    inner.append(5)
    value[1][b"new"] = 1
    value[2][b"c"] = 3
    value[3].append(4)
    value[4].add(b"w")
    m._num_allocated_chunks = 3
    for status in row:
        status.ref_cnt = 5

    assert state_codec.encode_frozen(frozen, table, attributes) == direct
    back = state_codec.decode(direct, table)
    assert back[0][0] is back[0][1] is back[1][b"k"] is back[1][b"j"][1][1], "one object stays one"
    assert (back[0][0].ref_cnt, back[0][2].chunk_id) == (2, 8)
    assert back[1][b"j"] == (1, [1, back[0][0]])
    assert list(back[2]) == [b"a", b"b"] and back[3].maxlen == 5 and len(back[3]) == 2
    assert back[4] == {b"x", b"y"} and back[5] == frozenset({4}) and back[6] == (1, (2, (3, b"z")))
    assert back[7]._num_allocated_chunks == 0
    assert [(s.ref_cnt, s.chunk_id) for s in back[8]] == [(-1, 0), (-1, 1), (-1, 2)]


def test_a_class_outside_the_table_is_refused_when_written_not_when_frozen() -> None:
    class Foreign:
        pass

    table = compat.snapshot_table()
    frozen = state_codec.freeze([Foreign()], table, compat._snapshot_attributes)
    with pytest.raises(TypeError, match="Foreign is not in the snapshot table"):
        state_codec.encode_frozen(frozen, table, compat._snapshot_attributes)
