"""The observed manager's methods introspect as the bare manager's (issue 31, class 7).

As tracing decorators and test spies meet them: ``inspect.signature``, a ``functools.wraps``
decorator that binds the call's arguments by name, ``mock.create_autospec`` and
``mock.patch.object(..., autospec=True)``, on every method of the protocol table, the observed
manager's next to the bare manager's, on vLLM's real CPU and tiering managers. kvobs keeps
recording through each of them.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
from vllm.v1.kv_offload.base import LookupResult, OffloadingManager, ReqContext

import kvobs
from kvobs.vllm import ObservedOffloadingManager, compat
from tests.support.causes import END, ctx, store
from tests.support.vllm_env import cpu_extra, create_manager, key, tiering_extra

EXTRAS = pytest.mark.parametrize("extra", [cpu_extra(4), tiering_extra(4)], ids=["cpu", "tiering"])


def _methods(inner: Any) -> list[str]:
    """Every protocol method the inner manager has (shutdown included: the wrapper's own)."""
    return [row.name for row in compat.PROTOCOL if hasattr(inner, row.name)]


def _traced(method: Callable[..., Any], calls: list[dict[str, Any]]) -> Callable[..., Any]:
    """A tracing decorator as OpenTelemetry-style helpers write it: named after the method, recording
    its arguments by name (``inspect.signature(...).bind``)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def traced(*args: Any, **kwargs: Any) -> Any:
        calls.append(dict(signature.bind(*args, **kwargs).arguments))
        return method(*args, **kwargs)

    return traced


def _accepts_no_arguments(spy: Any) -> bool:
    try:
        spy()
    except TypeError:
        return False
    return True


@EXTRAS
def test_every_method_has_the_bare_managers_signature_name_and_autospec(managers: list, extra: dict[str, Any]) -> None:
    bare = create_manager(dict(extra))
    managers.append(bare)
    observed = kvobs.observe(create_manager(dict(extra)))
    managers.append(observed)
    for name in _methods(observed.inner):
        mine, theirs = getattr(observed, name), getattr(bare, name)
        assert inspect.signature(mine, eval_str=True) == inspect.signature(theirs, eval_str=True), name
        wrapper = functools.wraps(mine)(lambda *args, **kwargs: None)
        assert wrapper.__name__ == theirs.__name__, name
        if name != "shutdown":  # the wrapper's own method (its qualified name and docstring say so)
            assert (wrapper.__qualname__, wrapper.__doc__) == (theirs.__qualname__, theirs.__doc__), name
            assert inspect.unwrap(mine) == getattr(observed.inner, name), name  # what kvobs wraps
        assert _accepts_no_arguments(mock.create_autospec(mine)) is _accepts_no_arguments(
            mock.create_autospec(theirs)), name
    for name in _methods(bare):  # through the class, as a spy of the class reads them: vLLM's base class's
        if hasattr(OffloadingManager, name) and name != "shutdown":
            assert inspect.signature(getattr(ObservedOffloadingManager, name)) == inspect.signature(
                getattr(OffloadingManager, name)), name


def test_a_tracing_decorator_and_an_autospecd_spy_see_the_arguments_and_kvobs_keeps_recording(
    managers: list,
) -> None:
    """The lookup traced by a decorator, the load spied on with autospec: each sees the call's arguments
    by name, and kvobs still explains the failed load by the lookup it recorded through the decorator."""
    m = kvobs.observe(create_manager(cpu_extra(4)))
    managers.append(m)
    calls: list[dict[str, Any]] = []
    m.lookup = _traced(m.lookup, calls)
    writer, reader = ctx(m, "req-writer"), ctx(m, "req-reader")
    store(m, [key(1)], writer)
    m.on_schedule_end(END)
    assert m.lookup(key(1), reader) is LookupResult.HIT
    assert calls == [{"key": key(1), "req_context": reader}]
    for i in range(2, 6):  # four more chunks on a 4-chunk tier: key(1) is evicted after its lookup
        store(m, [key(i)], writer)
        m.on_schedule_end(END)
    with mock.patch.object(m, "prepare_load", autospec=True, side_effect=m.prepare_load) as spy:
        with pytest.raises(TypeError):
            m.prepare_load()  # refused by the spy, as the bare manager's autospec refuses it
        with pytest.raises(AssertionError, match="cause: evicted_after_lookup"):
            m.prepare_load([key(1)], reader)
    spy.assert_called_once_with([key(1)], reader)
    assert +m.observer.failures == {"evicted_after_lookup": 1}


def test_a_spy_of_a_lookup_that_cannot_be_read_fails_as_on_the_bare_manager(managers: list) -> None:
    """A spy called with the wrong arguments raises before the tap runs: nothing is recorded."""
    m = kvobs.observe(create_manager(cpu_extra(4)))
    managers.append(m)
    spy = mock.create_autospec(m.lookup, side_effect=m.lookup)
    with pytest.raises(TypeError):
        spy(key(1))
    with pytest.raises(TypeError):
        spy(key(1), ReqContext("r"), 3)
    assert spy.call_count == 0
