"""Any sequence length, and right-padded batches: shard_inputs pads the sequence to a length the
partition splits (the padding labelled ignore_index, outside every real token's view) and turns a
right-padding attention_mask into ignored labels; the logits of the real tokens (gather_sequence),
the loss and every parameter gradient equal the unpatched model's on one process (float64)."""
import math

import torch
import torch.distributed as dist

import distributed
import models


def _reference(model, ids, mask, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, attention_mask=mask)
    shifted = models.shift_labels(labels)
    loss = models.causal_lm_loss(out.logits, shifted, int((shifted != -100).sum()))
    loss.backward()
    return out.logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _worker(rank, world, cases, partition):
    import mlacp
    import mlacp.hf

    groups = mlacp.ContextParallelGroups(dist.group.WORLD)
    reference = models.tiny_model(models.tiny_config(), torch.float64)
    model = models.clone(reference)
    cp = mlacp.hf.parallelize_model(model, groups, partition=partition)
    out = {}
    for b, s, real_lengths in cases:
        g = torch.Generator().manual_seed(s)
        ids = torch.randint(0, models.VOCAB, (b, s), generator=g)
        mask = None
        labels = ids.clone()
        if real_lengths is not None:  # right padding: 1s then 0s per row
            mask = (torch.arange(s)[None, :] < torch.tensor(real_lengths)[:, None]).long()
            labels = labels.masked_fill(mask == 0, -100)
        if rank == 0:  # one reference (the gathered logits and the reduced gradients are every rank's)
            ref_logits, ref_loss, ref_grads = _reference(reference, ids, mask, labels)
        model.zero_grad(set_to_none=True)
        batch = cp.shard_inputs(ids, labels=ids, attention_mask=mask)
        res = model(**batch)
        share = models.causal_lm_loss(res.logits, batch["shift_labels"], batch["num_items_in_batch"])
        share.backward()
        mlacp.reduce_gradients(model.parameters(), groups)
        loss = mlacp.all_reduce_loss(share, groups)
        logits = cp.gather_sequence(res.logits, batch)
        if rank != 0:
            continue
        real = torch.ones(b, s, dtype=torch.bool) if mask is None else mask.bool()
        err = {"logits": (logits - ref_logits)[real].abs().max().item() if real.any() else 0.0,
               "loss": 0.0 if math.isnan(ref_loss.item()) and math.isnan(loss.item())  # no label at all (S = 1)
               else abs(loss.item() - ref_loss.item()),
               # relative, but to at least 1: a gradient that is 0 by symmetry (one key per query at S = 2)
               # is 1e-19 in rounding on either side
               "grad": max(((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1.0)).item()
                           for n, p in model.named_parameters()),
               "shape": tuple(logits.shape), "local": tuple(batch["input_ids"].shape)}
        out[(b, s, None if real_lengths is None else tuple(real_lengths))] = err
    return out


def _check(results):
    for r in results:
        for case, e in r.items():
            b, s, _ = case
            assert e["shape"][:2] == (b, s), (case, e)
            assert e["logits"] <= 1e-10 and e["loss"] <= 1e-10 and e["grad"] <= 1e-10, (case, e)


def test_any_length_and_padded_batches_four_ranks():
    # S = 1 .. 4099 (the partition needs multiples of 8 on 4 ranks), and right-padded batches of 3
    cases = [(1, s, None) for s in (1, 2, 3, 7, 9, 30, 127, 4099)] + [(3, 37, [37, 20, 1]), (2, 16, [5, 0])]
    results = distributed.results(distributed.run(_worker, 4, cases, "head_tail"))
    print(results[0])
    _check(results)


def test_any_length_contiguous_two_ranks():
    results = distributed.results(distributed.run(_worker, 2, [(1, 5, None), (2, 33, [33, 17])], "contiguous"))
    _check(results)


def _left_padding_worker(rank, world):
    import mlacp
    import mlacp.hf

    cp = mlacp.hf.parallelize_model(models.tiny_model(models.tiny_config()), mlacp.ContextParallelGroups())
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    try:
        cp.shard_inputs(torch.zeros(2, 4, dtype=torch.long), attention_mask=mask)
    except mlacp.MlacpError as e:
        return str(e)
    return None


def test_left_padding_is_refused_with_the_way_out():
    for m in distributed.results(distributed.run(_left_padding_worker, 2)):
        assert m is not None and "must be right padding" in m and "padding_side" in m, m
