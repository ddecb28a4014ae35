"""What a compiled block costs (Plan.compile): what the partitioner saves, its fused kernels' traffic and launches.

torch.compile (runtime.compile) runs a block as two graphs, forward and backward, cut from one joint graph by
the min-cut partitioner, which also chooses what the forward saves: often a cheap tensor to recompute from rather
than eager's many. Inductor then fuses the memory-bound operators between matmuls and attention into a few
kernels. This traces a block as torch.compile does, without running anything: aot_autograd over fake tensors,
with inductor's decompositions and its partitioner, then reads off the graphs

- the bytes the forward saves for backward (parameters, buffers and their views left out; aliases counted once),
- the memory traffic of the fused kernels: each group of connected memory-bound operators reads what comes in
  from outside it once and writes what leaves it once (inductor's fusion, to a first approximation),
- the kernels launched: one per fused group and one per matmul or attention kernel; their host cost
  (GPU.compiled_launch_s) is what profile-hardware measures for compiled blocks.

Recomputation under compile is a tagged region of the same graph: the recomputing policies keep what eager keeps
(the block input; selective's matmul and attention outputs), and their replay is the compiled forward again.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from snugfit.hardware.catalogue import MMAP_THRESHOLD_BYTES

log = logging.getLogger(__name__)

# operators inductor hands to a library kernel rather than fusing (matmuls, attention): the GEMM and attention
# time the profile's FLOPs already count; each is a launch of its own
_EXTERN = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution"})
_EXTERN_PREFIXES = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")


@dataclass
class GraphCost:
    mem_bytes: float = 0.0  # read + written by the fused memory-bound kernels
    launches: int = 0  # fused kernels + library kernels
    fresh_bytes: float = 0.0  # what its kernels write to new tensors of MMAP_THRESHOLD_BYTES or more (OpCost)
    saved_bytes: int = 0  # forward graph only: activations kept for backward


def _bytes(node) -> int:
    val = node.meta.get("val") if hasattr(node, "meta") else None
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    return 0


def _fresh(node) -> int:
    """Bytes of the node's outputs that a CPU rank's allocator maps afresh (runtime.host_alloc)."""
    vals = tree_flatten(node.meta.get("val"))[0]
    return sum(n for v in vals if isinstance(v, torch.Tensor)
               and (n := v.numel() * v.element_size()) >= MMAP_THRESHOLD_BYTES)


def _is_view(node) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    name = str(getattr(node.target, "_overloadpacket", ""))
    return name == "aten._unsafe_view" or bool(schema and any(r.alias_info is not None for r in schema.returns))


def _is_extern(node) -> bool:
    name = str(getattr(node.target, "_overloadpacket", "")).removeprefix("aten.")
    return node.op == "call_function" and (name in _EXTERN or name.startswith(_EXTERN_PREFIXES))


def graph_cost(gm: torch.fx.GraphModule, skip: set[str] = frozenset()) -> GraphCost:
    """Traffic and launches of one compiled graph; `skip`: placeholders whose values are parameters or buffers
    (not counted among saved activations)."""
    nodes = list(gm.graph.nodes)
    base: dict = {}
    for n in nodes:
        base[n] = base[n.args[0]] if _is_view(n) and n.args and n.args[0] in base else n
    fusable = [n for n in nodes if n.op == "call_function" and n.target is not operator.getitem
               and not _is_view(n) and not _is_extern(n)]
    group = {n: n for n in fusable}

    def find(n):
        while group[n] is not n:
            group[n] = group[group[n]]
            n = group[n]
        return n

    for n in fusable:
        for a in tree_flatten((n.args, n.kwargs))[0]:
            b = base.get(a)
            if b in group:
                group[find(b)] = find(n)
    cost = GraphCost(launches=len({find(n) for n in fusable}) + sum(_is_extern(n) for n in nodes))

    def consumers(n):
        for u in n.users:
            if _is_view(u) or u.target is operator.getitem:
                yield from consumers(u)
            else:
                yield u

    for root in {find(n) for n in fusable}:
        members = [n for n in fusable if find(n) is root]
        reads: dict = {}
        for n in members:
            for a in tree_flatten((n.args, n.kwargs))[0]:
                b = base.get(a)
                if b is None or (b in group and find(b) is root):
                    continue
                reads[b] = max(reads.get(b, 0), min(_bytes(a), _bytes(b)) or _bytes(a))  # a slice reads less
        leaving = [n for n in members if any(c not in group or find(c) is not root for c in consumers(n))]
        cost.mem_bytes += sum(reads.values()) + sum(map(_bytes, leaving))
        cost.fresh_bytes += sum(map(_fresh, leaving))
    cost.fresh_bytes += sum(_fresh(n) for n in nodes if _is_extern(n))
    output = next(n for n in reversed(nodes) if n.op == "output")
    outs = tree_flatten(output.args)[0][1:]  # after the block's output: what backward needs
    saved = {base[o] for o in outs if o in base and not (base[o].op == "placeholder" and base[o].name in skip)}
    cost.saved_bytes = sum(_bytes(b) for b in saved)
    return cost


class _Call(nn.Module):
    """A block's call with the modules it is given, so that functional_call swaps all their tensors for inputs."""

    def __init__(self, block: nn.Module, given: list[nn.Module]):
        super().__init__()
        self.block, self.given = block, nn.ModuleList(given)

    def forward(self, x: torch.Tensor, rest: tuple, kwargs: dict):
        return self.block(x, *rest, **kwargs)


def trace_block(block: nn.Module, args: tuple, kwargs: dict) -> tuple[GraphCost, GraphCost]:
    """(forward, backward) costs of `block` compiled, called with fake `args`/`kwargs` (the first: its input)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict[str, torch.fx.GraphModule] = {}

    def capture(name):
        def compiler(gm, inputs):
            graphs[name] = gm
            return make_boxed_func(gm)
        return compiler

    # the graph takes tensors only: the block's other arguments are closed over, and modules among them (a Hugging
    # Face rotary embedding) have their tensors passed in beside the block's, as a call's own modules
    leaves, spec = tree_flatten((tuple(args[1:]), kwargs))
    slots = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    call = _Call(block, [v for v in leaves if isinstance(v, nn.Module)])
    params, buffers = dict(call.named_parameters()), dict(call.named_buffers())

    def run(params, buffers, x, tensors):
        filled = list(leaves)
        for i, t in zip(slots, tensors):
            filled[i] = t
        rest, kw = tree_unflatten(filled, spec)
        return torch.func.functional_call(call, {**params, **buffers}, (x, rest, kw))

    x = torch.empty_like(args[0]).requires_grad_(True)
    traced = aot_function(run, fw_compiler=capture("fw"), bw_compiler=capture("bw"),
                          partition_fn=min_cut_rematerialization_partition, decompositions=select_decomp_table())
    out = traced(params, buffers, x, [leaves[i] for i in slots])
    out = out[0] if isinstance(out, tuple) else out
    out.sum().backward()
    # the graph's placeholders follow the flattened inputs: parameters, buffers, the input, the other tensors
    # (rotary tables and the like), none of them activations of this block
    placeholders = [n.name for n in graphs["fw"].graph.nodes if n.op == "placeholder"]
    static = set(placeholders[:len(params) + len(buffers)]) | set(placeholders[len(params) + len(buffers) + 1:])
    return graph_cost(graphs["fw"], static), graph_cost(graphs["bw"])


def block_calls(model: nn.Module, blocks: list[nn.Module], run) -> list[tuple[tuple, dict]]:
    """Each block's (args, kwargs) as the model calls it, from one forward without gradients (`run`)."""
    calls: list = [None] * len(blocks)

    def hook(i):
        def pre(module, args, kwargs):
            calls[i] = (args, kwargs)
        return pre

    handles = [b.register_forward_pre_hook(hook(i), with_kwargs=True) for i, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return calls


def signature(block: nn.Module) -> tuple:
    """What decides a block's compiled graph: its parameters' names, shapes, dtypes and which are trained."""
    return tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())


def compiled_costs(model: nn.Module, blocks: list[nn.Module], run) -> list[tuple[GraphCost, GraphCost]]:
    """(forward, backward) costs of each block compiled; `run` runs the model's forward on fake tensors. Blocks
    of one signature share a graph, as at run time, so each is traced once."""
    calls = block_calls(model, blocks, run)
    traced: dict[tuple, tuple[GraphCost, GraphCost]] = {}
    for block, (args, kwargs) in zip(blocks, calls):
        key = signature(block)
        if key not in traced:
            traced[key] = trace_block(block, args, kwargs)
    return [traced[signature(b)] for b in blocks]
