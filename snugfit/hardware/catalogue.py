"""Hardware catalogue: GPUs, links and hosts as plain data.

Figures are vendor datasheet numbers for dense math (no sparsity) and per-direction
link bandwidth; `matmul_efficiency` and `mem_efficiency` say what fraction of them
real training kernels reach (guesses for catalogue GPUs, measured for "cpu").
Pure: no torch, so plan/ can use it.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from snugfit.errors import SnugfitError
from snugfit.hardware.load import is_busy, other_load_now

GiB = 1024**3
GB = 1e9


@dataclass
class GPU:
    name: str
    memory_bytes: int
    tflops: dict[str, float]  # dense TFLOPS by dtype: float32 (no TF32), tf32, bfloat16, float16
    hbm_gbps: float  # device memory bandwidth, GB/s
    pcie_gen: int
    nvlink: str | None = None  # intra-node link when the card is an SXM part
    inter: str = "eth-25g"  # default link between nodes of this kind
    matmul_efficiency: float = 0.6
    mem_efficiency: float = 0.75
    context_bytes: int = GiB // 2  # CUDA context + library workspaces, outside the allocator
    # Host time to dispatch one operator under autograd (eager PyTorch): a small microbatch's floor.
    # Measured for this machine's CPU by profile_hardware; for catalogue GPUs, what plain PyTorch's Llama step took
    # per counted operator on an H200's host (10.3 us, docs/gpu.md).
    op_overhead_s: float = 10e-6
    # Host time FSDP2 adds per wrapped unit and microbatch, forward and backward together (its hooks, the copy-in,
    # copy-out and collectives it launches): about 2.6 ms on an H200's host with torch 2.11 (docs/gpu.md: snugfit's
    # engine spent 0.17 s of host time per step of 17 units x 2 microbatches where plain PyTorch, the same
    # operators without FSDP2, spent 0.08 s). One measurement, used for every card. CPU ranks: profile_hardware
    # measures FSDP2's costs instead (plan.cpu_ranks.cpu_fsdp_time).
    unit_overhead_s: float = 2.6e-3
    # [forward, backward] TFLOP/s of causal attention where profile_hardware measured it (calibrate.hardware.
    # attention_tflops): CPU ranks in fp32; GPUs in bf16 (fp16 without it) at head dim 128 and 4,096 tokens, through
    # the kernel torch's SDPA picks; [] elsewhere: GPUs use flash attention's published rates (plan.kernels)
    attention_tflops: list[float] = field(default_factory=list)
    # Host time torch's selective checkpointing adds per forward operator and pass: its policy, a Python dispatch
    # mode, sees every operator in the forward and again in the replay. 13 us on this project's 2-core CPU
    # (profile_hardware measures it), 11-22 us on an H200's host (selective 0.34-0.41 s a step against full
    # recompute's 0.27 s, docs/gpu.md)
    sac_overhead_s: float = 13e-6
    # Host time per kernel a compiled block launches (Plan.compile; profile.compiled counts them), its graph's call
    # and guards spread over them. profile_hardware measures it where it measures a compiled block; elsewhere an
    # estimate, not yet measured on a GPU: inductor's generated code calls each Triton or library kernel from
    # Python, a few microseconds each, where eager dispatches each operator through autograd for ~10 us
    compiled_launch_s: float = 4e-6
    # Host seconds torch.compile takes per kernel of a block's graph it generates (plan.compile_choice: what the
    # first step spends compiling, weighed against the faster steps). profile_hardware measures it where it
    # measures a compiled block (0.1-0.2 s on this project's 2-core CPU, C++ kernels); elsewhere an estimate, not
    # yet measured on a GPU: inductor builds Triton kernels in parallel worker processes, under a second each
    compile_kernel_s: float = 0.5
    # CPU ranks: how fast the kernel pages in a step's fresh large tensors (profile.record.OpCost.fresh_bytes), measured
    # by profile_hardware (3-6 GB/s on this project's 2-core CPU); 0: not charged, as a GPU's caching allocator keeps
    # what it freed
    page_in_bytes_per_s: float = 0.0
    # PCIe peer-to-peer between two such cards; without it NCCL stages GPU-to-GPU traffic through host memory
    # (runtime.dist sets NCCL_P2P_DISABLE=1), at about half the PCIe bandwidth ("pcie4-host" links)
    p2p: bool = True
    sms: int = 0  # streaming multiprocessors (AMD: compute units), which run a GEMM's tiles in waves; 0: unknown
    arch: str = ""  # the generation its kernels are tuned for (plan.kernels: flash attention's rates); "": unknown

    def flops_per_s(self, dtype: str) -> float:
        """Achievable matmul rate; dtypes the card lacks (bf16 on V100/T4) fall back to float16, then float32."""
        return self.peak_flops(dtype)[1] * self.matmul_efficiency

    def peak_flops(self, dtype: str) -> tuple[str, float]:
        """(the dtype its tensor rate is for, dense peak FLOP/s), with flops_per_s's fallbacks."""
        for d in (dtype, "float16", "float32"):
            if self.tflops.get(d):
                return d, self.tflops[d] * 1e12
        raise SnugfitError(f"GPU {self.name} has no TFLOPS figure for {dtype}")

    def mem_bytes_per_s(self) -> float:
        return self.hbm_gbps * GB * self.mem_efficiency


@dataclass
class Link:
    name: str
    gbps: float  # GB/s per direction, achievable by one copy (offload, pipeline sends)
    latency_s: float
    # What NCCL's ring collectives reach over it (nccl-tests "busbw", large messages); 0 where NCCL does not run
    # (gloo ranks, links profile_hardware measured): gbps then. Sources beside LINKS.
    bus_gbps: float = 0.0
    rails: bool = False  # nodes have one such NIC per GPU (DGX/HGX design): NCCL runs a channel over each
    nodes: int = 1  # nodes a collective over it spans (Cluster.link_for); across nodes NCCL may use a tree


# per unit and microbatch: "replicate" (zero 0), "gather" (zero 1-2), "regather" (zero 3's extra);
# per unit and step: "allreduce" (zero 0), "reduce" (zero 1-3), "update" (the optimizer step's DTensor work);
# per pipeline stage and microbatch: "stage" (the pipeline runtime's own work);
# per tensor-parallel block and microbatch: "tp" (DTensor's dispatch and its collectives' latency)
FSDP_COSTS = ("replicate", "gather", "regather", "allreduce", "reduce", "update", "stage", "tp")


@dataclass
class Host:
    ram_bytes: int = 256 * GiB
    # an optimizer step on host tensors, all cores: AdamW on the fp32 master and 2 states, with the gradient's norm,
    # the clip and (offload on GPUs) the cast for the copy back; measured by calibrate.hardware.host_step_params_per_s
    adam_params_per_s: float = 1.5e9
    cores: int = 32
    # What FSDP2 (and pipelining) cost between N local CPU ranks (N = "2", and twice the cores), measured by
    # profile_hardware and used where this host's CPU is the device (plan/timing.py): FSDP_COSTS, each [seconds,
    # seconds per byte of the unit's parameters]; "contention": [how many times slower each rank computes with N
    # running]. Catalogue hosts have none: on GPUs the link's alpha-beta model and overlap with kernels apply.
    fsdp: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # How many times slower one thread computes than the whole CPU: local ranks run one thread each (torchrun
    # sets OMP_NUM_THREADS=1) where the device's rates were measured with all. Measured; None: not yet.
    thread_slowdown: float | None = None
    # a catalogue cluster's default RAM, not one given (--host-ram, a cluster file) or measured: reports say so
    ram_assumed: bool = False


def host_ram() -> int:
    """This machine's physical memory in bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GiB


def _gpu(name, mem_gb, fp32, tf32, bf16, fp16, hbm, pcie, nvlink=None, inter="eth-25g", p2p=True) -> GPU:
    tflops = {"float32": fp32, "tf32": tf32, "bfloat16": bf16, "float16": fp16}
    return GPU(name, int(mem_gb * GiB), {k: v for k, v in tflops.items() if v}, hbm, pcie, nvlink, inter, p2p=p2p)


GPUS: dict[str, GPU] = {g.name: g for g in [
    _gpu("V100-16GB", 16, 15.7, 0, 0, 125, 900, 3, "nvlink2", "ib-hdr"),
    _gpu("V100-32GB", 32, 15.7, 0, 0, 125, 900, 3, "nvlink2", "ib-hdr"),
    _gpu("T4", 16, 8.1, 0, 0, 65, 320, 3),
    _gpu("A10", 24, 31.2, 62.5, 125, 125, 600, 4),
    _gpu("L4", 24, 30.3, 60, 121, 121, 300, 4),
    _gpu("A100-40GB-PCIe", 40, 19.5, 156, 312, 312, 1555, 4, None, "ib-hdr"),
    _gpu("A100-40GB-SXM", 40, 19.5, 156, 312, 312, 1555, 4, "nvlink3", "ib-hdr"),
    _gpu("A100-80GB-PCIe", 80, 19.5, 156, 312, 312, 1935, 4, None, "ib-hdr"),
    _gpu("A100-80GB-SXM", 80, 19.5, 156, 312, 312, 2039, 4, "nvlink3", "ib-hdr"),
    _gpu("RTX3090", 24, 35.6, 35.6, 71, 71, 936, 4),
    # GeForce Ada and Blackwell cards: the driver offers no PCIe peer-to-peer between them
    # (torch.cuda.can_device_access_peer is False; NCCL hangs unless NCCL_P2P_DISABLE=1)
    _gpu("RTX4090", 24, 82.6, 82.6, 165, 165, 1008, 4, p2p=False),
    _gpu("RTX5090", 32, 104.8, 104.8, 209.5, 209.5, 1792, 5, p2p=False),
    _gpu("H100-PCIe", 80, 51, 378, 756, 756, 2000, 5, None, "ib-ndr"),
    _gpu("H100-SXM", 80, 67, 495, 989, 989, 3350, 5, "nvlink4", "ib-ndr"),
    _gpu("H200", 141, 67, 495, 989, 989, 4800, 5, "nvlink4", "ib-ndr"),
    # Sources (dense figures; tensor rates with fp32 accumulation, half the sparse figures vendors headline):
    # NVIDIA RTX A6000 / A5000 datasheets (2021): 38.7 / 27.8 fp32, 309.7 / 222.2 sparse tensor; 768 GB/s
    _gpu("RTX-A6000", 48, 38.7, 77.4, 154.8, 154.8, 768, 4),
    _gpu("RTX-A5000", 24, 27.8, 55.6, 111.1, 111.1, 768, 4),
    # NVIDIA L40S datasheet (2023): 91.6 fp32, 366 tf32 / 733 bf16 sparse; 864 GB/s
    _gpu("L40S", 48, 91.6, 183, 362, 362, 864, 4),
    # A800 / H800: the A100 / H100 SXM for China with NVLink cut to 400 GB/s (NVIDIA A800, H800 datasheets, 2022)
    _gpu("A800-80GB-SXM", 80, 19.5, 156, 312, 312, 2039, 4, "nvlink3-400", "ib-hdr"),
    _gpu("H800", 80, 67, 495, 989, 989, 3350, 5, "nvlink4-400", "ib-ndr"),
    # NVIDIA H100 NVL datasheet (2023): 94 GB, 3.9 TB/s, 60 fp32, 835 tf32 / 1671 bf16 sparse; PCIe 5, NVLink
    # bridges join pairs only, so GPUs of a node talk over PCIe
    _gpu("H100-NVL", 94, 60, 417, 835, 835, 3900, 5, None, "ib-ndr"),
    # The H100 SXM with HBM2e that torchtitan's published H100 runs used (docs/scale.md row 1): "96GB HBM2e with 2.4
    # TB/sec peak memory bandwidth", at "the default 500W power limit" (torchtitan docs/performance.md); 94 GiB and
    # 2.41 TB/s as Ujeniya et al. (arXiv 2604.11391) list their H100 HBM2e nodes. Its tensor peak is not published:
    # torchtitan's authors say it "should be between SXM and NVL" (989 and 835 dense bf16 TFLOPS) and use the SXM's
    # for MFU, as this entry does; the 500 W cap's effect on sustained clocks has no published figure, so it is not
    # modelled (an upper bound on its speed)
    _gpu("H100-SXM-HBM2e", 94, 67, 495, 989, 989, 2410, 5, "nvlink4", "ib-ndr"),
    # NVIDIA Ada whitepaper (RTX 4080) and Ampere GA102 whitepaper (RTX 3080): fp16/bf16 tensor, fp32 accumulate
    _gpu("RTX4080", 16, 48.7, 48.7, 97.5, 97.5, 717, 4, p2p=False),
    _gpu("RTX3080", 10, 29.8, 29.8, 59.5, 59.5, 760, 4),
    # AMD Instinct MI300X datasheet (2023): 192 GB HBM3, 5.3 TB/s, 163.4 fp32, 653.7 tf32, 1307.4 bf16/fp16
    _gpu("MI300X", 192, 163.4, 653.7, 1307.4, 1307.4, 5300, 5, "xgmi-mi300x", "ib-ndr"),
]}

# SM (CU) counts from the vendors' architecture whitepapers and datasheets
SMS = {"V100-16GB": 80, "V100-32GB": 80, "T4": 40, "A10": 72, "L4": 58, "A100-40GB-PCIe": 108, "A100-40GB-SXM": 108,
       "A100-80GB-PCIe": 108, "A100-80GB-SXM": 108, "RTX3090": 82, "RTX4090": 128, "RTX5090": 170, "H100-PCIe": 114,
       "H100-SXM": 132, "H200": 132, "RTX-A6000": 84, "RTX-A5000": 64, "L40S": 142, "A800-80GB-SXM": 108,
       "H800": 132, "H100-NVL": 132, "H100-SXM-HBM2e": 132, "RTX4080": 76, "RTX3080": 68, "MI300X": 304}
for _name, _sms in SMS.items():
    GPUS[_name].sms = _sms
ARCHS = {"volta": ["V100-16GB", "V100-32GB"], "turing": ["T4"],
         "ampere": ["A10", "A100-40GB-PCIe", "A100-40GB-SXM", "A100-80GB-PCIe", "A100-80GB-SXM", "RTX3090", "RTX3080",
                    "RTX-A6000", "RTX-A5000", "A800-80GB-SXM"],
         "ada": ["L4", "RTX4090", "RTX4080", "L40S"],
         "hopper": ["H100-PCIe", "H100-SXM", "H200", "H800", "H100-NVL", "H100-SXM-HBM2e"],
         "blackwell": ["RTX5090"], "cdna3": ["MI300X"]}
for _arch, _names in ARCHS.items():
    for _name in _names:
        GPUS[_name].arch = _arch


def cuda_arch(major: int, minor: int) -> str:
    """The generation of a CUDA compute capability (a measured card's `arch`)."""
    return {7: "turing" if minor >= 5 else "volta", 8: "ada" if minor >= 9 else "ampere", 9: "hopper"}.get(
        major, "blackwell" if major >= 10 else "")

ALIASES = {
    "V100": "V100-32GB", "A100": "A100-80GB-SXM", "A100-40GB": "A100-40GB-SXM", "A100-80GB": "A100-80GB-SXM",
    "H100": "H100-SXM", "H100-80GB": "H100-SXM", "H100-80GB-SXM": "H100-SXM", "H100-80GB-PCIe": "H100-PCIe",
    "H200-141GB": "H200", "RTX-3090": "RTX3090", "RTX-4090": "RTX4090", "RTX-5090": "RTX5090",
    "A6000": "RTX-A6000", "RTXA6000": "RTX-A6000", "A5000": "RTX-A5000", "RTXA5000": "RTX-A5000",
    "A800": "A800-80GB-SXM", "A800-80GB": "A800-80GB-SXM", "H800-80GB": "H800", "H100NVL": "H100-NVL",
    "H100-94GB": "H100-NVL", "RTX-4080": "RTX4080", "RTX-3080": "RTX3080",
    "H100-HBM2e": "H100-SXM-HBM2e", "H100-96GB-HBM2e": "H100-SXM-HBM2e",
}

# bus_gbps, NCCL's achieved bus bandwidth (nccl-tests busbw, ring, large messages):
# - NVLink: about 80% of the line rate, the protocol's overhead (S. Jeaugey, NVIDIA/nccl-tests#212: H100's 450 GB/s
#   give 370 GB/s busbw for ring collectives; its NVLink SHARP all-reduce, ~480, is not modelled); A100: 230 GB/s
#   measured on 8 GPUs (NVIDIA/nccl-tests#175: 232.5; NCCL's tuning caps sm80 at 235 GB/s)
# - PCIe with peer-to-peer: the same 80% of the per-direction rate
# - PCIe through host memory (no peer-to-peer, NCCL's SHM transport): 8 RTX 5090s on PCIe 5 reach 28 GB/s
#   (NVIDIA/nccl#1639); PCIe 4 and 3 pro rata
# - InfiniBand, per NIC: 4 HDR NICs per node reach 91-96 GB/s busbw across nodes, of 100 (NVIDIA/nccl-tests#100,
#   #119): 23 GB/s per 25 GB/s HDR NIC, 46 per NDR NIC. Rails: a node has one per GPU (Cluster.link_for adds them up)
# - Ethernet (TCP sockets) and gloo: the link's own rate
LINKS: dict[str, Link] = {lk.name: lk for lk in [
    Link("pcie3", 12.0, 5e-6, 10.0),
    Link("pcie4", 24.0, 5e-6, 20.0),
    Link("pcie5", 48.0, 5e-6, 40.0),
    # GPU to GPU through host memory (no peer-to-peer): each byte crosses PCIe twice, through a host bounce buffer
    Link("pcie3-host", 6.0, 10e-6, 7.0),
    Link("pcie4-host", 12.0, 10e-6, 14.0),
    Link("pcie5-host", 24.0, 10e-6, 28.0),
    Link("nvlink2", 150.0, 3e-6, 120.0),
    Link("nvlink3", 300.0, 3e-6, 230.0),
    Link("nvlink4", 450.0, 3e-6, 370.0),
    Link("nvlink3-400", 200.0, 3e-6, 160.0),  # A800: 400 GB/s both ways
    Link("nvlink4-400", 200.0, 3e-6, 160.0),  # H800: 400 GB/s both ways
    # MI300X: 7 Infinity Fabric links (896 GB/s in all); what RCCL's rings reach
    Link("xgmi-mi300x", 300.0, 3e-6, 300.0),
    Link("eth-10g", 1.1, 30e-6),
    Link("eth-25g", 2.8, 20e-6),
    Link("eth-100g", 11.0, 10e-6),
    Link("ib-hdr", 23.0, 3e-6, 23.0, rails=True),
    Link("ib-ndr", 46.0, 3e-6, 46.0, rails=True),
    Link("gloo-loopback", 1.0, 50e-6),  # default for local gloo ranks; profile_hardware measures it
]}


# -- the measured local machine ("cpu") --

def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "snugfit"


def hardware_cache_path() -> Path:
    """The measured profile of this machine; $SNUGFIT_HARDWARE_PROFILE puts it elsewhere (bench/ keeps its own
    there, so a benchmark never replaces the user's)."""
    return Path(os.environ.get("SNUGFIT_HARDWARE_PROFILE") or cache_dir() / "hardware.json")


def default_cpu() -> GPU:
    """This machine as a 'device' before it is measured: rough figures for a few AVX2 cores."""
    return GPU("cpu", 8 * GiB, {"float32": 0.1, "bfloat16": 0.0005}, 10.0, 0, None, "gloo-loopback",
               matmul_efficiency=1.0, mem_efficiency=1.0, context_bytes=0)


def _known(cls, d: dict):
    """cls from the fields it has: an older snugfit's cached measurement loads, what it lacks at the default."""
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in d.items() if k in names})


# the host allocator's mmap threshold as snugfit's ranks run (runtime.host_alloc): each tensor this large or more is
# mapped afresh and its pages faulted in at first touch (profile.record.OpCost.fresh_bytes, GPU.page_in_bytes_per_s)
MMAP_THRESHOLD_BYTES = 2**20

MEASUREMENT_VERSION = 8


@dataclass
class LocalHardware:
    """What profile_hardware measured here, in catalogue form."""

    device: GPU
    host: Host
    links: dict[str, Link] = field(default_factory=dict)
    # what was measured how; older measurements are taken again. 2: op_overhead_s per operator of a real model's step
    # (it was a chain of multiplies, per forward + backward pair); 3: CPU attention's rate and selective checkpointing's
    # cost per operator; 4: the one-thread slowdown timed past the thread pool's start; 5: the pipeline stage cost
    # without saved-tensor accounting, FSDP2's costs timed interleaved; 6: attention's rate on GPUs too, and the host's
    # optimizer step as the runtime runs it, past the CPU's caches; 7: a CPU's matmul and memory efficiencies, what a
    # decoder's training step reaches of its measured rates; 8: a CPU's page-in rate for a step's fresh tensors
    version: int = MEASUREMENT_VERSION
    compiled: bool = False  # device.compiled_launch_s was measured here (taken where compiled blocks are planned)
    measured_at: float = 0.0  # unix time
    other_load: float | None = None  # the share of the cores other work used meanwhile (hardware.load)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "LocalHardware":
        links = {k: Link(**v) for k, v in d.get("links", {}).items()}
        compiled = d.get("compiled", False) and "compile_kernel_s" in d["device"]  # else measured again
        return cls(_known(GPU, d["device"]), _known(Host, d["host"]), links, d.get("version", 1), compiled,
                   d.get("measured_at", 0.0), d.get("other_load"))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))


def load_local(path: str | Path | None = None) -> LocalHardware | None:
    """This machine's cached measurement; None (measure it again): none, an older snugfit's, or a load's since gone."""
    p = Path(path) if path else hardware_cache_path()
    if not p.exists():
        return None
    local = LocalHardware.from_dict(json.loads(p.read_text()))
    # what the time model uses all measured, one-thread ranks included, and not under other jobs' load that has gone
    complete = (local.version == MEASUREMENT_VERSION
                and all(set(FSDP_COSTS) <= set(c) for c in local.host.fsdp.values())
                and not (local.device.name == "cpu" and local.host.thread_slowdown is None)
                and not (is_busy(local.other_load) and not is_busy(other_load_now())))
    return local if complete else None


def _suggest(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    close = close or difflib.get_close_matches(name.upper(), [k.upper() for k in known], n=3, cutoff=0.5)
    return f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(sorted(known))}"


def get_gpu(name: str) -> GPU:
    """A catalogue GPU by name (case-insensitive, aliases allowed); 'cpu' is this machine as measured."""
    if name.lower() == "cpu":
        local = load_local()
        return local.device if local else default_cpu()
    by_lower = {k.lower(): k for k in [*GPUS, *ALIASES]}
    key = by_lower.get(name.lower())
    if key is None:
        raise SnugfitError(f"unknown GPU {name!r}; {_suggest(name, [*GPUS, *ALIASES, 'cpu'])}")
    return GPUS[ALIASES.get(key, key)]


_VENDOR_WORDS = {"NVIDIA", "GEFORCE", "TESLA", "QUADRO", "AMD", "INSTINCT", "RADEON"}
_FORM_WORDS = {"SXM": "SXM", "SXM2": "SXM", "SXM4": "SXM", "SXM5": "SXM", "PCIE": "PCIE", "NVL": "NVL"}


def _name_parts(name: str) -> tuple[str, str | None, int | None]:
    """(model, form factor, GB) of a GPU name: 'NVIDIA A100-SXM4-80GB' -> ('A100', 'SXM', 80),
    'NVIDIA GeForce RTX 4090' -> ('RTX4090', None, None). Memory-type words (HBM3) say nothing of the model."""
    model, form, gb = [], None, None
    for word in re.split(r"[\s\-_]+", name.upper()):
        if not word or word in _VENDOR_WORDS or re.fullmatch(r"HBM\d*E?", word):
            continue
        if word in _FORM_WORDS:
            form = _FORM_WORDS[word]
        elif m := re.fullmatch(r"(\d+)GB", word):
            gb = int(m[1])
        else:
            model.append(word)
    return "".join(model).removeprefix("RTX"), form, gb


def gpu_for_device(device_name: str, memory_bytes: int | None = None) -> GPU | None:
    """The catalogue entry of a card as torch names it ('NVIDIA H100 80GB HBM3', 'Tesla V100-SXM2-32GB'),
    or None when the catalogue lacks it (the caller then measures the card instead of refusing it).

    The model must match exactly ('RTX 3090 Ti' is not an 'RTX3090'); a form factor the name states
    (PCIe, SXM, NVL) must match the entry's, where an unstated one prefers the SXM part, as torch names
    SXM cards without it ('NVIDIA H100 80GB HBM3'); memory picks among the rest and must agree within 10%.
    """
    model, form, gb = _name_parts(device_name)
    memory = gb * GiB if gb else memory_bytes
    candidates = []
    for gpu in GPUS.values():
        g_model, g_form, _ = _name_parts(gpu.name)
        g_form = g_form or ("SXM" if gpu.nvlink else "PCIE")
        if g_model != model or (form and form != g_form):
            continue
        if memory and abs(gpu.memory_bytes / memory - 1) > 0.1:
            continue
        candidates.append((abs(gpu.memory_bytes - memory) if memory else 0, g_form != "SXM", gpu.name))
    return GPUS[min(candidates)[2]] if candidates else None


def measured_card(device_name: str, memory_bytes: int, sms: int, local: LocalHardware | None) -> GPU | None:
    """This card as `snugfit profile-hardware` measured it on this machine (its rates, attention, host costs), under
    the catalogue's name and links where the catalogue lists it; None when the cached measurement is of no such
    card (its memory and SM count tell)."""
    if local is None or (local.device.memory_bytes, local.device.sms) != (memory_bytes, sms):
        return None
    listed = gpu_for_device(device_name, memory_bytes)
    if listed is None:
        return replace(local.device, name=device_name)
    return replace(local.device, name=listed.name, nvlink=listed.nvlink, inter=listed.inter, p2p=listed.p2p)


def get_link(name: str) -> Link:
    local = load_local()
    if local and name in local.links:
        return local.links[name]
    if name not in LINKS:
        raise SnugfitError(f"unknown link {name!r}; {_suggest(name, list(LINKS))}")
    return LINKS[name]
