"""Patches an unpacked vLLM tree for tests/gpu/gpu_check.py (run by tests/gpu/run_gpu_check.sh on the device,
never on an installed vLLM): the bundle leaves out the flash-attention kernels (the engines run
``--attention-backend TRITON_ATTN``), but on CUDA vLLM still imports ``vllm.vllm_flash_attn`` (through
``v1/attention/backends/fa_utils.py``, which a Llama's and a Gemma 3's model modules import), whose
``__init__`` refuses to import without them. The patch keeps the module importable; anything that calls
a flash-attention kernel would still fail, loudly.

    python tests/gpu/patch_vllm.py /tmp/kvobs-gpu/vllm-tree

Exits 1, naming the file, when the code to patch is not found exactly once (another vLLM release)."""

from __future__ import annotations

import sys
from pathlib import Path

PATCHES = (
    (
        "vllm/vllm_flash_attn/__init__.py",
        "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError(",
        "if False and not (FA2_AVAILABLE or FA3_AVAILABLE):  # kvobs tests/gpu: kernels left out, TRITON_ATTN runs\n"
        "    raise ImportError(",
    ),
)


def patch(tree: Path) -> list[str]:
    done = []
    for relative, old, new in PATCHES:
        path = tree / relative
        text = path.read_text()
        if new in text:
            done.append(f"{relative}: already patched")
            continue
        if text.count(old) != 1:
            raise SystemExit(f"patch_vllm: {path}: the code to patch is there {text.count(old)} times, not once "
                             f"(another vLLM release?): {old!r}")
        path.write_text(text.replace(old, new))
        done.append(f"{relative}: flash-attention import guard relaxed")
    return done


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python tests/gpu/patch_vllm.py VLLM_TREE")
    for line in patch(Path(sys.argv[1])):
        print(f"patch_vllm: {line}")
