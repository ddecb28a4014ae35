"""Reliability of a single process: non-finite steps are skipped and bounded; exports reload exactly."""

import json

import pytest
import torch

from snugfit.errors import SnugfitError
from snugfit.model import Decoder
from snugfit.model.export import load_model, save_model
from snugfit.train.export import load_checkpoint_model
from snugfit.train.loop import train
from tests.test_train import tiny


def poison_steps(monkeypatch, bad: set[int]):
    """Make the loss NaN on the given optimizer steps (1-based; one forward per step)."""
    calls = {"n": 0}
    real = Decoder.forward

    def forward(self, tokens, targets=None, docs=None):
        out = real(self, tokens, targets, docs)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] in bad:
                return out * float("nan")
        return out

    monkeypatch.setattr(Decoder, "forward", forward)


def test_non_finite_steps_are_skipped_and_counted(tmp_path, monkeypatch):
    poison_steps(monkeypatch, {3, 4})
    result = train(tiny(tmp_path, steps=6, log_every=1, checkpoint_every=0))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in records if r["kind"] == "train"}
    assert skipped == {1: False, 2: False, 3: True, 4: True, 5: False, 6: False}
    assert [r for r in records if r["kind"] == "train"][-1]["skipped_total"] == 2
    assert all(v == v for k, v in result.losses.items() if k not in (3, 4))  # finite elsewhere


def test_too_many_bad_steps_stop_with_last_good_state(tmp_path, monkeypatch):
    clean = train(tiny(tmp_path / "clean", steps=2, checkpoint_every=0))
    good = load_checkpoint_model(clean.out_dir / "checkpoints" / "step_00000002").state_dict()
    poison_steps(monkeypatch, set(range(3, 100)))
    with pytest.raises(SnugfitError, match="not finite for 3 steps in a row.*last good state is saved"):
        train(tiny(tmp_path / "bad", steps=10, max_bad_steps=3, checkpoint_every=0, log_every=1, plot=True))
    saved = load_checkpoint_model(tmp_path / "bad" / "checkpoints" / "step_00000005").state_dict()
    for name, tensor in good.items():
        torch.testing.assert_close(saved[name], tensor, rtol=0, atol=0)
    records = [json.loads(line) for line in (tmp_path / "bad" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]  # none for the step that stopped it
    assert (tmp_path / "bad" / "loss.png").stat().st_size > 0  # drawn however the run ends


@pytest.mark.parametrize("arch, tie", [("llama", False), ("llama", True), ("gpt2", True), ("gpt2", False)])
def test_export_reloads_in_snugfit_and_transformers(tmp_path, arch, tie):
    from transformers import AutoModelForCausalLM

    from snugfit.model import ModelConfig

    cfg = ModelConfig(arch=arch, dim=64, n_layers=2, n_kv_heads=2 if arch == "llama" else None, tie_embeddings=tie)
    torch.manual_seed(0)
    model = Decoder(cfg).eval()
    save_model(model.state_dict(), cfg, tmp_path)
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(load_model(tmp_path)(x), want, rtol=0, atol=0)
        if (tmp_path / "config.json").exists():
            hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
            torch.testing.assert_close(hf(x).logits, want, rtol=1e-5, atol=1e-5)
        else:
            assert (arch, tie) == ("gpt2", False)  # no transformers twin: untied GPT-2 heads
