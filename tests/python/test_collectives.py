"""The package's own collectives (python/csrc/collectives.h): the loss and gradient sums and the
gathers give the right values, and the backend never holds a tensor that Python can see, so no
Gloo worker thread frees a Python object after the call has returned (at interpreter exit that
aborted a rank: "terminate called without an active exception")."""
import torch

import distributed
import mlacp
from mlacp import _C


def _worker(rank, world):
    groups = mlacp.ContextParallelGroups(None)
    out = {}
    loss = torch.tensor(float(rank + 1), dtype=torch.float64)
    total = mlacp.all_reduce_loss(loss, groups)
    out["loss"] = (total.item(), total._use_count(), loss.item())

    # Gradients of two dtypes (two buckets), one parameter without a gradient.
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(2)),
              torch.nn.Parameter(torch.zeros(1))]
    params[0].grad = torch.full((3,), float(rank), dtype=torch.float64)
    params[1].grad = torch.arange(2, dtype=torch.float32) * (rank + 1)
    counts = [p.grad._use_count() for p in params[:2]]
    mlacp.reduce_gradients(params, groups)
    out["grads"] = ([p.grad.tolist() for p in params[:2]], params[2].grad is None,
                    [p.grad._use_count() - c for p, c in zip(params[:2], counts)])

    summed = torch.full((4,), float(rank))
    _C.all_reduce_sum_(summed, groups.cp_group)
    out["sum"] = (summed.tolist(), summed._use_count())

    local = torch.arange(6, dtype=torch.int64).reshape(2, 3).t() + 10 * rank  # not contiguous
    gathered = _C.all_gather(local, groups.cp_group)
    out["gather"] = ([g.tolist() for g in gathered], [g._use_count() for g in gathered], local._use_count())
    try:
        _C.all_reduce_sum_(torch.zeros(4, 2).t(), groups.cp_group)
        out["strided"] = "no error"
    except mlacp.MlacpError as e:
        out["strided"] = str(e)
    return out


def test_sums_and_gathers_are_right_and_leave_no_tensor_with_the_backend():
    world = 2
    results = distributed.results(distributed.run(_worker, world))
    for rank, r in enumerate(results):
        total, total_refs, own = r["loss"]
        assert total == 3.0 and own == float(rank + 1)  # the sum of 1 and 2; the input untouched
        assert total_refs == 1  # only Python holds the result: no backend work still does
        grads, untouched, extra_refs = r["grads"]
        assert grads == [[1.0, 1.0, 1.0], [0.0, 3.0]] and untouched and extra_refs == [0, 0]
        assert r["sum"] == ([1.0] * 4, 1)
        shards, refs, local_refs = r["gather"]
        assert shards == [[[0, 3], [1, 4], [2, 5]], [[10, 13], [11, 14], [12, 15]]]
        assert refs == [1, 1] and local_refs == 1
        assert "must be contiguous" in r["strided"] and "strides=" in r["strided"]
