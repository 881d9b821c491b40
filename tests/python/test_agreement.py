"""No silent wrong step: the CP ranks agree on a forward before its first collective. Every way of
giving the ranks inputs they cannot run together (the whole sequence on every rank, shards of
different lengths or of different batches, a padding mask on some ranks, shards made in different
ways or for another rank, positions that are no partition's shards) is the same MlacpError on
every rank within a second: no wrong logits, no abort, no hang. A C++ fault names the group's
real timeout."""
import dataclasses
import datetime
import time

import torch
import torch.distributed as dist

import distributed
import models

SEQ = 32


def _inputs(case, cp, rank, world):
    """The forward's keyword arguments on this rank for one case."""
    ids, pos = models.batch(SEQ, seed=5)
    batch = cp.shard_inputs(ids, labels=ids)
    if case == "whole_sequence":  # shard_inputs forgotten: every rank the whole sequence
        return {"input_ids": ids}
    if case == "whole_sequence_with_positions":
        return {"input_ids": ids, "position_ids": torch.arange(SEQ)[None]}
    if case == "own_sequences_with_positions":  # every rank its own whole sequence, positions 0..S/P-1 each
        own = models.batch(SEQ // world, seed=rank)[0]
        return {"input_ids": own, "position_ids": torch.arange(SEQ // world)[None]}
    if case == "mask_on_one_rank":  # a padded mask whose zeros fall in rank 0's tokens only
        mask = torch.ones_like(batch["input_ids"])
        if rank == 0:
            mask[0, -1] = 0
        return {**batch, "attention_mask": mask}
    if case == "lengths_8_8_6_6":  # a hand sharding
        n = 8 if rank < 2 else 6
        return {"input_ids": ids[:, rank * 8:rank * 8 + n], "position_ids": torch.arange(rank * 8, rank * 8 + n)[None]}
    if case == "lengths_8_8_7_7":
        n = 8 if rank < 2 else 7
        return {"input_ids": ids[:, rank * 8:rank * 8 + n], "position_ids": torch.arange(rank * 8, rank * 8 + n)[None]}
    if case == "different_batches":  # a sampler over the whole world: each CP rank another sample
        other = models.batch(SEQ, seed=100 + rank)[0]
        return cp.shard_inputs(other, labels=other)
    if case == "mixed_ways":  # rank 1 drops shard_inputs' positions record
        if rank == 1:
            batch.pop("mlacp_positions")
        return batch
    if case == "token_of_another_rank":
        batch["mlacp_positions"] = dataclasses.replace(batch["mlacp_positions"], cp_rank=(rank + 1) % world)
        return batch
    if case == "use_cache_on_one_rank":
        return {**batch, "use_cache": rank == 2}
    raise ValueError(case)


def _worker(rank, world, cases):
    import mlacp
    import mlacp.hf

    cp = mlacp.hf.parallelize_model(models.tiny_model(models.tiny_config()), mlacp.ContextParallelGroups())
    out = {}
    for case in cases:
        kwargs = _inputs(case, cp, rank, world)
        start = time.monotonic()
        try:
            cp.model(**kwargs)
            out[case] = (None, time.monotonic() - start)
        except mlacp.MlacpError as e:
            out[case] = (str(e), time.monotonic() - start)
        dist.barrier()  # every rank is back: the next case starts together
    return out


CASES = {
    "whole_sequence": "a forward of a CP model needs inputs sharded by CpModel.shard_inputs",
    "whole_sequence_with_positions": "every CP rank holds the same inputs: they were not sharded",
    "own_sequences_with_positions": "the ranks' position_ids are not the partition's shards of one sequence",
    "mask_on_one_rank": "a forward takes no attention mask",
    "lengths_8_8_6_6": "every CP rank must hold the same batch and number of tokens",
    "lengths_8_8_7_7": "the head_tail partition needs an even number of local tokens",
    "different_batches": "the CP ranks' shards come from different global batches",
    "mixed_ways": "every CP rank must be given its shard the same way",
    "token_of_another_rank": "mlacp_positions was made for another CP rank or partition",
    "use_cache_on_one_rank": "use_cache=True is not supported",
}


def test_every_disagreement_is_the_same_error_on_every_rank_within_a_second():
    results = distributed.results(distributed.run(_worker, 4, list(CASES), timeout_s=300))
    for case, text in CASES.items():
        messages = [r[case][0] for r in results]
        assert all(m is not None and m.startswith("mlacp: ") and text in m for m in messages), (case, messages)
        assert len(set(messages)) == 1, (case, messages)
        assert max(r[case][1] for r in results) < 1.0, (case, [r[case][1] for r in results])
    # The ranks that found the problem are named.
    assert "[CP rank 0 of 4;" in results[0]["mask_on_one_rank"][0], results[0]["mask_on_one_rank"][0]
    assert "[CP ranks 2, 3 of 4;" in results[0]["lengths_8_8_7_7"][0], results[0]["lengths_8_8_7_7"][0]
    assert "local_tokens_per_rank=[8, 8, 6, 6]" in results[0]["lengths_8_8_6_6"][0]


def _timeout_worker(rank, world):
    import mlacp
    from mlacp import _ops
    from mlacp.hf import attention_config

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    groups = mlacp.ContextParallelGroups(group)
    model = models.tiny_model(models.tiny_config())
    attention = model.model.layers[0].self_attn
    layer = _ops.Layer(attention_config(model.config), dtype=torch.float64, device="cpu")
    layer.parallelize(groups, strategy="latent_kv_head", partition="head_tail", overlap=False, kernel="blockwise")
    if rank == 1:  # never enters the layer's collectives, but stays alive past rank 0's timeout
        time.sleep(6)
        return None
    x = torch.randn(1, 8, model.config.hidden_size, dtype=torch.float64)
    cos, sin = model.model.rotary_emb(x, mlacp.shard_sequence(torch.arange(16)[None], groups))
    try:
        layer(x, [attention.get_parameter(n) for n in layer.parameter_names], cos=cos, sin=sin)
    except mlacp.MlacpError as e:
        return str(e)
    return "no error"


def test_a_fault_names_the_groups_real_timeout():
    message = distributed.results(distributed.run(_timeout_worker, 2, timeout_s=120))[0]
    assert message.startswith("mlacp: communication: a collective failed") and "timeout_s=2" in message, message
