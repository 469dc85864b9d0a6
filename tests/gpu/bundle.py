"""Builds ``.gpu-carry/``: what a lent GPU machine (no network, Python 3.12, torch 2.11.0+cu130) needs to run
vLLM 0.34.0's GPU build with kvobs (tests/gpu/gpu_check.py), small enough to travel with the working tree
(the device tool carries at most 64 MiB in all).

    python tests/gpu/bundle.py [--wheel vllm-0.34.0-cp38-abi3-manylinux_2_28_x86_64.whl]

What it writes into ``.gpu-carry/`` (ignored by git; name it in the device tool's ``carry``):

- ``vllm-<release>-trimmed.tar.xz``: vLLM's wheel unpacked, without what a tiny text model on an H200 with
  ``--attention-backend TRITON_ATTN`` does not load: the flash-attention kernels, the MoE, FlashMLA, DeepGEMM,
  FlashKDA and deep-select kernels, the Rust frontend (``vllm-rs``), C/C++/CUDA headers and sources. Its
  kernels (``_C_stable_libtorch``) stay, with the GPU code for other architectures than sm_90 zeroed out of
  their fat binaries (each fat binary keeps its sm_90/sm_90a code, else its newest PTX up to compute_90;
  what no sm_90 GPU can run is zeroed) and the static symbol table stripped: the same file layout, most of
  it zeros, which xz compresses away.
- ``wheels/``: Python 3.12 manylinux wheels of what vLLM's ``vllm serve`` and kvobs import that the device
  image lacks (tests/gpu/requirements-gpu.txt, pinned, fetched with ``pip download --no-deps``).
- ``torch_symbols.txt``: the torch C symbols the kernels need (``nm -D --undefined-only``), which
  tests/gpu/run_gpu_check.sh checks against the device's torch before anything starts.
- ``MANIFEST.json``: what was left out, the fat-binary trimming, sizes.

The wheel is read from ``--wheel``, ``$VLLM_WHEEL`` or ``build/gpu-bundle/`` (downloaded there once with
``pip download``); the work files stay in ``build/gpu-bundle/``.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
RELEASE = "0.34.0"
WHEEL_NAME = f"vllm-{RELEASE}-cp38-abi3-manylinux_2_28_x86_64.whl"
CARRY = ROOT / ".gpu-carry"
WORK = ROOT / "build" / "gpu-bundle"
REQUIREMENTS = HERE / "requirements-gpu.txt"
LIMIT_BYTES = 64 << 20  # the device tool's limit on the working tree that travels, carried paths included
KEEP_ARCH = 90  # the H200 (and H100): sm_90
KERNELS = "vllm/_C_stable_libtorch.abi3.so"
LEFT_OUT = (  # (pattern, why)
    ("vllm/vllm_flash_attn/*.so", "flash-attention kernels: the engines run --attention-backend TRITON_ATTN"),
    ("vllm/vllm-rs", "the Rust frontend, used only with VLLM_USE_RUST_FRONTEND"),
    ("vllm/_moe_C_stable_libtorch.abi3.so", "MoE kernels (imported under contextlib.suppress(ImportError))"),
    ("vllm/_flashmla*", "FlashMLA kernels (MLA models)"),
    ("vllm/_flashkda_C.abi3.so", "FlashKDA kernels"),
    ("vllm/_deepselect_C.abi3.so", "deep-select kernels (sparse attention)"),
    ("vllm/third_party/deep_gemm/*", "DeepGEMM (FP8 GEMMs)"),
    ("vllm/third_party/fmha_sm100/*", "Blackwell FMHA sources"),
    ("*.h", "C/C++/CUDA headers and sources (JIT builds only)"),
    ("*.hpp", "C/C++/CUDA headers and sources (JIT builds only)"),
    ("*.cuh", "C/C++/CUDA headers and sources (JIT builds only)"),
    ("*.inl", "C/C++/CUDA headers and sources (JIT builds only)"),
    ("*.cu", "C/C++/CUDA headers and sources (JIT builds only)"),
    ("*.cpp", "C/C++/CUDA headers and sources (JIT builds only)"),
    ("vllm-*.dist-info/RECORD", "the wheel's file list (no longer true of the trimmed tree)"),
)
PIP_PLATFORMS = (*(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)), "manylinux2014_x86_64", "manylinux2010_x86_64",
                 "manylinux1_x86_64")
"""The device image is Ubuntu 24.04 (Python 3.12.3, glibc 2.39): any manylinux wheel up to 2.39 loads there;
pip matches each platform tag exactly, so every one is named."""


def say(msg: str) -> None:
    print(f"bundle: {msg}", flush=True)


# -- fat binaries ----------------------------------------------------------------------------------------------
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    str_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, base)
        end = data.index(b"\0", str_off + name_off)
        if bytes(data[str_off + name_off:end]).decode() == name:
            offset, size = struct.unpack_from("<QQ", data, base + 0x18)
            return offset, size
    raise KeyError(name)


def fatbin_containers(data: bytes | bytearray, offset: int, size: int) -> list[list[dict[str, int]]]:
    """The fat binaries in a ``.nv_fatbin`` section, each a list of its entries (kind, arch, where)."""
    found: list[list[dict[str, int]]] = []
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        entries = []
        entry, body_end = pos + header_size, pos + header_size + body_size
        while entry < body_end:
            kind, _ev, entry_header, padded = struct.unpack_from("<HHIQ", data, entry)
            arch, = struct.unpack_from("<I", data, entry + 28)
            entries.append({"kind": kind, "arch": arch, "payload": entry + entry_header, "size": padded})
            entry += entry_header + padded
        found.append(entries)
        pos = body_end
    return found


def trim_fatbins(path: Path, arch: int = KEEP_ARCH) -> dict[str, object]:
    """Zeroes every fat-binary entry an sm_``arch`` GPU cannot use or will not pick: where a fat binary has
    sm_``arch`` code (SASS; sm_90a too) the rest goes, else all but its newest PTX up to compute_``arch``,
    else (SASS for other architectures only: an sm_90 GPU could not run it anyway) everything. Sizes and
    offsets are untouched."""
    data = bytearray(path.read_bytes())
    offset, size = elf_section(data, ".nv_fatbin")
    kept = zeroed = 0
    unusable = 0
    for entries in fatbin_containers(data, offset, size):
        sass = [e for e in entries if e["kind"] == KIND_ELF and e["arch"] == arch]
        ptx = [e for e in entries if e["kind"] == KIND_PTX and e["arch"] <= arch]
        keep = sass or ([max(ptx, key=lambda e: e["arch"])] if ptx else [])
        unusable += not keep
        for e in entries:
            if any(e is k for k in keep):
                kept += e["size"]
            else:
                data[e["payload"]:e["payload"] + e["size"]] = bytes(e["size"])
                zeroed += e["size"]
    path.write_bytes(data)
    return {"fatbin_bytes": size, "kept_bytes": kept, "zeroed_bytes": zeroed, "arch": f"sm_{arch}",
            "fatbins_with_nothing_for_this_arch": unusable}


# -- the trimmed tree ------------------------------------------------------------------------------------------
def left_out(name: str) -> str | None:
    """Why ``name`` (a path in the wheel) stays out of the tree, or None; fnmatch's ``*`` spans folders."""
    return next((why for pattern, why in LEFT_OUT if fnmatch.fnmatch(name, pattern)), None)


def find_wheel(given: str | None) -> Path:
    for candidate in (given, os.environ.get("VLLM_WHEEL"), str(WORK / WHEEL_NAME)):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    WORK.mkdir(parents=True, exist_ok=True)
    say(f"downloading vllm=={RELEASE} (the GPU wheel, about 240 MB) into {WORK}")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
                    "manylinux_2_28_x86_64", "--python-version", "3.12", "-d", str(WORK), f"vllm=={RELEASE}"],
                   check=True)
    return WORK / WHEEL_NAME


def build_tree(wheel: Path, tree: Path) -> dict[str, object]:
    shutil.rmtree(tree, ignore_errors=True)
    tree.mkdir(parents=True)
    dropped: dict[str, int] = {}
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            why = left_out(info.filename)
            if why:
                dropped[why] = dropped.get(why, 0) + info.file_size
                continue
            z.extract(info, tree)
            mode = info.external_attr >> 16
            if mode:
                os.chmod(tree / info.filename, mode & 0o777 | 0o600)
    kernels = tree / KERNELS
    symbols = undefined_torch_symbols(kernels)
    trimmed = trim_fatbins(kernels)
    strip = shutil.which("strip")
    before = kernels.stat().st_size
    if strip:  # the static symbol table (.symtab/.strtab); the dynamic one stays
        subprocess.run([strip, "--strip-unneeded", str(kernels)], check=True)
    trimmed.update(stripped=bool(strip), bytes_before_strip=before, bytes_after=kernels.stat().st_size)
    return {"left_out_bytes": dropped, "kernels": trimmed, "torch_symbols": symbols}


def undefined_torch_symbols(lib: Path) -> list[str]:
    nm = shutil.which("nm")
    if nm is None:
        raise SystemExit("bundle: nm (binutils) is needed to list the torch symbols the kernels use")
    out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True, text=True, check=True)
    names = {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}
    return sorted(n for n in names if n.startswith(("aoti_torch_", "torch_")))


def pack(tree: Path, archive: Path) -> None:
    archive.unlink(missing_ok=True)
    if shutil.which("tar") and shutil.which("xz"):
        env = {**os.environ, "XZ_OPT": "-9 -T0"}
        subprocess.run(["tar", "-C", str(tree), "--owner=0", "--group=0", "--sort=name", "-cJf", str(archive), "."],
                       check=True, env=env)
    else:
        with tarfile.open(archive, "w:xz", preset=9) as tar:
            for child in sorted(tree.iterdir()):
                tar.add(child, arcname=child.name)


def download_wheels(dest: Path) -> list[str]:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
               "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none", "-d", str(dest),
               "-r", str(REQUIREMENTS)]
    for platform in PIP_PLATFORMS:
        command += ["--platform", platform]
    subprocess.run(command, check=True)
    wheels = sorted(p.name for p in dest.glob("*.whl"))
    names = [w.split("-")[0].lower().replace("_", "-") for w in wheels]
    doubles = sorted({n for n in names if names.count(n) > 1})
    if doubles:
        raise SystemExit(f"bundle: more than one wheel of {doubles}: pip would refuse to install them together")
    return wheels


def tree_bytes() -> int:
    """What travels besides .gpu-carry: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout
    return sum((ROOT / p).stat().st_size for p in out.decode().split("\0") if p and (ROOT / p).is_file())


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", help=f"vLLM's {WHEEL_NAME} (else $VLLM_WHEEL, else downloaded)")
    parser.add_argument("--no-wheels", action="store_true", help="keep .gpu-carry/wheels as it is")
    args = parser.parse_args(argv)
    wheel = find_wheel(args.wheel)
    CARRY.mkdir(exist_ok=True)
    say(f"unpacking {wheel.name} without what the GPU check does not load")
    tree = WORK / "tree"
    info = build_tree(wheel, tree)
    kernels: dict[str, Any] = info["kernels"]  # type: ignore[assignment]
    say(f"kernels: {kernels['zeroed_bytes'] / 1e6:.1f} MB of other architectures' GPU code zeroed, "
        f"{kernels['kept_bytes'] / 1e6:.1f} MB kept for {kernels['arch']}")
    symbols = info["torch_symbols"]
    assert isinstance(symbols, list)
    (CARRY / "torch_symbols.txt").write_text("".join(f"{s}\n" for s in symbols))
    archive = CARRY / f"vllm-{RELEASE}-trimmed.tar.xz"
    say(f"compressing the tree into {archive.relative_to(ROOT)} (xz -9; a few minutes on two cores)")
    pack(tree, archive)
    wheels_dir = CARRY / "wheels"
    if not args.no_wheels or not wheels_dir.is_dir():
        say(f"downloading the wheels of {REQUIREMENTS.relative_to(ROOT)} for Python 3.12")
        wheels = download_wheels(wheels_dir)
    else:
        wheels = sorted(p.name for p in wheels_dir.glob("*.whl"))
    carry = sum(p.stat().st_size for p in CARRY.rglob("*") if p.is_file())
    travels = carry + tree_bytes()
    archive_bytes = archive.stat().st_size
    wheels_bytes = sum((wheels_dir / w).stat().st_size for w in wheels)
    manifest = {
        "vllm": RELEASE, "wheel": wheel.name, "wheel_sha256": sha256(wheel), "archive": archive.name,
        "archive_bytes": archive_bytes, "wheels": wheels, "wheels_bytes": wheels_bytes,
        "left_out_bytes": info["left_out_bytes"], "kernels": kernels, "torch_symbols": len(symbols),
        "carry_bytes": carry, "travels_bytes": travels, "limit_bytes": LIMIT_BYTES,
    }
    (CARRY / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    say(f".gpu-carry: {carry / 2**20:.1f} MiB (archive {archive_bytes / 2**20:.1f}, "
        f"{len(wheels)} wheels {wheels_bytes / 2**20:.1f}); with the working tree "
        f"{travels / 2**20:.1f} MiB of the device tool's {LIMIT_BYTES >> 20} MiB")
    if travels > LIMIT_BYTES - (4 << 20):
        say("too large: less than 4 MiB of margin under the device tool's limit")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
