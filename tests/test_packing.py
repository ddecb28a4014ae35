"""Sequence packing (data.packing): examples packed into full sequences train as each would alone.

Each packed example's loss (and the gradients of their sum) equals that example run alone, through the built-in
decoder (rotary and learned positions, SDPA and eager attention) and transformers' own layers (a tiny Llama and
Qwen2 folder, against transformers' forward on each example alone); at 2 gloo ranks with cp 2, tp 2 and pp 2 (1F1B
and BPipe), built-in and Hugging Face, the packed batch's loss and gradients equal one process. Short chat examples
take fewer steps per epoch by the packing ratio, the data line counts what it says, and a packed run's tokens/s
counts tokens, not padding. The plan charges the masks a packed step holds (the runtime's tracked peak within 5%,
in one process and at pp 2, cp 2 and with recomputation at 2 ranks), and the GPU path's FlexAttention block mask
attends as the dense one.
"""

from __future__ import annotations

import json
import logging
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from snugfit.data.instruct import IGNORE, pack_example
from snugfit.data.packing import DOCS, bins, pack
from snugfit.model.decoder import Decoder, ModelConfig, document_mask, document_positions
from snugfit.plan import BlockPlan, Plan
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.optimizer import OptimConfig
from tests.distributed import check_update_gradients, run_ranks

SEQ, VOCAB = 32, 64
LLAMA = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=SEQ)
GPT2 = ModelConfig(arch="gpt2", dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ)
EAGER = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ, attention="eager")
HF_LLAMA = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)


def examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """n (ids, labels) examples of 3 to 20 tokens, the first 1 to 3 a masked prompt."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = g.integers(0, VOCAB, int(g.integers(3, 21))).tolist()
        prompt = int(g.integers(1, 3))
        out.append((ids, [IGNORE] * prompt + ids[prompt:]))
    return out


def packed(exs: list[tuple[list[int], list[int]]], seq: int = SEQ):
    rows = np.stack([pack_example(i, lab, seq, 0) for i, lab in exs])
    return pack(rows, np.array([len(i) for i, _ in exs]), pad_id=0)


def per_example_losses(token_losses: torch.Tensor, batch: torch.Tensor, exs) -> list[float]:
    """Each example's mean target loss, read off packed rows (examples in file order)."""
    docs, targets = batch[:, DOCS, :-1], batch[:, 1, 1:]
    found = {}
    for r, group in enumerate(bins(np.array([len(i) for i, _ in exs]), batch.shape[-1])):
        for doc, i in enumerate(group, start=1):
            keep = (docs[r] == doc) & (targets[r] != IGNORE)
            found[i] = token_losses[r][keep].mean().item()
    return [found[i] for i in range(len(exs))]


def test_pack_keeps_every_token_and_its_boundaries():
    exs = examples(12)
    p = packed(exs)
    lengths = [len(i) for i, _ in exs]
    assert p.examples == 12 and p.tokens == sum(lengths) and len(p.rows) < 12
    assert p.ratio == pytest.approx(12 / len(p.rows)) and p.padding == pytest.approx(
        1 - sum(lengths) / (len(p.rows) * (SEQ + 1)))
    for r, group in enumerate(bins(np.array(lengths), SEQ + 1)):
        at = 0
        for doc, i in enumerate(group, start=1):
            n = lengths[i]
            assert p.rows[r, 0, at:at + n].tolist() == exs[i][0]
            assert p.rows[r, 1, at].item() == IGNORE and p.rows[r, 1, at + 1:at + n].tolist() == exs[i][1][1:]
            assert (p.rows[r, DOCS, at:at + n] == doc).all()
            at += n
        assert (p.rows[r, DOCS, at:] == 0).all() and (p.rows[r, 1, at:] == IGNORE).all()  # padding
    docs = torch.tensor([[1, 1, 1, 2, 2, 0]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0]]
    mask = document_mask(docs)[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False] and mask[5].tolist() == [False] * 5 + [True]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2, EAGER], ids=["rope-sdpa", "learned-positions", "eager"])
def test_builtin_packed_loss_equals_each_example_alone(cfg):
    exs = examples(10)
    batch = torch.from_numpy(packed(exs).rows)
    torch.manual_seed(0)
    model = Decoder(cfg)
    masks = set()  # what the layers save of the document mask: one tensor, built once per forward (Documents)

    def saved(t):
        if t.shape[-2:] == (SEQ, SEQ) and t.shape[1] == 1:
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
        logits = model(batch[:, 0, :-1], None, batch[:, DOCS, :-1])
    assert len(masks) == (cfg.attention == "sdpa")  # eager adds it to the scores: nothing saved
    token_losses = F.cross_entropy(logits.flatten(0, 1), batch[:, 1, 1:].flatten(), reduction="none",
                                   ignore_index=IGNORE).view(len(batch), -1)
    alone = [model(torch.tensor(i[:-1])[None], torch.tensor(lab[1:])[None]) for i, lab in exs]
    assert per_example_losses(token_losses, batch, exs) == pytest.approx([a.item() for a in alone], abs=1e-5)
    # and the gradients: the sum of target losses, packed against each example alone
    token_losses.sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    sum(a * sum(t != IGNORE for t in lab[1:]) for a, (_, lab) in zip(alone, exs)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("arch, attention", [("llama", "sdpa"), ("qwen2", "eager")])
def test_hf_packed_logits_equal_transformers_on_each_example_alone(tmp_path, arch, attention):
    transformers = pytest.importorskip("transformers")
    from snugfit.model.hf import load_hf

    config = (transformers.LlamaConfig if arch == "llama" else transformers.Qwen2Config)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention).eval()
    hf.save_pretrained(str(tmp_path))
    model = load_hf(tmp_path, attention=attention).eval()
    assert model.hf_config._attn_implementation == attention
    exs = examples(8, seed=1)
    batch = torch.from_numpy(packed(exs).rows)
    with torch.no_grad():
        logits = model(batch[:, 0, :-1], None, batch[:, DOCS, :-1])
        lengths = np.array([len(i) for i, _ in exs])
        for r, group in enumerate(bins(lengths, SEQ + 1)):
            at = 0
            for i in group:
                n = min(int(lengths[i]), SEQ - at)  # the row's last token is a target only
                own = hf(input_ids=torch.tensor(exs[i][0][:n])[None]).logits[0]
                torch.testing.assert_close(logits[r, at:at + n], own, rtol=1e-4, atol=1e-5)
                at += n


# -- at 2 gloo ranks: packed rows through cp, tp and pp equal one process --
ROWS = 4
PLANS = {"cp2": (LLAMA, dict(cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3))),
         "cp2-gpt2": (GPT2, dict(cp=2, micro_batch_size=4, num_microbatches=1)),
         "hf-cp2": (HF_LLAMA, dict(cp=2, micro_batch_size=2, num_microbatches=2, block=BlockPlan(zero=3))),
         "tp2": (LLAMA, dict(tp=2, micro_batch_size=2, num_microbatches=2)),
         "hf-tp2": (HF_LLAMA, dict(tp=2, micro_batch_size=2, num_microbatches=2)),
         "pp2": (LLAMA, dict(pp=2, schedule="1f1b", micro_batch_size=1, num_microbatches=4)),
         "hf-pp2": (HF_LLAMA, dict(pp=2, schedule="1f1b", micro_batch_size=2, num_microbatches=2)),
         "pp2-bpipe": (LLAMA, dict(pp=2, schedule="bpipe", micro_batch_size=2, num_microbatches=2))}


def packed_batch() -> torch.Tensor:
    return torch.from_numpy(packed(examples(16, seed=2)).rows[:ROWS])


def fresh(cfg) -> torch.nn.Module:
    from snugfit.model.hf import hf_from_config

    torch.manual_seed(0)
    return hf_from_config(cfg, device="cpu") if isinstance(cfg, dict) else Decoder(cfg)


def _ranks(env: DistEnv) -> dict:
    from snugfit.runtime.build import build_engine

    out = {}
    for name, (cfg, spec) in PLANS.items():
        batch = packed_batch()
        ref = fresh(cfg)
        ref_loss = ref(batch[:, 0, :-1], batch[:, 1, 1:], batch[:, DOCS, :-1])
        ref_loss.backward()
        plan = Plan.uniform(ref.cfg.n_layers, seq_len=SEQ, **spec)
        engine = build_engine(fresh(cfg), plan, OptimConfig(grad_clip=0.0), env)
        checked, bad = [], []
        check_update_gradients(engine, {n: p.grad for n, p in ref.named_parameters()}, checked, bad)
        ev, step = engine.eval_loss(batch), engine.train_step(batch)
        out[name] = {"ref": ref_loss.item(), "eval": ev, "loss": step.loss, "checked": len(checked), "bad": bad}
    return out


def test_packed_at_two_ranks_equals_one_process():
    assert len(packed(examples(16, seed=2)).rows) >= ROWS
    for r in run_ranks(_ranks, 2):
        for name, res in r.items():
            assert res["loss"] == pytest.approx(res["ref"], rel=1e-5), name
            assert res["eval"] == pytest.approx(res["ref"], rel=1e-5), name
            assert res["checked"] and not res["bad"], (name, res["bad"][:2])


# -- the run's data: the packing ratio on short chat examples, and the data line's counts --
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "hello how are you fine thanks what is two plus equals four the answer yes no".split()


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """A word-level tokenizer with a ChatML template, as a model folder holds it."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + ["system", "user", "assistant", *WORDS, "\n"])}
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                  pre_tokenizers.WhitespaceSplit()])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    path = tmp_path_factory.mktemp("chat_model")
    tok.save_pretrained(str(path))
    return path


def chat_file(tmp_path, n: int = 60):
    g = np.random.default_rng(0)
    lines = []
    for _ in range(n):
        q, a = (" ".join(g.choice(WORDS, int(g.integers(1, k)))) for k in (6, 8))
        lines.append(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}))
    lines.append(json.dumps({"messages": [{"role": "user", "content": " ".join(["hello"] * 80)},
                                          {"role": "assistant", "content": "yes"}]}))  # nothing to learn in 64
    lines.append(json.dumps({"messages": [{"role": "user", "content": "hello"},
                                          {"role": "assistant", "content": " ".join(["no"] * 80)}]}))  # cut
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_short_chat_examples_pack_and_the_data_line_counts_them(chat_folder, tmp_path, caplog):
    from snugfit.config import build_config
    from snugfit.train.build import build_data

    def data(pack: bool | None):
        overrides = {"data.format": "chat", "data.path": str(chat_file(tmp_path)), "data.tokenizer": str(chat_folder),
                     "data.val_fraction": 0.1, "train.seq_len": 64, "train.batch_size": 4}
        cfg = build_config(None, {**overrides, **({} if pack is None else {"data.pack": pack})})
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="snugfit"):
            d = build_data(cfg, vocab_size=64)
        return d, next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data:"))

    padded, plain_line = data(False)
    packed_data, line = data(None)  # the default for chat data: packed
    assert padded.train.shape[1] == 2 and packed_data.train.shape[1] == 3
    assert np.array_equal(padded.val, packed_data.val)  # validation: the same rows, so the same loss, packed or not
    ratio = len(padded.train) / len(packed_data.train)  # steps per epoch drop by it
    assert ratio > 2.5, ratio
    assert f"packing ratio {ratio:.2f}" in line
    assert ("62 conversations read, 1 dropped (nothing to learn within 64 tokens), 1 truncated at 64 tokens from "
            f"{tmp_path / 'chat.jsonl'}, 6 held out for validation") in line
    learned = [int((d.train[:, 1, 1:] != IGNORE).sum()) for d in (padded, packed_data)]
    assert learned[0] == learned[1] > 0  # the same targets, packed or not
    n_tokens = int(sum(np.count_nonzero(row[DOCS]) for row in packed_data.train))
    assert f"{n_tokens:,} tokens in 55 training conversations packed into {len(packed_data.train)} sequences" in line
    assert "unpacked" in plain_line and packed_data.real_share == pytest.approx(
        n_tokens / packed_data.train[:, 0].size)


def test_pack_is_for_examples_only():
    from snugfit.config import build_config
    from snugfit.errors import SnugfitError

    assert build_config(None, {"data.format": "instruct"}).data.packs
    assert not build_config(None, {"data.format": "instruct", "data.pack": "false"}).data.packs
    assert not build_config(None, {}).data.packs
    with pytest.raises(SnugfitError, match="data.pack packs instruct and chat examples.*drop --pack"):
        build_config(None, {"data.format": "text", "data.pack": True})


def test_a_packed_run_trains_and_counts_its_real_tokens(tmp_path, caplog):
    from snugfit.train.loop import train
    from snugfit.train.metrics import read_metrics
    from tests.test_train import tiny

    rows = [{"prompt": f"Q{i}: {i}+1? ", "response": f"{i + 1}"} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    with caplog.at_level(logging.INFO, logger="snugfit"):
        result = train(tiny(tmp_path / "run", format="instruct", path=str(tmp_path / "sft.jsonl"), steps=4,
                            log_every=2, eval_every=0, checkpoint_every=0, val_fraction=0.1))
    assert result.val_losses and all(np.isfinite(v) for v in result.val_losses.values())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("data:"))
    share = 1 - float(line.split("padding ")[1].split("%")[0]) / 100
    plan = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("plan dp="))
    assert "tokens/step (of 128 positions; the rest padding)" in plan  # batch 4 x seq 32
    record = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "train")
    assert record["tokens_per_s"] * record["step_time_s"] == pytest.approx(128 * share, abs=2)
    # resuming it unpacked would change the data order under the saved position: one line, naming the fix
    from snugfit.errors import SnugfitError

    with pytest.raises(SnugfitError, match="trained on examples packed, this run does not pack them.*--pack true"):
        train(tiny(tmp_path / "run", format="instruct", path=str(tmp_path / "sft.jsonl"), steps=6, resume=True,
                   pack=False, eval_every=0, checkpoint_every=0, val_fraction=0.1))


# -- what a packed step holds: its documents' mask, dense on CPU, FlexAttention's block mask on GPUs --
LONG = 512  # where the dense mask (seq x seq per row) is a good part of what a step holds
LONG_LLAMA = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=LONG)


def _packed_rows(rows: int, seq: int) -> torch.Tensor:
    """(rows, 3, seq + 1) packed rows of three documents each (and padding), random tokens."""
    g = torch.Generator().manual_seed(0)
    out = torch.zeros(rows, 3, seq + 1, dtype=torch.long)
    out[:, 0] = out[:, 1] = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    at = [0, seq // 2, 3 * seq // 4, seq - 7]  # the last 7 positions padding (document 0)
    for doc, (a, b) in enumerate(zip(at, at[1:]), start=1):
        out[:, DOCS, a:b] = doc
    return out


@pytest.mark.parametrize("hf", [False, True], ids=["builtin", "hf"])
def test_packed_plan_charges_the_mask_the_runtime_holds(hf):
    """The packed profile charges the masks a CPU rank holds: the built-in decoder's one dense mask (batch x seq x
    seq, once however many blocks save it), Hugging Face layers' one each (recorded as theirs). The plan's tracked
    peak is within 5% of the runtime's, and above the unpacked plan's by the masks. A GPU cluster's profile
    charges the built-in decoder's FlexAttention block mask instead, a few KiB."""
    from snugfit.hardware import parse_cluster
    from snugfit.plan.estimate import estimate
    from snugfit.profile import profile_model
    from snugfit.runtime.build import build_engine

    cfg = dict(HF_LLAMA, max_position_embeddings=LONG) if hf else LONG_LLAMA
    plan = Plan.uniform(2, micro_batch_size=2, num_microbatches=1, seq_len=LONG)
    profiles = {pack: profile_model(cfg, micro_batch_size=2, seq_len=LONG, use_cache=False, pack=pack)
                for pack in (False, True)}
    mask = 2 * LONG * LONG * 4  # the built-in decoder's, additive in fp32
    assert profiles[True].mask_bytes == (0 if hf else mask) and profiles[False].mask_bytes == 0
    want = {pack: estimate(plan, p, parse_cluster("cpu")).tracked_by_rank[0]["device.total"]
            for pack, p in profiles.items()}
    engine = build_engine(fresh(cfg), plan, OptimConfig(), DistEnv())
    for _ in range(2):
        engine.train_step(_packed_rows(2, LONG))
    got = engine.memory.peak()["device.total"]
    assert got == pytest.approx(want[True], rel=0.05)
    if hf:  # each layer's, at least a boolean one
        assert want[True] - want[False] > 2 * (2 * LONG * LONG)
        return
    assert want[True] - want[False] == pytest.approx(mask, rel=0.05)
    assert mask > 0.2 * want[False]  # the gap it closes is no rounding error
    gpu = profile_model(cfg, micro_batch_size=2, seq_len=LONG, use_cache=False, pack=True, kernels="gpu")
    assert 0 < gpu.mask_bytes < mask / 100


PACKED_RANKS = {"pp2": Plan.uniform(2, pp=2, schedule="1f1b", micro_batch_size=1, num_microbatches=4, seq_len=LONG),
                "cp2": Plan.uniform(2, cp=2, micro_batch_size=2, num_microbatches=2, seq_len=LONG,
                                    block=BlockPlan(zero=3)),
                # checkpointed blocks show the mask their Documents hold to the tracker (model.recompute)
                "dp2_recompute": Plan.uniform(2, dp=2, micro_batch_size=2, seq_len=LONG,
                                              block=BlockPlan(activations="recompute"))}


def _packed_peaks(env: DistEnv) -> dict[str, int]:
    from snugfit.runtime.build import build_engine

    out = {}
    for name, plan in PACKED_RANKS.items():
        engine = build_engine(fresh(LONG_LLAMA), plan, OptimConfig(), env)
        for _ in range(2):
            engine.train_step(_packed_rows(plan.num_microbatches * plan.micro_batch_size, LONG))
        out[name] = engine.memory.peak()["device.total"]
    return out


def test_packed_tracked_peaks_at_two_ranks_hold_the_masks_as_planned():
    """Each pipeline stage makes its own mask for each microbatch it holds, each cp rank the whole sequence's, and a
    recomputed block's Documents hold it, whatever the policy: the plan's tracked peak per rank within 5% of the
    runtime's at pp 2, cp 2 and dp 2 with recomputation."""
    from snugfit.hardware import parse_cluster
    from snugfit.plan.estimate import estimate
    from snugfit.profile import profile_model

    measured = run_ranks(_packed_peaks, 2)
    for name, plan in PACKED_RANKS.items():
        prof = profile_model(LONG_LLAMA, micro_batch_size=plan.micro_batch_size, seq_len=LONG, use_cache=False,
                             pack=True)
        pred = estimate(plan, prof, parse_cluster("2xcpu"))
        for rank, peaks in enumerate(measured):
            want = pred.tracked_by_rank[rank]["device.total"]
            assert peaks[name] == pytest.approx(want, rel=0.05), (name, rank)


def test_flex_block_mask_attends_as_the_dense_mask():
    """The GPU path's block mask (Documents with flex) keeps attention where the dense mask does: FlexAttention's
    forward (without gradients: torch has no FlexAttention backward on CPU) equals SDPA under the dense mask."""
    from snugfit.model.decoder import Documents, LocalAttention, flex_trains_on

    assert flex_trains_on("cuda") and not flex_trains_on("cpu")
    assert not Documents(torch.ones(1, 4, dtype=torch.long)).flex  # a CPU tensor's documents: the dense mask
    docs = _packed_rows(2, 200)[:, DOCS, :-1]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 200, 8, generator=g) for _ in range(3))
    attend = LocalAttention(LLAMA)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager on CPU: unfused, as wanted here
        dense = attend(q, k, v, Documents(docs, flex=False).mask(torch.float32))
        block = attend(q, k, v, Documents(docs, flex=True).mask(torch.float32))
    torch.testing.assert_close(block, dense, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # and masked: no document attends across its edges, nor to the padding
        assert not torch.allclose(dense, attend(q, k, v, None))


def test_a_packed_profile_is_cached_apart(tmp_path):
    """Packed and unpacked profiles of one model have their own cache entries, the packed one with its mask."""
    from snugfit.profile import profile_model

    packed_prof, plain = (profile_model(LLAMA, micro_batch_size=2, seq_len=SEQ, cache_dir=tmp_path, pack=pack)
                          for pack in (True, False))
    assert len(list(tmp_path.rglob("*.json"))) == 2
    assert profile_model(LLAMA, micro_batch_size=2, seq_len=SEQ, cache_dir=tmp_path, pack=True) == packed_prof
    assert (packed_prof.mask_bytes, plain.mask_bytes) == (2 * SEQ * SEQ * 4, 0)
