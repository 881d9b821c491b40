"""The forward of a parallelized HuggingFace model.

Once per model forward, the decoder's pre-hook (``make_pre_hook``) reads what this rank was given,
has the CP ranks agree on it (``_agreement``), then resolves the global positions, the packed
documents and this rank's rows of the global rotary table into one :class:`Forward` record. The
record goes to every decoder layer as the keyword argument ``mlacp_forward`` (HuggingFace passes a
model's extra keyword arguments down to its attention modules), so it belongs to this forward
alone: a checkpointed layer recomputes with the record of its own forward, bit for bit, however many
forwards ran in between. Each attention layer (``install_attention``) then runs mlacp's custom op on
its current parameters, or HuggingFace's own forward under :meth:`mlacp.hf.CpModel.unsharded`.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from . import MlacpError, _C, _agreement, _error, _ops, shard_sequence, unshard_sequence

_WHAT = "HuggingFace model"


@dataclass(frozen=True)
class GlobalPositions:
    """What :meth:`CpModel.shard_inputs` found in the global batch, handed to the model's forward as
    ``mlacp_positions`` (no collective, no read of a device there), and how it sharded it."""

    positions: torch.Tensor  # global [B|1, S_padded], as the forward's rotary table needs them
    document_ends: List[int]  # exclusive ends of packed documents; [] for one document per row
    seq_len: int = -1  # the global length before padding (S); the padding is labelled ignore_index
    cp_size: int = 0
    cp_rank: int = -1
    partition: str = ""
    fingerprint: int = 0  # of the global batch (ids and positions): equal on every CP rank

    def to(self, *args, **kwargs) -> "GlobalPositions":
        """Itself: the forward moves the positions where it needs them (without a host
        synchronisation), so the usual ``{k: v.to(device) for k, v in batch.items()}`` just works."""
        return self


class Forward(NamedTuple):
    """One model forward's inputs of every attention layer (the ``mlacp_forward`` keyword)."""

    cos: torch.Tensor  # [B|1, S_local, Dr]: this rank's rows of the global rotary table
    sin: torch.Tensor
    document_ends: Optional[torch.Tensor]  # int64 host tensor of global document ends, or None


def document_ends(global_positions: torch.Tensor) -> List[int]:
    """The packed documents' exclusive ends in global positions ``[B, S]`` (HuggingFace's rule: a
    document starts where the position does not continue the previous one), or ``[]`` for one
    document per row. Reads the positions on the host."""
    starts = torch.ones_like(global_positions, dtype=torch.bool)
    starts[:, 1:] = global_positions[:, 1:] != global_positions[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return []
    if global_positions.shape[0] != 1:
        raise _error(_WHAT, "packed documents (position_ids restarting) need batch 1",
                     {"batch": global_positions.shape[0]}, "concatenate the batch into one row")
    idx = torch.nonzero(starts[0]).flatten().tolist()
    return idx[1:] + [global_positions.shape[1]]


# --------------------------------------------------------------------------------------------------
# attention layers

def install_attention(attention: torch.nn.Module, layer: "_ops.Layer", handle) -> None:
    """``attention.forward`` becomes mlacp's: the op on the module's current parameters."""
    attention._mlacp_layer = layer.id
    attention._mlacp_handle = handle
    attention._mlacp_hf_forward = attention.forward  # HuggingFace's, for CpModel.unsharded()
    # (owner module, attribute) per parameter in the op's order, read at every forward: FSDP2 puts
    # its gathered parameters there for the forward and its shards back afterwards.
    attention._mlacp_weights = [(attention.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
                                for name in layer.parameter_names]
    attention.forward = types.MethodType(_attention_forward, attention)


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                       mlacp_forward: Optional[Forward] = None, **kwargs):
    if mlacp_forward is None:
        if self._mlacp_handle._unsharded:
            return self._mlacp_hf_forward(hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)
        raise _error(_WHAT, "the attention layer must be called through the parallelized model's decoder", {},
                     "call the model (its forward resolves positions once for every layer), or run it under "
                     "CpModel.unsharded()")
    weights = [getattr(owner, attr) for owner, attr in self._mlacp_weights]
    for w in weights:
        if type(w).__name__ == "DTensor":
            raise _error(_WHAT, "the attention's parameters are DTensors at its forward (FSDP did not gather them)",
                         {"parameter_type": "DTensor"},
                         "call the model through the module fully_shard was applied to (its hooks gather them)")
    out = _ops.call(self._mlacp_layer, hidden_states, weights, cos=mlacp_forward.cos, sin=mlacp_forward.sin,
                    document_ends=mlacp_forward.document_ends, training=self.training)
    return out, None


# --------------------------------------------------------------------------------------------------
# the decoder's pre-hook

@dataclass
class _Given:
    """What this rank was given for one forward, read without communicating."""

    batch: int = 0
    local_len: int = 0
    mode: int = _agreement.NO_SHARD_INFO
    token: Optional[GlobalPositions] = None
    position_ids: Optional[torch.Tensor] = None  # [B|1, S_local] integer
    like: Optional[torch.Tensor] = None  # a tensor of the hidden states' dtype and device
    checksum: int = 0  # of the local inputs, without shard_inputs: the same everywhere = not sharded
    problem: Optional[str] = None

    def record(self) -> List[int]:
        t = self.token
        return [self.batch, self.local_len, self.mode, t.positions.shape[-1] if t else 0, t.fingerprint if t else 0,
                self.checksum]


def make_pre_hook(handle, base: torch.nn.Module):
    groups = handle.groups

    @torch.compiler.disable
    def pre_hook(module, args, kwargs):
        if handle._unsharded:  # HuggingFace's forward on whatever this rank holds
            return args, kwargs
        given = _read_given(handle, base, args, kwargs)
        rows = _agreement.agree(groups, given.record(), given.problem, _WHAT)
        _check_records(rows, groups.size)
        return args, _resolved(handle, base, given, kwargs)

    return pre_hook


def _read_given(handle, base, args, kwargs) -> _Given:
    given = _Given()
    try:
        _read_into(given, handle, base, args, kwargs)
    except MlacpError as e:
        given.problem = str(e)
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks, not leave them waiting
        given.problem = f"mlacp: {_WHAT}: reading this forward's inputs failed ({type(e).__name__}: {e}); report this"
    return given


def _read_into(given: _Given, handle, base, args, kwargs) -> None:
    p = handle.groups.size
    input_ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    tokens = input_ids if input_ids is not None else embeds
    if tokens is None:
        raise _error(_WHAT, "input_ids or inputs_embeds must be given", {}, "pass this rank's shard")
    given.batch, given.local_len = int(tokens.shape[0]), int(tokens.shape[1])
    given.like = embeds if embeds is not None else torch.empty(0, dtype=base.embed_tokens.weight.dtype,
                                                               device=tokens.device)
    if kwargs.get("use_cache"):
        raise _error(_WHAT, "use_cache=True is not supported (no KV cache with context parallelism)",
                     {"use_cache": True}, "call the model with use_cache=False, or generate under CpModel.unsharded()")
    if kwargs.get("past_key_values") is not None:
        raise _error(_WHAT, "a KV cache is not supported with context parallelism",
                     {"past_key_values": type(kwargs["past_key_values"]).__name__},
                     "pass past_key_values=None, or generate under CpModel.unsharded()")
    if kwargs.get("output_attentions"):
        raise _error(_WHAT, "attention weights cannot be returned (they are never materialised)",
                     {"output_attentions": True}, "set output_attentions=False")
    mask = kwargs.get("attention_mask")
    if not _truthy_mask(mask):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise _error(_WHAT, "a forward takes no attention mask (padding is shard_inputs' attention_mask=)",
                     {"attention_mask.shape": shape},
                     "pass the global padding mask to CpModel.shard_inputs(attention_mask=...) and its dict to the "
                     "model, or pack documents with position_ids restarting at 0")
    if handle.partition == "head_tail" and given.local_len % 2 != 0:
        raise _error(_WHAT, "the head_tail partition needs an even number of local tokens",
                     {"local_tokens": given.local_len, "cp": p},
                     "shard the global batch with CpModel.shard_inputs (it pads any length)")
    position_ids = kwargs.get("position_ids")
    token = kwargs.get("mlacp_positions")
    if position_ids is not None:
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.dim() != 2 or position_ids.shape[-1] != given.local_len or \
                position_ids.shape[0] not in (1, given.batch) or position_ids.is_floating_point():
            raise _error(_WHAT, "position_ids must be integer [B|1, S_local]",
                         {"position_ids.shape": tuple(position_ids.shape), "S_local": given.local_len},
                         "pass this rank's shard of the positions (CpModel.shard_inputs)")
        given.position_ids = position_ids
    if token is not None:
        _check_token(token, position_ids, given, handle)
        given.mode, given.token = _agreement.SHARD_INPUTS, token
    elif position_ids is not None:
        given.mode = _agreement.POSITION_IDS
        given.checksum = _agreement.checksum(tokens, position_ids)
    elif p > 1:
        raise _error(_WHAT, "a forward of a CP model needs inputs sharded by CpModel.shard_inputs",
                     {"local_tokens": given.local_len, "mlacp_positions": None, "position_ids": None},
                     "pass the whole dict cp.shard_inputs(...) returned; to run the whole sequence on every rank "
                     "(evaluation, generation) use `with cp.unsharded():`")


def _check_token(token, position_ids, given: _Given, handle) -> None:
    groups, p = handle.groups, handle.groups.size
    if not isinstance(token, GlobalPositions) or token.positions.shape[-1] != given.local_len * p:
        raise _error(_WHAT, "mlacp_positions must be what CpModel.shard_inputs returned for this batch",
                     {"type": type(token).__name__, "S": given.local_len * p,
                      "positions.shape": tuple(getattr(getattr(token, "positions", None), "shape", ()))},
                     "pass the whole dict CpModel.shard_inputs returned")
    if (token.cp_size, token.cp_rank, token.partition) != (p, groups.rank, handle.partition):
        raise _error(_WHAT, "mlacp_positions was made for another CP rank or partition",
                     {"made_for": f"rank {token.cp_rank} of {token.cp_size}, {token.partition}",
                      "this": f"rank {groups.rank} of {p}, {handle.partition}"},
                     "call this rank's CpModel.shard_inputs and pass its dict")
    if position_ids is None:
        raise _error(_WHAT, "mlacp_positions needs the position_ids shard_inputs made with it",
                     {"position_ids": None}, "pass the whole dict CpModel.shard_inputs returned")
    if position_ids.device.type == "cpu" and token.positions.device.type == "cpu":
        expected = shard_sequence(token.positions.expand(position_ids.shape[0], -1).contiguous(), groups,
                                  handle.partition)
        if not torch.equal(position_ids.to(expected.dtype), expected):
            raise _error(_WHAT, "position_ids are not this rank's shard of mlacp_positions",
                         {"cp_rank": groups.rank}, "pass the whole dict CpModel.shard_inputs returned, unchanged")


def _truthy_mask(mask) -> bool:
    """Whether a user attention_mask is "no mask" (all ones / all True)."""
    if mask is None:
        return True
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return False
    return bool((mask != 0).all()) if mask.dtype != torch.bool else bool(mask.all())


def _check_records(rows: List[List[int]], p: int) -> None:
    """The same error on every rank when the ranks' records contradict each other."""
    batches, lengths, modes = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    if set(modes) == {_agreement.SHARD_INPUTS}:  # first: which batch each rank sharded (then lengths follow)
        global_lengths, prints = [r[3] for r in rows], [r[4] for r in rows]
        if len(set(global_lengths)) > 1 or (all(prints) and len(set(prints)) > 1):
            raise _error(_WHAT, "the CP ranks' shards come from different global batches",
                         {"global_tokens_per_rank": global_lengths, "batch_checksums_differ": len(set(prints)) > 1},
                         "give every CP rank the same global batch (a data loader sampling over the data-parallel "
                         "ranks only, not over CP) and call shard_inputs on it")
    if len(set(batches)) > 1 or len(set(lengths)) > 1:
        raise _error(_WHAT, "every CP rank must hold the same batch and number of tokens (S / cp each)",
                     {"batch_per_rank": batches, "local_tokens_per_rank": lengths},
                     "shard the global batch with CpModel.shard_inputs on every rank (it pads any length)")
    if len(set(modes)) > 1:
        raise _error(_WHAT, "every CP rank must be given its shard the same way",
                     {"per_rank": [_agreement.mode_name(m) for m in modes]},
                     "pass the whole dict CpModel.shard_inputs returned on every rank")
    if p > 1 and modes[0] == _agreement.POSITION_IDS:
        sums = [r[5] for r in rows]
        if all(sums) and len(set(sums)) == 1:
            raise _error(_WHAT, "every CP rank holds the same inputs: they were not sharded",
                         {"local_tokens": lengths[0], "cp": p},
                         "pass the whole dict cp.shard_inputs(...) returned; to run the whole sequence on every "
                         "rank (evaluation, generation) use `with cp.unsharded():`")


def _resolved(handle, base, given: _Given, kwargs) -> dict:
    """The decoder's keyword arguments for this forward, with its Forward record."""
    groups, p = handle.groups, handle.groups.size
    kwargs.pop("mlacp_positions", None)
    kwargs["attention_mask"] = None
    kwargs["use_cache"] = False  # training: HF's default (the config's use_cache) would build a cache
    if given.mode == _agreement.SHARD_INPUTS:
        token = given.token
        global_positions = _on_device(token.positions, given.position_ids.device)
        ends = list(token.document_ends)
    elif given.mode == _agreement.POSITION_IDS:
        # One small collective: the global positions, for the document boundaries (on a GPU this
        # reads device values on the host: pass shard_inputs' mlacp_positions).
        local = given.position_ids.to(torch.int64).expand(given.batch, -1).contiguous()
        shards = _C.all_gather(local, groups.cp_group) if p > 1 else [local]
        global_positions = unshard_sequence(shards, handle.partition)
        ends = document_ends(global_positions)
        _check_gathered_documents(global_positions, ends)
    else:  # one rank, no positions: 0..S-1
        global_positions = torch.arange(given.local_len, device=given.like.device).unsqueeze(0)
        ends = []
    if given.position_ids is None:
        kwargs["position_ids"] = shard_sequence(global_positions, groups, handle.partition)
    else:
        kwargs["position_ids"] = given.position_ids
    cos, sin = _rotary_rows(handle, base, global_positions, given.like)
    ends_t = torch.tensor(ends, dtype=torch.int64) if ends else None
    kwargs["mlacp_forward"] = Forward(cos, sin, ends_t)
    return kwargs


def _check_gathered_documents(global_positions: torch.Tensor, ends: List[int]) -> None:
    """Positions gathered from hand-made shards must be one sequence's: every document after the
    first starts at position 0 (the whole sequence given to every rank, sharded nowhere, is not)."""
    if not ends:
        return
    starts = ends[:-1]
    bad = [s for s in starts if int(global_positions[0, s]) != 0]
    if bad:
        raise _error(_WHAT, "the ranks' position_ids are not the partition's shards of one sequence",
                     {"documents_not_starting_at_position_0": bad[:8]},
                     "pass the whole dict cp.shard_inputs(...) returned (or shard position_ids with "
                     "mlacp.shard_sequence in the model's partition)")


def _rotary_rows(handle, base, global_positions: torch.Tensor, like: torch.Tensor):
    """This rank's rows of the model's rotary table over the global positions: the same values as
    on one process (the rotary module's elementwise cos/sin are not bitwise position-deterministic
    across tensor shapes, so the local table would differ)."""
    with torch.no_grad():
        table = base.rotary_emb(like, global_positions)
    if isinstance(table, torch.Tensor):  # DeepSeek-V2: complex freqs_cis [B, S, Dr/2] (pairs of lanes)
        table = (torch.cat((table.real, table.real), -1), torch.cat((table.imag, table.imag), -1))
    cos, sin = (shard_sequence(t.contiguous(), handle.groups, handle.partition).to(like.dtype) for t in table)
    return cos, sin


def _on_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a CPU tensor reaches a GPU from pinned memory without a host
    synchronisation."""
    if t.device == torch.device(device):
        return t
    if t.device.type == "cpu" and torch.device(device).type != "cpu":
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)
