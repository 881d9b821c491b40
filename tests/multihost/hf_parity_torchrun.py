"""A torchrun worker (tests/multihost/torchrun_test.sh): the HuggingFace parity cases of
tests/python/test_hf_parity.py on torchrun's world (2 hosts x 2 ranks there): the patched model's
logits, loss and every parameter gradient equal the unpatched model's on one process (float64,
float32, bf16 autocast), both strategies, a hybrid U = 2 (Ulysses groups inside the hosts), packed
documents, MoE. The process group is the user's, made as a user makes it under torchrun."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import test_hf_parity as parity  # noqa: E402

dist.init_process_group("gloo")
torch.set_num_threads(1)
rank, world = dist.get_rank(), dist.get_world_size()
results = parity._worker(rank, world, parity.CASES_P4)
parity._check(results)  # raises on this rank if a bound is broken
if rank == 0:
    parity._print(results)
    print(f"hf parity on {world} ranks ({os.environ.get('LOCAL_WORLD_SIZE')} a host, node {os.environ.get('GROUP_RANK')}"
          f" leading, GLOO_SOCKET_IFNAME={os.environ.get('GLOO_SOCKET_IFNAME')}): PASS", flush=True)
dist.destroy_process_group()
