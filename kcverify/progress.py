"""Progress of long work on stderr: a bar with an ETA on a terminal (tqdm), plain lines otherwise
(a log file or CI keeps one readable line per step, as before).

* ``Bar(desc, total)``: ``update(done, note)`` after each unit (``bound``: one input).
* ``ProveProgress()``: the planner's progress callback (``ProveOptions.progress``). It prints the
  planner's messages as ``[kcverify] ...`` lines; on a terminal, the per-block messages of a slice
  being bounded (``bounding slice 'S': block k/n (B)``) drive one bar for that slice instead.
"""

from __future__ import annotations

import re
import sys
from typing import IO, Any

BLOCK = re.compile(r"^bounding slice (?P<slice>'.*'): block (?P<k>\d+)/(?P<n>\d+) \((?P<block>.*)\)$")


def is_tty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _tqdm(desc: str, total: int, stream: IO[str], unit: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=stream, unit=unit, leave=False, dynamic_ncols=True,
                mininterval=0.2)


class Bar:
    """One unit of progress at a time: a tqdm bar (count, rate, elapsed<remaining) on a TTY,
    else the line ``desc done/total (note)`` per update (none for 0 done). ``tty`` forces
    either."""

    def __init__(self, desc: str, total: int, stream: IO[str] | None = None,
                 tty: bool | None = None, unit: str = "it") -> None:
        self.desc, self.total = desc, total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_tty(self.stream) if tty is None else tty
        self.bar = _tqdm(desc, total, self.stream, unit) if self.tty else None

    def update(self, done: int, note: str = "") -> None:
        if self.bar is not None:
            self.bar.n = done
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.refresh()
            return
        if done == 0:
            return  # lines report what is done
        extra = f" ({note})" if note else ""
        self.stream.write(f"{self.desc} {done}/{self.total}{extra}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ProveProgress:
    """The planner's progress callback: lines, with a bar per slice being bounded on a TTY."""

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_tty(self.stream) if tty is None else tty
        self.bar: Bar | None = None
        self.slice: str | None = None

    def __call__(self, msg: str) -> None:
        m = BLOCK.match(msg) if self.tty else None
        if m is not None:
            k, n = int(m["k"]), int(m["n"])
            if self.bar is None or self.slice != m["slice"] or self.bar.total != n:
                self.close()
                self.slice = m["slice"]
                self.bar = Bar(f"bounding slice {m['slice']}", n, self.stream, tty=True,
                               unit="block")
            self.bar.update(k - 1, m["block"])  # block k starts: k - 1 done
            return
        self.close()
        print(f"[kcverify] {msg}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar, self.slice = None, None
