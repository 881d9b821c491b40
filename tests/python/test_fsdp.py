"""FSDP2 (fully_shard) and DDP with CP on a (dp=2, cp=2) DeviceMesh of 4 gloo processes: every
parameter gradient and three AdamW steps equal one process training on both data-parallel batches
(float64, <= 1e-10 relative), with fully_shard applied before or after parallelize_model, over
mesh["dp"] or over torchtitan's flattened dp x cp mesh; DDP on the DP group keeps working."""
import pytest
import torch
import torch.distributed as dist

import distributed
import models

STEPS = 3


def _shard(model, mesh, wrapper):
    from torch.distributed.fsdp import fully_shard

    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    shard_mesh = mesh["dp"] if wrapper == "fsdp-dp" else mesh["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


def _worker(rank, world, wrapper, order):
    import mlacp
    import mlacp.hf
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    groups = mlacp.ContextParallelGroups(mesh["cp"])
    reference = models.tiny_model(models.tiny_config(), torch.float64)
    model = models.clone(reference)
    wrapped = model
    if order == "before":
        wrapped = _shard(model, mesh, wrapper)
    cp = mlacp.hf.parallelize_model(model, groups)
    if order == "after":
        wrapped = _shard(model, mesh, wrapper)
    dp_rank = mesh["dp"].get_local_rank()
    opt, opt_ref = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(reference.parameters(), lr=1e-2)
    errors = []
    for step in range(STEPS):
        batches = [models.batch(32, seed=10 * step + d, packed=d == 1) for d in range(2)]
        opt_ref.zero_grad()
        total = 0
        for ids, pos in batches:  # one process: the mean over DP of each batch's mean loss
            shifted = models.shift_labels(ids)
            logits = reference(input_ids=ids, position_ids=pos).logits
            total = total + models.causal_lm_loss(logits, shifted, int((shifted != -100).sum())) / 2
        total.backward()
        ids, pos = batches[dp_rank]  # this DP rank's batch, sharded over its CP group
        opt.zero_grad()
        batch = cp.shard_inputs(ids, labels=ids, position_ids=pos)
        out = wrapped(**batch)
        models.causal_lm_loss(out.logits, batch["shift_labels"], batch["num_items_in_batch"]).backward()
        mlacp.reduce_gradients(model.parameters(), groups)
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        worst = 0.0
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            r = ref_grads[name.replace("module.", "", 1) if wrapper == "ddp" else name]
            worst = max(worst, ((g - r).abs().max() / r.abs().max().clamp_min(1e-30)).item())
        errors.append(worst)
        opt.step()
        opt_ref.step()
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    ref_params = dict(reference.named_parameters())
    drift = max(((params[n] - ref_params[n.replace("module.", "", 1) if wrapper == "ddp" else n]).abs().max()
                 / ref_params[n.replace("module.", "", 1) if wrapper == "ddp" else n].abs().max()).item()
                for n in params)
    return {"grad_errors": errors, "param_drift": drift}


@pytest.mark.parametrize("wrapper,order", [("fsdp-dp", "after"), ("fsdp-dp", "before"), ("fsdp-dp-cp", "after"),
                                           ("fsdp-dp-cp", "before"), ("ddp", "after")])
def test_data_parallel_wrappers_with_cp_equal_one_process(wrapper, order):
    results = distributed.results(distributed.run(_worker, 4, wrapper, order))
    print(wrapper, order, results[0])
    for r in results:
        assert len(r["grad_errors"]) == STEPS and max(r["grad_errors"]) <= 1e-10, r
        assert r["param_drift"] <= 1e-10, r
