"""A stand-in EngineCore process: drives a real observed vLLM manager, then (optionally) dies
on the failed load exactly as EngineCore does (the AssertionError is not caught).

Usage: python -m tests.support.engine_process DIR ENGINE ROUNDS fail|ok  (the repository root on sys.path)
"""

from __future__ import annotations

import sys

from vllm.v1.kv_offload.base import ReqContext

import kvobs
from tests.support.vllm_env import cpu_extra, create_manager, key


def main() -> None:
    directory, engine, rounds, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    manager = kvobs.observe(create_manager(cpu_extra(8)), dir=directory, engine=engine)
    writer = ReqContext("writer")
    manager.on_new_request(writer)
    for i in range(rounds):  # every round stores 4 new chunks: capacity evictions after the first two
        keys = [key(1000 + 4 * i + j) for j in range(4)]
        manager.prepare_store(keys, writer)
        manager.complete_store(keys, writer)
    victim = ReqContext("req-victim")
    manager.on_new_request(victim)
    last = [key(1000 + 4 * (rounds - 1) + j) for j in range(4)]
    assert manager.lookup(last[0], victim).name == "HIT"
    for i in range(2):  # two more rounds evict the chunk the victim's lookup reported
        keys = [key(900_000 + 4 * i + j) for j in range(4)]
        manager.prepare_store(keys, writer)
        manager.complete_store(keys, writer)
    if mode == "fail":
        manager.prepare_load([last[0]], victim)  # raises: the process dies here
    manager.shutdown()
    print("engine done", flush=True)


if __name__ == "__main__":
    main()
