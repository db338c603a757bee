"""kcverify replay: a logged request re-run under both kernels; signature and attribution."""

from __future__ import annotations

import json

from kcverify.cli import main


def test_clean_record_reproduces_and_is_explained(e5, capsys):
    code = main(["replay", f"{e5.traces}:5", str(e5.model), str(e5.contract), "--json"])
    body = json.loads(capsys.readouterr().out)
    assert code == 0 and body["ok"] and body["reproducible"]
    for side in ("train", "inf"):
        k = body["kernels"][side]
        assert k["reproducible"] and k["logits_max_abs_diff"] == 0.0
        assert [a["tensor"] for a in k["audit"]][-1] == "y"  # graph order: the output last
    a = body["attribution"]
    assert a["explained"] and 0 < a["observed"] <= a["contract_bound"]
    sources = {s["source"]: s for s in a["sources"]}
    assert set(sources) == {"precision/quantisation", "operator approximation", "batch-shape",
                            "routing"}
    # fp8 casts are the only source large enough: compute and order are fp32-exact-ish
    assert sources["precision/quantisation"]["explains"]
    assert not sources["operator approximation"]["explains"]
    assert sources["operator approximation"]["bound"] < a["observed"] / 100


def test_faulty_record_diverges_at_the_output_and_is_unexplained(e5, capsys):
    lines = e5.traces.read_text().splitlines()
    rid = json.loads(lines[700])["request_id"]
    code = main(["replay", f"{e5.traces}#{rid}", str(e5.model), str(e5.contract)])
    out = capsys.readouterr().out
    assert code == 1
    assert "train reproduced (3/3 audit points match" in out
    assert "inf   diverges at audit point 'y' (2/3 audit points match" in out
    assert "drift unexplained" in out and "(50x)" in out
    assert "replay: NOT OK" in out


def test_record_without_signature(e5, tmp_path, capsys):
    rec = json.loads(e5.clean.read_text().splitlines()[0])
    del rec["replay"]
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(rec) + "\n")
    code = main(["replay", str(one), str(e5.model), str(e5.contract), "--json",
                 "--no-attribution"])
    body = json.loads(capsys.readouterr().out)
    assert code == 1 and not body["signed"] and body["attribution"] is None
    assert body["kernels"]["inf"]["logits_max_abs_diff"] == 0.0  # same program, same logits


def test_bad_record_references(e5, capsys):
    assert main(["replay", f"{e5.traces}:99999", str(e5.model), str(e5.contract)]) == 2
    assert "no valid trace record at line 99999" in capsys.readouterr().err
    assert main(["replay", str(e5.traces), str(e5.model), str(e5.contract)]) == 2
    assert "holds 1200 records; name one" in capsys.readouterr().err
