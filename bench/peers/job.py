"""The one MLA job every system runs: the layer, its weights, the inputs and the shardings.

DeepSeek-V3 attention dims (q rank 1536, kv rank 512, nope 128, rope 64, value 128) with 16 heads
and hidden 1024, causal, batch 1. Every system starts from the same HuggingFace
``DeepseekV3Attention`` (same seed, same weights); the peers keep the layer's own projections and
replace only its attention core (HuggingFace's attention-function registry, the way they are
dropped into HF models), mlacp replaces the whole layer on the same parameter tensors.
"""
from __future__ import annotations

import copy

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

HIDDEN = 1024
HEADS = 16
DIMS = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
DQK = DIMS["qk_nope_head_dim"] + DIMS["qk_rope_head_dim"]
DV = DIMS["v_head_dim"]
DTYPES = ("float32", "bf16")


def make_config(max_seq: int, attn: str = "eager") -> DeepseekV3Config:
    config = DeepseekV3Config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                              max_position_embeddings=max(max_seq, 4096), attention_dropout=0.0,
                              use_cache=False, **DIMS)
    config._attn_implementation = attn
    return config


def make_layer(max_seq: int, seed: int = 0) -> tuple[DeepseekV3Attention, DeepseekV3RotaryEmbedding]:
    """The reference layer (eager attention) with random weights; the norms are random too, so
    every parameter changes the result."""
    config = make_config(max_seq)
    torch.manual_seed(seed)
    layer = DeepseekV3Attention(config, layer_idx=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layernorm.weight"):
                p.uniform_(0.5, 1.5)
    layer.train()
    return layer, DeepseekV3RotaryEmbedding(config)


def copy_layer(layer: DeepseekV3Attention, attn: str) -> DeepseekV3Attention:
    """An independent copy (own parameters and gradients) whose attention core is `attn`."""
    c = copy.deepcopy(layer)
    c.config._attn_implementation = attn
    return c


def inputs(seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global hidden states [1, S, hidden] and the upstream gradient dO [1, S, hidden]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, seq, HIDDEN, generator=g)
    d_out = torch.randn(1, seq, HIDDEN, generator=g) / seq ** 0.5
    return x, d_out


def rope_table(rotary: DeepseekV3RotaryEmbedding, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin over the global positions 0..S-1 (sharded afterwards: every system sees the same
    values for the same position)."""
    with torch.no_grad():
        return rotary(torch.empty(0), torch.arange(seq).unsqueeze(0))


def causal_mask(seq: int) -> torch.Tensor:
    """The additive causal mask of HuggingFace's eager path."""
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


def shard(t: torch.Tensor, partition: str, p: int, rank: int) -> torch.Tensor:
    """This rank's rows along dim 1 (contiguous: block r; head_tail: chunks r, 2P-1-r): mlacp's own
    sharding, which every system's partition names."""
    from mlacp import _C

    return _C.shard_sequence(t, partition=partition, cp=p, rank=rank, dim=1).contiguous()


def unshard(shards: list[torch.Tensor], partition: str) -> torch.Tensor:
    from mlacp import _C

    return _C.unshard_sequence(shards, partition=partition, dim=1)


def autocast(dtype: str):
    """bf16: CPU autocast (parameters and inputs stay float32); float32: no autocast."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=(dtype == "bf16"))


def eager_attention_bytes(seq: int, dtype: str) -> int:
    """Peak bytes of HuggingFace's eager attention forward+backward at S (scores, mask add,
    softmax in float32, probabilities, their gradient): ~4 live S x S x H float32-sized tensors."""
    del dtype  # the softmax runs in float32 under autocast too
    return 4 * seq * seq * HEADS * 4 + seq * seq * 4
