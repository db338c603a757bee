"""The adversarial campaign: >= 10^6 (input, conforming program pair) checks across the shipped
models, every rule case and a torch-exported encoder layer, per attack class.

    led = run_campaign(scale=1.0, seed=0, log=print)   # ~10^6 pairs at scale 1
    print(led.report())

Classes (a pair = one input row checked against one (training, inference) program pair):

* ``campaign/mlp/<model>/<spec>/<kind>``: a batch of inputs (normal, fp8 midpoints,
  saturating), interval domain over the batch, plus the best domain (zonotope included) on the
  first two rows; every program pair of attacks.pairs;
* ``campaign/mlp-region/<model>/<spec>``: L-inf boxes (eps 0.01, 0.05), linear domain, box
  corners and random points;
* ``campaign/rule/<case>/<spec>``: every rule case of rulecases.py at a batch of inputs of
  every kind (but the combinations an open finding of test_findings.py pins down);
* ``campaign/model/<name>``: the token models and the encoder layer (both exporters), domain
  best, a few pairs (each costs a forward pass per program);
* ``campaign/conv/<geometry>/<spec>``: test_conv.py's convolutions (strides, pads, SAME_*,
  dilations, 1-D, windows that skip elements), three Conv-compatible specs each in rotation,
  normal / midpoint / saturating batches in interval and linear, two rows in best, L-inf boxes;
* ``campaign/fp8/<model>/<spec>``: fp8 activations on every shipped model and the encoder
  layer: examples/contracts/fp8-deploy.yaml's inference kernel, its ``rounding: any`` variant,
  the same on Hopper FP8 tensor cores (``mma: sm90_fp8, promote: 128``) and per-token e4m3
  with bf16 compute; MLPs over batches of normal / fp8-midpoint / saturating inputs (interval,
  best on two rows), the transformers on token inputs (interval over a batch, best on one).

An engine that raises instead of bounding (InternalError, or a BoundError refusal such as
Sqrt of a box reaching below 0) is recorded per class as an engine error, not as a pair.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kcverify.bounds import Region, certify_drift
from kcverify.errors import BoundError, InternalError
from tests.soundness.adversarial.attacks import SPECS, box_points, pairs
from tests.soundness.adversarial.harness import TRAIN, Ledger, attack, graph_of, spec
from tests.soundness.adversarial.interp import ProgramRunner
from tests.soundness.adversarial.rulecases import CASES, conv_spec, feeds_for, open_finding
from tests.soundness.adversarial.subjects import encoder_layer, shipped

MLP_SPECS = ("fp8_token_fp32", "fp8_tensor_bf16", "e5m2_any_fp16", "fp8_static_block",
             "fp8_dynblock", "int8_block", "bf16_acc_bf16")
RULE_SPECS = ("fp8_tensor_bf16", "e5m2_any_fp16", "fp8_token_fp32", "fp16_ulps4")
W8_BF16 = spec(weights={"format": "fp8_e4m3", "scale": "per_channel"}, accumulate="fp32",
               compute="bf16")


def _mlp_x(d: int, kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    from tests.soundness.adversarial.test_models import _mlp_inputs  # one definition

    return _mlp_inputs("mlp_tiny" if d == 4 else "mlp_small", kind, n, rng)


def _check_batch(led: Ledger, cls: str, model, sp, x: dict[str, np.ndarray], n_pairs: int,
                 seed: int, domain: str) -> None:
    try:
        with np.errstate(all="ignore"):
            res = certify_drift(graph_of(model), TRAIN, sp, x, domain=domain).outputs
    except (InternalError, BoundError) as e:  # no certificate: recorded, not a pair
        led[cls].errors.append(f"{cls} ({domain}): {type(e).__name__}: {e}")
        return
    run = ProgramRunner(model)
    for p_t, p_i in pairs(TRAIN, sp, n_pairs, seed, per_sample="axis0"):
        with np.errstate(all="ignore"):
            yt, yi = run(p_t, x), run(p_i, x)
        for out, box in res.items():
            led.check(cls, box, yt[out], yi[out], f"{cls} seed {seed}: {p_t} | {p_i}")


def mlp_points(led: Ledger, scale: float, seed: int, log: Callable[[str], None]) -> None:
    n = max(2, int(1024 * scale))
    for name, d in (("mlp_tiny", 4), ("mlp_small", 8)):
        model = shipped(name)
        for sp_name in MLP_SPECS:
            for k, kind in enumerate(("normal", "midpoint", "saturate")):
                rng = np.random.default_rng([seed, d, k, len(sp_name)])
                x = {"x": _mlp_x(d, kind, n, rng)}
                cls = f"campaign/mlp/{name}/{sp_name}/{kind}"
                _check_batch(led, cls, model, SPECS[sp_name], x, 16, seed + k, "interval")
                _check_batch(led, cls, model, SPECS[sp_name], {"x": x["x"][:2]}, 4, seed + k,
                             "best")
            log(f"{name} {sp_name}: {led_total(led, f'campaign/mlp/{name}/{sp_name}')} pairs")


def mlp_regions(led: Ledger, scale: float, seed: int, log: Callable[[str], None]) -> None:
    centres = max(1, int(4 * scale))
    for name, d in (("mlp_tiny", 4), ("mlp_small", 8)):
        model = shipped(name)
        run = ProgramRunner(model)
        g = graph_of(model)
        for sp_name in MLP_SPECS:
            sp = SPECS[sp_name]
            cls = f"campaign/mlp-region/{name}/{sp_name}"
            for eps in (0.01, 0.05):
                rng = np.random.default_rng([seed, d, int(eps * 100)])
                x = _mlp_x(d, "normal", centres, rng)
                res = certify_drift(g, TRAIN, sp, {"x": x}, region=Region("input", "linf", eps),
                                    domain="linear").outputs
                for pt in box_points(rng, x, eps, 6):
                    for p_t, p_i in pairs(TRAIN, sp, 4, seed, per_sample="axis0"):
                        with np.errstate(all="ignore"):
                            yt, yi = run(p_t, {"x": pt}), run(p_i, {"x": pt})
                        for out, box in res.items():
                            led.check(cls, box, yt[out], yi[out], f"{cls} eps {eps}: {p_t} | {p_i}")
        log(f"{name} regions: {led_total(led, f'campaign/mlp-region/{name}')} pairs")


def rules(led: Ledger, scale: float, seed: int, log: Callable[[str], None]) -> None:
    n = max(2, int(320 * scale))
    for case in CASES:
        for sp_name in RULE_SPECS:
            for k, kind in enumerate(case.kinds):
                if case.extra.get("conv") and not conv_spec(SPECS[sp_name]):
                    continue  # a cast a convolution does not define (refused by the rule)
                if open_finding(case, sp_name, kind):
                    log(f"rule {case.id} {sp_name} {kind}: skipped, open finding "
                        f"{open_finding(case, sp_name, kind)}")
                    continue
                rng = np.random.default_rng([seed, k, len(case.id), len(sp_name)])
                feeds = feeds_for(case, kind, sp_name, rng, batch=n)
                cls = f"campaign/rule/{case.id}/{sp_name}"
                _check_batch(led, cls, case.model, SPECS[sp_name], feeds, 6, seed + k,
                             "interval")
        log(f"rule {case.id}: {led_total(led, f'campaign/rule/{case.id}/')} pairs")


def transformers(led: Ledger, scale: float, seed: int, log: Callable[[str], None]) -> None:
    token_fp8 = SPECS["fp8_token_fp32"]
    n_pairs = max(2, int(3 * scale))
    for name in ("tiny_encoder", "tiny_decoder"):
        ids = np.random.default_rng([seed, len(name)]).integers(0, 256, size=(2, 8))
        for sp in (W8_BF16, token_fp8):
            attack(led, f"campaign/model/{name}", shipped(name), TRAIN, sp, {"input_ids": ids},
                   pairs(TRAIN, sp, n_pairs, seed), domain="best")
        log(f"{name}: {led_total(led, f'campaign/model/{name}')} pairs")
    for exporter in ("legacy", "dynamo"):
        model = encoder_layer(exporter)
        if isinstance(model, str):
            log(f"encoder layer ({exporter}) skipped: {model}")
            continue
        for s in range(2):
            x = np.random.default_rng([seed, s]).normal(size=(1, 8, 32)).astype(np.float32)
            for sp in (W8_BF16, token_fp8, SPECS["fp8_tensor_bf16"]):
                attack(led, f"campaign/model/encoder_layer_{exporter}", model, TRAIN, sp,
                       {"x": x}, pairs(TRAIN, sp, n_pairs, seed + s), domain="best")
        log(f"encoder layer {exporter}: "
            f"{led_total(led, f'campaign/model/encoder_layer_{exporter}')} pairs")


FP8_SPECS = {
    "fp8-deploy": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                       activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                       accumulate="fp32", compute="fp32"),
    "fp8-deploy-any": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                           activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                           accumulate="fp32", compute="fp32", rounding="any"),
    "fp8-deploy-sm90": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                            activations={"format": "fp8_e4m3", "scale": "dynamic_per_tensor"},
                            accumulate={"format": "fp32", "mma": "sm90_fp8", "promote": 128},
                            compute="fp32"),
    "fp8-token-bf16": spec(weights={"format": "fp8_e4m3", "scale": "per_channel"},
                           activations={"format": "fp8_e4m3", "scale": "dynamic_per_token"},
                           accumulate="fp32", compute="bf16"),
}


def _fp8_pairs(sp, n: int, seed: int, **fixed) -> list:
    """attacks.pairs plus the sm90 variants (accumulator outside the alignment, truncation
    toward -inf) when the spec names the tensor core."""
    out = pairs(TRAIN, sp, n, seed, **fixed)
    if sp.accumulation.mma is not None:
        from tests.soundness.adversarial.programs import Program

        out += [(Program(TRAIN, order="seq"),
                 Program(sp, order="rev", mma_variant=v, mma_trunc=t, label=f"sm90 {v}/{t}",
                         **fixed))
                for v, t in (("no_c", "zero"), ("with_c", "floor"))]
    return out


def fp8_models(led: Ledger, scale: float, seed: int, log: Callable[[str], None]) -> None:
    n = max(2, int(256 * scale))
    n_pairs = max(2, int(8 * scale))
    for name, d in (("mlp_tiny", 4), ("mlp_small", 8)):
        model = shipped(name)
        for sp_name, sp in FP8_SPECS.items():
            cls = f"campaign/fp8/{name}/{sp_name}"
            for k, kind in enumerate(("normal", "midpoint", "saturate")):
                rng = np.random.default_rng([seed, d, k, len(sp_name), 8])
                x = {"x": _mlp_x(d, kind, n, rng)}
                _check_batch(led, cls, model, sp, x, 2 * n_pairs, seed + k, "interval")
                _check_batch(led, cls, model, sp, {"x": x["x"][:2]}, n_pairs, seed + k, "best")
            log(f"fp8 {name} {sp_name}: {_line(led, cls)}")
    n_ids = max(1, int(4 * scale))
    for name in ("tiny_encoder", "tiny_decoder"):
        model = shipped(name)
        for sp_name, sp in FP8_SPECS.items():
            cls = f"campaign/fp8/{name}/{sp_name}"
            ids = np.random.default_rng([seed, len(name), len(sp_name)]).integers(
                0, 256, size=(n_ids, 8))
            for domain, rows in (("interval", slice(None)), ("best", slice(0, 1))):
                try:
                    attack(led, cls, model, TRAIN, sp, {"input_ids": ids[rows]},
                           _fp8_pairs(sp, n_pairs, seed), domain=domain)
                except (InternalError, BoundError) as e:
                    led[cls].errors.append(f"{cls} ({domain}): {type(e).__name__}: {e}")
            log(f"fp8 {name} {sp_name}: {_line(led, cls)}")
    for exporter in ("legacy", "dynamo"):
        model = encoder_layer(exporter)
        if isinstance(model, str):
            log(f"fp8 encoder layer ({exporter}) skipped: {model}")
            continue
        for sp_name, sp in FP8_SPECS.items():
            cls = f"campaign/fp8/encoder_layer_{exporter}/{sp_name}"
            for s in range(max(1, int(2 * scale))):
                rng = np.random.default_rng([seed, s, len(sp_name)])
                x = (rng.normal(size=(1, 8, 32)) * (1.0 if s % 2 == 0 else 8.0)).astype(np.float32)
                for domain in ("interval", "best"):
                    try:
                        attack(led, cls, model, TRAIN, sp, {"x": x},
                               _fp8_pairs(sp, n_pairs, seed + s), domain=domain)
                    except (InternalError, BoundError) as e:
                        led[cls].errors.append(f"{cls} ({domain}): {type(e).__name__}: {e}")
            log(f"fp8 encoder layer {exporter} {sp_name}: {_line(led, cls)}")


def convs(led: Ledger, scale: float, seed: int, log: Callable[[str], None]) -> None:
    """Conv (test_conv.py's geometries, three specs each in rotation: every geometry x spec
    pair is test_conv's slow sweep): batches of normal / midpoint / saturating inputs in
    interval and linear, two rows in best, and an L-inf box (linear or best, alternating) at
    its corners and inside."""
    from tests.soundness.adversarial.test_conv import CONV_SPECS, GEOMS, conv_case

    n = max(2, int(8 * scale))  # the programs' cost grows with the rows (minutes per class at 64)
    names = sorted(CONV_SPECS)
    for gi, name in enumerate(GEOMS):
        case = conv_case(name)
        run = ProgramRunner(case.model)
        g = graph_of(case.model)
        for si in range(3):
            sp_name = names[(3 * gi + si) % len(names)]
            sp = CONV_SPECS[sp_name]
            cls = f"campaign/conv/{name}/{sp_name}"
            for k, kind in enumerate(("normal", "midpoint", "saturate")):
                rng = np.random.default_rng([seed, k, len(name), len(sp_name)])
                feeds = feeds_for(case, kind, sp, rng, batch=n)
                for domain, rows in (("interval", n), ("linear", n), ("best", 2)):
                    _check_batch(led, cls, case.model, sp, {"x": feeds["x"][:rows]}, 4,
                                 seed + k, domain)
            rng = np.random.default_rng([seed, len(name), len(sp_name)])
            x = feeds_for(case, "midpoint", sp, rng, batch=2)["x"]
            for domain in (("linear", "best")[(gi + si) % 2],):
                try:
                    with np.errstate(all="ignore"):
                        res = certify_drift(g, TRAIN, sp, {"x": x}, domain=domain,
                                            region=Region("input", "linf", 0.02)).outputs
                except (InternalError, BoundError) as e:
                    led[cls].errors.append(f"{cls} ({domain}, box): {type(e).__name__}: {e}")
                    continue
                for pt in box_points(rng, x, 0.02, 4):
                    for p_t, p_i in pairs(TRAIN, sp, 3, seed, per_sample="axis0"):
                        with np.errstate(all="ignore"):
                            yt, yi = run(p_t, {"x": pt}), run(p_i, {"x": pt})
                        for out, box in res.items():
                            led.check(cls, box, yt[out], yi[out],
                                      f"{cls} box {domain}: {p_t} | {p_i}")
            log(f"conv {name} {sp_name}: {_line(led, cls)}")


def _line(led: Ledger, cls: str) -> str:
    """One class's running figures (a campaign cut short still says what it found)."""
    st = led[cls]
    return (f"{st.pairs} pairs, {len(st.violations)} violations, worst obs/cert drift "
            f"{st.worst_drift:.4g}, excursion {st.worst_excursion:.4g}, engine errors "
            f"{len(st.errors)}" + (f"; first: {st.violations[0][:300]}" if st.violations else ""))


def led_total(led: Ledger, prefix: str) -> int:
    return sum(st.pairs for n, st in led.classes.items() if n.startswith(prefix))


PARTS = {"mlp": mlp_points, "regions": mlp_regions, "rules": rules, "models": transformers,
         "fp8": fp8_models, "conv": convs}
# the 10^6-pair campaign's parts (fp8: whole models with fp8 activations, its own test and
# bench run: python bench/adversarial.py --parts fp8)
DEFAULT_PARTS = ("mlp", "regions", "rules", "models")


def run_campaign(scale: float = 1.0, seed: int = 0, parts: tuple[str, ...] = DEFAULT_PARTS,
                 log: Callable[[str], None] = lambda s: None) -> Ledger:
    led = Ledger()
    for part in parts:
        t0 = time.perf_counter()
        PARTS[part](led, scale, seed, log)
        log(f"-- {part}: {time.perf_counter() - t0:.0f} s, {led_total(led, 'campaign/')} pairs so far")
    return led


def by_family(led: Ledger, depth: int = 3) -> Ledger:
    """The ledger folded to class prefixes of ``depth`` path components (for a short table)."""
    out = Ledger()
    for n, st in led.classes.items():
        key = "/".join(n.split("/")[:depth])
        sub = Ledger()
        sub.classes[key] = st
        out.merge(sub)
    return out
