# torchrun --nproc_per_node 4 examples/hf_context_parallel.py
# A tiny random DeepSeek-V3 (nothing downloaded) trained with context parallelism over 4 ranks,
# next to the same model trained on one process: the losses agree.
import copy, torch, torch.distributed as dist
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
import mlacp, mlacp.hf

dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, use_cache=False)
model = DeepseekV3ForCausalLM(config).double(); single = copy.deepcopy(model)   # same weights
groups = mlacp.ContextParallelGroups(dist.group.WORLD)                          # CP over all 4 ranks
cp = mlacp.hf.parallelize_model(model, groups, strategy="latent_kv_head")
opt, opt1 = torch.optim.AdamW(model.parameters(), 1e-3), torch.optim.AdamW(single.parameters(), 1e-3)
worst = 0.0
for step in range(5):
    ids = torch.randint(0, 128, (1, 256), generator=torch.Generator().manual_seed(step))
    out = model(**cp.shard_inputs(ids, labels=ids))             # this rank's 64 tokens
    out.loss.backward(); mlacp.reduce_gradients(model.parameters(), groups); opt.step(); opt.zero_grad()
    ref = single(input_ids=ids, labels=ids).loss                # the whole sequence, one process
    ref.backward(); opt1.step(); opt1.zero_grad()
    loss = mlacp.all_reduce_loss(out.loss, groups)
    worst = max(worst, abs(loss.item() - ref.item()) / abs(ref.item()))
    if dist.get_rank() == 0: print(f"step {step}: cp loss {loss:.7f}  single-process {ref:.7f}")
# HuggingFace computes the loss in float32 whatever the dtype: agreement to float32 rounding.
if dist.get_rank() == 0: print(f"losses agree: {worst <= 1e-6} (max relative difference {worst:.1e})")
dist.destroy_process_group()
