"""`kcverify monitor CONTRACT TRACES [--window 300s] [--json] [--follow]`: per time window of a
trace file, every clause's value and deviation, the health score H and the routing action.

Exit 0 when no window has a violated clause, 1 when one has, 2 for bad input (a malformed trace
line is ``file:line: error: ...`` unless --skip-bad counts it and warns).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "monitor", help="health score and routing action per time window of logged traces",
        description="Re-evaluate every clause of CONTRACT on each time window of TRACES (JSONL, "
                    "docs/enforcement.md): the clause values and deviations, the health score "
                    "H (weighted deviation: 0 compliant, rising to 1) and the action the "
                    "escalation policy recommends (none, log, guard, fallback). Windows start "
                    "at the first record's time. Exit 0: no clause violated in any window; 1: "
                    "some window violated a clause; 2: bad input.")
    p.add_argument("contract", help="the contract YAML file")
    p.add_argument("traces", help="the trace file (JSONL, one record per request and kernel)")
    p.add_argument("--window", default="300s", help="window width (e.g. 300s, 5m; default 300s)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object {windows: [...], summary} (with --follow: one "
                        "JSON object per window as it closes, then {summary})")
    p.add_argument("--follow", action="store_true",
                   help="keep reading as the file grows (Ctrl-C or --idle-timeout ends it)")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                   help="with --follow: stop after S seconds without a new record")
    p.add_argument("--poll", type=float, default=0.25, metavar="S",
                   help="with --follow: seconds between reads at the end of the file")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip malformed lines (counted, with a warning) instead of exit 2")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the per-window empirical decisions (default 0.95)")
    p.add_argument("--health-threshold", type=float, default=None, metavar="H",
                   help="H a compliant window may reach (drawn on the plot; default 0.1)")
    p.add_argument("--html", metavar="FILE",
                   help="write an HTML page with H over time, the threshold and action bands")
    p.set_defaults(func=run)


def _table_row(w: Any) -> str:
    h = "-" if w.health is None else f"{w.health:.3f}"
    bad = ", ".join(f"{c.id} {c.value:.4g}" if c.value is not None else c.id
                    for c in w.violated) or "-"
    return (f"{w.index:>4}  {w.start.strftime('%Y-%m-%d %H:%M:%S')}  {w.n:>6}  {h:>6}  "
            f"{w.action:<9} {bad}")


def run(args: argparse.Namespace) -> int:
    from kcverify.dsl import load_contract
    from kcverify.enforce.monitor import DEFAULT_HEALTH_THRESHOLD
    from kcverify.enforce.traces import parse_duration
    from kcverify.errors import KcverifyError

    contract = load_contract(args.contract)
    width = parse_duration(args.window)
    if not 0.0 < args.confidence < 1.0:
        raise KcverifyError(f"--confidence {args.confidence}: expected a number in (0, 1)")
    threshold = (DEFAULT_HEALTH_THRESHOLD if args.health_threshold is None
                 else args.health_threshold)
    stopping = {"now": False}
    previous: dict[int, Any] = {}
    if args.follow and threading.current_thread() is threading.main_thread():
        def on_signal(_sig: int, _frame: Any) -> None:
            stopping["now"] = True  # the reader stops; the open window is still reported

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        return _run(args, contract, width, threshold, stopping)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run(args: argparse.Namespace, contract: Any, width: float, threshold: float,
         stopping: dict[str, bool]) -> int:
    from kcverify.enforce.monitor import Summary, monitor, tracking
    from kcverify.enforce.promote import trace_slices
    from kcverify.enforce.traces import TraceReader

    reader = TraceReader(args.traces, follow=args.follow, skip_bad=args.skip_bad,
                         poll_s=args.poll, idle_timeout=args.idle_timeout,
                         stop=lambda: stopping["now"])
    extra = trace_slices(contract, args.traces)
    unknown: set[str] = set()

    def records() -> Any:
        for r in reader:
            if extra:
                r.slices = tuple(dict.fromkeys((*r.slices, *extra)))
            for name in r.slices:
                if name not in contract.slices and name not in unknown:
                    unknown.add(name)
                    print(f"{r.where}: warning: slice {name!r} is not a slice of the contract "
                          f"({', '.join(contract.slices)}); no clause is measured on it",
                          file=sys.stderr)
            yield r

    summary = Summary()
    out = sys.stdout
    header = (f"{args.traces}: contract {contract.name} {contract.version}, windows of "
              f"{width:g} s\n WIN  START                     N       H  ACTION    VIOLATED\n")
    for w in monitor(contract, tracking(records(), summary), width, args.confidence,
                     skipped=lambda: reader.skipped_total):
        summary.add_window(w)
        if args.json and args.follow:
            out.write(json.dumps(w.to_json(), sort_keys=True) + "\n")
        elif not args.json:
            out.write(header if w.index == 0 else "")
            out.write(_table_row(w) + "\n")
        out.flush()
    note = reader.summary()
    if note:
        print(note, file=sys.stderr)
    body = {
        "format": "kcverify-monitor", "format_version": 1,
        "contract": {"name": contract.name, "version": contract.version,
                     "sha256": contract.sha256},
        "traces": args.traces, "window_s": width, "health_threshold": threshold,
        "records": reader.records, "lines": reader.lines,
        "skipped": {"count": reader.skipped_total, "by_reason": dict(reader.skipped)},
        "summary": summary.to_json(),
    }
    if args.json and args.follow:
        out.write(json.dumps({"summary": body}, sort_keys=True) + "\n")
    elif args.json:
        body["windows"] = [w.to_json() for w in summary.windows]
        out.write(json.dumps(body, indent=2, sort_keys=True) + "\n")
    else:
        for ch in summary.changes():
            lag = ("not detected" if ch["detection_lag_s"] is None else
                   f"detected after {ch['detection_lag_s']:.0f} s ({ch['action']})")
            out.write(f"build {ch['from']} -> {ch['to']} at {ch['at']}: {lag}\n")
        if not summary.windows:
            out.write(f"{args.traces}: no trace records\n")
    if args.html:
        from kcverify.enforce.plot import write_monitor_html

        write_monitor_html(args.html, contract, summary, width, threshold, args.traces)
        if not args.json:
            out.write(f"html: {args.html}\n")
    return 1 if any(w.action != "none" for w in summary.windows) else 0
