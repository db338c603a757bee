"""Progress on stderr: a bar with an ETA on a terminal, plain lines otherwise."""

from __future__ import annotations

import io
import re

from kcverify.progress import Bar, ProveProgress


def test_bar_on_a_terminal_shows_count_and_eta() -> None:
    out = io.StringIO()
    bar = Bar("kcverify bound: input", 4, out, tty=True, unit="input")
    for done in range(5):
        bar.update(done)
    bar.close()
    text = out.getvalue()
    assert "kcverify bound: input" in text and "4/4" in text
    assert re.search(r"\d\d:\d\d<\d\d:\d\d", text), text  # elapsed<remaining


def test_plain_lines_without_a_terminal() -> None:
    out = io.StringIO()
    bar = Bar("kcverify bound: input", 3, out, tty=False)
    for done in range(4):
        bar.update(done)
    bar.close()
    assert out.getvalue().splitlines() == [f"kcverify bound: input {k}/3" for k in (1, 2, 3)]


MESSAGES = ["[1/2] N-1 (certifiable): ...",
            "bounding slice 'all': block 1/3 (embed)",
            "bounding slice 'all': block 2/3 (layer0)",
            "bounding slice 'all': block 3/3 (head)",
            "bounded slice 'all' in 1.0s: certified max drift 0.5"]


def test_prove_progress_lines_without_a_terminal() -> None:
    out = io.StringIO()
    p = ProveProgress(out, tty=False)
    for m in MESSAGES:
        p(m)
    assert out.getvalue().splitlines() == [f"[kcverify] {m}" for m in MESSAGES]


def test_prove_progress_bar_per_slice_on_a_terminal() -> None:
    out = io.StringIO()
    p = ProveProgress(out, tty=True)
    for m in MESSAGES:
        p(m)
    text = out.getvalue()
    lines = [m for m in MESSAGES if "block" not in m]
    assert [ln for ln in text.splitlines() if ln.startswith("[kcverify]")] == [
        f"[kcverify] {m}" for m in lines]
    assert "bounding slice 'all'" in text and "2/3" in text and "layer0" in text
    assert "[kcverify] bounding slice 'all': block" not in text
