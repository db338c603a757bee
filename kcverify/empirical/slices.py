"""Slices: finite sets of inputs loaded from data files, optionally filtered by ``where``.

Files (paths relative to the contract file):

* ``.npz``: one array per model input, keyed by input name, each [n, ...] (e.g. input_ids int64
  [n, seq], or embeddings float [n, seq, d]); the keys ``label``/``labels`` hold labels (int, [n]
  or [n, seq]) and ``len`` per-example lengths, neither is fed to the model.
* ``.npy``: a single array [n, ...], fed to the model's single input.
* ``.jsonl``: one JSON object per line; every key but ``label``/``labels``/``meta`` is an input
  (a number or nested list, equal shapes across lines); ``label`` is optional; scalar entries of
  ``meta`` become fields usable in ``where``.
* ``.vnnlib`` (or ``.vnnlib.gz``): a VNN-LIB property; the slice *is* its input box (proofs
  cover the whole box, kcverify.regions). As data it holds points of the box, flattened like
  VNN-LIB's X_i: the hull's corners lo and hi first, then each case's centre, then seeded uniform
  float32 points inside the cases (64 in all); ``feeds(names, shapes)`` reshapes them to the
  model's input.

Per-example fields for ``where``: ``len`` (the token count: the sum of ``attention_mask`` when
present, else the given ``len`` array, else the size of axis 1 of the first input, 1 for a 1-D
input), ``index`` (position in the file), ``label`` (when given), and ``meta`` scalars.

``where`` is a condition: a string in a tiny safe grammar (numbers, strings, field names,
``len(x)``, + - * /, comparisons, and / or / not, parentheses; nothing else is evaluated), or the
DSL's parsed expression tree (kcverify.dsl.ast nodes, evaluated by node type).
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kcverify.errors import ContractError, InputFileError

LABEL_KEYS = ("label", "labels")
SUFFIXES = (".npz", ".npy", ".jsonl")


@dataclass(frozen=True)
class SliceData:
    """The inputs of one slice: arrays [n, ...] by input name, labels, and per-example fields."""

    name: str
    source: Path
    inputs: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    flat: bool = False  # inputs are flattened (a VNN-LIB box's points): reshaped by feeds

    @property
    def n(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0]) if self.inputs else 0

    def select(self, idx: np.ndarray) -> SliceData:
        """The examples ``idx`` (a boolean mask or integer indices), in order."""
        return replace(
            self,
            inputs={k: v[idx] for k, v in self.inputs.items()},
            labels=None if self.labels is None else self.labels[idx],
            fields={k: v[idx] for k, v in self.fields.items()},
        )

    def feeds(self, input_names: Sequence[str],
              shapes: Mapping[str, Sequence[Any] | None] | None = None) -> dict[str, np.ndarray]:
        """The arrays to feed a model with inputs ``input_names``.

        Names are matched exactly; a slice holding a single array feeds a model with a single
        input whatever the names. InputFileError names what is missing otherwise. A flat slice
        (VNN-LIB) is reshaped to ``shapes[name]`` (the model input's shape; axis 0 the batch).
        """
        names = list(input_names)
        if all(k in self.inputs for k in names):
            return {k: self._shaped(k, self.inputs[k], shapes) for k in names}
        if len(self.inputs) == 1 and len(names) == 1:
            return {names[0]: self._shaped(names[0], next(iter(self.inputs.values())), shapes)}
        missing = [k for k in names if k not in self.inputs]
        raise InputFileError(f"{self.source}: slice {self.name!r} has no array for model "
                             f"input(s) {', '.join(missing)}; it holds {', '.join(sorted(self.inputs))}")


    def _shaped(self, name: str, a: np.ndarray,
                shapes: Mapping[str, Sequence[Any] | None] | None) -> np.ndarray:
        shape = (shapes or {}).get(name)
        if not self.flat or not shape or not all(isinstance(d, int) and d > 0
                                                 for d in shape[1:]):
            return a
        feat = tuple(int(d) for d in shape[1:])
        if int(np.prod(feat)) != a.shape[1]:
            raise InputFileError(f"{self.source}: slice {self.name!r} has {a.shape[1]} inputs "
                                 f"X_i, the model input {name!r} has {int(np.prod(feat))} "
                                 f"elements ({tuple(shape)})")
        return a.reshape(len(a), *feat)


def load_slice(spec: Any, base_dir: str | Path | None = None, where: Any = None,
               name: str | None = None) -> SliceData:
    """Load a slice from a path (str / Path) or a DSL Slice (``.inputs``, ``.where``, ``.name``).

    Relative paths resolve against ``base_dir`` (the contract file's directory). ``where`` (or the
    Slice's own) filters the examples.
    """
    if isinstance(spec, str | Path):
        path_text, slice_name = str(spec), name or Path(spec).stem
    else:
        path_text, slice_name = str(spec.inputs), name or getattr(spec, "name", None) or "slice"
        where = where if where is not None else getattr(spec, "where", None)
    path = Path(path_text)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    data = _read(path, slice_name)
    if where is not None:
        mask = np.asarray(evaluate_where(where, data.fields, source=str(path)), dtype=bool)
        if mask.ndim == 0:
            mask = np.full(data.n, bool(mask))
        data = data.select(mask)
    return data


def _read(path: Path, name: str) -> SliceData:
    if path.name.lower().endswith((".vnnlib", ".vnnlib.gz")):
        return _read_vnnlib(path, name)
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise InputFileError(f"{path}: slice {name!r}: unsupported data file; expected one of "
                             f"{', '.join(SUFFIXES)}")
    if not path.is_file():
        raise InputFileError(f"{path}: slice {name!r}: data file not found (expected a {suffix} "
                             f"file, relative to the contract)")
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: np.asarray(z[k]) for k in z.files}
            meta: dict[str, np.ndarray] = {}
        elif suffix == ".npy":
            arrays, meta = {path.stem: np.asarray(np.load(path, allow_pickle=False))}, {}
        else:
            arrays, meta = _read_jsonl(path)
    except InputFileError:
        raise
    except (OSError, ValueError, EOFError) as e:
        what = {".npz": "a numpy .npz archive of arrays keyed by input name",
                ".npy": "a numpy .npy array", ".jsonl": "one JSON object per line"}[suffix]
        raise InputFileError(f"{path}: slice {name!r}: unreadable ({e.__class__.__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); expected {what}") from None
    labels = None
    for key in LABEL_KEYS:
        if key in arrays:
            labels = arrays.pop(key)
    lengths = arrays.pop("len", None)
    if not arrays:
        raise InputFileError(f"{path}: slice {name!r}: no input arrays (only labels/len)")
    n = {k: (v.shape[0] if v.ndim else None) for k, v in arrays.items()}
    if None in n.values() or len(set(n.values())) != 1:
        raise InputFileError(f"{path}: slice {name!r}: every input needs the same leading "
                             f"(example) axis; got shapes "
                             f"{', '.join(f'{k} {v.shape}' for k, v in arrays.items())}")
    count = next(iter(n.values()))
    if labels is not None and labels.shape[:1] != (count,):
        raise InputFileError(f"{path}: slice {name!r}: labels have shape {labels.shape}, "
                             f"expected {count} examples on axis 0")
    fields: dict[str, np.ndarray] = {"index": np.arange(count)}
    if "attention_mask" in arrays and arrays["attention_mask"].ndim >= 2:
        m = arrays["attention_mask"]
        fields["len"] = m.reshape(count, -1).sum(axis=1).astype(np.int64)
    elif lengths is not None:
        fields["len"] = np.asarray(lengths).reshape(count).astype(np.int64)
    else:
        first = next(iter(arrays.values()))
        fields["len"] = np.full(count, first.shape[1] if first.ndim >= 2 else 1, dtype=np.int64)
    if labels is not None and labels.ndim == 1:
        fields["label"] = labels
    fields.update(meta)
    return SliceData(name, path, arrays, labels, fields)


VNNLIB_POINTS = 64


def _read_vnnlib(path: Path, name: str) -> SliceData:
    """Points of a VNN-LIB property's input box (see the module doc)."""
    from kcverify.dsl.vnnlib import load_vnnlib

    prop = load_vnnlib(path)
    lo, hi = (np.asarray(v, dtype=np.float64) for v in prop.box())
    rows = [lo, hi] + [0.5 * np.asarray(c.lo) + 0.5 * np.asarray(c.hi) for c in prop.cases]
    rng = np.random.default_rng(0)
    k = 0
    while len(rows) < VNNLIB_POINTS and k < 16 * VNNLIB_POINTS:
        c = prop.cases[k % len(prop.cases)]
        k += 1
        x = np.clip(rng.uniform(c.lo, c.hi), c.lo, c.hi).astype(np.float32)
        if c.contains(x.astype(np.float64).tolist()):
            rows.append(x.astype(np.float64))
    x = np.stack(rows[:VNNLIB_POINTS])
    fields = {"index": np.arange(len(x)), "len": np.ones(len(x), dtype=np.int64)}
    return SliceData(name, path, {path.stem: x}, None, fields, flat=True)


def _read_jsonl(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rows: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputFileError(f"{path}:{lineno}: not a JSON object ({e.msg}); expected one "
                                     f"object per line") from None
            if not isinstance(obj, dict):
                raise InputFileError(f"{path}:{lineno}: expected a JSON object with input arrays, "
                                     f"got {type(obj).__name__}")
            rows.append(obj)
    if not rows:
        raise InputFileError(f"{path}: no examples; expected one JSON object per line")
    keys = [k for k in rows[0] if k != "meta"]
    arrays: dict[str, np.ndarray] = {}
    for key in keys:
        vals = []
        for i, r in enumerate(rows, 1):
            if key not in r:
                raise InputFileError(f"{path}: example {i} has no {key!r} (example 1 has it)")
            vals.append(np.asarray(r[key]))
        shapes = {v.shape for v in vals}
        if len(shapes) != 1:
            raise InputFileError(f"{path}: {key!r} has different shapes across examples "
                                 f"({', '.join(str(s) for s in sorted(shapes))}); pad them to one "
                                 f"shape (and give attention_mask) or use an .npz")
        arrays[key] = np.stack(vals)
    meta: dict[str, np.ndarray] = {}
    if isinstance(rows[0].get("meta"), dict):
        for k, v in rows[0]["meta"].items():
            if isinstance(v, int | float | str | bool):
                meta[k] = np.asarray([r.get("meta", {}).get(k) for r in rows])
    return arrays, meta


# --------------------------------------------------------------------------------------------
# where: a tiny, safe, vectorised condition language
# --------------------------------------------------------------------------------------------

_CMP: dict[str, Callable[[Any, Any], Any]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt,
    "==": operator.eq, "!=": operator.ne,
}
_ARITH: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
}
_PY_CMP = {ast.LtE: "<=", ast.Lt: "<", ast.GtE: ">=", ast.Gt: ">", ast.Eq: "==", ast.NotEq: "!="}
_PY_ARITH = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def evaluate_where(where: Any, fields: Mapping[str, np.ndarray], source: str = "<where>") -> np.ndarray:
    """A boolean mask [n] from a condition over per-example fields (string or DSL tree)."""
    if isinstance(where, str):
        try:
            tree = ast.parse(where.strip(), mode="eval").body
        except SyntaxError as e:
            raise ContractError(f"where {where!r}: cannot parse ({e.msg}); expected a condition "
                                f"such as 'len >= 512 and label == 1'", file=source) from None
        return np.asarray(_eval_py(tree, fields, where, source))
    return np.asarray(_eval_dsl(where, fields, source))


def _field(name: str, fields: Mapping[str, np.ndarray], source: str, line: int | None = None,
           column: int | None = None) -> np.ndarray:
    if name not in fields:
        raise ContractError(f"where: unknown field {name!r}; this slice has "
                            f"{', '.join(sorted(fields))}", file=source, line=line, column=column)
    return fields[name]


def _eval_py(node: ast.AST, fields: Mapping[str, np.ndarray], text: str, source: str) -> Any:
    ev = lambda n: _eval_py(n, fields, text, source)  # noqa: E731
    if isinstance(node, ast.BoolOp):
        vals = [np.asarray(ev(v), dtype=bool) for v in node.values]
        out = vals[0]
        for v in vals[1:]:
            out = (out & v) if isinstance(node.op, ast.And) else (out | v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        return ~np.asarray(ev(node.operand), dtype=bool)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -ev(node.operand)
    if isinstance(node, ast.Compare):
        out, left = None, ev(node.left)
        for op, comp in zip(node.ops, node.comparators):
            if type(op) not in _PY_CMP:
                break
            right = ev(comp)
            r = np.asarray(_CMP[_PY_CMP[type(op)]](left, right), dtype=bool)
            out = r if out is None else (out & r)
            left = right
        else:
            return out
    elif isinstance(node, ast.BinOp) and type(node.op) in _PY_ARITH:
        return _ARITH[_PY_ARITH[type(node.op)]](ev(node.left), ev(node.right))
    elif isinstance(node, ast.Constant) and isinstance(node.value, int | float | str | bool):
        return node.value
    elif isinstance(node, ast.Name):
        return _field(node.id, fields, source)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords
          and len(node.args) == 1 and isinstance(node.args[0], ast.Name)):
        return _field(node.func.id, fields, source)  # len(x): the field 'len' of example x
    raise ContractError(f"where {text!r}: {ast.unparse(node)!r} is not allowed; use numbers, "
                        f"field names, + - * /, comparisons, and, or, not", file=source)


def _eval_dsl(node: Any, fields: Mapping[str, np.ndarray], source: str) -> Any:
    """Evaluate a kcverify.dsl.ast tree by node type (no import of the DSL needed)."""
    kind = type(node).__name__
    ev = lambda n: _eval_dsl(n, fields, source)  # noqa: E731
    line, col = getattr(node, "line", None), getattr(node, "column", None)
    if kind in ("Num", "Str"):
        return node.value
    if kind == "Var":
        return _field(node.name, fields, source, line, col)
    if kind == "Neg":
        return -ev(node.operand)
    if kind == "BinOp" and node.op in _ARITH:
        return _ARITH[node.op](ev(node.left), ev(node.right))
    if kind == "Compare" and node.op in _CMP:
        return np.asarray(_CMP[node.op](ev(node.left), ev(node.right)), dtype=bool)
    if kind == "Not":
        return ~np.asarray(ev(node.operand), dtype=bool)
    if kind == "BoolOp":
        a, b = np.asarray(ev(node.left), dtype=bool), np.asarray(ev(node.right), dtype=bool)
        return {"and": a & b, "or": a | b, "implies": ~a | b}[node.op]
    if kind == "Call" and len(node.args) == 1 and type(node.args[0]).__name__ == "Var":
        return _field(node.func, fields, source, line, col)  # len(x)
    raise ContractError(f"where: {kind} is not supported in a slice filter; use comparisons of "
                        f"len and numbers with and / or / not", file=source, line=line, column=col)
