"""mlacp: exact context-parallel Multi-head Latent Attention (DeepSeek MLA) for PyTorch.

Each rank of a context-parallel (CP) group holds a slice of a long sequence; mlacp computes exact
attention forward and backward across the slices, moving the 576-wide MLA latent
(``strategy="latent_kv_head"``) or per-head K/V (``strategy="expanded_ulysses"``, and Ulysses x
all-gather hybrids with ``ulysses=U``).

Typical use with a HuggingFace DeepSeek-V3/V2 model, under ``torchrun``::

    import mlacp, mlacp.hf
    dist.init_process_group("gloo")                          # or "nccl"
    groups = mlacp.ContextParallelGroups(dist.group.WORLD)   # the CP group (here: every rank)
    cp = mlacp.hf.parallelize_model(model, groups)           # every DeepseekV3Attention -> mlacp
    batch = cp.shard_inputs(input_ids, labels=input_ids)     # this rank's shard, any length
    loss = model(**batch).loss                               # this rank's share of the global loss
    loss.backward()
    mlacp.reduce_gradients(model.parameters(), groups)       # sum over CP (docs/DESIGN.md §7)

With FSDP2 (``fully_shard``) or DDP on the data-parallel dimension, in either order with
``parallelize_model``; with a ``DeviceMesh``, ``ContextParallelGroups(mesh["cp"])``.

Errors are raised as :class:`MlacpError` (a RuntimeError) with the library's ``mlacp: ...``
message, before any collective, on every rank alike.
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import _C

MlacpError = _C.MlacpError
MlaConfig = _C.MlaConfig

__all__ = [
    "MlacpError",
    "MlaConfig",
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


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without DeviceMesh
        return None
    return DeviceMesh


class ContextParallelGroups:
    """The CP group and, for a hybrid, its Ulysses x all-gather sub-groups.

    Args:
        cp_group: the torch.distributed process group over which the sequence is split (gloo for
            CPU tensors, nccl for CUDA), or a one-dimensional ``DeviceMesh`` (e.g. ``mesh["cp"]``
            of a ``("dp", "cp")`` mesh). ``None`` means the default (world) group.
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

    def __init__(self, cp_group=None, ulysses=None, *, model_config=None, seq_len: Optional[int] = None,
                 batch: int = 1, dtype: str = "float32", plan_hardware: str = "calibrate",
                 bandwidth_gbps: Optional[float] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise _error("process groups", "torch.distributed must be initialised", {},
                         "call torch.distributed.init_process_group() first (e.g. under torchrun)")
        mesh_type = _device_mesh_type()
        self.mesh = None
        if mesh_type is not None and isinstance(cp_group, mesh_type):
            if cp_group.ndim != 1:
                raise _error("process groups", "a DeviceMesh for CP must have one dimension",
                             {"mesh.ndim": cp_group.ndim, "mesh_dim_names": cp_group.mesh_dim_names},
                             'pass the CP dimension, e.g. mesh["cp"]')
            self.mesh = cp_group
            cp_group = cp_group.get_group()
        self.cp_group = cp_group if cp_group is not None else dist.group.WORLD
        self.size = dist.get_world_size(self.cp_group)
        self.rank = dist.get_rank(self.cp_group)
        self.ranks: List[int] = list(dist.get_process_group_ranks(self.cp_group))  # world ranks, CP order
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
        mine = (tuple(self.ranks), self.ulysses)
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
    from .hf import attention_config
    return _planned_choice(groups, attention_config(model_config), seq_len=seq_len, batch=batch, dtype=dtype,
                           ulysses=0, partitions=["head_tail"], overlap=True, hardware=plan_hardware,
                           bandwidth_gbps=bandwidth_gbps)


def _planned_choice(groups: "ContextParallelGroups", config: MlaConfig, *, seq_len, batch, dtype, ulysses, partitions,
                    overlap, hardware, bandwidth_gbps, cpu_run=False) -> dict:
    """The planner's choice for a CP group: rank 0 asks the planner and prints the choice and why;
    every rank receives the choice, or the error, by broadcast."""
    decision = [None]
    if groups.rank == 0:
        try:
            report = _C.plan(config=config, seq_len=int(seq_len), batch=int(batch), cp=groups.size, dtype=dtype,
                             ulysses=ulysses, partitions=partitions, overlap=overlap, hardware=hardware,
                             bandwidth_gbps=bandwidth_gbps, kv_recompute_when_short=cpu_run)
            if report["chosen"] is None:
                decision = [{"error": f"mlacp: plan: {report['explanation']}"}]
            else:
                c = report["candidates"][report["chosen"]]
                print(f"mlacp auto: {c['label']} ({report['summary']})\n" +
                      "\n".join("mlacp auto:   " + line for line in report["explanation"].splitlines()), flush=True)
                # kv_recompute: chosen where the latent layer does not fit the hardware's memory without it
                decision = [{"strategy": c["strategy"], "ulysses": c["ulysses"], "partition": c["partition"],
                             "overlap": c["overlap"], "kv_recompute": bool(c.get("kv_recompute", False)),
                             "label": c["label"]}]
        except MlacpError as e:
            decision = [{"error": str(e)}]
    if groups.size > 1:
        dist.broadcast_object_list(decision, src=groups.ranks[0], group=groups.cp_group)
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
    return _C.shard_sequence(tensor, partition=partition, cp=groups.size, rank=groups.rank, dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], partition: str = "head_tail", dim: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard (in CP rank order)."""
    _check_partition(partition)
    return _C.unshard_sequence(list(shards), partition=partition, dim=dim)


def reduce_gradients(parameters: Iterable[torch.nn.Parameter], groups: ContextParallelGroups) -> None:
    """Completes every parameter's gradient over the CP group (each rank saw other tokens).

    The rule (docs/DESIGN.md §7): with the loss of each rank being its share of the global loss
    (``CpModel.shard_inputs`` sets ``num_items_in_batch`` so), the global gradient is the SUM over
    CP ranks, averaged over data parallelism. Call it after ``backward()``, whatever reduces over
    your data-parallel ranks:

    - plain tensors, or DDP on the DP group: summed over the CP group here;
    - FSDP2 (``fully_shard``) on a mesh without the CP ranks (``mesh["dp"]``): each rank's local
      gradient shard is summed over the CP group (the CP ranks of one DP index hold the same shard);
    - FSDP2 on a mesh that contains the CP group (torchtitan's ``dp_shard x cp`` flattened): FSDP's
      reduce-scatter already summed over CP but divided by the CP size too; that factor is undone
      here (the local shard is multiplied by P), so the result is again the sum over CP.

    A wrapper that averages over a group containing the CP ranks without DTensor gradients (DDP on
    the whole world) is outside this rule: build it on the DP group only, or scale each rank's loss by
    that group's size and do not call this function (HuggingFace Trainer does exactly that:
    examples/hf_trainer.py). Parameters without a gradient are skipped (they must be the same on
    every rank).
    """
    if groups.size == 1:
        return
    cp_ranks = set(groups.ranks)
    to_sum: List[torch.Tensor] = []
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "device_mesh") and hasattr(g, "to_local"):  # a DTensor (FSDP2)
            mesh_ranks = set(g.device_mesh.mesh.flatten().tolist())
            local = g.to_local()
            if cp_ranks <= mesh_ranks:
                local.mul_(groups.size)
            elif cp_ranks & mesh_ranks == {dist.get_rank()}:
                to_sum.append(local)
            else:
                raise _error("reduce gradients", "a DTensor gradient's mesh must contain the CP group or none of it",
                             {"mesh_ranks": sorted(mesh_ranks), "cp_ranks": sorted(cp_ranks)},
                             'shard with FSDP over mesh["dp"] or over the flattened dp x cp mesh')
        else:
            to_sum.append(g)
    by_type = {}
    for g in to_sum:
        by_type.setdefault((g.dtype, g.device), []).append(g)
    for bucket in by_type.values():
        flat = torch._utils._flatten_dense_tensors(bucket)
        _C.all_reduce_sum_(flat, groups.cp_group)
        for g, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
            g.copy_(reduced)


def all_reduce_loss(loss: torch.Tensor, groups: ContextParallelGroups) -> torch.Tensor:
    """The global loss (sum of every rank's share), detached: for logging."""
    total = loss.detach().clone()
    if groups.size > 1:
        _C.all_reduce_sum_(total, groups.cp_group)
    return total
