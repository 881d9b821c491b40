"""Tiny random DeepSeek-V3 models (nothing downloaded) and the single-process reference."""
import copy

import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

VOCAB = 96


def tiny_config(q_latent=True, rope_interleave=True, yarn=True, layers=2, attn="sdpa", moe=False, v2=False):
    """moe=True: layer 1 is a MoE layer. HuggingFace's MoE router computes in float32 whatever the
    model's dtype, and its float32 GEMM rounds differently for different token counts, so a MoE
    model in float64 is only float32-deterministic across shardings (dense layers: exact)."""
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    if v2:  # DeepSeek-V2: rope always on interleaved pairs (complex freqs_cis), dense here
        config = DeepseekV2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=layers,
            q_lora_rank=32 if q_latent else None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
            v_head_dim=12, max_position_embeddings=128, rope_parameters=rope, tie_word_embeddings=False,
            use_cache=False, attention_dropout=0.0)
        config._attn_implementation = attn
        config._experts_implementation = "eager"
        return config
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1 if moe else layers, q_lora_rank=32 if q_latent else None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=128,
        rope_parameters=rope, rope_interleave=rope_interleave, tie_word_embeddings=False, use_cache=False,
        attention_dropout=0.0)
    config._attn_implementation = attn
    config._experts_implementation = "eager"  # grouped_mm has no float64
    return config


def tiny_model(config, dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cls = DeepseekV2ForCausalLM if isinstance(config, DeepseekV2Config) else DeepseekV3ForCausalLM
    model = cls(config).to(dtype)
    # Random (not the initial zero/identity) norms and router bias, so every parameter matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.train()
    return model


def batch(seq, seed=1, packed=False):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, seq), generator=g)
    position_ids = None
    if packed:
        # three documents, the second crossing shard boundaries
        ends = [seq // 5, seq // 5 + seq // 2, seq]
        pos, start = [], 0
        for end in ends:
            pos += list(range(end - start))
            start = end
        position_ids = torch.tensor(pos).unsqueeze(0)
    return input_ids, position_ids


def shift_labels(labels, ignore_index=-100):
    shifted = torch.full_like(labels, ignore_index)
    shifted[:, :-1] = labels[:, 1:]
    return shifted


def causal_lm_loss(logits, shifted, count):
    """Sum of the token losses / count, in float64 for a float64 model (HuggingFace's own loss
    computes in float32 whatever the model's dtype), else in float32 as HuggingFace does."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                                             ignore_index=-100, reduction="sum") / count


def reference_step(model, input_ids, position_ids, autocast=False):
    """Unpatched single-process forward+backward: logits, loss, every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    shifted = shift_labels(input_ids)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=input_ids, position_ids=position_ids)
        loss = causal_lm_loss(out.logits, shifted, int((shifted != -100).sum()))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().double(), loss.detach().double(), grads


def clone(model):
    return copy.deepcopy(model)
