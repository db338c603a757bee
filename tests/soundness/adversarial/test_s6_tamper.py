"""Session 6: tampered certificates. A valid certificate from ``kcverify prove`` (the MLP
example's contract; the w8 decoder's probe slice in the campaign, where prove may certify the
whole graph as one block) is altered one field at a time - a block record's method / domain /
cut (digest), its claims (out_state narrowed, in_state narrowed with a consistent out_state from
the engine itself, so only the chain link can catch it), a block dropped or two swapped, a
clause's bound or a proof leaf's bounds tightened - and ``kcverify check`` must refuse every
one: exit 1, a ``FAIL:`` line naming the problem, no traceback. The untouched certificate checks
from a fresh process (exit 0).

Refusal is asserted only where the alteration makes a claim false or unverifiable (a method
that is not the stored one and whose re-run does not fit; the fast test also expects a looser
domain, interval instead of best, to be refused: its re-run sticks out of best's boxes on
mlp_tiny's points, checked independently here with the engine before asserting).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kcverify.boxes import DiffBox
from tests.soundness.adversarial.test_s6_util import prove_cert

ROOT = Path(__file__).resolve().parents[3]
EX = ROOT / "examples"

MLP = f"""contract: s6-tamper
version: 1.0.0
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf:
    weights: {{format: fp8_e4m3, scale: per_channel}}
    activations: {{format: fp8_e4m3, scale: dynamic_per_tensor}}
    accumulate: fp32
    compute: fp32
slices:
  points: {{inputs: {EX / 'data' / 'mlp_points.npz'}}}
clauses:
  - id: N-1
    family: numerical
    assert: "forall x in points: linf(logits_inf(x) - logits_train(x)) <= 0.25"
    level: L2
    action: guard
escalation: {{L1: log, L2: guard, L3: fallback}}
"""


def run_check(cert: Path, model: Path, contract: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kcverify", "check", str(cert), str(model),
                           contract], capture_output=True, text=True, timeout=600)


def _hx(v: float) -> str:
    return float(v).hex()


def _scale_box(obj: dict, factor: float, fields=("drift_lo", "drift_hi")) -> dict:
    """A stored box with the given fields multiplied by factor (narrowed when < 1)."""
    box = DiffBox.from_json(obj, "box")
    arrs = dict(zip(("train_lo", "train_hi", "inf_lo", "inf_hi", "drift_lo", "drift_hi"),
                    box.arrays()))
    for f in fields:
        arrs[f] = arrs[f] * factor
    return DiffBox(*arrs.values()).to_json()


def _shrink_box(obj: dict, factor: float) -> dict:
    """A stored box with each of its three intervals shrunk about its centre (a consistent,
    narrower box: the engine accepts it as an input state)."""
    a = DiffBox.from_json(obj, "box").arrays()
    out = []
    for lo, hi in ((a[0], a[1]), (a[2], a[3]), (a[4], a[5])):
        c, h = 0.5 * (lo + hi), 0.5 * (hi - lo) * factor
        out += [c - h, c + h]
    return DiffBox(*out).to_json()


def _blocks(st: dict) -> dict:
    return st["predicate"]["blocks"]


def _leaf(node: dict) -> dict:
    """The proof node with the longest ``bounds`` list (a clause's per-input leaf)."""
    best, stack = None, [node]
    while stack:
        n = stack.pop()
        b = n.get("conclusion", {}).get("bounds")
        if b is not None and (best is None or len(b) > len(best["conclusion"]["bounds"])):
            best = n
        stack.extend(n.get("premises", []))
    return best


# --- mutations: statement -> None (in place) ------------------------------------------------
def m_clause_bound(st: dict, ctx: dict) -> None:
    c = st["predicate"]["clauses"][0]
    c["bound"] = _hx(float.fromhex(c["bound"]) * 0.5)


def m_leaf_bounds(st: dict, ctx: dict) -> None:
    leaf = _leaf(st["predicate"]["clauses"][0]["proof"])
    leaf["conclusion"]["bounds"] = [_hx(float.fromhex(v) * 0.5) for v in
                                    leaf["conclusion"]["bounds"]]


def m_out_narrow(st: dict, ctx: dict) -> None:
    key = list(_blocks(st))[-1]
    b = _blocks(st)[key]
    t = next(iter(b["out_state"]))
    b["out_state"][t] = _scale_box(b["out_state"][t], 0.5)


def m_out_narrow_first(st: dict, ctx: dict) -> None:
    b = next(iter(_blocks(st).values()))
    t = next(iter(b["out_state"]))
    b["out_state"][t] = _scale_box(b["out_state"][t], 0.9)


def m_method_bogus(st: dict, ctx: dict) -> None:
    for b in _blocks(st).values():
        b["method"] = "bogus-domain"


def m_method_interval(st: dict, ctx: dict) -> None:
    for b in _blocks(st).values():
        b["method"] = "interval"
        if "domain" in b:
            b["domain"] = "interval"


def m_digest_swap(st: dict, ctx: dict) -> None:
    keys = list(_blocks(st))
    if len(keys) < 2:
        b = _blocks(st)[keys[0]]
        b["digest"] = "0" * 64
        return
    a, b = _blocks(st)[keys[0]], _blocks(st)[keys[1]]
    a["digest"], b["digest"] = b["digest"], a["digest"]


def m_drop_block(st: dict, ctx: dict) -> None:
    keys = list(_blocks(st))
    del _blocks(st)[keys[len(keys) // 2]]


def m_domain_extra(st: dict, ctx: dict) -> None:
    for b in _blocks(st).values():
        b["domain"] = "interval"


def m_in_narrow_consistent(st: dict, ctx: dict) -> None:
    """The last block's in_state narrowed (drift halved) and its out_state replaced by the
    engine's own bound from that narrower in_state: the block re-runs clean, the link to the
    block before it (whose out_state is wider) is what must fail."""
    from kcverify.api import load_contract
    from kcverify.bounds import DiffBox as EngineBox
    from kcverify.bounds import bound_block
    from kcverify.certs.recheck import model_blocks
    from kcverify.models.ir import load_onnx

    keys = list(_blocks(st))
    b = _blocks(st)[keys[-1]]
    c = load_contract(ctx["contract"])
    graph = load_onnx(ctx["model"])
    block = model_blocks(graph)[b["digest"]]
    new_in = {t: _shrink_box(v, 0.5) for t, v in b["in_state"].items()}
    ins = {t: EngineBox.of(DiffBox.from_json(v, t)) for t, v in new_in.items()}
    out = bound_block(block, c.kernels["train"], c.kernels["inf"], ins,
                      b.get("domain", b["method"]))
    b["in_state"] = new_in
    b["out_state"] = {t: DiffBox.of(out[t]).to_json() for t in b["out_state"]}


def m_in_inconsistent(st: dict, ctx: dict) -> None:
    """The last block's in_state with its drift interval halved (train and inf kept): no
    (train, inf) pair of the box has a drift in it near the ends; the re-run must refuse it as a
    bad certificate (exit 1), not crash."""
    b = _blocks(st)[list(_blocks(st))[-1]]
    b["in_state"] = {t: _scale_box(v, 0.5) for t, v in b["in_state"].items()}


MUTATIONS: dict[str, Callable[[dict, dict], None]] = {
    "clause-bound": m_clause_bound, "leaf-bounds": m_leaf_bounds, "out-narrow": m_out_narrow,
    "out-narrow-first": m_out_narrow_first, "method-bogus": m_method_bogus,
    "method-interval": m_method_interval, "digest-swap": m_digest_swap,
    "drop-block": m_drop_block, "domain-extra": m_domain_extra,
    "in-narrow-consistent": m_in_narrow_consistent, "in-inconsistent": m_in_inconsistent,
}


def tampered(st: dict, name: str, where: Path, model: Path) -> Path:
    st2 = copy.deepcopy({k: v for k, v in st.items() if not k.startswith("s6:")})
    MUTATIONS[name](st2, {"contract": st["s6:contract"], "model": str(model)})
    p = where / f"tampered-{name}.kcert.json"
    p.write_text(json.dumps(st2, sort_keys=True))
    return p


@pytest.fixture(scope="module")
def mlp_cert(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("tamper")
    st = prove_cert(d, MLP, ROOT / "models" / "mlp_tiny.onnx", "mlp")
    assert st["predicate"]["clauses"][0]["verdict"] == "proved"
    return st


def _api_check(cert: Path, st: dict):
    import kcverify

    return kcverify.check(str(cert), str(ROOT / "models" / "mlp_tiny.onnx"), st["s6:contract"])


def test_untampered_copy_checks(mlp_cert: dict, tmp_path: Path) -> None:
    st2 = copy.deepcopy({k: v for k, v in mlp_cert.items() if not k.startswith("s6:")})
    cert = tmp_path / "copy.kcert.json"
    cert.write_text(json.dumps(st2, sort_keys=True))
    rep = _api_check(cert, mlp_cert)
    assert rep.ok, rep.problems


@pytest.mark.parametrize("name", sorted(MUTATIONS))  # in-inconsistent: F2, fixed
def test_tampered_mlp_refused(mlp_cert: dict, tmp_path: Path, name: str) -> None:
    cert = tampered(mlp_cert, name, tmp_path, ROOT / "models" / "mlp_tiny.onnx")
    rep = _api_check(cert, mlp_cert)
    assert not rep.ok, f"{name}: the tampered certificate checks"
    assert rep.problems and all("\n" not in p for p in rep.problems), rep.problems


def test_valid_and_one_tampered_from_fresh_process(mlp_cert: dict, tmp_path: Path) -> None:
    model = ROOT / "models" / "mlp_tiny.onnx"
    ok = run_check(Path(mlp_cert["s6:cert"]), model, mlp_cert["s6:contract"])
    assert ok.returncode == 0, ok.stdout[-400:] + ok.stderr[-400:]
    bad = run_check(tampered(mlp_cert, "out-narrow", tmp_path, model), model, mlp_cert["s6:contract"])
    assert bad.returncode == 1, (bad.returncode, bad.stdout[-400:], bad.stderr[-400:])
    assert "Traceback" not in bad.stderr
    fails = [ln for ln in bad.stdout.splitlines() if ln.startswith("FAIL:")]
    assert fails, bad.stdout


# --- the w8 decoder's probe slice (whole-graph best blocks when prove makes them) ----------
W8 = f"""contract: s6-tamper-w8
version: 1.0.0
kernels:
  train: {{compute: fp32, accumulate: fp32}}
  inf: {{weights: {{format: fp8_e4m3, scale: per_channel}}, accumulate: fp32, compute: fp32}}
slices:
  probe: {{inputs: {EX / 'data' / 'probe.npz'}}}
clauses:
  - id: N-W8-PROBE
    family: numerical
    assert: "forall x in probe: linf(logits_inf(x) - logits_train(x)) <= 0.5"
    level: L2
    action: guard
escalation: {{L1: log, L2: guard, L3: fallback}}
"""


@pytest.mark.campaign
def test_tampered_w8_decoder_refused(tmp_path: Path) -> None:
    model = ROOT / "models" / "tiny_decoder.onnx"
    st = prove_cert(tmp_path, W8, model, "w8")
    assert st["predicate"]["clauses"][0]["verdict"] == "proved"
    methods = sorted({(b["method"], b.get("domain"), b.get("cut"))
                      for b in _blocks(st).values()}, key=str)
    print("w8 probe blocks:", len(_blocks(st)), methods)
    ok = run_check(Path(st["s6:cert"]), model, st["s6:contract"])
    assert ok.returncode == 0, ok.stdout[-400:] + ok.stderr[-400:]
    refused = []
    for name in ("clause-bound", "leaf-bounds", "out-narrow", "method-bogus",
                 "method-interval", "digest-swap", "domain-extra", "drop-block",
                 "in-narrow-consistent"):
        r = run_check(tampered(st, name, tmp_path, model), model, st["s6:contract"])
        fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL:")]
        if r.returncode != 1 or "Traceback" in r.stderr or not fails:
            refused.append(f"{name}: exit {r.returncode}, {r.stdout[-300:]} {r.stderr[-300:]}")
    assert not refused, "\n".join(refused)



# --- whole-graph best blocks (prove --blocks auto, 580b1b2) ---------------------------------
W8_WHOLE = """contract: s6-whole-w8
version: 1.0.0
kernels:
  train: {compute: fp32, accumulate: fp32}
  inf: {weights: {format: fp8_e4m3, scale: per_channel}, accumulate: fp32, compute: fp32}
slices:
  two: {inputs: DATA}
clauses:
  - id: N-W8-WHOLE
    family: numerical
    assert: "forall x in two: linf(logits_inf(x) - logits_train(x)) <= 0.185"
    level: L2
    action: guard
escalation: {L1: log, L2: guard, L3: fallback}
"""


def m_swap_whole(st: dict, ctx: dict) -> None:
    """The two inputs' whole-graph records exchange their states (keys, names and digests
    kept): each claim now sits under the other input."""
    wh = [k for k, b in _blocks(st).items() if b.get("name") == "model"]
    a, b = _blocks(st)[wh[0]], _blocks(st)[wh[1]]
    for f in ("in_state", "out_state"):
        a[f], b[f] = b[f], a[f]


def m_whole_to_segment(st: dict, ctx: dict) -> None:
    """A whole-graph record's digest and name replaced by the first segment's."""
    from kcverify.certs.recheck import model_blocks
    from kcverify.models.blocks import segment
    from kcverify.models.ir import load_onnx

    seg = segment(load_onnx(ctx["model"]))[0]
    assert seg.digest in model_blocks(load_onnx(ctx["model"]))
    for b in _blocks(st).values():
        if b.get("name") == "model":
            b["digest"], b["name"] = seg.digest, seg.name
            break


def m_whole_name(st: dict, ctx: dict) -> None:
    for b in _blocks(st).values():
        if b.get("name") == "model":
            b["name"] = "layer0"
            break


def m_whole_out_narrow(st: dict, ctx: dict) -> None:
    for b in _blocks(st).values():
        if b.get("name") == "model":
            t = next(iter(b["out_state"]))
            b["out_state"][t] = _scale_box(b["out_state"][t], 0.9)
            break


MUTATIONS.update({"swap-whole": m_swap_whole, "whole-to-segment": m_whole_to_segment,
                  "whole-name": m_whole_name, "whole-out-narrow": m_whole_out_narrow})


@pytest.mark.campaign
def test_whole_graph_w8_decoder(tmp_path: Path) -> None:
    """Two sample inputs of the w8 decoder contract at a threshold the segments miss and the
    whole graph meets (prove's auto cut): the whole-graph boxes against conforming programs,
    then each alteration of a whole-graph record refused by a fresh ``kcverify check``."""
    import numpy as np
    import onnx

    from kcverify.api import load_contract
    from tests.soundness.adversarial.interp import ProgramRunner
    from tests.soundness.adversarial.test_s6_token_contracts import programs
    from tests.soundness.adversarial.test_s6_util import containment, leaf_bounds

    model = ROOT / "models" / "tiny_decoder.onnx"
    ids = np.load(EX / "data" / "sample.npz")["input_ids"][:2]
    data = tmp_path / "two.npz"
    np.savez(data, input_ids=ids)
    st = prove_cert(tmp_path, W8_WHOLE.replace("DATA", str(data)), model, "w8w")
    c = st["predicate"]["clauses"][0]
    recs = {k: (b["method"], b.get("name"), b["digest"][:10]) for k, b in _blocks(st).items()}
    print("whole w8:", c["verdict"], c.get("bound"), recs)
    if c["verdict"] != "proved" or not any(v[1] == "model" for v in recs.values()):
        pytest.skip(f"no whole-graph proof here: {c['verdict']}, {recs}")
    spec = load_contract(st["s6:contract"]).kernels
    run = ProgramRunner(onnx.load(str(model)))
    per = leaf_bounds(st, "N-W8-WHOLE")
    found, worst = [], 0.0
    for k in range(2):
        # the whole-graph record of input k: 'two/r<k>-<k+1>/whole/0:model' (580b1b2)
        keys = [key for key, b in _blocks(st).items()
                if b.get("name") == "model" and f"/r{k}-{k + 1}/" in key]
        assert len(keys) == 1, list(_blocks(st))
        box = DiffBox.from_json(_blocks(st)[keys[0]]["out_state"]["logits"], keys[0])
        feeds = {"input_ids": ids[k:k + 1]}
        with np.errstate(all="ignore"):
            zt = [run(p, feeds)["logits"] for p in programs(spec["train"], 10 * k)]
            zi = [run(p, feeds)["logits"] for p in programs(spec["inf"], 100 + 10 * k)]
        for a in zt:
            for b_ in zi:
                bad, r = containment(box, per[k:k + 1] if per is not None else None, a, b_,
                                     f"whole w8 input {k}")
                found += bad
                worst = max(worst, r)
    print("whole w8 programs: worst obs/cert", worst, "violations", len(found))
    assert not found, "\n".join(found[:3])
    ok = run_check(Path(st["s6:cert"]), model, st["s6:contract"])
    assert ok.returncode == 0, ok.stdout[-400:] + ok.stderr[-400:]
    refused = []
    for name in ("swap-whole", "whole-to-segment", "whole-name", "whole-out-narrow",
                 "method-interval", "leaf-bounds"):
        r = run_check(tampered(st, name, tmp_path, model), model, st["s6:contract"])
        fails = [ln for ln in r.stdout.splitlines() if ln.startswith("FAIL:")]
        print("whole w8 tamper", name, r.returncode, fails[:1])
        if r.returncode != 1 or "Traceback" in r.stderr or not fails:
            refused.append(f"{name}: exit {r.returncode}, {r.stdout[-300:]} {r.stderr[-300:]}")
    assert not refused, "\n".join(refused)
