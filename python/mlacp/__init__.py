"""mlacp: exact context-parallel Multi-head Latent Attention (DeepSeek MLA) for PyTorch.

Each rank of a context-parallel (CP) group holds a slice of a long sequence; mlacp computes exact
attention forward and backward across the slices, moving the 576-wide MLA latent
(``strategy="latent_kv_head"``) or per-head K/V (``strategy="expanded_ulysses"``, and Ulysses x
all-gather hybrids with ``ulysses=U``).

Typical use with a HuggingFace DeepSeek-V3/V2 model, under ``torchrun``::

    import mlacp, mlacp.hf
    dist.init_process_group("gloo")                      # or "nccl"
    groups = mlacp.ContextParallelGroups(dist.group.WORLD)   # the CP group (here: every rank)
    mlacp.hf.parallelize_model(model, groups)             # every DeepseekV3Attention -> mlacp
    batch = mlacp.hf.shard_inputs(groups, input_ids, labels=input_ids)
    loss = model(**batch).loss                            # this rank's share of the global loss
    loss.backward()
    mlacp.reduce_gradients(model.parameters(), groups)    # sum over CP (docs/DESIGN.md §7)

Errors are raised as :class:`MlacpError` (a RuntimeError) with the library's ``mlacp: ...``
message, before any collective, on every rank alike.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C

MlacpError = _C.MlacpError

__all__ = [
    "MlacpError",
    "ContextParallelGroups",
    "shard_sequence",
    "unshard_sequence",
    "reduce_gradients",
    "all_reduce_loss",
    "STRATEGIES",
    "PARTITIONS",
]

STRATEGIES = ("latent_kv_head", "expanded_ulysses")
PARTITIONS = ("head_tail", "contiguous")


def _error(what: str, rule: str, values: dict, hint: str) -> MlacpError:
    """An MlacpError in the library's one message shape."""
    got = ", ".join(f"{k}={v}" for k, v in values.items())
    return MlacpError(f"mlacp: {what}: {rule}" + (f"; got {got}" if got else "") + f"; {hint}")


class ContextParallelGroups:
    """The CP group and, for a hybrid, its Ulysses x all-gather sub-groups.

    Args:
        cp_group: the torch.distributed process group over which the sequence is split (gloo for
            CPU tensors, nccl for CUDA). ``None`` means the default (world) group.
        ulysses: the Ulysses degree U (a divisor of the CP size P). ``None`` = P (pure Ulysses
            for ``expanded_ulysses``; the latent strategy then exchanges heads over all of P).
            ``"auto"``: the planner chooses U and the strategy for ``model_config`` (a transformers
            DeepSeek config) at ``seq_len``, ``batch`` and ``dtype`` on ``plan_hardware``
            (``"calibrate"``, a profile or a hardware file) with ``bandwidth_gbps`` as the link;
            ``planned`` holds the choice and ``parallelize_model(strategy="auto")`` runs it.
            With ``1 < U < P`` the Ulysses groups are U consecutive CP ranks and the all-gather
            groups ``{u, u+U, ...}``; they are created here with ``dist.new_group``, so every
            rank of the world must construct its ContextParallelGroups at the same point.

    Like torch's ``DeviceMesh``, this must be built on every rank of the world in the same order.
    """

    def __init__(self, cp_group: Optional[dist.ProcessGroup] = None, ulysses=None, *, model_config=None,
                 seq_len: Optional[int] = None, batch: int = 1, dtype: str = "float32",
                 plan_hardware: str = "calibrate", bandwidth_gbps: Optional[float] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise _error("process groups", "torch.distributed must be initialised", {},
                         "call torch.distributed.init_process_group() first (e.g. under torchrun)")
        self.cp_group = cp_group if cp_group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.cp_group)
        self.rank = dist.get_rank(self.cp_group)
        # ulysses="auto": the planner's (strategy, U) for this model and S (rank 0 of the CP group
        # decides; parallelize_model(strategy="auto") then runs the planned strategy).
        self.planned: Optional[dict] = None
        if ulysses == "auto":
            self.planned = _plan_for_groups(self, model_config, seq_len, batch, dtype, plan_hardware, bandwidth_gbps)
            ulysses = self.planned["ulysses"]
        u = self.size if ulysses is None else int(ulysses)
        if u < 1 or self.size % u != 0:
            raise _error("process groups", "the CP group size must be divisible by the ulysses degree",
                         {"cp_group_size": self.size, "ulysses": u}, "choose ulysses dividing the CP group size")
        self.ulysses = u
        self.ulysses_group: Optional[dist.ProcessGroup] = None
        self.all_gather_group: Optional[dist.ProcessGroup] = None
        if 1 < u < self.size:
            self._build_hybrid_groups()

    def _build_hybrid_groups(self) -> None:
        # Every rank must create every sub-group (dist.new_group is collective over the world):
        # learn every CP group's members and degree, check they agree, then create them in order.
        mine = (tuple(dist.get_process_group_ranks(self.cp_group)), self.ulysses)
        everyone: List = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for ranks, u in everyone:
            if u != self.ulysses:
                raise _error("process groups", "every rank must ask for the same ulysses degree",
                             {"this_rank": self.ulysses, "another_rank": u},
                             "pass the same ulysses to ContextParallelGroups on every rank")
        cp_groups = sorted(set(ranks for ranks, _ in everyone))
        me = dist.get_rank()
        u = self.ulysses
        for ranks in cp_groups:
            for a in range(len(ranks) // u):
                members = list(ranks[a * u:(a + 1) * u])
                g = dist.new_group(members)
                if me in members:
                    self.ulysses_group = g
            for j in range(u):
                members = list(ranks[j::u])
                g = dist.new_group(members)
                if me in members:
                    self.all_gather_group = g

    def __repr__(self) -> str:
        return f"ContextParallelGroups(cp={self.size}, rank={self.rank}, ulysses={self.ulysses})"


def _plan_for_groups(groups: "ContextParallelGroups", model_config, seq_len, batch, dtype, plan_hardware,
                     bandwidth_gbps) -> dict:
    """The planner's choice of strategy and U for a CP group of ``groups.size`` ranks, with
    parallelize_model's defaults (head_tail, overlap on): rank 0 of the group asks the planner,
    every rank receives its answer (or its error)."""
    if model_config is None or seq_len is None or int(seq_len) <= 0:
        raise _error("process groups", "ulysses='auto' needs the model's config and the global sequence length",
                     {"model_config": type(model_config).__name__, "seq_len": seq_len},
                     "pass model_config=model.config and seq_len=S, or give ulysses")
    from .hf import _config_json
    return _planned_choice(groups, _config_json(model_config), seq_len, batch, dtype, 0, ["head_tail"], True,
                           plan_hardware, bandwidth_gbps)


def _planned_choice(groups: "ContextParallelGroups", config_json: str, seq_len, batch, dtype, ulysses, partitions,
                    overlap, plan_hardware, bandwidth_gbps) -> dict:
    """The planner's choice for a CP group: rank 0 asks the planner and prints the choice and why;
    every rank receives the choice, or the error, by broadcast."""
    decision = [None]
    if groups.rank == 0:
        try:
            import json
            report = json.loads(_C.plan(config_json, int(seq_len), int(batch), groups.size, 1, dtype, [], ulysses,
                                        partitions, overlap, plan_hardware, bandwidth_gbps, None))
            if report["chosen"] is None:
                decision = [{"error": f"mlacp: plan: {report['explanation']}"}]
            else:
                c = report["candidates"][report["chosen"]]
                print(f"mlacp auto: {c['label']} ({report['summary']})\n" +
                      "\n".join("mlacp auto:   " + line for line in report["explanation"].splitlines()), flush=True)
                decision = [{"strategy": c["strategy"], "ulysses": c["ulysses"], "partition": c["partition"],
                             "overlap": c["overlap"], "label": c["label"]}]
        except MlacpError as e:
            decision = [{"error": str(e)}]
    if groups.size > 1:
        dist.broadcast_object_list(decision, src=dist.get_global_rank(groups.cp_group, 0), group=groups.cp_group)
    if "error" in decision[0]:
        raise MlacpError(decision[0]["error"])
    return decision[0]


def _check_partition(partition: str) -> None:
    if partition not in PARTITIONS:
        raise _error("options", "partition must be head_tail or contiguous", {"partition": partition},
                     "head_tail balances causal work; contiguous keeps each rank's tokens in one block")


def shard_sequence(tensor: torch.Tensor, groups: ContextParallelGroups, partition: str = "head_tail",
                   dim: int = 1) -> torch.Tensor:
    """This rank's tokens of a global tensor along ``dim`` (head_tail: chunks r and 2P-1-r)."""
    _check_partition(partition)
    return _C.shard_sequence(tensor, partition, groups.size, groups.rank, dim)


def unshard_sequence(shards: Sequence[torch.Tensor], partition: str = "head_tail", dim: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard (in CP rank order)."""
    _check_partition(partition)
    return _C.unshard_sequence(list(shards), partition, dim)


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], groups: ContextParallelGroups) -> None:
    """Sums every parameter's gradient over the CP group (each rank saw other tokens).

    The rule (docs/DESIGN.md §7): with the loss of each rank being its share of the global loss
    (``mlacp.hf.shard_inputs`` sets ``num_items_in_batch`` so), the global gradient is the SUM over
    CP ranks. Data parallelism is separate: reduce (average) over your DP group afterwards, e.g.
    with DDP/FSDP built on the DP group only, never on a group that includes the CP ranks.
    Parameters without a gradient are skipped (they must be the same on every rank).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if groups.size == 1 or not grads:
        return
    by_type = {}
    for g in grads:
        by_type.setdefault((g.dtype, g.device), []).append(g)
    for bucket in by_type.values():
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=groups.cp_group)
        for g, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)


def all_reduce_loss(loss: torch.Tensor, groups: ContextParallelGroups) -> torch.Tensor:
    """The global loss (sum of every rank's share), detached: for logging."""
    total = loss.detach().clone()
    if groups.size > 1:
        dist.all_reduce(total, group=groups.cp_group)
    return total
