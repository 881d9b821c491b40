"""HuggingFace DeepSeek models with context parallelism in one call.

:func:`parallelize_model` makes every ``DeepseekV3Attention`` / ``DeepseekV2Attention`` of a
``transformers`` model run through mlacp on the model's own parameters (the same ``nn.Parameter``
objects: ``state_dict``, the optimizer and ``save_pretrained`` are unchanged). Everything else
(embeddings, MoE/MLP, norms, LM head) runs on each rank's tokens as usual. Each rank then feeds
its shard of the sequence (:meth:`CpModel.shard_inputs`).

What is rejected, before any collective and with an ``mlacp: ...`` message: attention masks
other than "no mask" / all ones (padding: pack documents instead, with position_ids that restart
at 0), ``use_cache=True`` or a ``past_key_values`` cache, ``output_attentions=True``, a local
sequence the partition cannot split, groups whose sizes contradict the options.
"""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from . import STRATEGIES, ContextParallelGroups, _C, _check_partition, _error, _planned_choice, shard_sequence, unshard_sequence

__all__ = ["parallelize_model", "CpModel", "GlobalPositions", "ATTENTION_CLASSES"]

ATTENTION_CLASSES = ("DeepseekV3Attention", "DeepseekV2Attention")
_WHAT = "HuggingFace model"


@dataclass
class GlobalPositions:
    """What :meth:`CpModel.shard_inputs` found in the global positions, handed to the model's
    forward as ``mlacp_positions`` (no collective, no read of a device there)."""

    positions: torch.Tensor  # global [B|1, S], as given to shard_inputs
    document_ends: List[int]  # exclusive ends of packed documents; [] for one document per row

    def to(self, *args, **kwargs) -> "GlobalPositions":
        """Itself: the forward moves the positions where it needs them (without a host
        synchronisation), so the usual ``{k: v.to(device) for k, v in batch.items()}`` just works."""
        return self


@dataclass
class _ForwardState:
    """What one model forward resolved once for all its attention layers."""

    document_ends: Optional[List[int]] = None
    position_embeddings: Optional[tuple] = None  # this rank's rows of the global rotary table


@dataclass
class CpModel:
    """The handle :func:`parallelize_model` returns.

    Attributes:
        groups: the CP groups.
        strategy, partition, overlap, kernel: the options every layer runs with.
        plans: layer name -> the plan text of its C++ runtime.
    """

    model: torch.nn.Module
    groups: ContextParallelGroups
    strategy: str
    partition: str
    overlap: bool
    kernel: str
    plans: Dict[str, str] = field(default_factory=dict)
    _state: _ForwardState = field(default_factory=_ForwardState)

    def shard_inputs(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, ignore_index: int = -100) -> dict:
        """This rank's shard of a global batch, as keyword arguments of the model's forward.

        Args:
            input_ids: the global ``[B, S]`` token ids (the same on every CP rank).
            labels: global ``[B, S]`` labels; they are shifted *before* sharding (token t predicts
                t+1 across shard boundaries) and passed as ``shift_labels``, with
                ``num_items_in_batch`` set to the global count, so each rank's ``loss`` is its
                share of the global mean loss and the gradients add up over CP
                (:func:`mlacp.reduce_gradients`). As in HuggingFace's own loss, a packed
                document's last token predicts the next document's first: set those labels to
                ``ignore_index`` yourself if that is not wanted.
            position_ids: global ``[B|1, S]`` positions; restarts at 0 mark packed documents
                (batch 1). Default ``0..S-1``.

        Returns ``dict(input_ids=..., position_ids=..., mlacp_positions=...[, labels=...,
        shift_labels=..., num_items_in_batch=...])``: ``mlacp_positions`` holds the global
        positions and the packed documents' ends, found here once; the model's forward takes them
        (its pre-hook removes the key) instead of gathering the positions from the ranks. Give the batch on the CPU (a data
        loader's tensors) and move the shards to the GPU afterwards: then nothing here or in the
        forward reads a GPU tensor on the host (docs/DESIGN.md §16). ``num_items_in_batch`` is an
        int for CPU labels and a 0-d tensor for device labels (read on the host, it would
        synchronise).
        """
        if input_ids.dim() != 2:
            raise _error(_WHAT, "input_ids must be [B, S]", {"shape": tuple(input_ids.shape)},
                         "pass the global batch of token ids")
        b, s = input_ids.shape
        p = self.groups.size
        parts = 2 * p if self.partition == "head_tail" else p
        if s % parts != 0:
            raise _error(_WHAT, f"the sequence length must be divisible by {'2 * cp' if parts == 2 * p else 'cp'}"
                         f" for the {self.partition} partition", {"S": s, "cp": p},
                         f"pad or cut the sequence to a multiple of {parts}")
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        position_ids = position_ids.expand(b, s)
        out = {
            "input_ids": shard_sequence(input_ids, self.groups, self.partition),
            "position_ids": shard_sequence(position_ids.contiguous(), self.groups, self.partition),
            "mlacp_positions": GlobalPositions(position_ids, _document_ends(position_ids)),
        }
        if labels is not None:
            shifted = torch.full_like(labels, ignore_index)
            shifted[:, :-1] = labels[:, 1:]
            local = shard_sequence(shifted, self.groups, self.partition)
            out["labels"] = local
            out["shift_labels"] = local
            count = (shifted != ignore_index).sum()
            out["num_items_in_batch"] = int(count) if count.device.type == "cpu" else count
        return out


def _document_ends(global_positions: torch.Tensor) -> List[int]:
    """The packed documents' exclusive ends in global positions ``[B, S]`` (HuggingFace's rule), or
    ``[]`` for one document per row. Reads the positions on the host."""
    starts = _document_starts(global_positions)
    if not bool(starts[:, 1:].any()):
        return []
    if global_positions.shape[0] != 1:
        raise _error(_WHAT, "packed documents (position_ids restarting) need batch 1",
                     {"batch": global_positions.shape[0]}, "concatenate the batch into one row")
    idx = torch.nonzero(starts[0]).flatten().tolist()
    return idx[1:] + [global_positions.shape[1]]


def _document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, S] bool: True where a new document starts (HuggingFace's rule: the position does not
    continue the previous one)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def _find_base_model(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if hasattr(module, "rotary_emb") and hasattr(module, "layers") and hasattr(module, "embed_tokens"):
            return module
    raise _error(_WHAT, "the model must contain a decoder (a module with embed_tokens, layers and rotary_emb)",
                 {"model": type(model).__name__}, "pass a transformers DeepseekV3/V2 model")


_ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "rope_interleave",
                     "attention_bias", "attention_dropout", "max_position_embeddings")


def _config_json(config) -> str:
    """The attention's part of a transformers config, as the C++ config reader reads it (the rest of
    the model's fields are not mlacp's). Every field that changes the attention's math is here; the
    rope settings go as the config holds them (rope_parameters, or rope_theta/rope_scaling), read by
    the one C++ reader."""
    d = config.to_dict()
    fields = _ATTENTION_FIELDS + ("rope_parameters", "rope_theta", "rope_scaling")
    return json.dumps({k: d[k] for k in fields if k in d and (d[k] is not None or k == "q_lora_rank")})


def _auto_strategy(config_json: str, groups: ContextParallelGroups, seq_len, batch: int, dtype: str, partition: str,
                   overlap: bool, plan_hardware: str, bandwidth_gbps) -> str:
    """The planner's strategy for the groups' P and U (rank 0 of the CP group decides, calibrating
    its machine or reading ``plan_hardware``; every rank receives the same answer or error)."""
    if seq_len is None or int(seq_len) <= 0:
        raise _error("options", "strategy='auto' needs the global sequence length", {"seq_len": seq_len},
                     "pass seq_len=S (and batch=B) to parallelize_model, or name the strategy")
    return _planned_choice(groups, config_json, seq_len, batch, dtype, groups.ulysses, [partition], bool(overlap),
                           plan_hardware, bandwidth_gbps)["strategy"]


def parallelize_model(model: torch.nn.Module, groups: ContextParallelGroups, *, strategy: str = "latent_kv_head",
                      partition: str = "head_tail", overlap: bool = True, kernel: str = "blockwise",
                      seq_len: Optional[int] = None, batch: int = 1, plan_hardware: str = "calibrate",
                      bandwidth_gbps: Optional[float] = None) -> CpModel:
    """Makes every DeepSeek MLA attention layer of ``model`` run with context parallelism.

    Args:
        model: a ``transformers`` DeepseekV3/V2 model (``...ForCausalLM`` or the base model), or
            any model whose attention modules are ``DeepseekV3Attention``/``DeepseekV2Attention``.
            Its parameters must already be on their device and dtype.
        groups: :class:`mlacp.ContextParallelGroups` (the CP group and the Ulysses degree).
        strategy: ``"latent_kv_head"`` (moves the latent), ``"expanded_ulysses"`` (per-head K/V), or
            ``"auto"``: the planner's choice (``mlacp plan``, docs/DESIGN.md §15) for ``seq_len``,
            ``batch``, the groups' P and U, the partition, overlap and the parameters' dtype, on
            ``plan_hardware`` (``"calibrate"``: rank 0 measures its machine; a profile such as
            ``"h200-nvlink-ib"``; or a hardware file) with ``bandwidth_gbps`` as the link. Rank 0
            of the CP group prints the choice and why, and every rank runs it. With groups built with
            ``ulysses="auto"`` (which plan strategy and U together) and no ``seq_len`` here, the
            groups' planned strategy runs.
        partition: ``"head_tail"`` (balanced causal work) or ``"contiguous"``.
        overlap: hide communication behind computation (same results bit for bit).
        kernel: ``"blockwise"`` (flash-style) or ``"reference"`` (naive; for checking).

    Every rank must call it with the same model config and options (a plan fingerprint is
    compared across the CP group: a mismatch is an error on every rank, not a hang).
    """
    if strategy not in STRATEGIES and strategy != "auto":
        raise _error("options", "strategy must be latent_kv_head, expanded_ulysses or auto", {"strategy": strategy},
                     "latent_kv_head moves the 576-wide latent; expanded_ulysses moves per-head K/V; auto asks the "
                     "planner")
    _check_partition(partition)
    base = _find_base_model(model)
    layers = [(name, m) for name, m in model.named_modules() if type(m).__name__ in ATTENTION_CLASSES]
    if not layers:
        raise _error(_WHAT, "the model has no DeepSeek MLA attention layer", {"model": type(model).__name__},
                     f"mlacp replaces {' / '.join(ATTENTION_CLASSES)} modules")
    if getattr(base, "_mlacp", None) is not None:
        raise _error(_WHAT, "the model is already parallelized", {}, "call parallelize_model once per model")
    config = getattr(model, "config", None) or base.config
    config_json = _config_json(config)
    if strategy == "auto" and groups.planned is not None and seq_len is None:
        strategy = groups.planned["strategy"]  # planned with the groups (ulysses="auto")
    if strategy == "auto":
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}.get(
            next(model.parameters()).dtype, "float32")
        strategy = _auto_strategy(config_json, groups, seq_len, batch, dtype, partition, overlap, plan_hardware,
                                  bandwidth_gbps)
    handle = CpModel(model, groups, strategy, partition, overlap, kernel)
    device = str(next(model.parameters()).device)  # "cpu" or "cuda:N": the groups' backend for it moves the tensors
    for name, attention in layers:
        version = 2 if type(attention).__name__ == "DeepseekV2Attention" else 3
        params = {n: p for n, p in attention.named_parameters()}
        core = _C.Attention(config_json, params, rms_norm_eps=float(attention.kv_a_layernorm.variance_epsilon),
                            rms_norm_float32=True)
        interleaved = version == 2 or bool(getattr(config, "rope_interleave", False))
        read = json.loads(core.config_json)
        if bool(read.get("rope_interleave")) != interleaved:
            raise _error(_WHAT, "the rope layout mlacp read differs from the model's", {
                "mlacp_rope_interleave": read.get("rope_interleave"), "model_rope_interleave": interleaved},
                "report this config")
        if abs(core.scaling - float(attention.scaling)) > 1e-12 * abs(float(attention.scaling)):
            raise _error(_WHAT, "the softmax scale mlacp derives differs from the model's", {
                "mlacp": core.scaling, "model": float(attention.scaling)}, "check rope_parameters (YaRN mscale)")
        handle.plans[name] = core.parallelize(groups.cp_group, groups.ulysses, groups.ulysses_group,
                                              groups.all_gather_group, strategy, partition, overlap, kernel,
                                              device)
        attention._mlacp = core
        attention._mlacp_state = handle._state
        attention._mlacp_version = version
        attention.forward = types.MethodType(_attention_forward, attention)
    base._mlacp = handle
    base.register_forward_pre_hook(_make_pre_hook(handle, base), with_kwargs=True)
    return handle


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                       **kwargs):
    if past_key_values is not None:
        raise _error(_WHAT, "a KV cache is not supported (mlacp is for training)", {"past_key_values": "given"},
                     "call the model with use_cache=False")
    if kwargs.get("output_attentions"):
        raise _error(_WHAT, "attention weights cannot be returned (they are never materialised)",
                     {"output_attentions": True}, "set output_attentions=False")
    # The rotary table of this rank's tokens, computed by the model's own rotary module over the
    # global positions (pre_hook): the same values as on one process (its elementwise cos/sin are
    # not bitwise position-deterministic across tensor shapes), not the decoder's local table.
    position_embeddings = self._mlacp_state.position_embeddings
    if position_embeddings is None:
        raise _error(_WHAT, "the attention layer must be called through the parallelized model's decoder", {},
                     "call the model (its forward resolves positions once for every layer)")
    if self._mlacp_version == 2:
        # DeepSeek-V2's rotary module returns complex freqs_cis [B, S, Dr/2] (pairs of lanes).
        cos, sin = position_embeddings.real, position_embeddings.imag
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        cos, sin = position_embeddings
    out = self._mlacp.forward(hidden_states, document_ends=self._mlacp_state.document_ends,
                              position_embeddings=(cos.to(hidden_states.dtype), sin.to(hidden_states.dtype)),
                              training=self.training)
    return out, None


def _truthy_mask(mask) -> bool:
    """Whether a user attention_mask is "no mask" (all ones / all True)."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    return bool((mask != 0).all()) if mask.dtype != torch.bool else bool(mask.all())


def _on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor reaches a GPU from pinned memory without a host
    synchronisation."""
    if t.device == torch.device(device):
        return t
    if t.device.type == "cpu" and torch.device(device).type != "cpu":
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _make_pre_hook(handle: CpModel, base: torch.nn.Module):
    groups = handle.groups

    def resolve_rope(global_positions, like):
        with torch.no_grad():
            table = base.rotary_emb(like, global_positions)
        if isinstance(table, torch.Tensor):  # DeepSeek-V2: complex freqs_cis
            table = (table,)
        local = tuple(shard_sequence(t.contiguous(), groups, handle.partition) for t in table)
        handle._state.position_embeddings = local if len(local) == 2 else local[0]

    def pre_hook(module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        tokens = input_ids if input_ids is not None else embeds
        if tokens is None:
            raise _error(_WHAT, "input_ids or inputs_embeds must be given", {}, "pass this rank's shard")
        b, s_local = tokens.shape[0], tokens.shape[1]
        if kwargs.get("use_cache"):
            raise _error(_WHAT, "use_cache=True is not supported (no KV cache with context parallelism)",
                         {"use_cache": True}, "call the model with use_cache=False")
        if kwargs.get("past_key_values") is not None:
            raise _error(_WHAT, "a KV cache is not supported (mlacp is for training)",
                         {"past_key_values": type(kwargs["past_key_values"]).__name__}, "pass past_key_values=None")
        if kwargs.get("output_attentions"):
            raise _error(_WHAT, "attention weights cannot be returned (they are never materialised)",
                         {"output_attentions": True}, "set output_attentions=False")
        mask = kwargs.get("attention_mask")
        if not _truthy_mask(mask):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise _error(_WHAT, "only 'no attention mask' is supported (causal, documents from position_ids)",
                         {"attention_mask.shape": shape},
                         "pack documents with position_ids restarting at 0 instead of padding; or pass None")
        kwargs["attention_mask"] = None
        given = kwargs.pop("mlacp_positions", None)  # from shard_inputs: found on the host
        p = groups.size
        if handle.partition == "head_tail" and s_local % 2 != 0:
            raise _error(_WHAT, "the head_tail partition needs an even number of local tokens",
                         {"local_tokens": s_local, "cp": p},
                         "use a global length divisible by 2 * cp (CpModel.shard_inputs checks it)")
        position_ids = kwargs.get("position_ids")
        like = embeds if embeds is not None else torch.empty(0, dtype=base.embed_tokens.weight.dtype,
                                                             device=tokens.device)
        if position_ids is None:
            if given is not None:
                raise _error(_WHAT, "mlacp_positions needs the position_ids shard_inputs made with it",
                             {"position_ids": None}, "pass the whole dict CpModel.shard_inputs returned")
            global_positions = torch.arange(s_local * p, device=tokens.device).unsqueeze(0)
            kwargs["position_ids"] = shard_sequence(global_positions, groups, handle.partition)
            handle._state.document_ends = None
            resolve_rope(global_positions, like)
            return args, kwargs
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.dim() != 2 or position_ids.shape[-1] != s_local or position_ids.shape[0] not in (1, b) \
                or position_ids.is_floating_point():
            raise _error(_WHAT, "position_ids must be integer [B|1, S_local]",
                         {"position_ids.shape": tuple(position_ids.shape), "S_local": s_local},
                         "pass this rank's shard of the positions (CpModel.shard_inputs)")
        kwargs["position_ids"] = position_ids
        if given is not None:
            # shard_inputs found the documents on the host: no collective, no read of the device.
            if not isinstance(given, GlobalPositions) or given.positions.shape[-1] != s_local * p:
                raise _error(_WHAT, "mlacp_positions must be what CpModel.shard_inputs returned for this batch",
                             {"type": type(given).__name__, "S": s_local * p,
                              "positions.shape": tuple(getattr(getattr(given, "positions", None), "shape", ()))},
                             "pass the whole dict CpModel.shard_inputs returned")
            handle._state.document_ends = list(given.document_ends) or None
            resolve_rope(_on_device(given.positions, position_ids.device), like)
            return args, kwargs
        # One small collective per forward: the global positions, for the document boundaries
        # (on a GPU this reads device values on the host: pass shard_inputs' mlacp_positions).
        local = position_ids.contiguous()
        if p > 1:
            shards = [torch.empty_like(local) for _ in range(p)]
            dist.all_gather(shards, local, group=groups.cp_group)
        else:
            shards = [local]
        global_positions = unshard_sequence(shards, handle.partition)
        handle._state.document_ends = _document_ends(global_positions) or None
        resolve_rope(global_positions, like)
        return args, kwargs

    return pre_hook
