"""HuggingFace DeepSeek models with context parallelism in one call.

:func:`parallelize_model` makes every ``DeepseekV3Attention`` / ``DeepseekV2Attention`` of a
``transformers`` model run through mlacp's custom op (``mlacp._ops``) on the model's own
parameters, read anew at every forward (so FSDP2's gathered parameters, before or after this call,
are what it reads and what its gradients reach). Everything else (embeddings, MoE/MLP, norms, LM
head) runs on each rank's tokens as usual. Each rank feeds its shard of the batch
(:meth:`CpModel.shard_inputs`, any length, right-padded batches); evaluation and generation on the
whole sequence run under :meth:`CpModel.unsharded` (``generate()`` does so by itself).

Before the first collective of every forward the CP ranks agree on what they were given (one
small all-gather; ``mlacp._agreement``): lengths, how the shard was made, which batch it came
from, and whether the inputs were sharded at all. Whatever one rank cannot run, every rank raises
as the same :class:`mlacp.MlacpError`.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from . import STRATEGIES, ContextParallelGroups, MlaConfig, _C, _agreement, _error, _hf_forward, _ops, \
    _planned_choice, _check_partition, shard_sequence, unshard_sequence
from ._hf_forward import GlobalPositions, document_ends as _document_ends

__all__ = ["parallelize_model", "CpModel", "GlobalPositions", "ATTENTION_CLASSES", "attention_config"]

ATTENTION_CLASSES = ("DeepseekV3Attention", "DeepseekV2Attention")
_WHAT = "HuggingFace model"


@dataclass
class CpModel:
    """The handle :func:`parallelize_model` returns.

    Attributes:
        groups: the CP groups.
        strategy, partition, overlap, kernel, kv_recompute: the options every layer runs with.
        plans: layer name -> the plan text of its C++ runtime.
    """

    model: torch.nn.Module
    groups: ContextParallelGroups
    strategy: str
    partition: str
    overlap: bool
    kernel: str
    kv_recompute: bool = False
    plans: Dict[str, str] = field(default_factory=dict)
    _layers: List[_ops.Layer] = field(default_factory=list, repr=False)
    _unsharded: int = 0

    def shard_inputs(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None, ignore_index: int = -100, *,
                     attention_mask: Optional[torch.Tensor] = None, pad_token_id: Optional[int] = None) -> dict:
        """This rank's shard of a global batch, as keyword arguments of the model's forward.

        Args:
            input_ids: the global ``[B, S]`` token ids (the same on every CP rank), any S >= 1.
                The sequence is padded at its end to a length the partition splits (a multiple of
                2·cp for head_tail, cp for contiguous); the padding's positions continue each row
                (no new document: causal attention keeps it out of every real token's view) and
                its labels are ``ignore_index``, so the loss and every real token's output are
                those of the unpadded batch. :meth:`gather_sequence` returns outputs without it.
            labels: global ``[B, S]`` labels; they are shifted *before* sharding (token t predicts
                t+1 across shard boundaries) and passed as ``shift_labels``, with
                ``num_items_in_batch`` set to the global count, so each rank's ``loss`` is its
                share of the global mean loss and the gradients add up over CP
                (:func:`mlacp.reduce_gradients`). As in HuggingFace's own loss, a packed
                document's last token predicts the next document's first: set those labels to
                ``ignore_index`` yourself if that is not wanted.
            position_ids: global ``[B|1, S]`` positions; restarts at 0 mark packed documents
                (batch 1). Default ``0..S-1``.
            attention_mask: global ``[B, S]`` right-padding mask (1 for real tokens, then 0s), as a
                tokenizer pads a batch: the padded tokens' labels become ``ignore_index``; the real
                tokens see exactly what the unpatched model shows them. Left padding is rejected.
            pad_token_id: the id given to the padding tokens (default: the model's
                ``pad_token_id``, else 0).

        Returns ``dict(input_ids=..., position_ids=..., mlacp_positions=...[, labels=...,
        shift_labels=..., num_items_in_batch=...])``: ``mlacp_positions`` holds the global
        positions and the packed documents' ends, found here once; the model's forward takes them
        (its pre-hook removes the key) instead of gathering the positions from the ranks. Give the
        batch on the CPU (a data loader's tensors) and move the shards to the GPU afterwards: then
        nothing here or in the forward reads a GPU tensor on the host (docs/DESIGN.md §16).
        ``num_items_in_batch`` is an int for CPU labels and a 0-d tensor for device labels (read on
        the host, it would synchronise).
        """
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise _error(_WHAT, "input_ids must be [B, S] with S >= 1",
                         {"shape": tuple(getattr(input_ids, "shape", ()))}, "pass the global batch of token ids")
        b, s = input_ids.shape
        p = self.groups.size
        parts = 2 * p if self.partition == "head_tail" else p
        padded = -(-s // parts) * parts
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.shape[-1] != s or position_ids.shape[0] not in (1, b) or position_ids.is_floating_point():
            raise _error(_WHAT, "position_ids must be integer [B|1, S] like input_ids",
                         {"position_ids.shape": tuple(position_ids.shape), "input_ids.shape": (b, s)},
                         "pass the global positions (or none: 0..S-1)")
        position_ids = position_ids.expand(b, s)
        real = _right_padding(attention_mask, b, s, input_ids.device)
        if pad_token_id is None:
            pad_token_id = getattr(getattr(self.model, "config", None), "pad_token_id", None) or 0
        if padded > s:  # the padding continues every row's positions: the same documents, outside every real view
            extra = padded - s
            input_ids = torch.cat([input_ids, input_ids.new_full((b, extra), pad_token_id)], 1)
            steps = torch.arange(1, extra + 1, device=position_ids.device)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], 1)
            real = torch.cat([real, real.new_zeros((b, extra))], 1)
        ends = _document_ends(position_ids)
        token = GlobalPositions(position_ids, ends, seq_len=s, cp_size=p, cp_rank=self.groups.rank,
                                partition=self.partition, fingerprint=_agreement.checksum(input_ids, position_ids))
        out = {
            "input_ids": shard_sequence(input_ids, self.groups, self.partition),
            "position_ids": shard_sequence(position_ids.contiguous(), self.groups, self.partition),
            "mlacp_positions": token,
        }
        if labels is not None:
            if tuple(labels.shape) != (b, s):
                raise _error(_WHAT, "labels must be [B, S] like input_ids",
                             {"labels.shape": tuple(labels.shape), "input_ids.shape": (b, s)},
                             "pass the global labels (usually input_ids)")
            labels = torch.cat([labels, labels.new_full((b, padded - s), ignore_index)], 1)
            labels = labels.masked_fill(~real, ignore_index)
            shifted = torch.full_like(labels, ignore_index)
            shifted[:, :-1] = labels[:, 1:]
            local = shard_sequence(shifted, self.groups, self.partition)
            out["labels"] = local
            out["shift_labels"] = local
            count = (shifted != ignore_index).sum()
            out["num_items_in_batch"] = int(count) if count.device.type == "cpu" else count
        return out

    def gather_sequence(self, local: torch.Tensor, inputs=None, dim: int = 1) -> torch.Tensor:
        """The global tensor from every CP rank's ``local`` shard (e.g. ``out.logits``), in token
        order; with ``inputs`` (the dict :meth:`shard_inputs` returned, or its ``mlacp_positions``)
        without the padding shard_inputs added. A collective over the CP group."""
        local = local.detach().contiguous()
        shards = _C.all_gather(local, self.groups.cp_group) if self.groups.size > 1 else [local]
        whole = unshard_sequence(shards, self.partition, dim)
        token = inputs.get("mlacp_positions") if isinstance(inputs, dict) else inputs
        if isinstance(token, GlobalPositions) and token.seq_len >= 0:
            whole = whole.narrow(dim, 0, token.seq_len)
        return whole

    @contextlib.contextmanager
    def unsharded(self):
        """Forwards inside run the model as HuggingFace wrote it, on whatever each rank is given (the
        whole sequence: evaluation, generation, a KV cache, attention masks): no CP, no collective.
        Gradients of such a forward are one rank's own; do not :func:`mlacp.reduce_gradients` them."""
        self._unsharded += 1
        try:
            yield self
        finally:
            self._unsharded -= 1


def _right_padding(mask: Optional[torch.Tensor], b: int, s: int, device) -> torch.Tensor:
    """[B, S] bool, True on real tokens, from a right-padding attention mask (or all True)."""
    if mask is None:
        return torch.ones((b, s), dtype=torch.bool, device=device)
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (b, s):
        raise _error(_WHAT, "attention_mask must be [B, S] like input_ids",
                     {"attention_mask.shape": tuple(getattr(mask, "shape", ())), "input_ids.shape": (b, s)},
                     "pass the tokenizer's 2-D padding mask")
    real = mask != 0
    # Right padding: once a row's mask is 0 it stays 0.
    if bool((real[:, 1:] & ~real[:, :-1]).any()):
        rows = torch.nonzero((real[:, 1:] & ~real[:, :-1]).any(1)).flatten().tolist()
        raise _error(_WHAT, "attention_mask must be right padding (each row: 1s, then 0s)",
                     {"rows_with_a_real_token_after_padding": rows[:8]},
                     "pad on the right (tokenizer.padding_side = 'right'), or pack the documents with position_ids")
    return real


def _find_base_model(model: torch.nn.Module) -> torch.nn.Module:
    for module in model.modules():
        if hasattr(module, "rotary_emb") and hasattr(module, "layers") and hasattr(module, "embed_tokens"):
            return module
    raise _error(_WHAT, "the model must contain a decoder (a module with embed_tokens, layers and rotary_emb)",
                 {"model": type(model).__name__}, "pass a transformers DeepseekV3/V2 model")


def _is_attention(module: torch.nn.Module) -> bool:
    """A DeepSeek attention layer, also under FSDP2's class swap (FSDPDeepseekV3Attention)."""
    return any(c.__name__ in ATTENTION_CLASSES for c in type(module).__mro__)


_ATTENTION_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps", "rope_interleave",
                     "attention_bias", "attention_dropout", "max_position_embeddings")


def attention_config(config) -> MlaConfig:
    """The attention of a transformers DeepSeek config, as the C++ config reader reads it (the
    rest of the model's fields are not mlacp's). Every field that changes the attention's math is
    passed; the rope settings go as the config holds them (rope_parameters, or
    rope_theta/rope_scaling)."""
    d = config.to_dict()
    fields = _ATTENTION_FIELDS + ("rope_parameters", "rope_theta", "rope_scaling")
    return MlaConfig.from_hf({k: d[k] for k in fields if k in d and (d[k] is not None or k == "q_lora_rank")})


def parallelize_model(model: torch.nn.Module, groups: ContextParallelGroups, *, strategy: str = "latent_kv_head",
                      partition: str = "head_tail", overlap: bool = True, kernel: str = "blockwise",
                      seq_len: Optional[int] = None, batch: int = 1, plan_hardware: str = "calibrate",
                      bandwidth_gbps: Optional[float] = None, kv_recompute: bool = False) -> CpModel:
    """Makes every DeepSeek MLA attention layer of ``model`` run with context parallelism.

    Args:
        model: a ``transformers`` DeepseekV3/V2 model (``...ForCausalLM`` or the base model), or
            any model whose attention modules are ``DeepseekV3Attention``/``DeepseekV2Attention``.
            Its parameters must already be on their device and dtype; they may be FSDP2's
            DTensors (``fully_shard`` before or after this call).
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
        kv_recompute: with the latent strategy and the blockwise kernel on the CPU, expand each
            layer's K/V a few heads at a time in the forward and again in the backward instead of
            keeping them (less memory per rank, one more kv_b_proj pass, the same values;
            docs/DESIGN.md §5.5).

    Every rank must call it with the same model config and options (a plan fingerprint is
    compared across the CP group: a mismatch is an error on every rank, not a hang).
    """
    if strategy not in STRATEGIES and strategy != "auto":
        raise _error("options", "strategy must be latent_kv_head, expanded_ulysses or auto", {"strategy": strategy},
                     "latent_kv_head moves the 576-wide latent; expanded_ulysses moves per-head K/V; auto asks the "
                     "planner")
    _check_partition(partition)
    base = _find_base_model(model)
    layers = [(name, m) for name, m in model.named_modules() if _is_attention(m)]
    if not layers:
        raise _error(_WHAT, "the model has no DeepSeek MLA attention layer", {"model": type(model).__name__},
                     f"mlacp replaces {' / '.join(ATTENTION_CLASSES)} modules")
    if getattr(base, "_mlacp", None) is not None:
        raise _error(_WHAT, "the model is already parallelized", {}, "call parallelize_model once per model")
    hf_config = getattr(model, "config", None) or base.config
    config = attention_config(hf_config)
    first = next(model.parameters())
    if strategy == "auto" and groups.planned is not None and seq_len is None:
        strategy = groups.planned["strategy"]  # planned with the groups (ulysses="auto")
        kv_recompute = kv_recompute or groups.planned.get("kv_recompute", False)
    if strategy == "auto":
        if seq_len is None or int(seq_len) <= 0:
            raise _error("options", "strategy='auto' needs the global sequence length", {"seq_len": seq_len},
                         "pass seq_len=S (and batch=B) to parallelize_model, or name the strategy")
        dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float64: "float64"}.get(first.dtype,
                                                                                                    "float32")
        choice = _planned_choice(groups, config, seq_len=seq_len, batch=batch, dtype=dtype, ulysses=groups.ulysses,
                                 partitions=[partition], overlap=bool(overlap), hardware=plan_hardware,
                                 bandwidth_gbps=bandwidth_gbps, cpu_run=first.device.type == "cpu")
        strategy = choice["strategy"]
        kv_recompute = kv_recompute or choice["kv_recompute"]  # the planner's, when memory is short
    handle = CpModel(model, groups, strategy, partition, overlap, kernel, kv_recompute)
    for name, attention in layers:
        version = 2 if any(c.__name__ == "DeepseekV2Attention" for c in type(attention).__mro__) else 3
        params = dict(attention.named_parameters())
        layer = _ops.Layer(config, dtype=first.dtype, device=first.device,
                           rms_norm_eps=float(attention.kv_a_layernorm.variance_epsilon), rms_norm_float32=True)
        shapes = layer.core.parameter_shapes
        if set(params) != set(shapes) or any(tuple(params[n].shape) != tuple(shapes[n]) for n in shapes):
            raise _error(_WHAT, "the attention's parameters must be the ones its config describes",
                         {"layer": name, "parameters": {n: tuple(p.shape) for n, p in params.items()},
                          "expected": dict(shapes)},
                         "report this model: its config and its attention module disagree")
        interleaved = version == 2 or bool(getattr(hf_config, "rope_interleave", False))
        if config.rope_interleave != interleaved:
            raise _error(_WHAT, "the rope layout mlacp read differs from the model's", {
                "mlacp_rope_interleave": config.rope_interleave, "model_rope_interleave": interleaved},
                "report this config")
        if abs(config.scaling - float(attention.scaling)) > 1e-12 * abs(float(attention.scaling)):
            raise _error(_WHAT, "the softmax scale mlacp derives differs from the model's", {
                "mlacp": config.scaling, "model": float(attention.scaling)}, "check rope_parameters (YaRN mscale)")
        handle.plans[name] = layer.parallelize(groups, strategy=strategy, partition=partition, overlap=overlap,
                                               kernel=kernel, kv_recompute=kv_recompute)
        handle._layers.append(layer)
        _hf_forward.install_attention(attention, layer, handle)
    base._mlacp = handle
    base.register_forward_pre_hook(_hf_forward.make_pre_hook(handle, base), with_kwargs=True)
    if hasattr(model, "generate"):  # generation runs on the whole sequence on every rank
        model.generate = types.MethodType(_unsharded_generate(type(model).generate, handle), model)
    return handle


def _unsharded_generate(generate, handle: CpModel):
    def run(self, *args, **kwargs):
        with handle.unsharded():
            return generate(self, *args, **kwargs)

    run.__doc__ = ("HuggingFace's generate() under CpModel.unsharded(): every rank generates from the whole "
                   "prompt it is given, with HF's own attention and KV cache.")
    return run
