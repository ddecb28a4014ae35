"""Pipeline runtime: losses and gradients equal a single-process reference; stages hold what the schedule says.

Spawns are the cost here (seconds each on a loaded machine), so every 4-rank
configuration runs in one spawn and each configuration checks several things.
Each rank compares its own gradient shards (device or host) with a reference
it computes itself, and reports what did not match.
"""

import os
import time
from dataclasses import replace

import pytest
import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.plan import BlockPlan, Plan, PlanError
from snugfit.plan.schedules import SCHEDULES, programs
from snugfit.plan.simulate import simulate
from snugfit.runtime.microbatches import split_batch
from snugfit.runtime.optimizer import OptimConfig
from snugfit.runtime.build import build_engine
from snugfit.runtime.p2p import PipelineError
from tests.distributed import check_update_gradients, run_ranks

SEQ, MICRO = 16, 4
KEEP = ["keep"]

# name -> (blocks, Plan.uniform arguments, per-block policies, vocabulary, extras)
CONFIGS = {
    # 1F1B; every stage has a "keep" block (p - s resident microbatches) next to recompute/selective/offload ones
    # (block 6 begins the last stage: its checkpoint, offloaded, is the buffer the stage received)
    "1f1b": (8, dict(pp=4, schedule="1f1b"), ["recompute", "keep", "selective", "keep", "offload", "keep",
                                              "recompute_offload", "keep"], 64, {}),
    "interleaved": (8, dict(pp=4, schedule="interleaved", virtual_stages=2), KEEP, 64, {}),
    # BPipe, uneven on purpose: the last stage also holds logits, so give it 1 block and a wide vocabulary
    "bpipe": (8, dict(pp=4, schedule="bpipe"), KEEP, 1536, dict(stage_blocks=[2, 2, 3, 1])),
    # pp x dp, sharded inside stages (zero 3, parameter offload on odd blocks), on instruction batches
    "pp2xdp2-zero3": (4, dict(pp=2, dp=2, schedule="1f1b", block=BlockPlan(zero=3)), KEEP, 64,
                      dict(offload_params=[1, 3], instruct=True)),
    # BPipe with recomputation on ZeRO-2 blocks whose optimizer lives on host (selective's kept outputs evicted too)
    "pp2xdp2-bpipe-zero2-offload": (4, dict(pp=2, dp=2, schedule="bpipe",
                                            block=BlockPlan(zero=2, placement="host_step")),
                                    ["selective", "recompute"], 64, dict(evict_bound=1)),
    # zero bubble, V-shaped: 8 stages of one block on 4 ranks; the weight backward unpacks what the input backward
    # did once more (recomputed blocks recompute again, offloaded ones copy back again)
    "zbv": (8, dict(pp=4, schedule="zbv"), ["recompute", "keep", "offload", "keep"], 64, {}),
    # interleaved zero bubble over pp x dp, ZeRO-3 blocks gathered again for the weight backward
    "pp2xdp2-interleaved_zb-zero2": (4, dict(pp=2, dp=2, schedule="interleaved_zb", virtual_stages=2,
                                             block=BlockPlan(zero=2)), KEEP, 64, {}),
}


def _cfg(n_blocks: int, vocab: int) -> ModelConfig:
    return ModelConfig(dim=32, n_layers=n_blocks, n_heads=4, vocab_size=vocab, max_seq_len=SEQ)


def _setup(name: str):
    """Model config, plan and the global batch (all dp ranks) of a configuration."""
    n, spec, policies, vocab, extra = CONFIGS[name]
    plan = Plan.uniform(n, micro_batch_size=2, num_microbatches=MICRO, seq_len=SEQ, **spec)
    plan.blocks = [replace(b, activations=policies[i % len(policies)],
                           placement="params_on_host" if i in extra.get("offload_params", ()) else b.placement)
                   for i, b in enumerate(plan.blocks)]
    plan.stage_blocks = extra.get("stage_blocks", plan.stage_blocks)
    plan.shape = replace(plan.shape, evict_bound=extra.get("evict_bound"))
    plan.validate(n_blocks=n, world_size=4)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (plan.global_batch, SEQ + 1), generator=gen)
    if not extra.get("instruct"):
        return _cfg(n, vocab), plan, tokens
    targets = tokens.clone()
    targets[:, : SEQ // 2] = -100  # the prompt: no loss
    return _cfg(n, vocab), plan, torch.stack([tokens, targets], dim=1)


def _reference(cfg: ModelConfig, plan: Plan, batch: torch.Tensor):
    """Plain Decoder, one process: mean loss over all microbatches of all dp ranks, and its gradients."""
    torch.manual_seed(0)
    model = Decoder(cfg)
    micro = [mb for rank_batch in batch.chunk(plan.dp) for mb in split_batch(rank_batch, plan)]
    total = 0.0
    for mb in micro:
        loss = model(*mb) / len(micro)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad for n, p in model.named_parameters()}


def _run(env, name: str) -> dict:
    """Eval, then one train step of a configuration on this rank, checked against the reference here."""
    cfg, plan, batch = _setup(name)
    ref_loss, ref_grads = _reference(cfg, plan, batch)
    torch.manual_seed(0)
    engine = build_engine(Decoder(cfg), plan, OptimConfig(grad_clip=0.0), env)
    checked, bad = [], []
    update = check_update_gradients(engine, ref_grads, checked, bad)
    rank_batch = batch.chunk(plan.dp)[env.rank % plan.dp]
    eval_loss = engine.eval_loss(rank_batch)
    result = engine.train_step(rank_batch)
    stats = engine.stage_stats()
    engine._update, engine.track_memory = update, False  # a step whose memory nobody counts
    engine.train_step(rank_batch)
    return {"loss": result.loss, "eval": eval_loss, "ref_loss": ref_loss, "checked": checked, "bad": bad,
            "stats": stats, "uncounted": engine.stage_stats(), "names": sorted(engine.state_dict()["model"])}


def _gathers_per_step(env) -> dict[str, int]:
    """FSDP2's all-gathers in a step of pp 2 x dp 2, ZeRO-2, 4 microbatches (at its private foreach_all_gather)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group

    from snugfit.runtime.build import build_engine

    real, calls, out = param_group.foreach_all_gather, [], {}

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    param_group.foreach_all_gather = counted
    try:
        for schedule in ("1f1b", "bpipe"):
            plan = Plan.uniform(4, pp=2, dp=2, schedule=schedule, block=BlockPlan(zero=2), root=BlockPlan(zero=2),
                                num_microbatches=4, seq_len=16)
            engine = build_engine(Decoder(_cfg(4, 64)), plan, OptimConfig(), env)
            batch = torch.randint(0, 64, (4, 17))  # this rank's 4 microbatches of 1
            engine.train_step(batch)  # the first step also infers shapes
            calls.clear()
            engine.train_step(batch)
            out[schedule] = len(calls)
            del engine  # one pipeline engine at a time: live ones would share the gloo pairs
    finally:
        param_group.foreach_all_gather = real
    return out


def _four_rank_checks(env) -> dict:
    out = {}
    for name in CONFIGS:
        start = time.monotonic()
        out[name] = _run(env, name)
        out[name]["seconds"] = time.monotonic() - start
    out["gathers"] = _gathers_per_step(env)
    return out


@pytest.fixture(scope="module")
def four_ranks():
    results = run_ranks(_four_rank_checks, 4)
    return {name: [r[name] for r in results] for name in [*CONFIGS, "gathers"]}


def test_zero2_units_gather_once_a_step_under_1f1b_and_bpipe(four_ranks):
    assert four_ranks["gathers"] == [{"1f1b": 3, "bpipe": 3}] * 4  # a stage's 2 blocks and root, 4 microbatches


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_single_process(four_ranks, name):
    n, _, _, vocab, _ = CONFIGS[name]
    for r in four_ranks[name]:
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert r["eval"] == pytest.approx(r["ref_loss"], rel=1e-5)  # forward-only path
        assert not r["bad"], r["bad"]
    every = {p for p, _ in Decoder(_cfg(n, vocab)).named_parameters()}
    assert set().union(*(r["checked"] for r in four_ranks[name])) == every, "every gradient checked on some rank"
    # checkpoints: full-model names, whatever the split, sharding or offload
    assert set().union(*(r["names"] for r in four_ranks[name])) == every


def test_1f1b_stage_s_holds_p_minus_s_microbatches(four_ranks):
    assert [r["stats"]["peak_microbatches"] for r in four_ranks["1f1b"]] == [4, 3, 2, 1]
    assert [r["uncounted"]["peak_microbatches"] for r in four_ranks["1f1b"]] == [0] * 4  # an uncounted step: none
    assert four_ranks["bpipe"][0]["uncounted"]["evictions"] > 0  # recorded all the same under BPipe, which moves them


def test_bpipe_keeps_bound_and_balances_memory(four_ranks):
    stats = [r["stats"] for r in four_ranks["bpipe"]]
    assert max(s["peak_microbatches"] for s in stats) <= 3, stats  # bpipe_bound at p=4
    assert stats[0]["evictions"] > 0 and stats[3]["accepted"] == stats[0]["evictions"], stats
    # Stage 3 holds its own microbatch and one of stage 0's, as planned, when stage 0's sends arrive before its
    # own backward of that microbatch; its receiving thread may run later on busy cores, and then it holds less.
    # So the balance is checked on what it holds as planned, and the measured peak never exceeds that.
    peak = [s["peak_activation_bytes"] for s in stats]
    planned = peak[:3] + [stats[3]["peak_own_bytes"] + stats[3]["largest_accepted_bytes"]]
    assert stats[3]["largest_accepted_bytes"] > 0 and peak[3] <= planned[3], stats
    assert max(planned) / min(planned) <= 1.3, planned
    # bound 1 at p=2 (ranks: stage * dp + dp_rank): the heavy stage holds one microbatch; the light one
    # holds its own and, depending on timing, one or two of its partner's
    stats = [r["stats"] for r in four_ranks["pp2xdp2-bpipe-zero2-offload"]]
    assert [s["peak_microbatches"] for s in stats[:2]] == [1, 1], stats
    assert all(2 <= s["peak_microbatches"] <= 3 for s in stats[2:]), stats
    assert [s["accepted"] for s in stats[2:]] == [s["evictions"] for s in stats[:2]] == [MICRO, MICRO], stats


@pytest.mark.parametrize("p", [2, 3, 4, 5, 8])
def test_bpipe_program_keeps_bound(p):
    for m in (p, p + 1, 2 * p):
        for bound in range(1, p + 1):
            for stage in range(p):
                program = [(a.kind, a.mb) for a in programs("bpipe", p, 1, m, bound)[stage]]
                assert [a for a in program if a[0] in "FB"] == [(a.kind, a.mb) for a in
                                                               SCHEDULES["1f1b"].order(p, 1, m, stage)]
                resident, evicted = set(), set()
                for op, mb in program:
                    if op == "F":
                        resident.add(mb)
                    elif op == "EVICT":
                        resident.remove(mb), evicted.add(mb)
                    elif op == "LOAD":
                        evicted.remove(mb), resident.add(mb)
                    else:
                        assert mb in resident, "backward of an evicted microbatch"
                        resident.remove(mb)
                    if stage < p - 1 - stage:
                        assert len(resident) <= bound
                assert not resident and not evicted


@pytest.mark.parametrize("p", [2, 4, 5])
def test_time_model_moves_activations_as_bpipe_program_does(p):
    """The memory model reads what each rank holds from the simulation, so its evictions and loads are the runtime's."""
    for m in (p, 2 * p + 1):
        for bound in range(1, p + 1):
            sim = simulate("bpipe", p, m, [1.0] * p, [2.0] * p, bound=bound, move=[0.1] * p)
            for stage in range(p):
                moves = [(e.kind.upper(), e.stage, e.mb) for e in sim.events if e.rank == stage]
                assert moves == [tuple(a) for a in programs("bpipe", p, 1, m, bound)[stage]], (m, bound, stage)


def test_split_batch_takes_instruction_pairs():
    plan = Plan.uniform(1, micro_batch_size=2, num_microbatches=2, seq_len=4)
    batch = torch.arange(4 * 2 * 5).view(4, 2, 5)
    (x0, y0, d0), (x1, y1, _) = split_batch(batch, plan)
    assert torch.equal(torch.cat([x0, x1]), batch[:, 0, :-1]) and torch.equal(torch.cat([y0, y1]), batch[:, 1, 1:])
    assert d0 is None  # no document ids: not packed
    (x0, y0, _), _ = split_batch(batch[:, 0], plan)  # a token stream: targets are the inputs shifted
    assert torch.equal(x0, batch[:2, 0, :-1]) and torch.equal(y0, batch[:2, 0, 1:])
    with pytest.raises(PlanError, match=r"\(4, 2, 5\)"):
        split_batch(batch[:, :, :-1], plan)


DEAD_PEER_TIMEOUT_S = 3


def _dead_peer(env) -> dict:
    engines = {}
    for schedule in ("bpipe", "1f1b"):
        plan = Plan.uniform(2, pp=2, schedule=schedule, micro_batch_size=1, num_microbatches=2, seq_len=SEQ)
        engines[schedule] = build_engine(Decoder(_cfg(2, 64)), plan, OptimConfig(),
                                                  replace(env, timeout_s=DEAD_PEER_TIMEOUT_S))
    if env.rank == 1:
        return {}  # built its stages, then leaves without stepping
    out = {}
    for schedule, engine in engines.items():
        start = time.monotonic()
        try:
            engine.train_step(torch.randint(0, 64, (2, SEQ + 1)))
            out[schedule] = ("no error", 0.0)
        except PipelineError as err:
            out[schedule] = (str(err), time.monotonic() - start)
    return out


def test_dead_peer_names_the_stage():
    results, _ = run_ranks(_dead_peer, 2)
    for schedule, (message, elapsed) in results.items():
        assert "stage" in message and "0" in message and "rank 0" in message, (schedule, message)
        assert elapsed < 5 * DEAD_PEER_TIMEOUT_S, (schedule, elapsed)


def _rebuilt_engines(env) -> list[int]:
    """Native threads of this rank after each of several engines built in turn (pipelines and data parallel)."""
    import os

    from snugfit.runtime.build import build_engine

    cfg = _cfg(4, 64)
    plans = [Plan.uniform(4, pp=2, schedule="bpipe", num_microbatches=2, seq_len=16),
             Plan.uniform(4, dp=2, block=BlockPlan(zero=2), num_microbatches=2, seq_len=16)]
    threads = []
    for i in range(6):
        engine = build_engine(Decoder(cfg), plans[i % 2], OptimConfig(), env)
        engine.train_step(torch.randint(0, 64, (2, 17)))  # each rank: 2 microbatches of 1
        del engine
        threads.append(len(os.listdir("/proc/self/task")))
    return threads


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux /proc")
def test_engines_built_one_after_another_reuse_their_process_groups():
    """Each gloo group starts threads that torch never stops: an engine per plan must not add groups."""
    for threads in run_ranks(_rebuilt_engines, 2):
        assert threads[2:] == threads[2:3] * 4, threads  # after both kinds were built once, no growth


def test_a_stage_posts_its_sends_in_one_batch_with_its_next_receive(monkeypatch):
    """NCCL blocks an unbatched send until matched: neighbours that both send, then receive, must batch."""
    from types import SimpleNamespace

    import snugfit.runtime.p2p as schedules

    batches = []
    monkeypatch.setattr(schedules.dist, "batch_isend_irecv",
                        lambda ops: batches.append([(op.op.__name__, op.peer) for op in ops]) or [None] * len(ops))
    monkeypatch.setattr(schedules.dist, "get_process_group_ranks", lambda group: [10, 11, 12])
    monkeypatch.setattr(schedules.dist, "P2POp", lambda op, tensor, peer, group, tag: SimpleNamespace(
        op=op, tensor=tensor, peer=peer))
    comms = schedules.StageComms(object(), stage=1, num_stages=3, timeout_s=1)
    monkeypatch.setattr(comms, "wait", lambda work, action: None)
    y = torch.zeros(2)
    comms.send_forward(y, 0)  # steady 1F1B: forward out to stage 2 ...
    assert batches == []  # ... not posted alone
    comms.recv_backward(y, 0)  # ... then its gradient in from stage 2
    comms.send_backward(y, 0)
    comms.finish_sends()
    assert batches == [[("isend", 12), ("irecv", 12)], [("isend", 10)]]


def test_bpipe_partner_receives_evicted_activations_into_device_memory(monkeypatch):
    """The heavy stage sends device buffers; the partner must receive on its device (one backend for both)."""
    from types import SimpleNamespace

    import snugfit.runtime.bpipe as schedules
    from snugfit.plan.schedules import Action

    received = []

    def recv(t, stage, tag, action, group=None):
        received.append(t)
        return t.fill_(7) if t.dtype == torch.int64 else t

    comms = SimpleNamespace(recv=recv, timeout_s=1, stage=3)
    accepted = {}
    acts = SimpleNamespace(accept=lambda key, flat: accepted.update({key: flat}))
    store = schedules.PartnerStore(comms, None, heavy=0, moves=[Action("EVICT", 0, 0)], acts=acts,
                                   device=torch.device("meta"))
    store.accept(0)
    count, sizes, *parts = received  # 7 storages of 7 bytes, one message each
    assert count.device.type == sizes.device.type == "cpu" and sizes.tolist() == [7] * 7
    assert len(parts) == 7 and all(p.device.type == "meta" and p.numel() == 7 for p in parts)
    assert accepted[(0, 0)].device.type == "meta" and accepted[(0, 0)].numel() == 49


def test_eviction_sends_the_saved_storages_themselves_and_frees_them_once_sent():
    """No concatenated copy (it would briefly double the microbatch on the heavy stage): the tensors to send are
    the saved storages; freeing empties every alias; load re-allocates them for the bytes to come back."""
    from snugfit.runtime.stage_activations import StageActivations

    lin = torch.nn.Linear(8, 8)
    acts = StageActivations([lin])
    x = torch.randn(4, 8, requires_grad=True)
    with acts.microbatch("mb"):
        y = torch.tanh(lin(x * 2))
    saved = acts._storages("mb")
    views = acts.evict("mb")
    assert sorted(v.data_ptr() for v in views) == sorted(s.data_ptr() for s in saved)
    kept = [v.clone() for v in views]  # what the partner would hold
    StageActivations.free(views)
    assert all(s.nbytes() == 0 for s in saved)
    for view, data in zip(acts.load("mb"), kept):
        view.copy_(data)  # as the receive does
    y.sum().backward()
    reference = torch.autograd.grad(torch.tanh(lin(x.detach().requires_grad_() * 2)).sum(), lin.weight)[0]
    torch.testing.assert_close(lin.weight.grad, reference)


def _bf16_stages(env) -> dict:
    """A 2-stage bf16 pipeline of each kind: what stage 0 sends, and the step's loss."""
    out = {}
    for schedule in ("1f1b", "bpipe"):
        cfg = _cfg(2, 64)
        plan = Plan.uniform(2, pp=2, schedule=schedule, micro_batch_size=2, num_microbatches=2, seq_len=SEQ,
                            compute_dtype="bfloat16")
        torch.manual_seed(0)
        engine = build_engine(Decoder(cfg), plan, OptimConfig(), env)
        sent = []
        engine.runner.stages[0].register_forward_hook(lambda m, a, y: sent.append(y.dtype))
        batch = torch.randint(0, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
        out[schedule] = (engine.train_step(batch).loss, sent[-1])
    return out


def test_bf16_stages_send_bf16_hidden_states():
    """Half the bytes of fp32 between stages, as the time model charges; the last stage's output stays fp32."""
    from snugfit.runtime.build import build_engine
    from snugfit.runtime.dist import DistEnv

    torch.manual_seed(0)
    plan = Plan.uniform(2, micro_batch_size=2, num_microbatches=2, seq_len=SEQ, compute_dtype="bfloat16")
    batch = torch.randint(0, 64, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    reference = build_engine(Decoder(_cfg(2, 64)), plan, OptimConfig(), DistEnv()).train_step(batch).loss
    for rank, result in enumerate(run_ranks(_bf16_stages, 2)):
        for schedule, (loss, sent) in result.items():
            assert sent == (torch.bfloat16 if rank == 0 else torch.float32), (schedule, rank)
            assert loss == pytest.approx(reference, rel=2e-2), schedule  # bf16 activations on both paths
