"""The CP ranks agree on a forward before its first collective.

Every rank reads its own inputs without communicating, then all ranks exchange one fixed-size
record (a few int64s: whether it can go on, its batch and local length, how its shard was made,
which global batch it came from, a checksum of its inputs) in one all-gather that every rank
enters whatever it found. If a rank cannot go on, the ranks exchange their reasons and every rank
raises the same :class:`mlacp.MlacpError`; if the records contradict each other (different
lengths, shards of different batches, the same unsharded inputs everywhere), every rank raises the
same error computed from the same records. No rank reaches a collective of the step alone, so a
mistake on one rank is an error on all of them at once, not a hang or an abort.
"""

from __future__ import annotations

import zlib
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from . import MlacpError, _C

# How a rank's shard was made (record field "mode").
NO_SHARD_INFO, POSITION_IDS, SHARD_INPUTS = 0, 1, 2
_MODE_NAMES = {NO_SHARD_INFO: "neither mlacp_positions nor position_ids", POSITION_IDS: "position_ids only",
               SHARD_INPUTS: "CpModel.shard_inputs' mlacp_positions"}


def checksum(*tensors: Optional[torch.Tensor]) -> int:
    """A checksum of host tensors' bytes (0 if any is on a device: reading it would synchronise)."""
    crc = 0
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cpu":
            return 0
        t = t.detach().contiguous()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        crc = zlib.crc32(t.numpy().tobytes(), crc)
    return crc | (1 << 40)  # nonzero: known


def _control_device(group) -> torch.device:
    """Where the group moves small control tensors without a device synchronisation: the host, unless
    the group has only a CUDA backend (NCCL)."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "cpu" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def agree(groups, record: Sequence[int], problem: Optional[str], what: str) -> List[List[int]]:
    """Every CP rank's record, or the same MlacpError on every rank if any rank has a problem."""
    if groups.size == 1:
        if problem:
            raise MlacpError(problem)
        return [list(record)]
    vec = torch.tensor([1 if problem else 0] + [int(v) for v in record], dtype=torch.int64,
                       device=_control_device(groups.cp_group))
    rows = _C.all_gather(vec, groups.cp_group)
    table = torch.stack(rows).tolist()
    if any(row[0] for row in table):
        texts: List[Optional[str]] = [None] * groups.size
        dist.all_gather_object(texts, problem or "", group=groups.cp_group)
        raise MlacpError(_combined(texts, what))
    return [row[1:] for row in table]


def _combined(texts: List[str], what: str) -> str:
    failing = [(r, t) for r, t in enumerate(texts) if t]
    distinct = list(dict.fromkeys(t for _, t in failing))
    ranks = ", ".join(str(r) for r, _ in failing)
    where = f"CP rank{'s' if len(failing) > 1 else ''} {ranks} of {len(texts)}"
    if len(distinct) == 1:
        return f"{distinct[0]} [{where}; every rank of the CP group stopped before the forward's first collective]"
    parts = "; ".join(f"rank {r}: {t[len('mlacp: '):] if t.startswith('mlacp: ') else t}" for r, t in failing)
    return (f"mlacp: {what}: CP ranks cannot run this forward (every rank stopped before its first collective); "
            f"{parts}")


def mode_name(mode: int) -> str:
    return _MODE_NAMES.get(mode, str(mode))
