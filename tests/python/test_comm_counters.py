"""The binding's byte counters: what a layer puts on the wire equals docs/DESIGN.md §4.6's
formula (the peer benchmark relies on both), on real gloo processes."""
import torch

import distributed
import models
import mlacp
from mlacp import _C
from mlacp.hf import _config_json


def _worker(rank, world):
    model = models.tiny_model(models.tiny_config(), dtype=torch.float64)
    attention = model.model.layers[0].self_attn
    out = {}
    for strategy in mlacp.STRATEGIES:
        for ulysses in (None, 2):
            if ulysses is not None and world % ulysses:
                continue
            groups = mlacp.ContextParallelGroups(None, ulysses)
            core = _C.Attention(_config_json(model.config), dict(attention.named_parameters()),
                                rms_norm_eps=float(attention.kv_a_layernorm.variance_epsilon))
            try:
                core.expected_comm_bytes(1, 32, 8)
                before = "no error"
            except mlacp.MlacpError as e:
                before = str(e)
            core.parallelize(groups.cp_group, groups.ulysses, groups.ulysses_group, groups.all_gather_group,
                             strategy, "head_tail", True, "blockwise", "cpu")
            seq = 16 * world
            x = torch.randn(1, seq // world, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
            core.forward(x, position_ids=mlacp.shard_sequence(torch.arange(seq)[None], groups), is_causal=True)\
                .sum().backward()
            sent = sum(core.comm_bytes().values())
            core.reset_comm_counters()
            out[(strategy, groups.ulysses)] = dict(sent=sent, formula=core.expected_comm_bytes(1, seq, 8),
                                                   after_reset=sum(core.comm_bytes().values()), before=before)
    return out


def test_counted_bytes_equal_the_formula():
    for world in (2, 4):
        for result in distributed.results(distributed.run(_worker, world)):
            for key, r in result.items():
                assert r["sent"] > 0, key
                assert r["sent"] == r["formula"], (world, key, r)
                assert r["after_reset"] == 0, (world, key, r)
                assert "must be parallelized first" in r["before"], r["before"]
