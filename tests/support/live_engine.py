"""A long-lived stand-in engine process: a real observed vLLM CPU manager that stores chunks when told.

Usage: python -m tests.support.live_engine DIR OPTIONS_JSON  (the repository root on sys.path). It prints
``ready`` once observed, then reads commands on standard input, one a line: ``store N`` stores N new
chunks (printing ``stored``), ``exit`` shuts the manager down (its final journal flush) and prints
``done``. For tests that need engines alive at the same time, sharing a directory (issue 31, class 3).
"""

from __future__ import annotations

import json
import sys

from vllm.v1.kv_offload.base import ReqContext

import kvobs
from tests.support.vllm_env import cpu_extra, create_manager, key


def main() -> None:
    directory, options = sys.argv[1], json.loads(sys.argv[2])
    manager = kvobs.observe(create_manager(cpu_extra(64)), dir=directory, **options)
    writer = ReqContext("writer")
    manager.on_new_request(writer)
    print("ready", flush=True)
    serial = 0
    for line in sys.stdin:
        command = line.split()
        if command[:1] == ["store"]:
            for _ in range(int(command[1])):
                serial += 1
                keys = [key(serial)]
                manager.prepare_store(keys, writer)
                manager.complete_store(keys, writer)
            print("stored", flush=True)
        elif command == ["exit"]:
            break
    manager.shutdown()
    print("done", flush=True)


if __name__ == "__main__":
    main()
