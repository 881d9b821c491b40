"""What one rank measures around a step: bytes it put on the wire, its peak memory, its time.

Bytes: the torch.distributed collectives the peers call are wrapped at the module attribute
(DeepSpeed's comm layer and yunchang call ``torch.distributed.<fn>`` at call time). A rank's bytes
are what it sends under a bandwidth-optimal algorithm, the convention of mlacp's own counters:
all-to-all (G-1)/G of its buffer, all-gather (G-1) x its chunk, ring all-reduce 2(G-1)/G, a
point-to-point send its tensor. mlacp's collectives are C++ (c10d called directly) and are read from
its own counters (``Attention.comm_bytes``).

Memory: the rank's peak resident set during the step above its resident set before it
(``/proc/self/clear_refs`` resets the peak), measured in the untimed check step with glibc told to
map every allocation of 64 KiB or more on its own and unmap it when freed (``exact_memory``), so
that the resident set follows the live tensors and freed memory kept by the allocator does not
hide a peak. The timed steps run under one fixed policy for every system (``timing_memory``:
32 MiB mmap threshold, no trimming: the policy mlacp's tool applies).
"""
from __future__ import annotations

import ctypes
import time

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class ByteMeter:
    def __init__(self) -> None:
        self.on = False
        self.bytes = 0
        self.calls = 0
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        self._installed = True

        def nbytes(t: torch.Tensor) -> int:
            return t.numel() * t.element_size()

        def size(group) -> int:
            return dist.get_world_size(group)

        def a2a_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
            g = size(group)
            if input_split_sizes:
                row = nbytes(input) // max(input.shape[0], 1)
                me = dist.get_rank(group)
                return row * (sum(input_split_sizes) - input_split_sizes[me])
            return nbytes(input) * (g - 1) // g

        def a2a(output_tensor_list, input_tensor_list, group=None, async_op=False):
            me = dist.get_rank(group)
            return sum(nbytes(t) for i, t in enumerate(input_tensor_list) if i != me)

        def all_gather(tensor_list, tensor, group=None, async_op=False):
            return nbytes(tensor) * (size(group) - 1)

        def all_gather_into(output_tensor, input_tensor, group=None, async_op=False):
            return nbytes(input_tensor) * (size(group) - 1)

        def all_reduce(tensor, op=None, group=None, async_op=False):
            g = size(group)
            return 2 * nbytes(tensor) * (g - 1) // g

        def reduce_scatter_tensor(output, input, op=None, group=None, async_op=False):
            g = size(group)
            return nbytes(input) * (g - 1) // g

        def batch(p2p_op_list):
            return sum(nbytes(op.tensor) for op in p2p_op_list if op.op in (c10d.isend, c10d.send))

        counters = dict(all_to_all_single=a2a_single, all_to_all=a2a, all_gather=all_gather,
                        all_gather_into_tensor=all_gather_into, all_reduce=all_reduce,
                        reduce_scatter_tensor=reduce_scatter_tensor, batch_isend_irecv=batch)
        for name, count in counters.items():
            original = getattr(c10d, name)

            def wrapped(*args, __original=original, __count=count, **kwargs):
                if self.on:
                    self.bytes += __count(*args, **kwargs)
                    self.calls += 1
                return __original(*args, **kwargs)

            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        # Point-to-point sends are counted where the peers issue them, batch_isend_irecv (yunchang's
        # ring): isend/irecv themselves stay unwrapped because P2POp accepts only the originals.
        # A peer sending with bare isend would be missed: the formula check in the report shows it.

    def start(self) -> None:
        self.bytes, self.calls, self.on = 0, 0, True

    def stop(self) -> int:
        self.on = False
        return self.bytes


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc: the memory figures are then what the allocator returns to the OS
    _libc = None


def exact_memory() -> None:
    if _libc is not None:
        _libc.malloc_trim(0)
        _libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
        _libc.mallopt(_M_TRIM_THRESHOLD, 0)


def timing_memory() -> None:
    if _libc is not None:
        _libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        _libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class MemoryMeter:
    """Peak resident bytes of this process during a span, above its resident bytes at the start."""

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.base = _status_kib("VmRSS")

    def stop(self) -> int:
        return max(0, _status_kib("VmHWM") - self.base) * 1024


def now() -> float:
    return time.perf_counter()
