"""Measure what CPU ranks on this machine cost each other: collective bandwidth between local gloo ranks, FSDP2's,
tensor parallelism's and the pipeline runtime's own costs among them, and how much they slow one another down when
more ranks than cores share it. profile_hardware stores it in Host.fsdp for the time model (plan.timing).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch

from snugfit.calibrate.timers import best_time, interleaved_times, typical_time
from snugfit.hardware.catalogue import Host, Link
from snugfit.runtime.spawn import forkserver, free_port


FSDP_UNITS = 4  # blocks timed for FSDP2's own costs
FSDP_WIDTHS = (32, 256)  # two block widths: a line through them gives a fixed and a per-byte cost
FSDP_ROUNDS = 11  # rounds in which every variant below runs once
FSDP_VARIANTS = {  # the decoder's wrappings whose differences are FSDP2's costs (make_step's arguments)
    "plain": {}, "plain_update": {"update": True},
    "replicated": {"wrap": "replicate"}, "synced": {"wrap": "replicate", "sync": True},
    "updated": {"wrap": "replicate", "sync": True, "update": True},
    "kept": {"wrap": "shard"}, "regathered": {"wrap": "shard", "reshard": True},
    "reduced": {"wrap": "shard", "sync": True},
}


def _fsdp_costs(world: int) -> dict[str, list[float]]:
    """FSDP2's costs between `world` ranks on this machine's CPU, each as [seconds, seconds per byte of the
    unit's parameters], for units wrapped as runtime/sharding.py wraps them: "replicate" per unit and
    microbatch of zero 0 (HSDP over (world, 1): copies and hooks, no collective), "gather" the same for zero 1-2
    (forward all-gather), "regather" the extra of zero 3 (backward gathers again); per unit and step,
    "allreduce" (zero 0) and "reduce" (zero 1-3, reduce-scatter) for the gradient sync, and "update": the
    runtime's update of the unit's DTensors (global norm, AdamW) beyond what a plain fused AdamW costs.

    Measured rather than derived from the link: on CPU these collectives, FSDP2's copies and
    its hooks share the cores with compute, and dominate the step of a small model. The units are the
    built-in decoder's blocks (and its root: embedding, norm, head), at two widths: FSDP2's cost depends on
    the unit's tensors and hooks, not only its bytes, and the planner applies it to decoder blocks.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.runtime.grad_norm import global_grad_norm
    from snugfit.runtime.optimizer import OptimConfig, make_adamw

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "one"))
    meshes = {"replicate": mesh, "shard": mesh["dp"]}
    units = FSDP_UNITS + 1  # the blocks and the root

    def make_step(cfg: ModelConfig, wrap: str | None = None, reshard: bool = False, sync: bool = False,
                  update: bool = False) -> Callable[[], None]:
        """A forward and backward (and, with `update`, the runtime's update after it) of a decoder so wrapped."""
        torch.manual_seed(0)
        model = Decoder(cfg)
        if wrap is not None:
            for block in model.blocks.values():
                fully_shard(block, mesh=meshes[wrap], reshard_after_forward=reshard)
            fully_shard(model, mesh=meshes[wrap])
            model.set_requires_gradient_sync(sync)
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))
        params = list(model.parameters())
        optimizer = make_adamw(params, OptimConfig())

        def step():
            model(tokens[:, :-1], tokens[:, 1:]).backward()
            if update:
                global_grad_norm([(p, p.grad) for p in params], torch.device("cpu")).item()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return step

    points: dict[str, list[tuple[float, float]]] = {}
    for width in FSDP_WIDTHS:
        cfg = ModelConfig(dim=width, n_layers=FSDP_UNITS, n_heads=4, vocab_size=64, max_seq_len=16)
        nbytes = 4 * sum(p.numel() for p in Decoder(cfg).blocks["0"].parameters())
        steps = {name: make_step(cfg, **kw) for name, kw in FSDP_VARIANTS.items()}
        times = interleaved_times(steps, FSDP_ROUNDS, torch.distributed.barrier)

        def added(a: str, b: str) -> list[float]:
            """What variant a adds to b in each round: a drift of the machine's speed hits both alike."""
            return [x - y for x, y in zip(times[a], times[b])]

        # the runtime's update beyond what a plain fused AdamW adds: the time model's AdamW rate covers that
        update = [x - y for x, y in zip(added("updated", "synced"), added("plain_update", "plain"))]
        for name, diffs in (("replicate", added("replicated", "plain")), ("gather", added("kept", "plain")),
                            ("regather", added("regathered", "kept")), ("allreduce", added("synced", "replicated")),
                            ("reduce", added("reduced", "kept")), ("update", update)):
            points.setdefault(name, []).append((nbytes, max(statistics.median(diffs) / units, 0.0)))
    out = {}
    for name, ((b1, t1), (b2, t2)) in points.items():
        per_byte = max((t2 - t1) / (b2 - b1), 0.0)
        out[name] = [max(t1 - per_byte * b1, 0.0), per_byte]
    return out


def _tensor_parallel_cost(world: int) -> float:
    """Seconds per block and microbatch that tensor parallelism over `world` ranks adds on CPU ranks beyond the
    split compute: DTensor's per-operator dispatch and redistribution, and its collectives' latency. Measured on
    a decoder so narrow that its compute is negligible, through runtime.tensor_parallel itself."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.runtime.tensor_parallel import apply_tp

    cfg = ModelConfig(dim=8 * world, n_layers=FSDP_UNITS, n_heads=world, vocab_size=16 * world, max_seq_len=4 * world)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))

    def step_time(model: Decoder, loss: Callable = nullcontext) -> float:
        def step():
            with loss():  # the split head's logits stay split by vocabulary: torch's loss_parallel, as engines run it
                model(tokens[:, :-1], tokens[:, 1:]).backward()
        step()
        torch.distributed.barrier()
        return typical_time(step, 9)

    torch.manual_seed(0)
    plain = step_time(Decoder(cfg))
    split = Decoder(cfg)
    apply_tp(split, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    return max(0.0, step_time(split, loss_parallel) - plain) / (FSDP_UNITS + 2)  # per piece: blocks, embedding, head


PIPE_EXTRA_MICROBATCHES = 6  # two 1F1B steps, with as many microbatches as stages and this many more


def _pipeline_stage_cost(world: int, replicate: list[float]) -> float:
    """Seconds per microbatch and pipeline stage that the pipeline runtime adds on CPU ranks beyond compute and
    FSDP2 (PipelineStage's bookkeeping, point-to-point transfers that spend both ranks' cores): the slope over microbatches of a 1F1B step through `world` one-block stages of a
    tiny decoder, less what the time model already charges a stage per microbatch (its two FSDP2 units as
    `replicate`, and its compute). Measured through the runtime itself: those costs are its own."""
    from snugfit.model.decoder import Decoder, ModelConfig
    from snugfit.plan.plan import Plan
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.dist import DistEnv
    from snugfit.runtime.optimizer import OptimConfig

    cfg = ModelConfig(dim=16, n_layers=world, n_heads=2, vocab_size=32, max_seq_len=8)
    rank = torch.distributed.get_rank()
    env = DistEnv(rank, world, rank, torch.device("cpu"))

    def step_time(m: int) -> float:
        plan = Plan.uniform(world, dp=1, pp=world, schedule="1f1b", micro_batch_size=1, num_microbatches=m,
                            seq_len=cfg.max_seq_len)
        torch.manual_seed(0)
        engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
        engine.track_memory = False
        tokens = torch.randint(0, cfg.vocab_size, (m, cfg.max_seq_len + 1))
        engine.train_step(tokens)
        torch.distributed.barrier()
        return typical_time(lambda: engine.train_step(tokens), 7)

    slope = (step_time(world + PIPE_EXTRA_MICROBATCHES) - step_time(world)) / PIPE_EXTRA_MICROBATCHES
    model = Decoder(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, cfg.max_seq_len + 1))
    compute = typical_time(lambda: model(tokens[:, :-1], tokens[:, 1:]).backward(), 7) / world
    return max(0.0, slope - 2 * replicate[0] - compute)


def _compute_probe() -> float:
    """Seconds of a fixed single-threaded matmul loop (about 0.3 s here): timed alone, then on every rank at
    once. The whole loop, not the best of short runs: ranks crowding the cores take turns in time slices."""
    a = torch.randn(256, 256)
    a @ a
    t0 = time.perf_counter()
    for _ in range(300):
        a @ a
    return time.perf_counter() - t0


def _collective_worker(rank: int, world: int, port: int, out: str, nbytes: int) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    # a peer that never comes fails the measurement in two minutes, not gloo's default half hour
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        x = torch.ones(nbytes // 4)
        small = torch.ones(1)
        dist.all_reduce(x)
        dist.barrier()
        lat = best_time(lambda: dist.all_reduce(small), 5)
        t = best_time(lambda: dist.all_reduce(x), 3)
        fsdp = _fsdp_costs(world)
        fsdp["stage"] = [_pipeline_stage_cost(world, fsdp["replicate"]), 0.0]
        fsdp["tp"] = [_tensor_parallel_cost(world), 0.0]
        dist.barrier()
        together = _compute_probe()
        if rank == 0:
            # ring all-reduce moves 2 (w-1)/w of the buffer over each rank's link
            gbps = 2 * (world - 1) / world * nbytes / max(t - lat, 1e-9) / 1e9
            Path(out).write_text(json.dumps({"gbps": gbps, "latency": lat, "fsdp": fsdp, "together": together}))
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int = 2, nbytes: int = 16 * 2**20) -> tuple[Link, dict[str, list[float]], float]:
    """All-reduce bus bandwidth and latency between `world` local gloo processes, FSDP2's costs there
    (`_fsdp_costs`), and how long `_compute_probe` takes while every rank runs it."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "result")
        # forked from the fork server: the children skip re-importing torch (seconds on a busy machine), and none
        # is a fork of this process, whatever threads it runs
        forkserver()
        mp.start_processes(_collective_worker, args=(world, free_port(), out, nbytes), nprocs=world, join=True,
                           start_method="forkserver")
        r = json.loads(Path(out).read_text())
    return Link("gloo-loopback", r["gbps"], r["latency"]), r["fsdp"], r["together"]


MAX_CROWDED = 8  # most local ranks measured (twice the cores, on machines small enough to be crowded)


def measure_local_ranks(host: Host) -> Link:
    """Fill host.fsdp for 2 local ranks and for twice as many ranks as cores (where ranks crowd the cores);
    return the gloo link measured between 2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank runs
    alone = _compute_probe()
    torch.set_num_threads(threads)
    link = None
    for world in sorted({2} | ({2 * host.cores} if 2 * host.cores <= MAX_CROWDED else set())):
        measured, costs, together = measure_collectives(world)
        link = link or measured
        host.fsdp[str(world)] = {**costs, "contention": [max(1.0, together / alone)]}
    return link
