"""ddtree: DDTree speculative decoding with a DFlash drafter, served."""
from ddtree.engine.llm import LLM
from ddtree.engine.llm_engine import RequestOutput
from ddtree.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]
