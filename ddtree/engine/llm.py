"""vLLM-shaped offline API: ``LLM(...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import contextlib
import gc
import logging
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ddtree.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from ddtree.engine.sampling_params import SamplingParams
from ddtree.models.decoder import DecoderLM
from ddtree.models.dflash import DFlashDrafter, random_drafter
from ddtree.models.loader import load_target, load_tokenizer, resolve_target

log = logging.getLogger("ddtree")

SHIPPED_DRAFTERS = Path(__file__).resolve().parent.parent / "drafters"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@contextlib.contextmanager
def frozen_heap():
    """Keep every object alive now (modules, models, captured graphs: ~360k on CPU) out of the
    garbage collector's full passes while a long-lived loop runs (serving, benchmarking). A full
    pass over them took 150-200 ms on a 2-core CPU, a stall of every stream in flight; after
    ``gc.freeze`` it scans only what was made since. Collects first, so no garbage is frozen
    (frozen cycles are never freed: not for code that builds and drops engines); unfreezes on
    exit, where Triton's bindings would otherwise report the frozen objects as leaked. vLLM
    freezes its heap after warm-up for the same reason. Yields the number of frozen objects."""
    gc.collect()
    gc.freeze()
    try:
        yield gc.get_freeze_count()
    finally:
        gc.unfreeze()


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def shipped_drafter_for(target_dir: Path) -> Path | None:
    """The drafter shipped in the package for this target (matched by the target's name)."""
    name = target_dir.name.lower()
    for cand in sorted(SHIPPED_DRAFTERS.glob("*")) if SHIPPED_DRAFTERS.exists() else []:
        if (cand / "config.json").exists() and cand.name.lower().split("-dflash")[0] in name:
            return cand
    return None


class LLM:
    def __init__(self, target=None, drafter=None, method: str = "ddtree", budget: int | str = "auto",
                 device=None, dtype=None, max_model_len: int = 2048, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, kv_cache_gb: float = 1.0, seed: int = 0,
                 tokenizer=None, max_budget: int = 128, cuda_graphs: bool = True,
                 overlap_steps: bool | None = None, join_wait_rounds: int = 8):
        """target: None (default SmolLM2), a HF folder, a .gguf file, or a loaded DecoderLM (then
        pass ``tokenizer`` too, or None to work on token ids only). budget: a DDTree node budget,
        or "auto" to choose per step among plain decoding, the chain and trees up to
        ``max_budget``. cuda_graphs: capture decode steps on CUDA. overlap_steps: launch the next
        decode round before reading the current one (None: wherever rounds are CUDA graphs).
        join_wait_rounds: under load a request joining a running batch waits for a group to
        join with it, at most this many rounds (0: joins at once; see ``Scheduler``)."""
        config = EngineConfig(method=method, budget=budget, max_budget=max_budget, max_model_len=max_model_len,
                              max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              kv_cache_gb=kv_cache_gb, cuda_graphs=cuda_graphs, overlap_steps=overlap_steps,
                              join_wait_rounds=join_wait_rounds)
        config.validate()  # fail fast, before loading weights
        torch.manual_seed(seed)
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = resolve_dtype(dtype, self.device)
        if isinstance(target, DecoderLM):
            target_dir = Path("in-memory")
            self.target = target.to(self.device, self.dtype)
            self.tokenizer = tokenizer
        else:
            target_dir = resolve_target(target)
            self.target = load_target(target_dir, device=self.device, dtype=self.dtype)
            self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(target_dir)
        self.target_dir = target_dir
        self.drafter = None if method == "ar" else self._load_drafter(drafter, target_dir)
        self.engine = LLMEngine(self.target, self.drafter, self.tokenizer, config, self.device, self.dtype)

    def _load_drafter(self, drafter, target_dir: Path):
        if drafter is None:
            drafter = shipped_drafter_for(target_dir)
            if drafter is None:
                log.warning("no trained drafter ships for %s: using a random drafter (tau ~ 1)", target_dir.name)
                drafter = "random"
        if isinstance(drafter, str) and drafter == "random":
            return random_drafter(self.target.config).to(self.device, self.dtype).eval()
        if isinstance(drafter, (str, Path)):
            drafter = DFlashDrafter.from_pretrained(drafter)
        if isinstance(drafter, DFlashDrafter):
            drafter.config.check_fits(self.target.config)
            return drafter.to(self.device, self.dtype).eval()
        if hasattr(drafter, "draft_logprobs") and hasattr(drafter, "block_size"):
            return drafter  # a custom drafter (tests use an oracle)
        raise ValueError(f"drafter must be a path, 'random', a DFlashDrafter or None, got {type(drafter).__name__}")

    # ---- generation --------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, or a list of such lists."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                              and all(isinstance(t, int) for t in prompts))
        if single:
            prompts = [prompts]
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts must be a non-empty string, list of strings or list of token-id lists")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        seqs = []
        try:
            for (text, ids), p in zip(encoded, params):
                seqs.append(self.engine.add_request(ids, p, prompt=text))
        except ValueError:
            for s in seqs:
                self.engine.abort(s.request_id)
            raise
        bar = tqdm(total=len(seqs), disable=not use_tqdm, desc="generate")
        done = 0
        while self.engine.has_unfinished():
            self.engine.step()
            finished = sum(s.is_finished for s in seqs)
            bar.update(finished - done)
            done = finished
        bar.close()
        return [self.engine.output(s) for s in seqs]

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this LLM has no tokenizer: pass token ids")
            if not prompt:
                raise ValueError("prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list):
            return None, prompt
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def chat(self, conversations, sampling_params=None, use_tqdm: bool = False) -> list[RequestOutput]:
        """A conversation is a list of {"role", "content"} dicts; a list of them is a batch."""
        if not isinstance(conversations, list) or not conversations:
            raise ValueError("messages must be a non-empty list of {role, content} messages")
        single = isinstance(conversations[0], dict)
        batch = [conversations] if single else conversations
        return self.generate(self.apply_chat_templates(batch), sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation) -> list[int]:
        return self.apply_chat_templates([conversation])[0]

    def apply_chat_templates(self, conversations: list) -> list[list[int]]:
        if self.tokenizer is None:
            raise ValueError("this LLM has no tokenizer: pass token ids")
        return chat_template_ids(self.tokenizer, conversations)


def chat_template_ids(tokenizer, conversations: list) -> list[list[int]]:
    """Templated token ids of many conversations in one tokenizer call: the fast tokenizer
    encodes a batch on its own threads (2-3x faster per prompt than one call each)."""
    if not conversations:
        return []
    for conversation in conversations:
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("messages must be a non-empty list of {role, content} messages")
        for m in conversation:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"each message needs string 'role' and 'content' fields, got {m!r}")
    ids = tokenizer.apply_chat_template(conversations, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [list(x) for x in ids]
