"""The systems compared, each as a user of that library would set it up for this layer.

Every system runs on each rank's tokens: ``forward(x_local, cos_local, sin_local)`` returns this
rank's rows of the layer output, autograd-connected to ``x_local`` and the system's own copy of the
layer's parameters. ``partition`` says which global rows a rank holds (``job.shard``).
``formula_bytes`` is what the scheme should put on the wire per rank per layer, forward+backward,
written from the scheme's description (checked against the wrapped collectives in the report).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import job


class Unavailable(Exception):
    """The system cannot run here; the message says why (recorded in the report)."""


class System:
    name = "?"
    partition = "contiguous"
    parallel = True  # False: the single-process baseline (rank 0 only)

    def setup(self, layer, p: int, rank: int) -> None:
        raise NotImplementedError

    def forward(self, x, cos, sin):
        raise NotImplementedError

    def parameters(self):
        return self.layer.parameters()

    def formula_bytes(self, seq: int, p: int, elem: int) -> Optional[int]:
        return None

    def measured_bytes(self, meter_bytes: int) -> int:
        return meter_bytes

    def reset_bytes(self) -> None:
        pass

    def version(self) -> str:
        return ""


def _sdpa_causal(q, k, v, scale):
    """The local attention the Ulysses peers wrap: torch's SDPA, causal, layout [B, S, H, D]."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         scale=scale)
    return out.transpose(1, 2)


def _register(name: str, core: Callable) -> None:
    """Makes `core(q, k, v, scale) -> [B, L, H, Dv]` (inputs [B, L, H, D]) an HF attention function."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if attention_mask is not None:
            raise RuntimeError(f"{name}: the benchmark runs causal attention without a mask")
        out = core(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), scaling)
        return out.contiguous(), None

    AttentionInterface.register(name, attention)


class HfSingle(System):
    """HuggingFace DeepseekV3Attention on one process, eager attention: the baseline."""

    name = "hf-eager (1 process)"
    parallel = False

    def setup(self, layer, p, rank):
        self.layer = job.copy_layer(layer, "eager")
        self.mask = None

    def forward(self, x, cos, sin):
        if self.mask is None or self.mask.shape[-1] != x.shape[1]:
            self.mask = job.causal_mask(x.shape[1])
        return self.layer(x, (cos, sin), self.mask)[0]

    def formula_bytes(self, seq, p, elem):
        return 0

    def version(self):
        import transformers

        return f"transformers {transformers.__version__}"


class Mlacp(System):
    def __init__(self, strategy: str, ulysses: Optional[int] = None, kv_recompute: bool = False):
        self.strategy = strategy
        self.ulysses = ulysses
        self.kv_recompute = kv_recompute
        short = "latent" if strategy == "latent_kv_head" else "expanded"
        self.name = f"mlacp {short}" + (f" U={ulysses}" if ulysses else "") + (" kv-recompute" if kv_recompute else "")
        self.partition = "head_tail"

    def setup(self, layer, p, rank):
        import mlacp
        from mlacp import _ops
        from mlacp.hf import attention_config

        if self.ulysses is not None and not (1 < self.ulysses < p and p % self.ulysses == 0):
            raise Unavailable(f"a hybrid needs 1 < U < P with U | P (U={self.ulysses}, P={p})")
        self.layer = job.copy_layer(layer, "eager")
        self.groups = mlacp.ContextParallelGroups(None, self.ulysses)
        self.mla = _ops.Layer(attention_config(self.layer.config), dtype=next(self.layer.parameters()).dtype, device="cpu",
                              rms_norm_eps=float(self.layer.kv_a_layernorm.variance_epsilon), rms_norm_float32=True)
        self.core = self.mla.core
        self.weights = [self.layer.get_parameter(n) for n in self.mla.parameter_names]
        self.plan = self.mla.parallelize(self.groups, strategy=self.strategy, partition="head_tail", overlap=True,
                                         kernel="blockwise", kv_recompute=self.kv_recompute)

    def forward(self, x, cos, sin):
        return self.mla(x, self.weights, cos=cos, sin=sin, training=True)

    def reset_bytes(self):
        self.core.reset_comm_counters()

    def measured_bytes(self, meter_bytes):
        return meter_bytes + sum(self.core.comm_bytes().values())

    def formula_bytes(self, seq, p, elem):
        return self.core.expected_comm_bytes(batch=1, seq_len=seq, wire_bytes=elem)  # docs/DESIGN.md §4.6, from the plan

    def version(self):
        from mlacp import _C

        return f"mlacp (this tree, LibTorch {_C.torch_version()})"


class DeepSpeedUlysses(System):
    """deepspeed.sequence.layer.DistributedAttention around torch SDPA (its README's pattern).

    V is zero-padded from 128 to 192 before the exchange and the output cut back, as DeepSpeed's
    MLA users do: fused attention kernels want one head dim (here torch's CPU flash kernel: with
    Dv != Dqk SDPA falls back to its quadratic-memory math kernel, 2.2x slower at S = 4K). The
    padding travels: V, O and their gradients move 192 wide (counted in the formula).
    """

    name = "deepspeed-ulysses (V padded)"

    def setup(self, layer, p, rank):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        try:
            import deepspeed
            from deepspeed.sequence.layer import DistributedAttention
        except Exception as e:  # noqa: BLE001 - recorded as the reason
            raise Unavailable(f"import deepspeed failed: {type(e).__name__}: {e}") from e
        if job.HEADS % p:
            raise Unavailable(f"Ulysses needs heads divisible by P ({job.HEADS} % {p})")
        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
        scale_holder = {}

        def local(q, k, v, *args, **kwargs):
            return _sdpa_causal(q, k, v, scale_holder["scale"])

        self.dist_attn = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)

        def core(q, k, v, scale):
            scale_holder["scale"] = scale
            padded = F.pad(v, (0, job.DQK - job.DV))
            return self.dist_attn(q, k, padded, 0)[..., :job.DV]

        _register("bench_deepspeed_ulysses", core)
        self.layer = job.copy_layer(layer, "bench_deepspeed_ulysses")

    def forward(self, x, cos, sin):
        return self.layer(x, (cos, sin), None)[0]

    def formula_bytes(self, seq, p, elem):
        # Q, K, V (padded) out and O back in the forward, dO out and dQ, dK, dV back: 8 x Dqk wide
        l, h = seq // p, job.HEADS
        return int((p - 1) / p * l * h * 8 * job.DQK * elem)

    def version(self):
        import deepspeed

        return f"deepspeed {deepspeed.__version__}"


class YunchangUsp(System):
    """yunchang's LongContextAttention (USP: Ulysses x ring) with a torch attention backend.

    Its README's torch configuration (for hardware without flash-attn) is
    ``ring_impl_type="basic", attn_type=AttnType.TORCH_EFFICIENT`` ("the backward pass is not
    supported"); ``TORCH_MATH`` is the backend that runs everywhere. Both are tried as given.
    """

    def __init__(self, ulysses: int, ring: int, attn: str):
        self.u, self.r, self.attn_name = ulysses, ring, attn
        self.name = f"yunchang U={ulysses}xR={ring} {attn}"

    def setup(self, layer, p, rank):
        if self.u * self.r != p:
            raise Unavailable(f"U x R must be P ({self.u} x {self.r} != {p})")
        try:
            from yunchang import LongContextAttention, set_seq_parallel_pg
            from yunchang.kernels import AttnType
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"import yunchang failed: {type(e).__name__}: {e}") from e
        set_seq_parallel_pg(self.u, self.r, rank, p)
        self.attn = LongContextAttention(ring_impl_type="basic", attn_type=AttnType(self.attn_name))
        key = f"bench_yunchang_{self.u}x{self.r}_{self.attn_name}"

        def core(q, k, v, scale):
            return self.attn(q, k, v, softmax_scale=scale, causal=True)

        _register(key, core)
        self.layer = job.copy_layer(layer, key)

    def forward(self, x, cos, sin):
        return self.layer(x, (cos, sin), None)[0]

    def formula_bytes(self, seq, p, elem):
        l, h = seq // p, job.HEADS
        u, r = self.u, self.r
        ulysses = (u - 1) / u * l * h * (2 * (2 * job.DQK + job.DV) + 2 * job.DV) * elem
        block = (seq // r) * (h // u) * (job.DQK + job.DV)  # one ring block of K and V
        # forward: K, V passed R-1 times; backward: again R-1 times, and dK, dV (float32) R times.
        ring = block * (2 * (r - 1) * elem + r * 4) if r > 1 else 0
        return int(ulysses + ring)

    def version(self):
        import yunchang

        return f"yunchang {yunchang.__version__}"


class TorchContextParallel(System):
    """torch.distributed.tensor.experimental.context_parallel around the HF layer's SDPA."""

    def __init__(self, rotate: str):
        self.rotate = rotate
        self.name = f"torch context_parallel ({rotate})"
        self.partition = "head_tail"  # its load balancer for causal attention

    def setup(self, layer, p, rank):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental._attention import set_rotate_method

        self.mesh = init_device_mesh("cpu", (p,))
        set_rotate_method(self.rotate)
        self.layer = job.copy_layer(layer, "sdpa")
        self.p, self.rank = p, rank

    def forward(self, x, cos, sin):
        raise RuntimeError("torch context_parallel shards global buffers itself: use step()")

    def step(self, x_global, cos_global, sin_global, d_out_global):
        """One forward+backward inside the context manager, which shards the buffers along the
        sequence (load-balanced) and replaces SDPA with its ring. Returns the local output, dX."""
        from torch.distributed.tensor.experimental import context_parallel

        x = x_global.clone()
        cos, sin, d_out = cos_global.clone(), sin_global.clone(), d_out_global.clone()
        with context_parallel(self.mesh, buffers=[x, cos, sin, d_out], buffer_seq_dims=[1, 1, 1, 1]):
            x_local = x.detach().requires_grad_(True)  # the buffers themselves are resized on exit
            out = self.layer(x_local, (cos, sin), None, is_causal=True)[0]
            out.backward(d_out.to(out.dtype))
        return out.detach(), x_local.grad

    def version(self):
        return f"torch {torch.__version__}"


def all_systems(p: int):
    """Every system of the comparison at CP size P, the baseline first."""
    systems = [HfSingle(), Mlacp("latent_kv_head"), Mlacp("latent_kv_head", kv_recompute=True),
               Mlacp("expanded_ulysses")]
    if p >= 4:
        systems += [Mlacp("latent_kv_head", 2), Mlacp("expanded_ulysses", 2)]
    systems.append(DeepSpeedUlysses())
    shapes = [(2, 1), (1, 2)] if p == 2 else [(p // 2, 2), (p, 1)]
    systems += [YunchangUsp(u, r, attn) for u, r in shapes for attn in ("torch_efficient", "torch_math")]
    systems += [TorchContextParallel("allgather"), TorchContextParallel("alltoall")]
    return systems


GPU_ONLY = {
    "ring-flash-attention": "needs flash-attn's CUDA kernels (no CPU path); left to the GPU script",
    "yunchang zigzag/stripe rings": "call flash-attn's CUDA kernels",
}
