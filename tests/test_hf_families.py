"""Every Hugging Face family the README lists, end to end as a user runs it: a tiny random folder plans, trains
(with LoRA and without), exports, and the export reloads in transformers with the trained model's logits."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from snugfit.cli import main  # noqa: E402
from snugfit.model.hf import attention_for  # noqa: E402
from snugfit.train.export import export_checkpoint, load_checkpoint_model  # noqa: E402
from snugfit.train.loop import train  # noqa: E402
from tests.test_hf import CONFIGS  # noqa: E402
from tests.test_train import tiny  # noqa: E402

FAMILIES = ["llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "opt", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("arch", FAMILIES)
def test_a_family_plans_trains_exports_and_reloads(arch, tmp_path, capsys):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **{**CONFIGS[arch], "vocab_size": 256})  # the byte tokenizer's
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    assert main(["plan", "--model", str(tmp_path / "base"), "--seq", "16", "--global-batch", "4", "--json",
                 "--profile-cache", str(tmp_path / "profiles")]) == 0
    assert len(json.loads(capsys.readouterr().out)["blocks"]) == 2
    lora = {"lora_rank": 4} if FAMILIES.index(arch) % 2 == 0 else {}  # every other family fully fine-tuned
    run = tiny(tmp_path / "run", **{"model.name": str(tmp_path / "base"), "steps": 2, "seq_len": 16, "lr": 0.05,
                                    **lora})
    result = train(run)
    assert all(torch.isfinite(torch.tensor(v)) for v in result.losses.values())
    step = tmp_path / "run" / "checkpoints" / "step_00000002"
    tuned = load_checkpoint_model(step).eval()
    out = export_checkpoint(step, tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation=attention_for(cfg)).eval()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, tuned(x), rtol=1e-4, atol=1e-4)
