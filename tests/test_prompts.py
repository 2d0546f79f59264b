"""Drafter training prompts (ddtree.train.prompts) and evaluation sets (ddtree.bench.datasets).

The builder must never let an evaluation prompt (HumanEval, MT-Bench) into the training prompts,
also when it is reformatted or embedded in a longer text."""
import ast
import json
import re

import pytest

from ddtree.bench.datasets import eval_texts, humaneval_prompts, mtbench_prompts
from ddtree.train import prompts as P


def test_eval_sets_complete():
    he = humaneval_prompts()
    assert len(he) == 164
    assert len({p["id"] for p in he}) == 164
    assert he[0]["id"] == "HumanEval/0" and he[0]["entry_point"] == "has_close_elements"
    assert all(p["prompt"].strip() and p["entry_point"] in p["prompt"] for p in he)
    mt = mtbench_prompts()
    assert len(mt) == 80
    assert len({q["id"] for q in mt}) == 80
    assert all(len(q["turns"]) == 2 and q["turns"][0].strip() for q in mt)
    assert {q["category"] for q in mt} >= {"writing", "math", "coding", "reasoning"}
    texts = eval_texts()
    assert len(texts) == 164 + 160
    assert he[7]["prompt"] in texts and mt[5]["turns"][1] in texts


def test_contamination_index():
    idx = P.ContaminationIndex([
        "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences.",
        "Take a moment to evaluate and critique your own response.",  # 10 words: one 10-word shingle
        "Express z-x in y",  # 5 words: exact match only
    ])
    assert idx.check("COMPOSE an engaging   travel blog post about a recent trip to Hawaii, highlighting "
                     "cultural experiences.") == "exact"
    assert idx.check("Hi! please compose an engaging travel blog post about a recent trip to Hawaii, "
                     "highlighting cultural stuff") == "ngram"
    assert idx.check("First this. Then: take a moment to evaluate and critique your own response!") == "ngram"
    assert idx.check("express Z-X in y.") == "exact"
    assert idx.check("Now express z-x in y, please") is None  # too short to match inside a text
    assert idx.check("Compose an engaging travel blog post about a recent trip to Peru") is None  # 12 words shared
    assert idx.check("Write a haiku about autumn leaves falling on a quiet pond.") is None


def test_englishish():
    assert P.is_englishish("What is the capital of France?")
    assert P.is_englishish("def f(x):\n    return x + 1  # fix this")
    assert not P.is_englishish("Necesito un ejemplo de test de una clase REST en la cual se simule la api")
    assert not P.is_englishish("高等教育의 필요성에 관한 영어 에세이를 작성하시오.")
    assert not P.is_englishish("1234 5678 !!!")


def test_json_array_stream_stops_at_truncated_tail(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n {"id": "a", "x": [1, 2]},\n {"id": "b", "x": "}]"},\n {"id": "c", "x": "cut o',
                    encoding="utf-8")
    assert [o["id"] for o in P.iter_json_array(path, chunk_chars=7)] == ["a", "b"]
    path.write_text('[{"id": "a"}, {"id": "b"}]', encoding="utf-8")
    assert [o["id"] for o in P.iter_json_array(path, chunk_chars=5)] == ["a", "b"]


def _shingles(text, n=13):
    w = re.findall(r"[0-9a-z_]+", text.lower())
    if len(w) < n:
        return set()
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def _read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_builder_removes_injected_eval_prompts(tmp_path):
    he = sorted(humaneval_prompts(), key=lambda p: len(p["prompt"]))[:3]
    mt = mtbench_prompts()
    sharegpt_bad = [
        mt[0]["turns"][0],  # verbatim
        "  " + mt[1]["turns"][0].upper().replace(" ", "\n  ") + "  ",  # case and whitespace
        "Hello there! I need some help with a task. " + mt[2]["turns"][0] + " Thanks a lot in advance.",  # embedded
        "Hi. " + mt[0]["turns"][1].lower() + " Also keep it brief",  # 11-word second turn, embedded
    ]
    code_bad = [
        he[0]["prompt"],
        he[1]["prompt"].replace("    ", "\t").replace("\n\n", "\n"),
        "Complete the following Python code and explain it:\n```python\n" + he[2]["prompt"] + "```\nThank you!",
    ]
    gsm8k_bad = [mt[9]["turns"][0].lower().rstrip(".?!")]
    keep = {"sharegpt": "Tell me three fun facts about octopuses and their intelligence.",
            "code": "Write a Python function that merges two sorted lists into one sorted list.",
            "gsm8k": "A baker sells 12 loaves a day for 5 days. How many loaves does she sell in total?"}
    duplicate = "  " + keep["sharegpt"].upper() + "!"  # same normalised text as a kept prompt
    extra = {"sharegpt": sharegpt_bad + [keep["sharegpt"], duplicate], "code": code_bad + [keep["code"]],
             "gsm8k": gsm8k_bad + [keep["gsm8k"]]}
    out = tmp_path / "p.jsonl"
    stats = P.build_prompts(out, n_sharegpt=6, n_gsm8k=3, n_code=3, seed=1, extra_candidates=extra)

    rows = _read_jsonl(out)
    texts = [r["messages"][0]["content"] for r in rows]
    src = stats["sources"]
    assert src["sharegpt"]["contaminated"] == len(sharegpt_bad)
    assert src["sharegpt"]["contaminated_exact"] == 2 and src["sharegpt"]["contaminated_ngram"] == 2
    assert src["code"]["contaminated"] == len(code_bad)
    assert src["gsm8k"]["contaminated_exact"] == len(gsm8k_bad)
    assert stats["contaminated"] == len(sharegpt_bad) + len(code_bad) + len(gsm8k_bad)
    assert all(src[s]["extra_candidates"] == len(extra.get(s, ())) for s in P.SOURCES)
    for bad in sharegpt_bad + code_bad + gsm8k_bad:
        assert bad.strip() not in texts
    assert set(keep.values()) <= set(texts)  # clean injected prompts are kept
    assert duplicate.strip() not in texts and src["sharegpt"]["duplicate"] >= 1
    assert [src[s]["written"] for s in P.SOURCES] == [6, 3, 3, 0, 0] and len(rows) == 12


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    out = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    stats = P.build_prompts(out, n_sharegpt=50, n_gsm8k=50, n_code=50, seed=0)
    return out, stats


def test_small_build_valid_and_clean(small_build):
    out, stats = small_build
    rows = _read_jsonl(out)
    assert len(rows) == 150 == stats["total"]
    counts = {}
    for r in rows:
        assert set(r) == {"source", "messages"}
        (msg,) = r["messages"]
        assert msg["role"] == "user" and isinstance(msg["content"], str)
        assert P.MIN_CHARS <= len(msg["content"]) <= P.MAX_CHARS
        assert msg["content"] == msg["content"].strip()
        counts[r["source"]] = counts.get(r["source"], 0) + 1
    assert counts == {"sharegpt": 50, "gsm8k": 50, "code": 50}
    assert json.loads(P.stats_path(out).read_text()) == stats
    assert stats["sources"]["sharegpt"]["conversations_read"] < 200  # streamed, not the whole file

    texts = [r["messages"][0]["content"] for r in rows]
    norm = [" ".join(re.findall(r"\w+", t.lower())) for t in texts]
    assert len(set(norm)) == len(norm)
    evals = eval_texts()
    eval_norm = {" ".join(re.findall(r"\w+", t.lower())) for t in evals}
    eval_grams = set().union(*(_shingles(t) for t in evals))
    assert eval_grams  # the check below is not vacuous
    for t, n in zip(texts, norm):
        assert n not in eval_norm
        assert not (_shingles(t) & eval_grams), t[:200]
    entry_points = {p["entry_point"] for p in humaneval_prompts()}
    code = [t for r, t in zip(rows, texts) if r["source"] == "code"]
    assert all(t.startswith(("Write", "Implement", "In Python")) and "`" in t for t in code)
    assert not any(re.search(r"`(?:\w+\.)?" + re.escape(ep) + r"\(", t) for t in code for ep in entry_points)


def test_small_build_is_deterministic(small_build, tmp_path):
    out, _ = small_build
    again = tmp_path / "again.jsonl"
    P.build_prompts(again, n_sharegpt=50, n_gsm8k=50, n_code=50, seed=0)
    assert again.read_bytes() == out.read_bytes()


def test_missing_gsm8k_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope" / "gsm8k_train.jsonl"
    with pytest.raises(FileNotFoundError, match="GSM8K train file not found.*nope"):
        P.build_prompts(tmp_path / "o.jsonl", n_sharegpt=1, n_gsm8k=1, n_code=1, gsm8k_path=missing)
    assert not (tmp_path / "o.jsonl").exists()
    assert P.main(["--out", str(tmp_path / "o.jsonl"), "--gsm8k", str(missing)]) == 2
    assert "--gsm8k" in capsys.readouterr().err
    assert P.DEFAULT_GSM8K.name == "gsm8k_train.jsonl" and P.DEFAULT_GSM8K.parent.parent.name == "shared"


def _conversation(*turns):
    return {"conversations": [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]}


def test_later_turns_come_with_their_recent_context(tmp_path):
    path = tmp_path / "sharegpt.json"
    long_reply = "word " * 500  # 2,500 characters: more than the whole context budget
    convs = [
        _conversation("Tell me about tides.", "Tides come from the moon.", "Why twice a day?",
                      "Two bulges.", "Shorter please."),
        _conversation("Write a long essay.", long_reply, "Now summarise it in one line."),
        {"conversations": [{"from": "human", "value": "Hi there, how are you?"}, {"from": "human", "value": "Hello??"},
                           {"from": "gpt", "value": "Hi."}, {"from": "human", "value": "What is rain?"}]},
        {"conversations": [{"from": "gpt", "value": "I start."}, {"from": "human", "value": "Fine then."}]},
    ]
    path.write_text(json.dumps(convs), encoding="utf-8")
    stats = {}
    got = list(P.iter_sharegpt_later(path, stats, max_context_chars=70))
    assert got == [
        ("Why twice a day?", [{"role": "user", "content": "Tell me about tides."},
                              {"role": "assistant", "content": "Tides come from the moon."}]),
        # the whole context (61 characters) and the turn (15) pass 70: only the latest pair stays
        ("Shorter please.", [{"role": "user", "content": "Why twice a day?"},
                             {"role": "assistant", "content": "Two bulges."}]),
    ]
    assert stats == {"conversations_read": 4, "not_user_first": 1, "turns_read": 3, "context_too_long": 1,
                     "not_alternating": 1}


def test_builder_checks_the_context_of_later_turns(tmp_path):
    mt = mtbench_prompts()
    ctx = [{"role": "user", "content": "Give me a recipe for pancakes."},
           {"role": "assistant", "content": "Mix flour, eggs and milk, then fry thin rounds."}]
    other = [{"role": "user", "content": "Tell me a story about a dragon."},
             {"role": "assistant", "content": "Once upon a time a small dragon learned to fly."}]
    bad_ctx = [{"role": "user", "content": mt[3]["turns"][0]}, ctx[1]]
    foreign_ctx = [{"role": "user", "content": "Necesito un ejemplo de una clase en la cual se simule la api"}, ctx[1]]
    extra = {"sharegpt_later": [("Make it shorter.", bad_ctx), ("Make it shorter.", foreign_ctx),
                                ("Thanks, and " + mt[4]["turns"][0], ctx),
                                ("Make it shorter.", ctx), ("  MAKE it shorter!", ctx),  # a duplicate: same turn and context
                                ("Make it shorter.", other)]}
    out = tmp_path / "p.jsonl"
    stats = P.build_prompts(out, n_sharegpt=0, n_gsm8k=0, n_code=0, n_sharegpt_later=2, extra_candidates=extra)
    s = stats["sources"]["sharegpt_later"]
    assert (s["contaminated"], s["non_english"], s["duplicate"], s["written"]) == (2, 1, 1, 2)
    rows = _read_jsonl(out)
    assert sorted(r["messages"][0]["content"] for r in rows) == sorted([ctx[0]["content"], other[0]["content"]])
    assert all(r["source"] == "sharegpt_later" and r["messages"][-1] == {"role": "user", "content": "Make it shorter."}
               for r in rows)


def test_small_build_with_later_turns(tmp_path):
    out = tmp_path / "later.jsonl"
    stats = P.build_prompts(out, n_sharegpt=5, n_gsm8k=0, n_code=0, n_sharegpt_later=40, seed=0)
    rows = _read_jsonl(out)
    later = [r for r in rows if r["source"] == "sharegpt_later"]
    assert len(later) == 40 and len(rows) == 45
    eval_grams = set().union(*(_shingles(t) for t in eval_texts()))
    for r in later:
        roles = [m["role"] for m in r["messages"]]
        assert len(roles) >= 3 and roles == ["user", "assistant"] * (len(roles) // 2) + ["user"]
        assert sum(len(m["content"]) for m in r["messages"]) <= P.MAX_CONTEXT_CHARS
        assert not any(_shingles(m["content"]) & eval_grams for m in r["messages"])
    assert stats["sources"]["sharegpt_later"]["conversations_read"] < 200  # streamed
    # the first turns are the same prompts as in a build without later turns
    P.build_prompts(tmp_path / "first.jsonl", n_sharegpt=5, n_gsm8k=0, n_code=0, seed=0)
    first = {r["messages"][0]["content"] for r in _read_jsonl(tmp_path / "first.jsonl")}
    assert first == {r["messages"][0]["content"] for r in rows if r["source"] == "sharegpt"}


def _wheel(directory, dist, version, licence_lines, files):
    """A minimal wheel: METADATA with the given licence headers, and the given Python files."""
    import zipfile
    stem = dist.replace("-", "_")
    path = directory / f"{stem}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{stem}-{version}.dist-info/METADATA",
                   "\n".join(["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}", *licence_lines,
                              "", "Long description. License: GPL is only mentioned here."]) + "\n")
        for name, text in files.items():
            z.writestr(name, text)
    return path


_DOCUMENTED = '''
def merge_runs(left, right):
    """Merge two sorted runs of numbers into one sorted list."""

def _private_helper(x):
    """Not public, so never a prompt."""

def undocumented(x):
    pass

class Interval:
    def overlaps(self, other) -> bool:
        """Tell whether this interval shares a point with another one."""
'''


def test_code_packages_read_documented_functions_and_problems_from_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "CODE_PACKAGES", (("tidy-utils", "1.0", None), ("puzzles", "2.0", 1)))
    monkeypatch.setattr(P, "PROBLEM_PACKAGES", frozenset({"puzzles"}))
    he = humaneval_prompts()[0]["entry_point"]
    _wheel(tmp_path, "tidy-utils", "1.0", ["License-Expression: MIT"], {
        "tidy_utils/__init__.py": _DOCUMENTED,
        "tidy_utils/_impl.py": 'def hidden_gem(x):\n    """A public name inside a private module."""\n',
        "tidy_utils/tests/test_core.py": 'def check_all(x):\n    """A test helper that reads like a task."""\n',
        "tidy_utils/clash.py": f'def {he}(x):\n    """Same name as a HumanEval entry point here."""\n',
    })
    problem = ('"""Josephus Problem\n\nPeople sit in a circle; every k-th person is eliminated until\n'
               'nobody is left. Yield the elimination order.\n\nReference: a book\n"""\n')
    _wheel(tmp_path, "puzzles", "2.0", ["Classifier: License :: OSI Approved :: BSD License"], {
        "puzzles/josephus.py": problem, "puzzles/other.py": problem.replace("Josephus", "Circle"),
    })
    out = tmp_path / "p.jsonl"
    stats = P.build_prompts(out, n_sharegpt=0, n_gsm8k=0, n_code=0, n_code_packages=100, code_wheels=tmp_path)
    texts = [r["messages"][-1]["content"] for r in _read_jsonl(out)]
    src = stats["sources"]["code_packages"]
    assert src["packages"]["tidy-utils"] == {"wheel": "tidy_utils-1.0-py3-none-any.whl", "license": "MIT",
                                             "items": 3, "taken": 3}
    assert src["packages"]["puzzles"]["items"] == 2 and src["packages"]["puzzles"]["taken"] == 1  # capped
    assert src["entry_point"] == 1 and src["written"] == 3 and src["exhausted"]
    joined = "\n".join(texts)
    assert "merge_runs(left, right)" in joined and "overlaps(self, other) -> bool" in joined
    assert "Interval" in joined and "elimination order" in joined and "Reference" not in joined
    assert not any(w in joined for w in ("_private_helper", "undocumented", "hidden_gem", "check_all", he + "("))
    again = tmp_path / "again.jsonl"
    P.build_prompts(again, n_sharegpt=0, n_gsm8k=0, n_code=0, n_code_packages=100, code_wheels=tmp_path)
    assert again.read_text() == out.read_text()  # seeded


def test_code_packages_refuse_unlicensed_or_missing_wheels(tmp_path, monkeypatch):
    monkeypatch.setattr(P, "CODE_PACKAGES", (("copyleft", "1.0", None),))
    _wheel(tmp_path, "copyleft", "1.0", ["License: GPL-3.0-or-later"], {"copyleft/a.py": _DOCUMENTED})
    with pytest.raises(ValueError, match=r"copyleft-1\.0.*GPL-3\.0-or-later.*not one of MIT"):
        P.build_prompts(tmp_path / "o.jsonl", n_sharegpt=0, n_gsm8k=0, n_code=0, n_code_packages=5,
                        code_wheels=tmp_path)
    (tmp_path / "copyleft-1.0-py3-none-any.whl").unlink()
    _wheel(tmp_path, "copyleft", "1.0", [], {"copyleft/a.py": _DOCUMENTED})
    with pytest.raises(ValueError, match="not declared"):
        P.build_prompts(tmp_path / "o.jsonl", n_sharegpt=0, n_gsm8k=0, n_code=0, n_code_packages=5,
                        code_wheels=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no wheel of copyleft==1\.0"):
        P.ensure_code_wheels(tmp_path / "empty", download=False)

    class Failed:
        returncode, stderr = 1, "ERROR: No matching distribution found for copyleft==1.0"
    monkeypatch.setattr(P.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(FileNotFoundError, match=r"could not fetch the wheel of copyleft==1\.0.*No matching"):
        P.ensure_code_wheels(tmp_path / "empty")


def test_code_stubs_read_like_a_function_to_complete():
    source = b'''
class Interval:
    def overlaps(self, other) -> bool:
        """Tell whether this interval shares a point with another one.

        >>> Interval().overlaps(Interval())
        True
        """

async def fetch_all(urls, *, limit=4):
    """Fetch every url, at most ``limit`` at a time, and say \\"\\"\\"done\\"\\"\\" after."""
'''
    (_, cls, sig, para, stub), (_, _, _, _, stub2) = P._code_items("m", source)
    assert (cls, sig, para) == ("Interval", "overlaps(self, other) -> bool",
                                "Tell whether this interval shares a point with another one.")
    assert stub == ('class Interval:\n    def overlaps(self, other) -> bool:\n'
                    '        """Tell whether this interval shares a point with another one.\n\n'
                    '        >>> Interval().overlaps(Interval())\n        True\n        """\n')
    assert stub2 == ("async def fetch_all(urls, *, limit=4):\n"
                     '    """Fetch every url, at most ``limit`` at a time, and say \'\'\'done\'\'\' after."""\n')
    compile(stub + stub2, "stubs", "exec")  # valid Python (a docstring is a body)
    long_doc = "First paragraph.\n\n" + "word " * 300
    stub3 = P._stub(ast.parse("def f(): pass").body[0], "f()", long_doc, None)
    assert stub3 == 'def f():\n    """First paragraph."""\n'  # whole paragraphs within the limit
