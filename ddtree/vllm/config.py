"""`--speculative-config '{"method": "ddtree", "model": <drafter>, "budget": 64}'`, translated into
what vLLM's closed config accepts.

vLLM validates `method` against a fixed list, so the plugin rewrites a "ddtree" entry before vLLM
builds its SpeculativeConfig: it becomes vLLM's own DFlash config (the drafter and its KV cache are
vLLM's) with `num_speculative_tokens = max(budget, block_size - 1)` (the scheduler reserves room
for the whole tree, and the drafter's buffers for its whole block),
and the DDTree settings travel to the workers in `additional_config["ddtree"]`.
"""
from __future__ import annotations

import os
from typing import Any

from ddtree.vllm.version import unsupported_reason

METHOD = "ddtree"
DEFAULT_BUDGET = 64
CONFIG_KEY = "ddtree"  # key in vLLM's additional_config
# Keys of a "ddtree" speculative config the plugin consumes; the rest goes to vLLM unchanged.
OWN_KEYS = ("budget",)


def parse_budget(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ddtree: 'budget' must be an integer number of tree nodes, got {value!r} "
                         f"({type(value).__name__})")
    if value < 1:
        raise ValueError(f"ddtree: 'budget' must be >= 1, got {value}")
    return value


def translate(spec: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A user's "ddtree" speculative config -> (vLLM DFlash speculative config, ddtree settings)."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    if spec.get("method") != METHOD:
        raise ValueError(f"not a ddtree config: method={spec.get('method')!r}")
    if not spec.get("model"):
        raise ValueError("ddtree: 'model' must name the DFlash drafter folder "
                         "(e.g. the one `python -m ddtree.vllm` prints)")
    budget = parse_budget(spec.pop("budget", DEFAULT_BUDGET))
    tokens = spec.pop("num_speculative_tokens", None)
    if tokens is not None and tokens != budget:
        raise ValueError(f"ddtree: num_speculative_tokens ({tokens}) is set by 'budget' ({budget}); "
                         "give only 'budget'")
    if spec.get("disable_padded_drafter_batch"):
        raise ValueError("ddtree: disable_padded_drafter_batch is not supported")
    if spec.get("num_speculative_tokens_per_batch_size"):
        raise ValueError("ddtree: num_speculative_tokens_per_batch_size is not supported; "
                         "the tree size is 'budget'")
    spec.update(method="dflash", num_speculative_tokens=budget)
    return spec, {"budget": budget}


def check_target(model_config, parallel_config) -> None:
    """Refuse targets and layouts the tree path does not handle, naming what is wrong."""
    if model_config.is_hybrid or model_config.has_inner_state or model_config.is_attention_free:
        raise ValueError(f"ddtree: target {model_config.model!r} has recurrent/hybrid layers; "
                         "tree verification needs a pure-attention target")
    if model_config.is_multimodal_model:
        raise ValueError(f"ddtree: multimodal target {model_config.model!r} is not supported")
    if parallel_config.pipeline_parallel_size > 1 or parallel_config.tensor_parallel_size > 1:
        raise ValueError("ddtree: tensor/pipeline parallelism is not supported (one worker only)")
    # Logprobs come from the raw logits of the nodes the walk visits (runner.py); the processed
    # modes would need each node's sampling distribution.
    if model_config.logprobs_mode not in ("raw_logprobs", "raw_logits"):
        raise ValueError(f"ddtree: logprobs_mode {model_config.logprobs_mode!r} is not supported "
                         "('raw_logprobs', the default, or 'raw_logits')")


def gpu_engine_settings(engine_args) -> None:
    """What the tree path needs from a CUDA engine, set on its EngineArgs before vLLM builds the
    configs (a conflicting explicit choice is refused, naming it):
    - vLLM's V1 GPU model runner (VLLM_USE_V2_MODEL_RUNNER=0): the runner the hooks are written
      for, shared with the CPU backend (Model Runner V2 is another design);
    - no async scheduling: the runner checks the scheduled draft tokens against its trees, and
      async scheduling schedules placeholders;
    - CUDA graphs PIECEWISE at most: the target's attention must run eagerly to take the tree
      mask (piecewise graphs leave attention out; FULL graphs would replay the causal kernel)."""
    from vllm.config import CUDAGraphMode

    v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower()
    if v2 in ("1", "true"):
        raise ValueError("ddtree: VLLM_USE_V2_MODEL_RUNNER=1 is not supported: the tree path hooks "
                         "vLLM's V1 GPU model runner (unset it)")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if engine_args.async_scheduling:
        raise ValueError("ddtree: async scheduling is not supported (drop --async-scheduling)")
    engine_args.async_scheduling = False
    compilation = engine_args.compilation_config
    mode = compilation.cudagraph_mode
    if mode is not None and mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
        raise ValueError(f"ddtree: cudagraph_mode {mode.name} captures the target's attention, "
                         "which must take the tree mask; use PIECEWISE (the plugin's default) or NONE")
    if mode is None and not engine_args.enforce_eager:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE


def install_config_hook() -> None:
    """Wrap EngineArgs.create_speculative_config so a "ddtree" entry is translated first.

    The general-plugin hook runs in EngineArgs.__post_init__, i.e. before vLLM creates its
    configs, in every process that parses arguments (vllm serve, vllm.LLM)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_speculative_config
    if getattr(original, "_ddtree", False):
        return

    def create_speculative_config(self, target_model_config, target_parallel_config):
        spec = self.speculative_config
        if isinstance(spec, dict) and spec.get("method") == METHOD:
            reason = unsupported_reason()
            if reason is not None:
                raise RuntimeError(f"ddtree: {reason}")
            check_target(target_model_config, target_parallel_config)
            from vllm.platforms import current_platform

            from ddtree.vllm.worker import worker_class_for_platform

            self.speculative_config, settings = translate(spec)
            if current_platform.is_cuda():
                gpu_engine_settings(self)
            # additional_config is read when the VllmConfig is built, after this call; the
            # parallel config already exists, so the worker class is set on it directly.
            self.additional_config = {**(self.additional_config or {}), CONFIG_KEY: settings}
            if target_parallel_config.worker_cls not in ("auto", None):
                raise ValueError(f"ddtree: a custom worker_cls ({target_parallel_config.worker_cls}) "
                                 "cannot be combined with the ddtree plugin")
            target_parallel_config.worker_cls = worker_class_for_platform()
            result = original(self, target_model_config, target_parallel_config)
            depth = drafter_depth(result)
            if result.num_speculative_tokens < depth:
                # One drafter pass always drafts `depth` positions, and vLLM sizes the drafter's
                # buffers and the scheduler's lookahead slots by num_speculative_tokens: a smaller
                # budget must not shrink them (the tree itself still has `budget` nodes).
                from vllm.config import SpeculativeConfig

                self.speculative_config["num_speculative_tokens"] = depth
                result = SpeculativeConfig(**self.speculative_config)
            return result
        return original(self, target_model_config, target_parallel_config)

    create_speculative_config._ddtree = True
    EngineArgs.create_speculative_config = create_speculative_config


def drafter_depth(spec_config) -> int:
    """Positions one drafter pass predicts: the DFlash block size minus one (the bonus slot)."""
    block = getattr(spec_config.draft_model_config.hf_config, "block_size", None)
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"ddtree: drafter config.json needs an integer block_size >= 2, got {block!r}")
    return block - 1


def settings_of(vllm_config) -> dict[str, Any] | None:
    """The ddtree settings of a running engine, or None when DDTree is not enabled."""
    extra = getattr(vllm_config, "additional_config", None)
    if isinstance(extra, dict):
        return extra.get(CONFIG_KEY)
    return None
