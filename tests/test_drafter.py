"""DFlash drafter: z-lab checkpoint format, save/load round trip, fit checks."""
import json

import pytest
import torch

from ddtree.models.dflash import DFlashDrafter, default_tap_layers, random_drafter

from conftest import make_llm


def test_default_taps_spread():
    assert default_tap_layers(30, 5) == [1, 8, 14, 20, 27]
    assert default_tap_layers(30, 1) == [27]


def test_checkpoint_has_zlab_fields_and_round_trips(smol, tokenizer, prompts, tmp_path):
    drafter = random_drafter(smol.config, num_layers=2, block_size=8, num_taps=3, seed=5)
    drafter.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 30
    assert cfg["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    assert "mask_token_id" in cfg["dflash_config"]
    saved = torch.load(tmp_path / "mask_embedding.pt")
    assert saved["embedding"].shape == (576,) and saved["mask_token_id"] == cfg["dflash_config"]["mask_token_id"]
    from safetensors.torch import load_file
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.k_norm.weight"} <= set(names)

    loaded = DFlashDrafter.from_pretrained(tmp_path)
    # Same drafts inside the engine: identical per-depth log-probabilities on a real prefix.
    outs = []
    for d in (drafter, loaded):
        llm = make_llm(smol, tokenizer, method="ddtree", budget=4, drafter=d)
        seq = llm.engine.add_request(prompts[0], __import__("ddtree").SamplingParams(temperature=0, max_tokens=2))
        llm.engine.step()  # prefill (stores drafter context)
        runner = llm.engine.runner
        outs.append(runner.draft_for([seq]))
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape == (1, 7, smol.config.vocab_size)


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 64, "hidden_size"),
    ("vocab_size", 1000, "vocab_size"),
    ("target_layer_ids", [1, 30], "target_layer_ids"),
    ("mask_token_id", 10**6, "mask_token_id"),
])
def test_drafter_that_does_not_fit_is_refused(smol, tokenizer, field, value, message):
    drafter = random_drafter(smol.config, num_layers=1, block_size=4)
    setattr(drafter.config, field, value)
    with pytest.raises(ValueError, match=message):
        make_llm(smol, tokenizer, method="ddtree", drafter=drafter)


def test_missing_dflash_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="dflash_config"):
        DFlashDrafter.from_pretrained(tmp_path)
