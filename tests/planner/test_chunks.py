"""prove bounds a slice in chunks of its inputs (ProveOptions.chunk_rows): one chain per chunk
(sequential with rows), joined by concat-rows; the checker re-runs every chunk's blocks and
rejects a chunk dropped, moved or repeated."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kcverify.certs.checker import check_certificate
from kcverify.planner.prove import ProveOptions, prove

Workspace = Callable[[str, str], tuple[Path, Path]]


def nodes(node: Any, rule: str) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if node.get("rule") == rule:
            yield node
        for p in node.get("premises", []):
            yield from nodes(p, rule)


def clause(stmt: dict[str, Any], cid: str) -> dict[str, Any]:
    return next(c for c in stmt["predicate"]["clauses"] if c["id"] == cid)


def test_chunked_proof_checks_and_matches_the_whole_slice(workspace: Workspace) -> None:
    model, contract = workspace("mlp_tiny.onnx", "mlp-fp8.yaml")
    whole = prove(contract, model, ProveOptions(domain="interval", chunk_rows=0, realizations=1,
                                                write_certificate=False))
    res = prove(contract, model, ProveOptions(domain="interval", chunk_rows=16, realizations=1,
                                              force=True))
    assert res.cert_path is not None
    st = res.statement
    c = clause(st, "N-MLP-1")
    assert c["verdict"] == "proved"
    joins = list(nodes(c["proof"], "concat-rows"))
    assert joins and all(j["params"]["n"] == 64 for j in joins)
    chains = [s for j in joins[:1] for s in nodes(j, "sequential")]
    assert [s["params"]["rows"] for s in chains] == [[0, 16], [16, 32], [32, 48], [48, 64]]
    assert not list(nodes(clause(whole.statement, "N-MLP-1")["proof"], "concat-rows"))
    # the interval domain bounds each input on its own: chunking changes no bound
    assert clause(whole.statement, "N-MLP-1")["bound"] == c["bound"]
    report = check_certificate(res.cert_path, model, contract)
    assert report.ok, report.problems

    def tampered(edit: Callable[[dict[str, Any]], None]) -> list[str]:
        bad = copy.deepcopy(st)
        edit(clause(bad, "N-MLP-1")["proof"])
        path = model.with_name("tampered.kcert.json")
        path.write_text(json.dumps(bad))
        rep = check_certificate(path, model, contract)
        assert not rep.ok
        return rep.problems

    def drop(proof: dict[str, Any]) -> None:
        next(nodes(proof, "concat-rows"))["premises"].pop(1)

    def swap(proof: dict[str, Any]) -> None:
        prem = next(nodes(proof, "concat-rows"))["premises"]
        prem[0], prem[1] = prem[1], prem[0]

    def shift(proof: dict[str, Any]) -> None:  # a chain claims rows it was not bounded on
        seq = next(nodes(next(nodes(proof, "concat-rows"))["premises"][1], "sequential"))
        seq["params"]["rows"] = [0, 16]
        seq["conclusion"]["rows"] = [0, 16]

    assert any("concat-rows" in p for p in tampered(drop))
    assert any("concat-rows" in p for p in tampered(swap))
    assert any("does not contain the inputs" in p for p in tampered(shift))
