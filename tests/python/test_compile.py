"""torch.compile of a parallelized model: each attention layer is one mlacp::mla_layer op inside a
captured graph (torch._dynamo.explain: no graph break inside mlacp's attention), and the compiled
model (AOTAutograd, which traces the op's fake kernels and its backward op) gives the eager
model's logits and gradients to the bit."""
import torch
import torch.distributed as dist

import distributed
import models


def _worker(rank, world):
    import torch._dynamo as dynamo

    import mlacp
    import mlacp.hf

    model = models.tiny_model(models.tiny_config(), torch.float64)
    cp = mlacp.hf.parallelize_model(model, mlacp.ContextParallelGroups(dist.group.WORLD))
    ids, pos = models.batch(32, packed=True)
    batch = cp.shard_inputs(ids, labels=ids, position_ids=pos)
    explained = dynamo.explain(model)(**batch)
    ops_in_graphs = sum(str(g.code).count("mlacp.mla_layer") for g in explained.graphs)
    breaks_in_mlacp = [str(b.reason) for b in explained.break_reasons
                       if any("mlacp" in str(frame.filename) for frame in b.user_stack)]
    dynamo.reset()

    def step(m):
        model.zero_grad(set_to_none=True)
        out = m(**batch)
        models.causal_lm_loss(out.logits, batch["shift_labels"], batch["num_items_in_batch"]).backward()
        return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    compiled_logits, compiled_grads = step(torch.compile(model, backend="aot_eager"))
    eager_logits, eager_grads = step(model)
    return {"ops_in_graphs": ops_in_graphs, "breaks_in_mlacp": breaks_in_mlacp,
            "logits_equal": torch.equal(compiled_logits, eager_logits),
            "grads_equal": all(torch.equal(compiled_grads[n], eager_grads[n]) for n in eager_grads)}


def test_compiled_model_has_no_break_in_attention_and_equals_eager():
    layers = models.tiny_config().num_hidden_layers
    for r in distributed.results(distributed.run(_worker, 2)):
        assert r["ops_in_graphs"] == layers and r["breaks_in_mlacp"] == [], r
        assert r["logits_equal"] and r["grads_equal"], r
