"""`snugfit train --model HF_FOLDER --lora-rank R --format instruct`: end to end through the trainer and export."""

import json

import torch

from snugfit.train.export import export_checkpoint, load_checkpoint_model
from snugfit.train.loop import train
from tests.test_train import tiny


def test_lora_finetune_of_a_local_hf_model_exports_for_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "base")
    rows = [{"prompt": f"Q{i}: what is {i}+1? ", "response": f"{i + 1}"} for i in range(40)]
    (tmp_path / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in rows))

    cfg = tiny(tmp_path / "run", **{"model.name": str(tmp_path / "base"), "lora_rank": 4, "format": "instruct",
                                    "path": str(tmp_path / "sft.jsonl"), "steps": 4, "lr": 0.05, "val_fraction": 0.2})
    result = train(cfg)
    assert result.val_losses[4] < result.val_losses[0]

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000004"
    tuned = load_checkpoint_model(ckpt).eval()
    base_names = {n for n, p in tuned.named_parameters() if "lora" not in n}
    assert base_names and all(not p.requires_grad for n, p in tuned.named_parameters() if n in base_names)
    out = export_checkpoint(ckpt, tmp_path / "exported")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, tuned(x), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(reloaded(x).logits, hf.eval()(x).logits)  # the adapters changed the model
