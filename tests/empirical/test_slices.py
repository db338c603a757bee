"""Slices from .npz / .npy / .jsonl, where filters (string and DSL tree), clear file errors."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from kcverify.empirical.slices import evaluate_where, load_slice
from kcverify.errors import ContractError, InputFileError


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    ids = np.arange(5 * 4, dtype=np.int64).reshape(5, 4)
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    np.savez(tmp_path / "eval.npz", input_ids=ids, attention_mask=mask, label=np.array([0, 1, 0, 1, 1]))
    return tmp_path / "eval.npz"


def test_npz_inputs_labels_len(npz: Path) -> None:
    s = load_slice("eval.npz", base_dir=npz.parent)
    assert s.n == 5 and set(s.inputs) == {"input_ids", "attention_mask"}
    assert s.labels.tolist() == [0, 1, 0, 1, 1]
    assert s.fields["len"].tolist() == [4, 2, 1, 3, 4]
    assert set(s.feeds(["input_ids", "attention_mask"])) == {"input_ids", "attention_mask"}
    with pytest.raises(InputFileError, match="no array for model input.*token_type_ids"):
        s.feeds(["input_ids", "token_type_ids"])


@pytest.mark.parametrize("where, rows", [
    ("len >= 3", [0, 3, 4]),
    ("len >= 3 and label == 1", [3, 4]),
    ("not (len > 1) or index == 4", [2, 4]),
    ("len(x) * 2 < 5", [1, 2]),
    ("1 < len <= 3", [1, 3]),
])
def test_where_strings(npz: Path, where: str, rows: list[int]) -> None:
    s = load_slice(npz, where=where)
    assert s.fields["index"].tolist() == rows
    assert s.inputs["input_ids"][:, 0].tolist() == [4 * r for r in rows]


@pytest.mark.parametrize("where, message", [
    ("__import__('os').system('true')", "is not allowed"),
    ("len.real > 2", "is not allowed"),
    ("speed > 3", "unknown field 'speed'; this slice has index, label, len"),
    ("len >=", "cannot parse"),
])
def test_where_rejects(npz: Path, where: str, message: str) -> None:
    with pytest.raises(ContractError, match=message):
        load_slice(npz, where=where)


# Minimal stand-ins with the DSL tree's node names and fields.
@dataclass(frozen=True)
class Var:
    name: str


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Compare:
    op: str
    left: object
    right: object


@dataclass(frozen=True)
class BoolOp:
    op: str
    left: object
    right: object


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple


def test_where_dsl_tree() -> None:
    fields = {"len": np.array([1, 5, 9]), "index": np.arange(3)}
    tree = BoolOp("and", Compare(">=", Call("len", (Var("x"),)), Num(4)), Compare("<", Var("len"), Num(9)))
    assert evaluate_where(tree, fields).tolist() == [False, True, False]
    implies = BoolOp("implies", Compare(">", Var("len"), Num(2)), Compare("==", Var("index"), Num(2)))
    assert evaluate_where(implies, fields).tolist() == [True, False, True]


def test_dsl_slice_object(npz: Path) -> None:
    @dataclass
    class Slice:
        name: str
        inputs: str
        where: object

    s = load_slice(Slice("long", "eval.npz", Compare(">=", Var("len"), Num(4))), base_dir=npz.parent)
    assert s.name == "long" and s.fields["index"].tolist() == [0, 4]


def test_npy_single_input(tmp_path: Path) -> None:
    np.save(tmp_path / "emb.npy", np.ones((3, 2, 8), dtype=np.float32))
    s = load_slice(tmp_path / "emb.npy")
    assert s.n == 3 and s.fields["len"].tolist() == [2, 2, 2]
    assert s.feeds(["embeddings"])["embeddings"].shape == (3, 2, 8)


def test_jsonl_with_labels_and_meta(tmp_path: Path) -> None:
    lines = [{"input_ids": [1, 2, 3], "label": 2, "meta": {"lang": "en"}},
             {"input_ids": [4, 5, 6], "label": 0, "meta": {"lang": "de"}}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    s = load_slice(tmp_path / "d.jsonl", where="lang == 'de'")
    assert s.inputs["input_ids"].tolist() == [[4, 5, 6]] and s.labels.tolist() == [0]


@pytest.mark.parametrize("content, message", [
    ('{"input_ids": [1, 2]}\n{"input_ids": [1]}\n', "different shapes across examples"),
    ('{"input_ids": [1, 2]}\nnot json\n', r"d.jsonl:2: not a JSON object"),
    ("", "no examples"),
])
def test_jsonl_errors(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "d.jsonl").write_text(content)
    with pytest.raises(InputFileError, match=message):
        load_slice(tmp_path / "d.jsonl")


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match=r"nope.npz: slice 'nope': data file not found"):
        load_slice("nope.npz", base_dir=tmp_path)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(InputFileError, match=r"bad.npz: slice 'bad': unreadable .*expected a numpy .npz"):
        load_slice(tmp_path / "bad.npz")
    with pytest.raises(InputFileError, match="unsupported data file; expected one of .npz"):
        load_slice(tmp_path / "x.csv")


def test_shipped_example_data(root: Path) -> None:
    path = root / "examples" / "data" / "eval.npz"
    if not path.exists():
        pytest.skip("no shipped example data yet")
    s = load_slice(path)
    assert s.n > 0 and "input_ids" in s.inputs
