"""Before any engine starts on the GPU machine (tests/gpu/run_gpu_check.sh): is everything there that vLLM 0.34.0's
trimmed GPU build and kvobs need? Each step says what is missing instead of letting an engine hang or die later.

    python tests/gpu/preflight.py CARRY_DIR VLLM_TREE

1. torch sees a CUDA device; its compute capability is the one the bundle's kernels were trimmed for (sm_90);
2. every torch C symbol vLLM's kernels need (CARRY_DIR/torch_symbols.txt, from ``nm -D --undefined-only``) is
   exported by this torch (vLLM 0.34.0 asks for torch 2.14; its kernels use only torch's stable C ABI);
3. the kernels load, and three of them run and give the right answer (rms_norm, silu_and_mul, and the
   host<->GPU copy vLLM's CPU offload worker uses, swap_blocks_batch): the trimmed fat binaries work;
4. the modules ``vllm serve`` and the checks import, each in this process: the API server, the GPU model
   runner, the models, the Triton attention backend, vLLM's CPU offloading spec and CUDA worker, kvobs's
   spec and connector, tests/gpu/gpudefects.py.

Writes $OUT/preflight.json; exits 0 when all passed, else 3 with the first failure on the last line."""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ARCH = (9, 0)
MODULES = (
    "vllm.entrypoints.openai.api_server", "vllm.v1.engine.core", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner", "vllm.model_executor.models.llama", "vllm.model_executor.models.gemma3",
    "vllm.v1.attention.backends.triton_attn", "vllm.v1.kv_offload.cpu.spec", "vllm.v1.kv_offload.cpu.gpu_worker",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector",
    "kvobs.vllm", "kvobs.vllm.connector", "gpudefects",
)
RESULT: dict[str, Any] = {"steps": {}}
OUT = Path(os.environ.get("OUT") or "/tmp/kvobs-gpu-out")


def step(name: str, ok: bool, detail: Any) -> None:
    RESULT["steps"][name] = {"ok": ok, "detail": detail}
    print(f"preflight: {name}: {'ok' if ok else 'FAILED'}: {detail}"[:2000], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "preflight.json").write_text(json.dumps(RESULT, indent=1, default=str))
    if not ok:
        print(f"preflight FAILED at {name}: {detail}"[:2000], flush=True)
        sys.exit(3)


def torch_exports(torch_lib: Path, symbols: list[str]) -> list[str]:
    libs = [ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL) for name in ("libtorch.so", "libtorch_cpu.so",
                                                                        "libtorch_cuda.so")
            if (p := torch_lib / name).exists()]
    return [s for s in symbols if not any(hasattr(lib, s) for lib in libs)]


def kernels() -> dict[str, Any]:
    import torch

    t = time.monotonic()
    import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C*)

    figures: dict[str, Any] = {"load_s": round(time.monotonic() - t, 2)}
    x = torch.randn(64, 256, device="cuda", dtype=torch.float32)
    w = torch.rand(256, device="cuda", dtype=torch.float32)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-6)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    figures["rms_norm_max_err"] = float((out - ref).abs().max())
    y = torch.randn(64, 512, device="cuda", dtype=torch.float32)
    act = torch.empty(64, 256, device="cuda", dtype=torch.float32)
    torch.ops._C.silu_and_mul(act, y)
    ref_act = torch.nn.functional.silu(y[:, :256]) * y[:, 256:]
    figures["silu_and_mul_max_err"] = float((act - ref_act).abs().max())
    src = torch.arange(4096, dtype=torch.float32).pin_memory()
    dst = torch.zeros(4096, dtype=torch.float32, device="cuda")
    torch.ops._C_cache_ops.swap_blocks_batch(torch.tensor([src.data_ptr()], dtype=torch.int64),
                                             torch.tensor([dst.data_ptr()], dtype=torch.int64),
                                             torch.tensor([src.numel() * 4], dtype=torch.int64), False)
    torch.cuda.synchronize()
    figures["swap_blocks_batch_equal"] = bool(torch.equal(dst.cpu(), src))
    figures["ok"] = figures["rms_norm_max_err"] < 1e-3 and figures["silu_and_mul_max_err"] < 1e-3 \
        and figures["swap_blocks_batch_equal"]
    return figures


def main() -> None:
    carry, tree = Path(sys.argv[1]), Path(sys.argv[2])
    import torch

    cuda = torch.cuda.is_available()
    RESULT["torch"] = torch.__version__
    RESULT["torch_cuda"] = torch.version.cuda
    step("cuda", cuda, torch.cuda.get_device_name(0) if cuda else "torch sees no CUDA device")
    capability = torch.cuda.get_device_capability(0)
    step("arch", tuple(capability) == ARCH,
         f"sm_{capability[0]}{capability[1]}" + ("" if tuple(capability) == ARCH else
                                                 f": the bundle kept vLLM's GPU code for sm_{ARCH[0]}{ARCH[1]} only "
                                                 "(tests/gpu/bundle.py, KEEP_ARCH)"))
    symbols = [s for s in (carry / "torch_symbols.txt").read_text().split() if s]
    missing = torch_exports(Path(torch.__file__).parent / "lib", symbols)
    step("torch_symbols", not missing, f"{len(symbols) - len(missing)} of {len(symbols)} exported by torch "
         f"{torch.__version__}" + (f"; missing: {missing}" if missing else ""))
    vllm_file = importlib.import_module("vllm").__file__ or ""
    step("vllm_from_bundle", vllm_file.startswith(str(tree)), vllm_file)
    try:
        figures = kernels()
    except Exception as exc:  # the detail is the point
        figures = {"ok": False, "error": repr(exc)[:800], "trace": traceback.format_exc()[-1500:]}
    step("kernels", bool(figures.get("ok")), figures)
    for module in MODULES:
        t = time.monotonic()
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            step(f"import {module}", False, f"no module named {exc.name!r} (not in the device image nor in "
                 f".gpu-carry/wheels: add it to tests/gpu/requirements-gpu.txt)")
        except Exception as exc:  # the detail is the point
            step(f"import {module}", False, f"{exc!r}"[:800] + " " + traceback.format_exc()[-800:])
        step(f"import {module}", True, f"{time.monotonic() - t:.1f} s")
    print("preflight: all passed", flush=True)


if __name__ == "__main__":
    main()
