"""vLLM worker classes that build the DDTree model runner."""
from __future__ import annotations

from unittest import mock

CPU_WORKER = "ddtree.vllm.worker.DDTreeCPUWorker"
GPU_WORKER = "ddtree.vllm.gpu_worker.DDTreeGPUWorker"  # its own module: CPU installs never import it


def worker_class_for_platform(platform=None) -> str:
    if platform is None:
        from vllm.platforms import current_platform as platform

    if platform.is_cpu():
        return CPU_WORKER
    if platform.is_cuda():
        return GPU_WORKER
    raise ValueError(f"ddtree: the vLLM plugin supports vLLM's CPU and CUDA platforms, not "
                     f"{platform.device_name!r}")


def _cpu_worker_base():
    from vllm.v1.worker.cpu_worker import CPUWorker
    return CPUWorker


class DDTreeCPUWorker(_cpu_worker_base()):
    def init_device(self):
        import vllm.v1.worker.cpu_worker as cpu_worker

        from ddtree.vllm.runner import DDTreeCPUModelRunner

        if getattr(self, "use_v2_model_runner", False):
            raise ValueError("ddtree: needs vLLM's legacy model runner on CPU (unset VLLM_USE_V2_MODEL_RUNNER)")
        # CPUWorker.init_device constructs the runner by this module-level name.
        with mock.patch.object(cpu_worker, "CPUModelRunner", DDTreeCPUModelRunner):
            super().init_device()
