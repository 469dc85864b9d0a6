"""Every process kvobs and its demo start is started by kvobs/children.py, so it ends with its parent (issue 21,
class 9).

Why: a child started with plain ``subprocess`` has no parent-death signal: the serve demo's model build
and its ``kvobs explain`` run outlived a SIGKILL of the demo. A new call site must not reopen that.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KVOBS = ROOT / "kvobs"
CHECKED = (KVOBS, ROOT / "demo")  # the product and the demo (not in the wheel, but it starts engines and sidecars)
STARTERS = {("subprocess", name) for name in ("run", "Popen", "call", "check_call", "check_output",
                                              "getoutput", "getstatusoutput")} | {
    ("os", name) for name in ("system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp",
                              "spawnl", "spawnle", "spawnlp", "spawnv", "spawnve", "spawnvp", "execv", "execve")}


def test_no_module_but_children_starts_a_process() -> None:
    found = []
    for path in sorted(p for folder in CHECKED for p in folder.rglob("*.py")):
        if path == KVOBS / "children.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            call = node.func if isinstance(node, ast.Call) else None  # a call, not an annotation
            if (isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name)
                    and (call.value.id, call.attr) in STARTERS):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {call.value.id}.{call.attr}")
            if isinstance(node, ast.ImportFrom) and node.module in ("subprocess", "os"):
                found += [f"{path.relative_to(ROOT)}:{node.lineno} from {node.module} import {a.name}"
                          for a in node.names if (node.module, a.name) in STARTERS]
    assert not found, "start processes through kvobs.children (start_child, run_child): " + ", ".join(found)
