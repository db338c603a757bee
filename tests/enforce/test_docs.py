"""docs/enforcement.md's E5 example is what the commands print, and the traces are seeded."""

from __future__ import annotations

import re
from pathlib import Path

from kcverify.cli import main
from kcverify.enforce.synthetic import FaultPlan, synthetic_traces

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "enforcement.md").read_text()


def _block_after(marker: str) -> list[str]:
    i = DOC.index(marker)
    m = re.compile(r"```text\n(.*?)```", re.S).search(DOC, i)
    assert m is not None
    return m.group(1).splitlines()


def test_monitor_output_in_the_doc(e5, capsys):
    main(["monitor", str(e5.contract), str(e5.traces), "--window", "300s"])
    got = capsys.readouterr().out.splitlines()
    want = _block_after("kcverify monitor examples/traces/contract.yaml out/traces/traces.jsonl")
    assert got[1:] == want[1:-1]  # the path in the header and the html line differ


def test_replay_output_in_the_doc(e5, capsys):
    main(["replay", f"{e5.traces}#req-000700", str(e5.model), str(e5.contract)])
    got = capsys.readouterr().out.splitlines()
    want = _block_after("kcverify replay 'out/traces/traces.jsonl#req-000700'")
    for line in want[1:]:
        head = line.split("{...}")[0].split("...")[0].rstrip()
        assert any(g.startswith(head) for g in got), line


def test_traces_are_deterministic(e5, tmp_path):
    synthetic_traces(e5.contract, tmp_path / "again.jsonl", FaultPlan())
    assert (tmp_path / "again.jsonl").read_bytes() == e5.traces.read_bytes()
