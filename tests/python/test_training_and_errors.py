"""Ten AdamW steps equal single-process training; the state_dict is unchanged; bad input raises
MlacpError before any collective, on every rank alike."""
import torch
import torch.distributed as dist

import distributed
import models


def _train_worker(rank, world, strategy, steps):
    import mlacp
    import mlacp.hf

    config = models.tiny_config()
    reference = models.tiny_model(config, torch.float64)
    patched = models.clone(reference)
    groups = mlacp.ContextParallelGroups(dist.group.WORLD)
    cp = mlacp.hf.parallelize_model(patched, groups, strategy=strategy)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt_cp = torch.optim.AdamW(patched.parameters(), lr=1e-2)
    losses_ref, losses_cp, hf_loss_ratio = [], [], []
    for step in range(steps):
        input_ids, position_ids = models.batch(32, seed=100 + step, packed=step % 2 == 1)
        shifted = models.shift_labels(input_ids)
        count = int((shifted != -100).sum())
        opt_ref.zero_grad()
        out_ref = reference(input_ids=input_ids, position_ids=position_ids, labels=input_ids)
        # The loss in float64 (HuggingFace's own loss computes in float32 whatever the dtype).
        loss = models.causal_lm_loss(out_ref.logits, shifted, count)
        loss.backward()
        opt_ref.step()
        losses_ref.append(loss.item())
        opt_cp.zero_grad()
        batch = cp.shard_inputs(input_ids, labels=input_ids, position_ids=position_ids)
        out = patched(**batch)
        share = models.causal_lm_loss(out.logits, batch["shift_labels"], batch["num_items_in_batch"])
        share.backward()
        mlacp.reduce_gradients(patched.parameters(), groups)
        opt_cp.step()
        losses_cp.append(mlacp.all_reduce_loss(share, groups).item())
        # HuggingFace's own loss through shard_inputs' labels: the same global loss (float32).
        hf_loss_ratio.append(mlacp.all_reduce_loss(out.loss.double(), groups).item() / out_ref.loss.item())
    # The patched model's state_dict loads into an unpatched model unchanged.
    keys_ref, keys_cp = set(reference.state_dict()), set(patched.state_dict())
    fresh = models.tiny_model(config, torch.float64, seed=7)
    fresh.load_state_dict(patched.state_dict())
    same = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), patched.state_dict().values()))
    return {"ref": losses_ref, "cp": losses_cp, "hf_loss_ratio": hf_loss_ratio, "keys_equal": keys_ref == keys_cp, "reload_equal": same}


def test_ten_adamw_steps_match_single_process():
    for strategy in ("latent_kv_head", "expanded_ulysses"):
        results = distributed.results(distributed.run(_train_worker, 2, strategy, 10))
        for r in results:
            assert r["keys_equal"] and r["reload_equal"]
            assert all(abs(x - 1) <= 1e-6 for x in r["hf_loss_ratio"]), r["hf_loss_ratio"]
            for a, b in zip(r["ref"], r["cp"]):
                assert abs(a - b) <= 1e-9 * abs(a), (strategy, r["ref"], r["cp"])
        print(strategy, "losses", ["%.12f" % x for x in results[0]["cp"]])


def _error_worker(rank, world, case):
    import mlacp
    import mlacp.hf

    config = models.tiny_config()
    model = models.tiny_model(config, torch.float32)
    ulysses = 3 if case == "ulysses_contradicts" else None
    try:
        groups = mlacp.ContextParallelGroups(dist.group.WORLD, ulysses=ulysses)
        strategy = "bogus" if case == "bad_strategy" else "latent_kv_head"
        cp = mlacp.hf.parallelize_model(model, groups, strategy=strategy)
        input_ids, _ = models.batch(32)
        batch = cp.shard_inputs(input_ids, labels=input_ids)
        if case == "padding_mask":
            mask = torch.ones_like(batch["input_ids"])
            mask[0, 0] = 0
            batch["attention_mask"] = mask
        elif case == "use_cache":
            batch["use_cache"] = True
        elif case == "output_attentions":
            batch["output_attentions"] = True
        elif case == "odd_local_sequence":
            batch = {"input_ids": batch["input_ids"][:, :-1]}
        elif case == "foreign_positions":  # another batch's positions (64 tokens for a 32-token batch)
            batch["mlacp_positions"] = cp.shard_inputs(models.batch(64)[0])["mlacp_positions"]
        elif case == "positions_without_position_ids":
            del batch["position_ids"]
        # the usual device move leaves mlacp_positions as it is (the forward moves its positions)
        batch = {k: v.to("cpu") if hasattr(v, "to") else v for k, v in batch.items()}
        model(**batch)
    except mlacp.MlacpError as e:
        return str(e)
    return None


ERROR_CASES = {
    "padding_mask": "a forward takes no attention mask",
    "use_cache": "use_cache=True is not supported",
    "output_attentions": "attention weights cannot be returned",
    "ulysses_contradicts": "the CP group size must be divisible by the ulysses degree",
    "odd_local_sequence": "head_tail partition needs an even number of local tokens",
    "bad_strategy": "strategy must be latent_kv_head, expanded_ulysses or auto",
    "foreign_positions": "mlacp_positions must be what CpModel.shard_inputs returned for this batch",
    "positions_without_position_ids": "mlacp_positions needs the position_ids shard_inputs made with it",
}


def test_bad_input_raises_the_mlacp_message_on_every_rank():
    for case, text in ERROR_CASES.items():
        messages = distributed.results(distributed.run(_error_worker, 4, case))
        for m in messages:
            assert m is not None and m.startswith("mlacp: ") and text in m, (case, m)
        assert len(set(messages)) == 1, (case, messages)


def _cpp_error_worker(rank, world):
    import mlacp

    try:  # an error raised by the C++ library keeps its text and type
        mlacp.shard_sequence(torch.zeros(1, 6, 2), mlacp.ContextParallelGroups(dist.group.WORLD), "head_tail")
    except mlacp.MlacpError as e:
        return str(e)
    return None


def test_cpp_errors_surface_as_mlacp_error():
    for m in distributed.results(distributed.run(_cpp_error_worker, 4)):
        assert m is not None and m.startswith("mlacp: "), m
