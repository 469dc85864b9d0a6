"""The soak's seeded random traffic (benchmarks/soak.py): the same actions, in the same order, for each engine.

Why a stream of actions rather than a list of prompts: the soak runs for a duration, not a count, and
each engine gets its own client thread walking the same seeded stream, so the kvobs engine and the bare
one see the same prompts, bursts, aborts and disconnects whatever their speeds. Kinds of action:

* ``complete``: one greedy completion, a long prompt (one shared document or one and a half, i.e. shared prefixes
  that leave the engine's cache and come back from the offload tiers), a one-off document (fills the
  tiers, gets evicted) or a short line;
* ``burst``: several of those at once (the scheduler batches them; vLLM's n-gram drafts run in batches);
* ``disconnect``: a streamed completion the client hangs up on after a few chunks (vLLM aborts it mid-stream);
* ``abort``: a completion the client gives up on after a short timeout, before its answer;
* ``pause``: no traffic for a moment (idle steps, the journal's flushes with nothing new).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from demo.engine import VllmServer
from demo.tiny_model import corpus

SHARED_DOCUMENTS = 16
"""Recurring documents: more than the engine's own cache holds, about what the CPU tier holds, fewer
than the CPU and file tiers together hold, so they come back from both tiers."""
LINES_PER_DOCUMENT = 20  # ~10 blocks of 32 tokens
KINDS = {"complete": 0.55, "burst": 0.2, "disconnect": 0.1, "abort": 0.08, "pause": 0.07}
ABORT_AFTER_S = 0.3
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Action:
    kind: str
    prompts: tuple[str, ...] = ()
    max_tokens: int = 8
    cut_after: int = 0
    """Streamed chunks read before a ``disconnect`` hangs up."""
    pause_s: float = 0.0


def _document(rng: random.Random, lines: list[str]) -> str:
    return " ".join(rng.sample(lines, LINES_PER_DOCUMENT))


def actions(seed: int) -> Iterator[Action]:
    """The endless seeded stream of actions (the same ``seed``: the same stream)."""
    rng = random.Random(seed)
    lines = corpus()
    shared = [_document(random.Random(f"{seed}-doc-{i}"), lines) for i in range(SHARED_DOCUMENTS)]

    def prompt() -> str:
        draw = rng.random()
        if draw < 0.55:  # a shared prefix, asked about again
            return f"{rng.choice(shared)} question {rng.randrange(1000)}"
        if draw < 0.7:  # long: a shared document and half of another (within the model's 1024 tokens)
            first, second = rng.sample(shared, 2)
            half = second.split()
            return f"{first} {' '.join(half[:len(half) // 2])} compare {rng.randrange(1000)}"
        if draw < 0.85:  # a one-off document
            return _document(rng, lines)
        return rng.choice(lines)  # short

    kinds, weights = list(KINDS), list(KINDS.values())
    while True:
        kind = rng.choices(kinds, weights)[0]
        if kind == "burst":
            yield Action(kind, tuple(prompt() for _ in range(rng.randint(2, 6))), max_tokens=rng.randint(4, 24))
        elif kind == "disconnect":
            yield Action(kind, (prompt(),), max_tokens=rng.randint(16, 48), cut_after=rng.randint(1, 6))
        elif kind == "pause":
            yield Action(kind, pause_s=rng.uniform(0.2, 2.0))
        else:
            yield Action(kind, (prompt(),), max_tokens=rng.randint(1, 32))


def _body(server: VllmServer, prompt: str, max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": server.served_model_name or os.path.abspath(server.model), "prompt": prompt,
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}).encode()


def disconnect_mid_stream(server: VllmServer, prompt: str, max_tokens: int, cut_after: int) -> int:
    """A streamed completion the client hangs up on after ``cut_after`` chunks; the chunks it read."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REQUEST_TIMEOUT_S)
    try:
        conn.request("POST", "/v1/completions", _body(server, prompt, max_tokens, True),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise http.client.HTTPException(f"HTTP {response.status}: {response.read()[:300]!r}")
        read = 0
        while read < cut_after:
            line = response.fp.readline()
            if not line or line.strip() == b"data: [DONE]":
                break
            read += line.startswith(b"data:")
        return read
    finally:
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(2)  # the hang-up vLLM sees, whatever the response object still buffers
        conn.close()


def abort_early(server: VllmServer, prompt: str, max_tokens: int) -> bool:
    """A completion the client gives up on after ``ABORT_AFTER_S``; True when it did give up."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=ABORT_AFTER_S)
    try:
        conn.request("POST", "/v1/completions", _body(server, prompt, max_tokens, False),
                     {"Content-Type": "application/json"})
        conn.getresponse().read()
        return False
    except TimeoutError:
        return True
    finally:
        conn.close()


@dataclass
class Traffic:
    """The clients of every engine, in lockstep: each action runs on every engine at once and the next
    one starts when all are done, so the engines do the same work at the same time and their memory
    can be compared sample by sample. Walks ``actions(seed)`` until ``stop``; while ``held``, waits
    (``idle`` set) at an action's end."""

    servers: dict[str, VllmServer]
    seed: int
    stop: threading.Event
    held: threading.Event
    idle: threading.Event = field(default_factory=threading.Event)
    kinds: Counter[str] = field(default_factory=Counter)
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.servers:
            self.counts[name], self.errors[name] = Counter(), []

    def run(self) -> None:
        pools = {name: ThreadPoolExecutor(max_workers=6) for name in self.servers}
        try:
            with ThreadPoolExecutor(max_workers=len(self.servers)) as sides:
                for action in actions(self.seed):
                    while self.held.is_set() and not self.stop.is_set():
                        self.idle.set()
                        self.stop.wait(0.1)
                    self.idle.clear()
                    if self.stop.is_set():
                        break
                    self.kinds[action.kind] += 1
                    list(sides.map(lambda name, a=action: self.act(name, a, pools[name]), self.servers))
        finally:
            for pool in pools.values():
                pool.shutdown()
            self.idle.set()

    def act(self, name: str, action: Action, pool: ThreadPoolExecutor) -> None:
        server, counts = self.servers[name], self.counts[name]
        try:
            if action.kind == "pause":
                self.stop.wait(action.pause_s)
            elif action.kind == "disconnect":
                counts["chunks_before_hang_up"] += disconnect_mid_stream(
                    server, action.prompts[0], action.max_tokens, action.cut_after)
            elif action.kind == "abort":
                counts["gave_up"] += abort_early(server, action.prompts[0], action.max_tokens)
            else:
                done = list(pool.map(lambda p: server.complete(p, action.max_tokens, timeout=REQUEST_TIMEOUT_S),
                                     action.prompts))
                counts["completions"] += len(done)
        except Exception as exc:  # noqa: BLE001 (kept and reported: the soak fails on any)
            self.errors[name].append(f"{action.kind}: {type(exc).__name__}: {exc}"[:500])
