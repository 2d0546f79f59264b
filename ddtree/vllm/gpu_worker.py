"""vLLM's V1 GPU worker building the DDTree runner (CUDA; written against vLLM 0.32.0, not run
on a GPU here: see the README's "Use with vLLM")."""
from __future__ import annotations

from vllm.v1.worker.gpu_worker import Worker


class DDTreeGPUWorker(Worker):
    def _make_model_runner(self):
        if self.use_v2_model_runner:
            raise ValueError("ddtree: the tree path hooks vLLM's V1 GPU model runner; "
                             "set VLLM_USE_V2_MODEL_RUNNER=0 (the plugin sets it unless it is given)")
        from ddtree.vllm.attention import install_gpu_attention_hook
        from ddtree.vllm.runner import DDTreeGPUModelRunner

        install_gpu_attention_hook()
        return DDTreeGPUModelRunner(self.vllm_config, self.device)
