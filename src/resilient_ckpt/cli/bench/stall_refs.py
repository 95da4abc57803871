"""The stall benchmark's references, measured in the same run as our saves: a memcpy of the
state's bytes into pre-faulted shared memory (by one thread, or split as our copy pool
splits it), and on CUDA a pinned device-to-host copy of the same tensors."""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ...async_ckpt._copy import copy_segments, split_shares


class Memcpy:
    """``memmove`` of the same tensors into pre-faulted shared memory, by ``threads`` threads.

    One thread (the reference every CPU stall is divided by) copies tensor by tensor. More
    split the bytes into equal shares, one copied by the calling thread and the others by
    threads started once (``memmove`` releases the GIL): what copying in parallel
    gains on this machine, the same number of threads as our copy pool uses.
    """

    def __init__(self, tensors: list[torch.Tensor], threads: int = 1) -> None:
        self.tensors = tensors
        total = sum(t.numel() * t.element_size() for t in tensors)
        fd = os.memfd_create("bench_memcpy")
        os.ftruncate(fd, max(total, 1))
        self.mm = mmap.mmap(fd, max(total, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        os.close(fd)
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads - 1) if threads > 1 else None
        ranges, dst = [], self.base.data_ptr()
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            ranges.append((dst, t.data_ptr(), nbytes))
            dst += nbytes
        # Split whatever the size (our copy keeps states under 8 MB on one thread).
        self.shares = split_shares(ranges, threads, min_bytes=0)

    def __call__(self) -> float:
        started = time.perf_counter()
        if self.pool is None:
            copy_segments(self.shares[0])
        else:
            others = [self.pool.submit(copy_segments, share) for share in self.shares[1:]]
            copy_segments(self.shares[0])
            for future in others:
                future.result()
        return time.perf_counter() - started

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()
        del self.base
        self.mm.close()


class PinnedCopy:
    """The GPU reference: each CUDA tensor copied (``non_blocking``) into its slot of one
    pre-allocated pinned host buffer, then one synchronize."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        total = sum(t.numel() * t.element_size() for t in tensors)
        self.buffer = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
        self.slots, offset = [], 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.slots.append(self.buffer[offset : offset + n].view(t.dtype).view(t.shape))
            offset += n

    def __call__(self) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for dst, src in zip(self.slots, self.tensors, strict=True):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    def close(self) -> None:
        self.slots = []
        del self.buffer
