"""YAML loading that remembers where every key and value came from.

``load_source(path)`` composes the YAML node graph (``yaml.compose``), turns it into plain Python
values, and keeps, per key path (a tuple of mapping keys and list indices), the node of the value
and of its key. Errors name file:line:col (1-based). Duplicate keys are errors, not silently merged.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kcverify.errors import ContractError

Path_ = tuple[str | int, ...]


@dataclass
class Source:
    """A loaded YAML document: its data and the position of every node."""

    file: str
    text: str
    data: Any
    values: dict[Path_, yaml.Node] = field(default_factory=dict)
    keys: dict[Path_, yaml.Node] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._line_starts = [0] + [i + 1 for i, c in enumerate(self.text) if c == "\n"]

    def position(self, index: int) -> tuple[int, int]:
        """(line, column), 1-based, of a character index in the file."""
        line = bisect.bisect_right(self._line_starts, index) - 1
        return line + 1, index - self._line_starts[line] + 1

    def value_at(self, path: Path_) -> tuple[int, int]:
        """Where the value at ``path`` starts (falling back to the nearest located ancestor)."""
        while path:
            node = self.values.get(path)
            if node is not None:
                return node.start_mark.line + 1, node.start_mark.column + 1
            path = path[:-1]
        return 1, 1

    def key_at(self, path: Path_) -> tuple[int, int]:
        """Where the key of ``path`` starts (its value's position for list items)."""
        node = self.keys.get(path)
        if node is not None:
            return node.start_mark.line + 1, node.start_mark.column + 1
        return self.value_at(path)

    def error(self, message: str, path: Path_, at: str = "value") -> ContractError:
        line, col = self.key_at(path) if at == "key" else self.value_at(path)
        return ContractError(message, self.file, line, col)

    def string_locator(self, path: Path_) -> Callable[[int], tuple[int, int]]:
        """Map an offset inside the string value at ``path`` to its file position.

        Works for plain, quoted, folded and literal scalars: the value's characters are aligned
        with the raw text between the node's marks (indentation, quotes, line breaks skipped).
        """
        node = self.values.get(path)
        if not isinstance(node, yaml.ScalarNode):
            pos = self.value_at(path)
            return lambda _offset: pos
        value = str(node.value)
        start, end = node.start_mark.index, node.end_mark.index
        raw = self.text[start:end]
        body = 0
        if node.style in ("|", ">"):
            body = raw.find("\n") + 1  # skip the block header line
        elif node.style in ('"', "'"):
            body = 1
        index: list[int] = []
        j = body
        for ch in value:
            if ch.isspace() and j < len(raw) and raw[j].isspace():
                k = j
            else:
                k = raw.find(ch, j)
                if k < 0:
                    k = min(j, max(len(raw) - 1, 0))
            index.append(k)
            j = k + 1
        index.append(j)  # one past the end, for errors at the end of the text

        def locate(offset: int) -> tuple[int, int]:
            offset = max(0, min(offset, len(index) - 1))
            return self.position(start + index[offset])

        return locate


def _build(node: yaml.Node, path: Path_, src: Source, ctor: yaml.constructor.SafeConstructor) -> Any:
    src.values[path] = node
    if isinstance(node, yaml.MappingNode):
        out: dict[Any, Any] = {}
        ctor.flatten_mapping(node)
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                raise ContractError("a mapping key must be a plain name", src.file, line, col)
            key = ctor.construct_object(key_node)
            key = str(key) if not isinstance(key, str) else key
            if key in out:
                line, col = key_node.start_mark.line + 1, key_node.start_mark.column + 1
                raise ContractError(f"duplicate key {key!r}", src.file, line, col)
            src.keys[(*path, key)] = key_node
            out[key] = _build(value_node, (*path, key), src, ctor)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_build(v, (*path, i), src, ctor) for i, v in enumerate(node.value)]
    return ctor.construct_object(node)


def parse_source(text: str, file: str) -> Source:
    """Compose and construct one YAML document; ContractError for malformed YAML."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        what = e.problem or e.context or "cannot parse"
        raise ContractError(f"malformed YAML: {what}", file, line, col) from None
    except yaml.YAMLError as e:
        raise ContractError(f"malformed YAML: {e}", file) from None
    src = Source(file, text, None)
    if root is None:
        raise ContractError("empty contract; expected a mapping with keys contract, kernels, "
                            "slices, clauses", file, 1, 1)
    ctor = yaml.SafeLoader("")
    try:
        src.data = _build(root, (), src, ctor)
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (None, None)
        raise ContractError(f"malformed YAML: {e.problem or e}", file, line, col) from None
    return src


def load_source(path: str | Path) -> Source:
    """Read and parse a contract file; ContractError if it cannot be read or parsed."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ContractError("contract file not found", str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ContractError(f"cannot read the contract: {e}", str(path)) from None
    return parse_source(text, str(path))
