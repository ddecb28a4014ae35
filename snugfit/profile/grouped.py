"""Grouped GEMMs (`torch._grouped_mm`: a Mixture-of-Experts layer's experts, one matmul per expert over its
tokens) in the fake-tensor recording: a shape for them in any dtype (their FLOPs: profile.record.op_cost).

torch's meta kernel for `_grouped_mm` (what fake tensors run) insists on
bfloat16 (torch 2.13), although the CPU kernel computes float32 too: a float32 profile of an MoE model ended in
"Expected inputs of BF16 type". What the profile measures of experts: dropless routing
(every token reaches its top-k experts, no capacity factor), so S = tokens x top_k rows run through the experts'
GEMMs whatever the router picks; the fake router's choice moves rows between experts but changes neither the
FLOPs nor the bytes counted. That is balanced routing's cost; per-expert GEMM efficiency and imbalance are not in it.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GROUPED_MM = "aten._grouped_mm"


class AnyDtypeGroupedMM(TorchDispatchMode):
    """Under fake tensors: a float32 (or float16) `_grouped_mm` gets its output's shape from the bfloat16 meta
    kernel, cast back, so modes above this one see one `_grouped_mm` of the true dtype. Enter it inside
    FakeTensorMode and beneath the recorder."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if str(func._overloadpacket) != GROUPED_MM or args[0].dtype == torch.bfloat16:
            return func(*args, **kwargs)
        dtype = kwargs.get("out_dtype") or args[0].dtype
        low = [t.to(torch.bfloat16) if i < 2 else t for i, t in enumerate(args)]
        bias = kwargs.get("bias")
        kw = {**kwargs, "out_dtype": None, **({"bias": bias.to(torch.bfloat16)} if bias is not None else {})}
        return func(*low, **kw).to(dtype)
