"""Evaluation and generation of a parallelized model: under CpModel.unsharded() a forward on the
whole sequence (attention masks, a KV cache) is the unpatched model's, to the bit; generate() runs
unsharded by itself and produces the unpatched model's tokens; training forwards are CP again
afterwards."""
import pytest
import torch
import torch.distributed as dist

import distributed
import models


def _worker(rank, world, v2):
    import mlacp
    import mlacp.hf

    reference = models.tiny_model(models.tiny_config(v2=v2), torch.float64)
    model = models.clone(reference)
    cp = mlacp.hf.parallelize_model(model, mlacp.ContextParallelGroups(dist.group.WORLD))
    ids = models.batch(24, seed=rank)[0]  # each rank evaluates its own sample (a data-parallel eval)
    mask = torch.ones_like(ids)
    mask[:, -5:] = 0
    out = {}
    with torch.no_grad():
        reference.eval()
        model.eval()
        with cp.unsharded():
            got = model(input_ids=ids, attention_mask=mask).logits
        want = reference(input_ids=ids, attention_mask=mask).logits
        out["eval_equal"] = torch.equal(got, want)
        prompt = ids[:, :7]
        got = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        want = reference.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
        out["generate_equal"] = torch.equal(got, want)
        out["generated"] = got.shape[1] - prompt.shape[1]
    model.train()
    reference.train()
    try:  # a whole-sequence forward outside unsharded() is refused, not computed wrong
        model(input_ids=ids)
        out["refused"] = None
    except mlacp.MlacpError as e:
        out["refused"] = str(e)
    shared = models.batch(32, seed=9)[0]  # and CP training forwards still work after all this
    batch = cp.shard_inputs(shared, labels=shared)
    share = models.causal_lm_loss(model(**batch).logits, batch["shift_labels"], batch["num_items_in_batch"])
    shifted = models.shift_labels(shared)
    ref_loss = models.causal_lm_loss(reference(input_ids=shared).logits, shifted, int((shifted != -100).sum()))
    out["cp_loss_error"] = abs(mlacp.all_reduce_loss(share, cp.groups).item() - ref_loss.item())
    return out


@pytest.mark.parametrize("v2", [False, True], ids=["deepseek-v3", "deepseek-v2"])
def test_unsharded_evaluation_and_generation_equal_the_unpatched_model(v2):
    for r in distributed.results(distributed.run(_worker, 2, v2)):
        assert r["eval_equal"] and r["generate_equal"] and r["generated"] == 6, r
        assert r["refused"] is not None and "cp.unsharded()" in r["refused"], r
        # DeepSeek-V2's HF rope rotates in float32 complex arithmetic whatever the dtype (test_hf_parity)
        assert r["cp_loss_error"] <= (1e-6 if v2 else 1e-12), r
