"""Room on a GPU for what the CUDA driver allocates outside torch's caching allocator.

torch's allocator keeps the blocks it has freed (reserved) and grows until cudaMalloc fails, when it
releases its cache and retries; a CUDA call that allocates device memory itself (a new stream, the
mappings of cudaHostRegister) has no such retry. After a capture process has run forwards of varied
shapes, its allocator can hold the whole card: at the Qwen3.5-27B capture shape on an H100, 78.5 of 79.2
GiB reserved with 50.1 GiB in use, and the writer pool's side stream then failed with "CUDA error: out of
memory" (2026-12-07). `leave_driver_room` gives the cached blocks back first when the driver has too
little left; it costs one device sync, and only where it was needed."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

DRIVER_ROOM_BYTES = 1 << 30  # free device memory below which the cache is given back before such a call


def leave_driver_room(device: torch.device | str, need: int = DRIVER_ROOM_BYTES) -> bool:
    """On CUDA, before a call that allocates device memory outside torch's allocator: if the driver has less
    than `need` bytes free, torch's cached, unused blocks go back to it (torch.cuda.empty_cache). Returns whether
    they did; on any other device nothing happens."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    if free >= need:
        return False
    reserved = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()
    log.info("GPU %s: %.2f GiB free, torch's cache of %.1f GiB given back to the driver (now %.2f GiB free)",
             device, free / 2**30, reserved / 2**30, torch.cuda.mem_get_info(device)[0] / 2**30)
    return True
