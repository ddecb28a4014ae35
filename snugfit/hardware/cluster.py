"""Clusters: nodes of GPUs joined by links, from a short spec or a TOML file.

Specs: "4xRTX4090" (one node, 4 GPUs), "2x8xH100-80GB" (2 nodes of 8),
"2xRTX4090+2xRTX3090" (each '+' term is its own node), "cpu" / "2xcpu" (gloo
ranks on this machine). Ranks are numbered node by node.
"""

from __future__ import annotations

import functools
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from snugfit.errors import SnugfitError
from snugfit.hardware.catalogue import GPUS, GPU, Host, Link, get_gpu, get_link, host_ram, load_local


@dataclass
class Node:
    gpu: GPU
    count: int
    intra: Link  # between GPUs of this node
    pcie: Link  # host <-> GPU (offload traffic)
    host: Host = field(default_factory=Host)
    # the time model's factors per term, measured by a run on this hardware (plan.corrections; empty: none)
    corrections: dict[str, float] = field(default_factory=dict)


@dataclass
class Cluster:
    nodes: list[Node]
    inter: Link  # between nodes
    spec: str = ""
    notes: tuple[str, ...] = ()  # what the spec's names chose where they name several cards (`card_note`)

    @property
    def world_size(self) -> int:
        return sum(n.count for n in self.nodes)

    @functools.cached_property
    def _node_by_rank(self) -> list[int]:
        # estimate() asks for hundreds of thousands of ranks' nodes on a 1024-GPU cluster: a scan of the nodes each
        # time was most of its 2.3 s
        return [i for i, n in enumerate(self.nodes) for _ in range(n.count)]

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < len(self._node_by_rank):
            raise SnugfitError(f"rank {rank} is outside a cluster of {self.world_size} GPUs")
        return self._node_by_rank[rank]

    def ranks_of(self, node: int) -> range:
        """The ranks on node `node` (each node's ranks follow the previous node's)."""
        start = sum(n.count for n in self.nodes[:node])
        return range(start, start + self.nodes[node].count)

    def gpu_of(self, rank: int) -> GPU:
        return self.nodes[self.node_of(rank)].gpu

    def link_for(self, ranks: list[int]) -> Link:
        """The slowest link a collective over these ranks crosses. Across nodes: the inter-node link, with the
        nodes it spans and, where each GPU has its own NIC (rails), NCCL's bus bandwidth over as many NICs as the
        group has ranks on its sparsest node (NCCL runs a channel over each), up to the nodes' own links."""
        per_node: dict[int, int] = {}
        for r in ranks:
            node = self.node_of(r)
            per_node[node] = per_node.get(node, 0) + 1
        if len(per_node) == 1:
            return self.nodes[next(iter(per_node))].intra
        inter, bus = self.inter, self.inter.bus_gbps
        if inter.rails and bus:
            intra = min(self.nodes[n].intra.bus_gbps or self.nodes[n].intra.gbps for n in per_node)
            bus = min(bus * min(per_node.values()), max(bus, intra))
        return replace(inter, bus_gbps=bus, nodes=len(per_node))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_toml(self) -> str:
        """This cluster as a TOML file parse_cluster loads: GPUs the catalogue lacks as [[gpu]] tables."""
        lines = [f'inter = "{self.inter.name}"', ""]
        for gpu in {n.gpu.name: n.gpu for n in self.nodes if n.gpu.name not in GPUS and n.gpu.name != "cpu"}.values():
            tflops = ", ".join(f"{k} = {v:g}" for k, v in gpu.tflops.items())
            lines += ["[[gpu]]", f'name = "{gpu.name}"', f"memory_gib = {gpu.memory_bytes / 2**30:g}",
                      f"tflops = {{ {tflops} }}", f"hbm_gbps = {gpu.hbm_gbps:g}", f"pcie_gen = {gpu.pcie_gen}",
                      *([f'nvlink = "{gpu.nvlink}"'] if gpu.nvlink else []),
                      *(["p2p = false"] if not gpu.p2p else []),
                      *(f"{k} = {_toml_value(getattr(gpu, k))}" for k in GPU_FIGURES
                        if k in ("matmul_efficiency", "mem_efficiency") or getattr(gpu, k) != _GPU_DEFAULTS[k]), ""]
        for n in self.nodes:
            # links only where they differ from the GPU's own: a CPU node's offload link is a memcpy at its memory
            # bandwidth, which has no catalogue name to write
            default = make_node(n.gpu.name, 1, host=n.host, custom={n.gpu.name: n.gpu})
            lines += ["[[node]]", f'gpu = "{n.gpu.name}"', f"count = {n.count}",
                      *([f'intra = "{n.intra.name}"'] if n.intra.name != default.intra.name else []),
                      *([f'pcie = "{n.pcie.name}"'] if n.pcie.name != default.pcie.name else []),
                      *([] if n.host.ram_assumed else [f"host_ram_gib = {n.host.ram_bytes / 2**30:g}"]),
                      f"host_adam_params_per_s = {n.host.adam_params_per_s:g}", ""]
        return "\n".join(lines)


_TERM = re.compile(r"^(?:(\d+)x)?(?:(\d+)x)?(.+)$", re.IGNORECASE)


def make_node(gpu_name: str, count: int, intra: str | None = None, pcie: str | None = None,
              host: Host | None = None, custom: dict[str, GPU] | None = None) -> Node:
    """`count` GPUs by name (the catalogue's, or `custom` ones a cluster file defines) with their links."""
    gpu = (custom or {}).get(gpu_name) or get_gpu(gpu_name)
    if gpu.name == "cpu":
        local = load_local()
        host = host or (local.host if local else Host(ram_bytes=host_ram(), adam_params_per_s=1e9, cores=2))
        intra = intra or "gloo-loopback"
        pcie_link = Link("host-memory", gpu.hbm_gbps, 0.0)  # offload on a CPU "device" is a memcpy
        return Node(gpu, count, get_link(intra), get_link(pcie) if pcie else pcie_link, host)
    intra = intra or gpu.nvlink or f"pcie{gpu.pcie_gen}" + ("" if gpu.p2p else "-host")
    return Node(gpu, count, get_link(intra), get_link(pcie or f"pcie{gpu.pcie_gen}"), host or Host(ram_assumed=True))


def parse_cluster(spec: str, inter: str | None = None) -> Cluster:
    """A Cluster from a spec string or a .toml path; unknown GPU names suggest close matches."""
    if spec.endswith(".toml"):
        return load_cluster_toml(spec)
    nodes: list[Node] = []
    for term in spec.replace(" ", "").split("+"):
        m = _TERM.match(term)
        if not term or not m:
            raise SnugfitError(f"cannot read cluster term {term!r}; write e.g. 4xRTX4090, 2x8xH100-80GB, 2xA10+2xL4")
        a, b, name = m.groups()
        n_nodes, per_node = (int(a), int(b)) if b else (1, int(a or 1))
        if n_nodes < 1 or per_node < 1:
            raise SnugfitError(f"cluster term {term!r} has a zero count")
        nodes += [make_node(name, per_node) for _ in range(n_nodes)]
    inter_name = inter or min((n.gpu.inter for n in nodes), key=lambda k: get_link(k).gbps)
    names = dict.fromkeys(m.groups()[2] for m in map(_TERM.match, spec.replace(" ", "").split("+")))
    return Cluster(nodes, get_link(inter_name), spec, tuple(filter(None, map(card_note, names))))


def card_note(name: str) -> str | None:
    """Where a short name stands for one of several catalogue cards ('A100': 40 or 80 GB, PCIe or SXM), the one
    line that says which it took and what else it could mean; None where the name is one card's."""
    if name.lower() == "cpu":
        return None
    taken = get_gpu(name).name
    family, *parts = name.upper().split("-")

    def fits(gpu: str, part: str) -> bool:  # '80GB': that much memory, named or not ('H100-80GB': PCIe or SXM)
        if part.endswith("GB") and part[:-2].isdigit():
            return abs(GPUS[gpu].memory_bytes / 2**30 / int(part[:-2]) - 1) < 0.1
        return part in gpu.upper()

    alike = [g for g in GPUS if g.upper().startswith(family) and all(fits(g, p) for p in parts)]
    if name.upper() == taken.upper() or len(alike) < 2:
        return None
    others = ", ".join(g for g in alike if g != taken)
    return f"{name} is taken as the {taken} ({GPUS[taken].memory_bytes / 2**30:.0f} GiB); the catalogue also has " \
           f"{others}: name one to plan it"


def load_cluster_toml(path: str | Path) -> Cluster:
    """TOML: top-level `inter`; [host] (ram_gib, cores, adam_params_per_s) for every node; [[gpu]] tables defining
    GPUs the catalogue lacks (name, memory_gib, tflops = {float32 = .., bfloat16 = ..}, hbm_gbps, pcie_gen, and
    optionally nvlink, p2p = false for cards without PCIe peer access, and the GPU_FIGURES profile-hardware
    measures: matmul_efficiency, mem_efficiency, sms, arch, op_overhead_s, sac_overhead_s, attention_tflops,
    compiled_launch_s); then
    [[node]] tables with gpu, count and optional intra, pcie, host_ram_gib, host_adam_params_per_s."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    p = Path(path)
    if not p.exists():
        raise SnugfitError(f"cluster file {path} does not exist")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SnugfitError(f"cluster file {path} is not valid TOML: {e}; fix the file") from None
    if not data.get("node"):
        raise SnugfitError(f"cluster file {path} has no [[node]] tables")
    custom = {g.name: g for g in (_gpu_table(t, path) for t in data.get("gpu", []))}
    h = data.get("host", {})
    base = Host(ram_bytes=int(h.get("ram_gib", Host().ram_bytes / 2**30) * 2**30), ram_assumed="ram_gib" not in h,
                adam_params_per_s=float(h.get("adam_params_per_s", Host().adam_params_per_s)),
                cores=int(h.get("cores", Host().cores)))
    nodes = []
    for t in data["node"]:
        host = replace(base, ram_bytes=int(t.get("host_ram_gib", base.ram_bytes / 2**30) * 2**30),
                       ram_assumed=base.ram_assumed and "host_ram_gib" not in t,
                       adam_params_per_s=float(t.get("host_adam_params_per_s", base.adam_params_per_s)))
        nodes.append(make_node(t["gpu"], int(t.get("count", 1)), t.get("intra"), t.get("pcie"), host, custom))
    inter_name = data.get("inter") or min((n.gpu.inter for n in nodes), key=lambda k: get_link(k).gbps)
    return Cluster(nodes, get_link(inter_name), str(path))


def _gpu_table(t: dict, path) -> GPU:
    """A [[gpu]] table as a GPU; a missing figure is one error naming it."""
    missing = [k for k in ("name", "memory_gib", "tflops", "hbm_gbps", "pcie_gen") if k not in t]
    if missing:
        raise SnugfitError(f"cluster file {path}: a [[gpu]] table lacks {', '.join(missing)}; give name, memory_gib, "
                           "tflops = { float32 = .., bfloat16 = .. }, hbm_gbps and pcie_gen")
    gpu = GPU(str(t["name"]), int(float(t["memory_gib"]) * 2**30), {k: float(v) for k, v in t["tflops"].items()},
              float(t["hbm_gbps"]), int(t["pcie_gen"]), t.get("nvlink") or None, p2p=bool(t.get("p2p", True)))
    for key in GPU_FIGURES:
        if key in t:
            default = _GPU_DEFAULTS[key]
            setattr(gpu, key, [float(v) for v in t[key]] if isinstance(default, list) else type(default)(t[key]))
    return gpu


# what profile-hardware measures of a card beyond its [[gpu]] table's required figures, written to and read from
# cluster files so that plans for a measured card time its GEMMs by tile and wave (sms), its attention as its
# generation runs it (arch), and its host costs as measured
GPU_FIGURES = ("matmul_efficiency", "mem_efficiency", "sms", "arch", "op_overhead_s", "sac_overhead_s",
               "attention_tflops", "compiled_launch_s")
_GPU_DEFAULTS = {k: getattr(GPU("", 0, {}, 0.0, 0), k) for k in GPU_FIGURES}


def _toml_value(v) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(f"{x:g}" for x in v) + "]"
    return f"{v:g}"


def with_host_ram(cluster: Cluster, ram_bytes: int) -> Cluster:
    """The cluster with every node's host memory set (`--host-ram`)."""
    return replace(cluster, nodes=[replace(n, host=replace(n.host, ram_bytes=ram_bytes, ram_assumed=False))
                                   for n in cluster.nodes])
