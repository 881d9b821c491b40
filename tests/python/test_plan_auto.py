"""strategy="auto": the planner's choice, made by rank 0 of the CP group (calibrating its machine,
or from a profile) and run by every rank; the choice is the report's; errors reach every rank."""
import json

import torch
import torch.distributed as dist

import distributed
import models


def _loss_error(cp, patched, reference, groups, seed):
    """|CP loss - single-process loss| of one batch of 32 tokens."""
    import mlacp

    input_ids, position_ids = models.batch(32, seed=seed)
    batch = cp.shard_inputs(input_ids, labels=input_ids, position_ids=position_ids)
    shifted = models.shift_labels(input_ids)
    share = models.causal_lm_loss(patched(**batch).logits, batch["shift_labels"], batch["num_items_in_batch"])
    loss = mlacp.all_reduce_loss(share, groups).item()
    want = models.causal_lm_loss(reference(input_ids=input_ids, position_ids=position_ids).logits, shifted,
                                 int((shifted != -100).sum())).item()
    return abs(loss - want)


def _auto_worker(rank, world, hardware, bandwidth):
    import mlacp
    import mlacp.hf

    config = models.tiny_config()
    reference = models.tiny_model(config, torch.float64)
    patched = models.clone(reference)
    groups = mlacp.ContextParallelGroups(dist.group.WORLD)
    cp = mlacp.hf.parallelize_model(patched, groups, strategy="auto", seq_len=32, plan_hardware=hardware,
                                    bandwidth_gbps=bandwidth)
    return {"strategy": cp.strategy, "loss_error": _loss_error(cp, patched, reference, groups, seed=3)}


def test_auto_runs_the_planners_choice_on_every_rank():
    import mlacp

    for bandwidth in (None, 1e-4):
        out = distributed.results(distributed.run(_auto_worker, 2, "calibrate", bandwidth))
        strategies = {o["strategy"] for o in out}
        assert len(strategies) == 1 and strategies <= set(mlacp.STRATEGIES), out
        assert all(o["loss_error"] < 1e-10 for o in out), out
    # A very slow link (0.1 MB/s): the latent (fewer bytes) is the choice.
    assert out[0]["strategy"] == "latent_kv_head", out


def test_the_binding_returns_the_planners_report():
    import mlacp
    import mlacp.hf

    report = mlacp._C.plan(config=mlacp.hf.attention_config(models.tiny_config()), seq_len=4096, cp=4,
                           dtype="bfloat16", hardware="h200-nvlink-ib", bandwidth_gbps=1e-4)
    choice = report["candidates"][report["chosen"]]
    assert choice["feasible"] and choice["strategy"] == "latent_kv_head" and choice["ulysses"] == 1, choice
    assert "chosen: " + choice["label"] in report["explanation"]


def _tight_cpu_hardware(path):
    """A CPU host of 2 ranks whose memory is just short of the latent layer's (by the planner's
    own count): it fits only with K/V recompute."""
    import mlacp
    import mlacp.hf

    rates = {"gemm_flops": 1e10, "attention_forward_flops": 1e10, "attention_backward_flops": 1e10}
    hardware = {"name": "tight cpu", "cores_per_node": 2, "devices_per_node": 2, "memory_bytes": 1e12,
                "intra_node": {"bandwidth_bytes_per_s": 1e9, "latency_s": 1e-5}, "rates": {"float64": rates}}
    with open(path, "w") as f:
        json.dump(hardware, f)
    report = mlacp._C.plan(config=mlacp.hf.attention_config(models.tiny_config()), seq_len=32, cp=2, dtype="float64",
                           strategies=["latent_kv_head"], ulysses=2, partitions=["head_tail"], overlap=True,
                           hardware=str(path))
    need = max(c["memory_bytes"] for c in report["candidates"] if c["feasible"])
    hardware["memory_bytes"] = 2 * 0.999 * need  # the host's, shared by its 2 ranks
    with open(path, "w") as f:
        json.dump(hardware, f)


def _kv_recompute_worker(rank, world, hardware):
    import mlacp
    import mlacp.hf

    config = models.tiny_config()
    reference = models.tiny_model(config, torch.float64)
    patched = models.clone(reference)
    groups = mlacp.ContextParallelGroups(dist.group.WORLD)
    cp = mlacp.hf.parallelize_model(patched, groups, strategy="auto", seq_len=32, plan_hardware=hardware)
    return {"strategy": cp.strategy, "kv_recompute": cp.kv_recompute,
            "loss_error": _loss_error(cp, patched, reference, groups, seed=5)}


def test_auto_recomputes_kv_where_the_layer_does_not_fit_without_it(tmp_path):
    hardware = tmp_path / "tight.json"
    _tight_cpu_hardware(hardware)
    out = distributed.results(distributed.run(_kv_recompute_worker, 2, str(hardware)))
    assert all(o["strategy"] == "latent_kv_head" and o["kv_recompute"] for o in out), out
    assert all(o["loss_error"] < 1e-10 for o in out), out


def _auto_groups_worker(rank, world):
    import mlacp
    import mlacp.hf

    config = models.tiny_config()
    reference = models.tiny_model(config, torch.float64)
    patched = models.clone(reference)
    groups = mlacp.ContextParallelGroups(dist.group.WORLD, ulysses="auto", model_config=config, seq_len=32,
                                         dtype="float64", bandwidth_gbps=1e-4)
    cp = mlacp.hf.parallelize_model(patched, groups, strategy="auto")
    return {"planned": groups.planned, "ulysses": groups.ulysses, "strategy": cp.strategy,
            "loss_error": _loss_error(cp, patched, reference, groups, seed=4)}


def test_ulysses_auto_plans_the_groups_and_the_strategy():
    out = distributed.results(distributed.run(_auto_groups_worker, 4))
    assert len({json.dumps(o["planned"], sort_keys=True) for o in out}) == 1, out
    planned = out[0]["planned"]
    assert all(o["ulysses"] == planned["ulysses"] and o["strategy"] == planned["strategy"] for o in out), out
    assert all(o["loss_error"] < 1e-10 for o in out), out
    # A 0.1 MB/s link on 4 ranks: the latent gathered over all of them, no Q/O exchange (U = 1).
    assert planned["strategy"] == "latent_kv_head" and planned["ulysses"] == 1, planned


def _auto_error_worker(rank, world):
    import mlacp
    import mlacp.hf

    model = models.tiny_model(models.tiny_config(), torch.float64)
    try:
        mlacp.hf.parallelize_model(model, mlacp.ContextParallelGroups(dist.group.WORLD), strategy="auto",
                                   seq_len=32, plan_hardware="no-such-profile")
    except mlacp.MlacpError as e:
        return str(e)
    return None


def test_auto_errors_reach_every_rank():
    messages = distributed.results(distributed.run(_auto_error_worker, 2))
    assert len(set(messages)) == 1 and messages[0].startswith("mlacp: "), messages
    assert "neither a profile nor a readable hardware file" in messages[0], messages
