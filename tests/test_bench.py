"""`ddtree bench --quick`: the side-by-side speed harness runs on CPU and writes JSON + PNG."""
import json

import pytest

from ddtree.bench.speed import main, parse_methods


def test_parse_methods():
    assert parse_methods("ar,dflash,ddtree:16,auto") == [("ar", 0), ("dflash", 0), ("ddtree", 16),
                                                          ("ddtree", "auto")]
    with pytest.raises(ValueError, match="budget"):
        parse_methods("ddtree")
    with pytest.raises(ValueError, match="unknown method"):
        parse_methods("medusa")


def test_bench_quick(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--quick", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {(r["method"], r["budget"], r["concurrency"]) for r in rows} == {
        (m, b, c) for m, b in [("ar", 0), ("dflash", 0), ("ddtree", 8), ("ddtree", "auto")] for c in (1, 2)}
    for r in rows:
        assert r["tokens"] == 2 * 8 and r["tokens_per_s"] > 0 and r["tau"] >= 1.0
        assert r["split_s"]["verify"] > 0
        if r["method"] == "ar":
            assert r["speedup_vs_ar"] == 1.0 and r["tau"] == 1.0
        elif r["budget"] == "auto":  # every step of an auto run is one of its candidates
            assert sum(r["auto_choices"].values()) == r["engine_decode_steps"] > 0
            assert set(r["auto_choices"]) <= {"ar:0", "dflash:0", "ddtree:8"}
        else:
            assert r["split_s"]["draft"] > 0
    assert data["meta"]["device"] == "cpu"
    assert (tmp_path / "bench.png").stat().st_size > 10_000
