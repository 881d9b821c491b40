# torchrun --nproc_per_node 4 examples/fsdp2_context_parallel.py
# torchtitan's layout on 4 ranks: a (dp=2, cp=2) DeviceMesh, FSDP2 sharding every decoder layer over
# the flattened dp x cp mesh, activation checkpointing, batches of any length; mlacp runs the
# attention of each CP pair. Next to it, the same model trained on one process on both DP batches:
# the losses agree.
import copy, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
import mlacp, mlacp.hf

dist.init_process_group("gloo"); torch.manual_seed(0); torch.set_num_threads(1)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
config = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=2, use_cache=False)
model = DeepseekV3ForCausalLM(config).double(); single = copy.deepcopy(model)   # same weights
groups = mlacp.ContextParallelGroups(mesh["cp"])                                # CP within each DP pair
cp = mlacp.hf.parallelize_model(model, groups)                                  # before or after fully_shard
model.gradient_checkpointing_enable()
for layer in model.model.layers:                                                # FSDP2 over dp x cp
    fully_shard(layer, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))
opt, opt1 = torch.optim.AdamW(model.parameters(), 1e-3), torch.optim.AdamW(single.parameters(), 1e-3)
dp = mesh["dp"].get_local_rank()
worst = 0.0
for step in range(5):
    batches = [torch.randint(0, 128, (1, 250 + d), generator=torch.Generator().manual_seed(10 * step + d))
               for d in range(2)]                                               # one per DP rank, any length
    out = model(**cp.shard_inputs(batches[dp], labels=batches[dp]))             # this rank's share of its batch
    out.loss.backward(); mlacp.reduce_gradients(model.parameters(), groups)     # sum over CP; FSDP averaged DP
    opt.step(); opt.zero_grad()
    ref = sum(single(input_ids=ids, labels=ids).loss for ids in batches) / 2    # one process, both batches
    ref.backward(); opt1.step(); opt1.zero_grad()
    loss = mlacp.all_reduce_loss(out.loss, groups)                              # this DP rank's batch loss
    mean = loss.clone(); dist.all_reduce(mean, group=mesh["dp"].get_group()); mean /= 2
    worst = max(worst, abs(mean.item() - ref.item()) / abs(ref.item()))
    if dist.get_rank() == 0: print(f"step {step}: fsdp2 x cp loss {mean.item():.10f}  single-process {ref.item():.10f}")
# HuggingFace computes the loss in float32 whatever the dtype: agreement to float32 rounding.
if dist.get_rank() == 0: print(f"losses agree: {worst <= 1e-6} (max relative difference {worst:.1e})")
dist.destroy_process_group()
