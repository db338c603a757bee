"""Build a typed Contract from a YAML file: validate keys, parse and type-check expressions,
desugar the short metric form, classify clauses. Reads only the contract file itself.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kcverify.dsl.ast import BoolOp, Compare, Expr, Quantifier, number, number_value
from kcverify.dsl.metrics import METRICS
from kcverify.dsl.model import (
    ACTIONS,
    DEFAULT_ESCALATION,
    FAMILIES,
    LEVELS,
    REGION_NORMS,
    REGION_SPACES,
    Clause,
    Contract,
    ModelRef,
    Region,
    Slice,
)
from kcverify.dsl.parser import parse_expr
from kcverify.dsl.source import Path_, Source, load_source, parse_source
from kcverify.dsl.typecheck import Checker, check_condition, suggest
from kcverify.errors import ContractError, KernelSpecError
from kcverify.kernels.spec import KernelSpec, parse_kernel_spec

TOP_KEYS = ("contract", "version", "description", "model", "kernels", "slices", "clauses",
            "escalation", "temperature")
CLAUSE_KEYS = ("id", "family", "description", "assert", "metric", "slices", "threshold",
               "budget", "hard", "level", "action", "temperature")
SLICE_KEYS = ("inputs", "where", "region", "traces", "vnnlib")
REGION_KEYS = ("space", "norm", "eps")
MODEL_KEYS = ("onnx", "sha256")
KERNELS = ("train", "inf")
# Per-input fields a slice's where may test (kcverify.empirical.slices computes them).
WHERE_FIELDS = {"len": "number", "index": "number", "label": "number"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z_0-9]*$")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
_SHA = re.compile(r"^[0-9a-f]{64}$")
_KEYWORDS = ("forall", "exists", "in", "and", "or", "not", "implies")


def classify(kinds: set[str], expr: Expr) -> str:
    """semantics §1.2: runtime or label-needing measurements are empirical; a condition on the
    artifacts alone is static; model quantities quantified over slices are certifiable."""
    if kinds & {"runtime", "label"}:
        return "empirical"
    if "model" in kinds:
        return "certifiable"
    return "static"


def comparison_threshold(expr: Expr) -> float | None:
    """c for a condition of the shape [quantifiers:] Q op c (c a number), else None."""
    while isinstance(expr, Quantifier):
        expr = expr.body
    if isinstance(expr, Compare):
        return number_value(expr.right)
    return None


class _Loader:
    def __init__(self, src: Source) -> None:
        self.src = src
        self.file = src.file

    # --------------------------------------------------------------- helpers
    def fail(self, message: str, path: Path_, at: str = "value") -> ContractError:
        return self.src.error(message, path, at)

    def mapping(self, value: Any, path: Path_, what: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(f"{what} must be a mapping (key: value), got {_kind(value)}", path)
        return value

    def keys(self, raw: Mapping[str, Any], path: Path_, allowed: tuple[str, ...],
             what: str) -> None:
        for key in raw:
            if key not in allowed:
                raise self.fail(f"unknown key {key!r} in {what}{suggest(str(key), allowed)}; "
                                f"expected one of {', '.join(allowed)}", (*path, key), "key")

    def require(self, raw: Mapping[str, Any], path: Path_, key: str, what: str,
                hint: str = "") -> Any:
        if key not in raw or raw[key] is None:
            where = (*path, key) if key in raw else path
            raise self.fail(f"missing required key {key!r} in {what}{hint}", where,
                            "key" if key not in raw else "value")
        return raw[key]

    def number(self, value: Any, path: Path_, what: str) -> float:
        if isinstance(value, str) and _NUMBER.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e-3 as a string
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(f"{what} must be a number, got {_kind(value)} {value!r}", path)
        if not math.isfinite(value):
            raise self.fail(f"{what} must be a finite number, got {value!r}", path)
        return float(value)

    def string(self, value: Any, path: Path_, what: str) -> str:
        if not isinstance(value, str):
            raise self.fail(f"{what} must be a string, got {_kind(value)}", path)
        if not value.strip():
            raise self.fail(f"{what} must not be empty", path)
        return value

    def choice(self, value: Any, path: Path_, what: str, options: tuple[str, ...]) -> str:
        if not isinstance(value, str) or value not in options:
            raise self.fail(f"unknown {what} {value!r}{suggest(str(value), options)}; expected "
                            f"one of {', '.join(options)}", path)
        return value

    def expr(self, text: Any, path: Path_, what: str) -> Expr:
        text = self.string(text, path, what)
        return parse_expr(text, self.file, self.src.string_locator(path))

    # --------------------------------------------------------------- sections
    def contract(self, path: Path) -> Contract:
        data = self.src.data
        if not isinstance(data, Mapping):
            raise self.fail(f"a contract must be a mapping with keys {', '.join(TOP_KEYS)}, "
                            f"got {_kind(data)}", ())
        self.keys(data, (), TOP_KEYS, "the contract")
        name = self.string(self.require(data, (), "contract", "the contract",
                                        " (the contract's name)"), ("contract",), "contract")
        version = data.get("version", "0")
        if isinstance(version, bool) or not isinstance(version, str | int | float):
            raise self.fail("version must be a string such as 1.2.0", ("version",))
        description = data.get("description")
        temperature = 1.0
        if "temperature" in data:
            temperature = self.temperature(data["temperature"], ("temperature",))
        model = self.model(data.get("model"))
        kernels = self.kernels(self.require(data, (), "kernels", "the contract",
                                            " (train and inf kernel specs)"))
        slices = self.slices(data.get("slices") or {})
        escalation = self.escalation(data.get("escalation"))
        clauses = self.clauses(self.require(data, (), "clauses", "the contract"), slices,
                               escalation, temperature)
        digest = hashlib.sha256(self.src.text.encode("utf-8")).hexdigest()
        return Contract(name, str(version), model, kernels, slices, clauses, escalation, path,
                        digest, temperature, description if isinstance(description, str) else None)

    def temperature(self, value: Any, path: Path_) -> float:
        t = self.number(value, path, "temperature")
        if not t > 0:
            raise self.fail(f"temperature must be > 0, got {value!r}", path)
        return t

    def model(self, raw: Any) -> ModelRef:
        path: Path_ = ("model",)
        if raw is None:
            return ModelRef()
        if isinstance(raw, str):
            return ModelRef(raw)
        raw = self.mapping(raw, path, "model")
        self.keys(raw, path, MODEL_KEYS, "model")
        onnx = raw.get("onnx")
        if onnx is not None:
            onnx = self.string(onnx, (*path, "onnx"), "model onnx path")
        sha = raw.get("sha256", "auto")
        if not isinstance(sha, str) or not (sha == "auto" or _SHA.match(sha)):
            raise self.fail("model sha256 must be 'auto' or 64 lowercase hex digits",
                            (*path, "sha256"))
        return ModelRef(onnx, sha)

    def kernels(self, raw: Any) -> dict[str, KernelSpec]:
        path: Path_ = ("kernels",)
        raw = self.mapping(raw, path, "kernels")
        self.keys(raw, path, KERNELS, "kernels")
        for name in KERNELS:
            self.require(raw, path, name, "kernels",
                         f" (the {'training' if name == 'train' else 'inference'} kernel spec)")
        last: list[tuple[str, ...]] = [()]

        def locate(p: tuple[str, ...]) -> tuple[str | None, int | None, int | None]:
            last[0] = p
            line, col = self.src.value_at(p)
            return self.file, line, col

        out: dict[str, KernelSpec] = {}
        for name in KERNELS:
            try:
                out[name] = parse_kernel_spec(name, raw[name], locate)
            except KernelSpecError as e:
                at = "key" if e.message.startswith("unknown key") else "value"
                raise self.fail(e.message, last[0], at) from None
        return out

    def slices(self, raw: Any) -> dict[str, Slice]:
        path: Path_ = ("slices",)
        raw = self.mapping(raw, path, "slices")
        out: dict[str, Slice] = {}
        for name, spec in raw.items():
            p = (*path, name)
            if not _NAME.match(str(name)) or name in _KEYWORDS:
                raise self.fail(f"slice name {name!r} must be an identifier (letters, digits, _) "
                                f"and not a keyword", p, "key")
            if isinstance(spec, str):
                spec = {"inputs": spec}
            spec = self.mapping(spec, p, f"slice {name!r}")
            self.keys(spec, p, SLICE_KEYS, f"slice {name!r}")
            if "vnnlib" in spec:  # a VNN-LIB property's input box (kcverify.regions)
                spec = self.vnnlib_slice(spec, p, str(name))
            traces = (self.string(spec["traces"], (*p, "traces"), "traces")
                      if "traces" in spec else None)  # kcverify.enforce: a JSONL trace file
            inputs = "" if traces is not None and "inputs" not in spec else self.string(
                self.require(spec, p, "inputs", f"slice {name!r}",
                             " (an .npz file of token ids, or traces: a JSONL trace file)"),
                (*p, "inputs"), "inputs")
            where = None
            if spec.get("where") is not None:
                where = self.expr(spec["where"], (*p, "where"), "where")
                check_condition(where, self.file, (), WHERE_FIELDS, "a slice's where")
            region = self.region(spec["region"], (*p, "region")) if "region" in spec else None
            line, col = self.src.key_at(p)
            out[str(name)] = Slice(str(name), inputs, where, region, traces, line=line,
                                   column=col)
        return out

    def vnnlib_slice(self, spec: Mapping[str, Any], p: Path_, name: str) -> dict[str, Any]:
        """{vnnlib: FILE}: the slice is the property's input box (read when proving, not here);
        the file is its data (digested in certificates)."""
        for key in spec:
            if key != "vnnlib":
                raise self.fail(f"slice {name!r}: a vnnlib slice is the property's input box; "
                                f"{key!r} does not apply to it", (*p, key), "key")
        path = self.string(spec["vnnlib"], (*p, "vnnlib"), "vnnlib")
        if not (path.lower().endswith(".vnnlib") or path.lower().endswith(".vnnlib.gz")):
            raise self.fail(f"vnnlib must name a .vnnlib (or .vnnlib.gz) file, got {path!r}",
                            (*p, "vnnlib"))
        return {"inputs": path}

    def region(self, raw: Any, path: Path_) -> Region:
        raw = self.mapping(raw, path, "region")
        self.keys(raw, path, REGION_KEYS, "region")
        space = self.choice(raw.get("space", "input"), (*path, "space"), "region space",
                            REGION_SPACES)
        norm = self.choice(raw.get("norm", "linf"), (*path, "norm"), "region norm", REGION_NORMS)
        eps = self.number(self.require(raw, path, "eps", "region", " (the radius)"),
                          (*path, "eps"), "eps")
        if eps < 0:
            raise self.fail(f"eps must be >= 0, got {eps!r}", (*path, "eps"))
        return Region(space, norm, eps)

    def escalation(self, raw: Any) -> dict[str, str]:
        out = dict(DEFAULT_ESCALATION)
        if raw is None:
            return out
        path: Path_ = ("escalation",)
        raw = self.mapping(raw, path, "escalation")
        for level, action in raw.items():
            self.choice(level, (*path, level), "level", LEVELS)
            out[level] = self.choice(action, (*path, level), "action", ACTIONS)
        return out

    def clauses(self, raw: Any, slices: dict[str, Slice], escalation: dict[str, str],
                temperature: float) -> tuple[Clause, ...]:
        path: Path_ = ("clauses",)
        if not isinstance(raw, list) or not raw:
            raise self.fail("clauses must be a non-empty list of clauses", path)
        seen: dict[str, int] = {}
        out = []
        for i, item in enumerate(raw):
            clause = self.clause(item, (*path, i), slices, escalation, temperature)
            if clause.id in seen:
                raise self.fail(f"duplicate clause id {clause.id!r} (first used by clause "
                                f"{seen[clause.id] + 1})", (*path, i, "id"))
            seen[clause.id] = i
            out.append(clause)
        return tuple(out)

    def clause(self, raw: Any, path: Path_, slices: dict[str, Slice],
               escalation: dict[str, str], temperature: float) -> Clause:
        raw = self.mapping(raw, path, "a clause")
        cid_raw = self.require(raw, path, "id", "a clause")
        if isinstance(cid_raw, bool) or not isinstance(cid_raw, str | int):
            raise self.fail("clause id must be a string such as N-1", (*path, "id"))
        cid = str(cid_raw)
        what = f"clause {cid!r}"
        self.keys(raw, path, CLAUSE_KEYS, what)
        has_assert, has_metric = "assert" in raw, "metric" in raw
        if has_assert == has_metric:
            raise self.fail(f"{what} needs exactly one of 'assert' (explicit condition) or "
                            f"'metric' (short form)", path if not has_assert else
                            (*path, "metric"), "value" if not has_assert else "key")
        family = self.require(raw, path, "family", what) if has_assert else raw.get("family")
        metric = threshold = None
        names = tuple(slices)
        if has_metric:
            metric = raw["metric"]
            if not isinstance(metric, str) or metric not in METRICS:
                raise self.fail(f"unknown metric {metric!r}{suggest(str(metric), METRICS)}; "
                                f"known: {', '.join(METRICS)}", (*path, "metric"))
            m = METRICS[metric]
            family = m.family if family is None else family
            threshold = self.number(self.require(raw, path, "threshold", what),
                                    (*path, "threshold"), "threshold")
            expr = self.desugar(metric, raw, path, threshold, names)
        else:
            for key in ("slices", "threshold"):
                if key in raw:
                    raise self.fail(f"{key!r} belongs to the short form (with 'metric'); an "
                                    f"assert names its slices and threshold itself",
                                    (*path, key), "key")
            expr = self.expr(raw["assert"], (*path, "assert"), "assert")
            threshold = comparison_threshold(expr)
        family = self.choice(family, (*path, "family"), "family", FAMILIES)
        where = (*path, "metric") if has_metric else (*path, "assert")
        checker: Checker = check_condition(expr, self.file, names)
        kinds = checker.kinds
        if "static" in kinds and kinds & {"model", "runtime", "label"}:
            raise self.fail("a clause cannot mix static checks (has_metadata, opset) with "
                            "model or runtime quantities; split it into two clauses", where)
        klass = classify(kinds, expr)
        if klass != "static" and not checker.used_slices:
            raise self.fail("a model or runtime quantity must range over a slice; write "
                            "'forall x in SLICE: ...' or 'mean(x in SLICE: ...)'", where)
        level = raw.get("level", "L2")
        level = self.choice(level, (*path, "level"), "level", LEVELS)
        action = self.choice(raw.get("action", escalation[level]), (*path, "action"), "action",
                             ACTIONS)
        budget = None
        if raw.get("budget") is not None:
            budget = self.number(raw["budget"], (*path, "budget"), "budget")
            if not 0 <= budget <= 1:
                raise self.fail(f"budget must be a number in [0, 1], got {raw['budget']!r}",
                                (*path, "budget"))
        hard = raw.get("hard", budget is None)
        if not isinstance(hard, bool):
            raise self.fail(f"hard must be true or false, got {hard!r}", (*path, "hard"))
        if hard and budget is not None:
            raise self.fail("a hard clause has no budget; drop 'budget' or set hard: false",
                            (*path, "budget"))
        temp = temperature
        if "temperature" in raw:
            temp = self.temperature(raw["temperature"], (*path, "temperature"))
        desc = raw.get("description")
        line, col = self.src.value_at(path)
        return Clause(cid, family, expr, level, action, klass, hard, metric, threshold, budget,
                      tuple(checker.used_slices), temp, "metric" if has_metric else "assert",
                      desc if isinstance(desc, str) else None, line=line, column=col)

    def desugar(self, metric: str, raw: Mapping[str, Any], path: Path_, threshold: float,
                names: tuple[str, ...]) -> Expr:
        """QUANTITY(S) op threshold for every listed slice S, joined by 'and'."""
        m = METRICS[metric]
        if "slices" in raw:
            sl = raw["slices"]
            if isinstance(sl, str):
                sl = [sl]
            if not isinstance(sl, list) or not sl:
                raise self.fail("slices must be a non-empty list of slice names",
                                (*path, "slices"))
            for j, s in enumerate(sl):
                if s not in names:
                    p = (*path, "slices", j) if isinstance(raw["slices"], list) else (*path, "slices")
                    known = ", ".join(names) or "none"
                    raise self.fail(f"undefined slice {s!r}{suggest(str(s), names)}; defined: "
                                    f"{known}", p)
        elif "all" in names:
            sl = ["all"]
        else:
            raise self.fail(f"clause needs 'slices' (there is no slice named 'all' to default "
                            f"to); defined: {', '.join(names) or 'none'}", path)
        pos = self.src.value_at((*path, "metric"))
        result: Expr | None = None
        for s in sl:
            q = parse_expr(m.quantity.format(slice=s), self.file, lambda _o: pos)
            cmp = Compare(m.direction, q, number(threshold), line=pos[0], column=pos[1])
            result = cmp if result is None else BoolOp("and", result, cmp, line=pos[0],
                                                       column=pos[1])
        assert result is not None
        return result


def _kind(value: Any) -> str:
    if value is None:
        return "nothing"
    return {bool: "a boolean", int: "a number", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(value), type(value).__name__)


def load_contract(path: str | Path) -> Contract:
    """Read, validate and type-check a contract file (never opens the model or data files).

    Raises ContractError with file:line:col on any mistake.
    """
    src = load_source(path)
    return _Loader(src).contract(Path(path))


def parse_contract(text: str, file: str = "<contract>") -> Contract:
    """Like load_contract, from text (positions name ``file``)."""
    return _Loader(parse_source(text, file)).contract(Path(file))
