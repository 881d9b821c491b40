"""The binding's byte counters: what a layer puts on the wire equals docs/DESIGN.md §4.6's
formula (the peer benchmark relies on both), on real gloo processes."""
import torch

import distributed
import models
import mlacp
from mlacp import _ops
from mlacp.hf import attention_config


def _worker(rank, world):
    model = models.tiny_model(models.tiny_config(), dtype=torch.float64)
    attention = model.model.layers[0].self_attn
    out = {}
    for strategy in mlacp.STRATEGIES:
        for ulysses in (None, 2):
            if ulysses is not None and world % ulysses:
                continue
            groups = mlacp.ContextParallelGroups(None, ulysses)
            layer = _ops.Layer(attention_config(model.config), dtype=torch.float64, device="cpu",
                               rms_norm_eps=float(attention.kv_a_layernorm.variance_epsilon))
            core = layer.core
            try:
                core.expected_comm_bytes(batch=1, seq_len=32, wire_bytes=8)
                before = "no error"
            except mlacp.MlacpError as e:
                before = str(e)
            layer.parallelize(groups, strategy=strategy, partition="head_tail", overlap=True, kernel="blockwise")
            seq = 16 * world
            x = torch.randn(1, seq // world, model.config.hidden_size, dtype=torch.float64, requires_grad=True)
            cos, sin = model.model.rotary_emb(x, mlacp.shard_sequence(torch.arange(seq)[None], groups))
            weights = [attention.get_parameter(n) for n in layer.parameter_names]
            layer(x, weights, cos=cos, sin=sin).sum().backward()
            sent = sum(core.comm_bytes().values())
            core.reset_comm_counters()
            out[(strategy, groups.ulysses)] = dict(sent=sent, formula=core.expected_comm_bytes(batch=1, seq_len=seq,
                                                                                               wire_bytes=8),
                                                   after_reset=sum(core.comm_bytes().values()), before=before,
                                                   graphs=_ops.live_graphs())
    return out


def test_counted_bytes_equal_the_formula():
    for world in (2, 4):
        for result in distributed.results(distributed.run(_worker, world)):
            for key, r in result.items():
                assert r["sent"] > 0, key
                assert r["sent"] == r["formula"], (world, key, r)
                assert r["after_reset"] == 0, (world, key, r)
                assert r["graphs"] == 0, (world, key, r)  # every backward freed its forward's graph
                assert "must be parallelized first" in r["before"], r["before"]
