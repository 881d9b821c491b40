# torchrun --nproc_per_node 2 examples/hf_trainer.py [--cp 2] [--batch 2] [--steps 6] [--dtype float64]
# python examples/hf_trainer.py --reference [--batch 2] ...   (the same Trainer on one process, no mlacp)
"""HuggingFace ``Trainer`` with mlacp: a tiny random DeepSeek-V3 (nothing downloaded) trained with
AdamW and evaluated with context parallelism (CP), gloo on CPUs; the world is dp x cp ranks (default:
one CP group). With --dtype float64 every logged loss, gradient norm and eval loss, and the trained
weights, equal the --reference run's (tests/python/test_trainer_example.py checks it).

How it fits Trainer (transformers 5.23, accelerate 1.16) without changing Trainer's math:
- Data: the collator shards each global batch with ``cp.shard_inputs`` (any length; a right-padded
  batch through attention_mask). accelerate deals the batches out to *all* processes; the CP ranks
  of one data-parallel replica need the same ones, so its BatchSamplerShard gets the DP size and rank
  (as Trainer does itself for its BatchRebalanceSampler). accelerate's ParallelismConfig(cp_size) does
  not fit: it runs torch's own context_parallel and refuses a CPU (MULTI_CPU) world.
- Loss and gradients: the shards carry ``shift_labels``, so Trainer counts each rank's own labels, sums
  the counts over all processes (``_get_num_items_in_batch``, average_tokens_across_devices) and
  multiplies each rank's loss by the number of processes (``compute_loss``): every rank's loss is
  world * (its tokens' loss sum) / (all tokens of the step). The DDP accelerate puts around every
  process *averages* the gradients: that is the gradient of the global mean loss, CP ranks counting as
  DP ranks that hold other tokens. So no ``mlacp.reduce_gradients`` here: it would count CP twice.
  max_grad_norm clips after DDP's reduction, on the full gradient; gradient accumulation works too.
- Evaluation: the same sharded forward (not ``cp.unsharded()``: a long sequence need not fit on one
  rank), and Trainer normalises the eval loss the same way. The logits are shards, so metrics on them
  (compute_metrics) are refused rather than computed on the wrong tensors.
"""
import argparse
import functools
import tempfile

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard
from torch.distributed.device_mesh import init_device_mesh
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Trainer, TrainingArguments

import mlacp
import mlacp.hf

VOCAB = 96


def tiny_model(dtype):
    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
        first_k_dense_replace=2, max_position_embeddings=128, use_cache=False, tie_word_embeddings=False)
    model = DeepseekV3ForCausalLM(config).to(dtype)
    if dtype == torch.float64:  # HF's loss computes in float32 whatever the model's dtype
        model.loss_function = float64_causal_lm_loss
    return model


def float64_causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                           **_):
    """transformers' ForCausalLMLoss, without its cast of the logits to float32."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), reduction="sum",
                                             ignore_index=ignore_index)
    return loss / (num_items_in_batch if num_items_in_batch is not None else (shift_labels != ignore_index).sum())


def random_sequences(count, seed):
    """Sequences of odd lengths 13..39: no batch is a multiple of 2*cp tokens long (shard_inputs pads it)."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (2 * int(torch.randint(6, 20, (1,), generator=g)) + 1,), generator=g)}
            for _ in range(count)]


def collate(features, cp=None):
    """Right-pads the sequences, as a tokenizer would; with CP, returns this rank's shard of the batch."""
    ids = torch.nn.utils.rnn.pad_sequence([f["input_ids"] for f in features], batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(f["input_ids"]) for f in features], batch_first=True)
    labels = ids.masked_fill(mask == 0, -100)
    if cp is None:
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    shard = cp.shard_inputs(ids, labels=labels, attention_mask=mask)
    del shard["num_items_in_batch"]  # Trainer passes its own count (from shift_labels) to the model
    return shard


class CpTrainer(Trainer):
    def __init__(self, *args, dp_size, dp_rank, **kwargs):
        super().__init__(*args, **kwargs)
        self.dp_size, self.dp_rank = dp_size, dp_rank
        if not self.args.average_tokens_across_devices or self.args.label_smoothing_factor:
            raise ValueError("CP needs Trainer's loss divided by the token count of all processes, and labels shifted "
                             "once before sharding: keep average_tokens_across_devices=True and no label smoothing")

    def _same_batches_on_cp_ranks(self, loader):
        shard = loader.batch_sampler  # accelerate's: batch i goes to process i % num_processes
        if isinstance(shard, BatchSamplerShard):
            shard.num_processes, shard.process_index = self.dp_size, self.dp_rank
        elif self.args.world_size > 1:  # an IterableDataset, or dispatch_batches: no batch sampler deals them out
            raise ValueError("CpTrainer needs a map-style dataset (accelerate deals its batches out to the ranks)")
        return loader

    def get_train_dataloader(self):
        return self._same_batches_on_cp_ranks(super().get_train_dataloader())

    def get_eval_dataloader(self, eval_dataset=None):
        loader = self._same_batches_on_cp_ranks(super().get_eval_dataloader(eval_dataset))
        if len(loader.dataset) % (self.args.eval_batch_size * self.dp_size) and not self.args.dataloader_drop_last:
            # accelerate would fill the last batch with repeated samples, and gather_for_metrics cut the gathered
            # losses as if every process held other samples (CP ranks hold shares of the same ones)
            raise ValueError("with CP, the eval set's size must be a multiple of eval batch size x dp")
        return loader

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if not prediction_loss_only:
            raise ValueError("with CP the logits are each rank's shard of the sequence: evaluate the loss only, or "
                             "gather them with cp.gather_sequence(logits, inputs) in your own prediction_step")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)


def train(reference=False, cp_size=None, steps=6, batch=2, dtype=torch.float32, output_dir=None):
    """Trains and evaluates; reference: plain Trainer, no mlacp. cp_size: default the world size.
    Returns Trainer's log history, the final eval loss and the trained parameters."""
    if dtype == torch.float64:
        torch.set_default_dtype(dtype)  # Trainer also adds up the step losses in a default-dtype tensor
    model, cp, dp, dp_rank = tiny_model(dtype), None, 1, 0
    if not reference:
        if not dist.is_initialized():
            dist.init_process_group("gloo")
        cp_size = cp_size or dist.get_world_size()
        dp = dist.get_world_size() // cp_size
        mesh = init_device_mesh("cpu", (dp, cp_size), mesh_dim_names=("dp", "cp"))
        cp = mlacp.hf.parallelize_model(model, mlacp.ContextParallelGroups(mesh["cp"]))
        dp_rank = mesh["dp"].get_local_rank()
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(), use_cpu=True, max_steps=steps, learning_rate=1e-2,
        per_device_train_batch_size=batch // dp, per_device_eval_batch_size=batch // dp, eval_strategy="steps",
        eval_steps=max(steps // 2, 1), logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        ddp_find_unused_parameters=False)
    common = dict(model=model, args=args, train_dataset=random_sequences(4 * batch, seed=1),
                  eval_dataset=random_sequences(2 * batch, seed=2), data_collator=functools.partial(collate, cp=cp))
    trainer = Trainer(**common) if reference else CpTrainer(**common, dp_size=dp, dp_rank=dp_rank)
    trainer.train()
    final = trainer.evaluate()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return {"log": trainer.state.log_history, "eval_loss": final["eval_loss"], "params": params}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true", help="one process, plain Trainer, no mlacp")
    parser.add_argument("--cp", type=int, default=None, help="CP group size (default: every rank; dp = world / cp)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per step, over all data-parallel ranks")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    a = parser.parse_args()
    torch.set_num_threads(1)
    out = train(a.reference, a.cp, a.steps, a.batch, getattr(torch, a.dtype))
    if a.reference or dist.get_rank() == 0:
        print("step losses:", [e["loss"] for e in out["log"] if "loss" in e])
        print("eval losses:", [e["eval_loss"] for e in out["log"] if "eval_loss" in e])
    if dist.is_initialized():
        dist.destroy_process_group()
