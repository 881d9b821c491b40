"""mlacp's MLA layer as torch.library custom ops: the one path every forward takes (eager,
checkpointed, compiled).

``mlacp::mla_layer`` runs one CP attention layer (projections, the exchange, attention, the output
projection) in the C++ library and returns its output and a *key*: a small tensor whose storage
owns the layer's autograd graph (python/csrc/layer.h). ``mlacp::mla_layer_backward`` takes the key
and the output's gradient and returns the gradients of the hidden states and of every weight. So:

- the parameters are inputs of each call: FSDP's gathered parameters, whatever objects they are at
  this forward, are what the layer reads and what its gradients flow to;
- a forward's state (rotary rows, documents, saved activations) belongs to that call: two forwards
  before one backward, or a checkpoint that recomputes one, never see each other's;
- activation checkpointing frees the layer's activations (it drops the key, which frees the graph)
  and recomputation makes a new one;
- ``torch.compile`` sees two opaque ops with fake kernels: no graph break inside attention.

Layers are registered by an integer id (the ops take plain values, not Python objects).
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _C

_LAYERS: Dict[int, "_C.Layer"] = {}
_IDS = itertools.count(1)
# The C++ layers hold c10d groups: they go at exit while the interpreter and torch.distributed are
# alive (registered after torch's own exit handlers, so it runs before them). A Gloo group left
# to the process's static destructors aborts it ("terminate called without an active exception").
atexit.register(_LAYERS.clear)


class Layer:
    """One C++ MLA layer (``_C.Layer``) reachable from the custom ops.

    Args:
        config: the layer's :class:`mlacp._C.MlaConfig`.
        dtype, device: of the parameters it will be given.
        rms_norm_eps, rms_norm_float32: the latent norms' epsilon and HuggingFace's float32 rule.
    """

    def __init__(self, config: "_C.MlaConfig", *, dtype: torch.dtype, device, rms_norm_eps: Optional[float] = None,
                 rms_norm_float32: bool = False):
        core = _C.Layer(config, dtype=dtype, device=torch.device(device), rms_norm_eps=rms_norm_eps,
                        rms_norm_float32=rms_norm_float32)
        self.id = next(_IDS)
        self.parameter_names: List[str] = list(core.parameter_names)
        # The registry holds the only reference: the C++ layer goes when this object does, or at exit.
        _LAYERS[self.id] = core
        weakref.finalize(self, _LAYERS.pop, self.id, None)

    @property
    def core(self) -> "_C.Layer":
        return _LAYERS[self.id]

    def parallelize(self, groups, *, strategy: str, partition: str, overlap: bool, kernel: str,
                    kv_recompute: bool = False) -> str:
        """Installs CP over ``groups`` (:class:`mlacp.ContextParallelGroups`); one fingerprint
        collective. Returns the plan's text. ``kv_recompute``: the latent strategy expands K/V a
        few heads at a time, again in the backward, instead of keeping them (docs/DESIGN.md §5.5)."""
        return self.core.parallelize(cp_group=groups.cp_group, ulysses=groups.ulysses,
                                     ulysses_group=groups.ulysses_group, all_gather_group=groups.all_gather_group,
                                     strategy=strategy, partition=partition, overlap=overlap, kernel=kernel,
                                     kv_recompute=kv_recompute)

    def __call__(self, hidden: torch.Tensor, weights: Sequence[torch.Tensor], *, cos: torch.Tensor, sin: torch.Tensor,
                 document_ends: Optional[torch.Tensor] = None, training: bool = True) -> torch.Tensor:
        """This rank's ``[B, S_local, d]`` output for its shard ``hidden`` (differentiable w.r.t.
        ``hidden`` and ``weights``, given in ``parameter_names`` order). ``cos``/``sin``: the
        rotary rows of the local tokens ``[B|1, S_local, Dr]``; ``document_ends``: the global
        exclusive ends of packed documents (an int64 CPU tensor) or None."""
        return call(self.id, hidden, weights, cos=cos, sin=sin, document_ends=document_ends, training=training)


def call(layer: int, hidden: torch.Tensor, weights: Sequence[torch.Tensor], *, cos: torch.Tensor, sin: torch.Tensor,
         document_ends: Optional[torch.Tensor], training: bool) -> torch.Tensor:
    grad = torch.is_grad_enabled()
    needs_grad = [grad and hidden.requires_grad] + [grad and w.requires_grad for w in weights]
    out, _ = torch.ops.mlacp.mla_layer(hidden, cos, sin, list(weights), document_ends, layer, training, needs_grad)
    return out


@torch.library.custom_op("mlacp::mla_layer", mutates_args=())
def _mla_layer(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, weights: List[torch.Tensor],
               document_ends: Optional[torch.Tensor], layer: int, training: bool,
               needs_grad: List[bool]) -> Tuple[torch.Tensor, torch.Tensor]:
    ends = None if document_ends is None else [int(e) for e in document_ends.tolist()]
    return _LAYERS[layer].forward(hidden, weights=weights, needs_grad=needs_grad, cos=cos, sin=sin,
                                  document_ends=ends, training=training)


@_mla_layer.register_fake
def _mla_layer_fake(hidden, cos, sin, weights, document_ends, layer, training, needs_grad):
    dtype = hidden.dtype
    if torch.is_autocast_enabled(hidden.device.type):  # the layer's projections run in autocast's dtype
        dtype = torch.get_autocast_dtype(hidden.device.type)
    return torch.empty_like(hidden, dtype=dtype), torch.empty(1, dtype=torch.long)


@torch.library.custom_op("mlacp::mla_layer_backward", mutates_args=())
def _mla_layer_backward(key: torch.Tensor, grad_output: torch.Tensor, hidden: torch.Tensor,
                        weights: List[torch.Tensor], needs_grad: List[bool]) -> List[torch.Tensor]:
    grads = _C.layer_backward(key, grad_output)
    # Entries nobody needs are empty tensors (an op returns tensors); _backward maps them to None.
    return [g if g is not None else t.new_empty(0) for g, t in zip(grads, [hidden] + list(weights))]


@_mla_layer_backward.register_fake
def _mla_layer_backward_fake(key, grad_output, hidden, weights, needs_grad):
    likes = [hidden] + list(weights)
    return [torch.empty_like(t) if n else t.new_empty(0) for t, n in zip(likes, needs_grad)]


def _setup_context(ctx, inputs, output):
    hidden, _cos, _sin, weights, _ends, _layer, _training, needs_grad = inputs
    # hidden and the weights only for their shapes (the graph in the key saved what it needs; these
    # are the same storages, no copy).
    ctx.save_for_backward(output[1], hidden, *weights)
    ctx.needs_grad = list(needs_grad)


def _backward(ctx, grad_output, _grad_key):
    key, hidden, *weights = ctx.saved_tensors
    grads = torch.ops.mlacp.mla_layer_backward(key, grad_output.contiguous(), hidden, weights, ctx.needs_grad)
    grads = [g if n else None for g, n in zip(grads, ctx.needs_grad)]
    return grads[0], None, None, grads[1:], None, None, None, None


_mla_layer.register_autograd(_backward, setup_context=_setup_context)


def live_graphs() -> int:
    """How many layer forwards hold their autograd graphs now (tests: a freed key frees its graph)."""
    return _C.live_layer_graphs()
