"""The SQL92 subset RocketMQ accepts as a subscription filter (pure).

Grammar (RocketMQ ``filter`` module, ``SelectorParser.jj``)::

    expr    := and ("OR" and)*
    and     := not ("AND" not)*
    not     := "NOT" not | cmp
    cmp     := "(" expr ")" | TRUE | FALSE
             | ident op literal | ident [NOT] BETWEEN num AND num
             | ident [NOT] IN "(" string ("," string)* ")" | ident IS [NOT] NULL
             | ident [NOT] (CONTAINS | STARTSWITH | ENDSWITH) string
    op      := "=" | "<>" | "!=" | ">" | ">=" | "<" | "<="

Identifiers name user properties; ``TAGS`` names the tag. A comparison with a missing
property is false (so ``NOT`` of it is true only through ``IS NULL``), as in RocketMQ.

A filter comes from any peer and is evaluated for every message the subscription sees,
so it is bounded where it is parsed: at most ``max_length`` characters and
``max_depth`` nested parentheses and NOTs. Chains of AND and OR become one node with
many operands rather than a deep left-leaning tree, so the tree (and the evaluator's
recursion over it) is never deeper than about twice that nesting, however long the
expression.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from polymq.storage.model import Message

__all__ = ["DEFAULT_MAX_DEPTH", "MAX_LENGTH", "Expression", "SqlError", "evaluate", "parse"]

# Nesting as limits.max_nesting_depth ships; a real filter nests a handful of levels.
DEFAULT_MAX_DEPTH = 64
# Characters of one expression: real filters are a line or two of SQL, and parsing is
# done on the event loop (16 KiB of operators parse in about 15 ms, 64 KiB in 60).
MAX_LENGTH = 16 << 10


class SqlError(ValueError):
    pass


Literal = str | float | bool


@dataclass(frozen=True, slots=True)
class Expression:
    """A parsed node: ``op`` and its operands (sub-expressions, names or literals)."""

    op: str
    args: tuple[object, ...]


_TOKEN = re.compile(
    r"\s*(?:(?P<num>-?\d+(?:\.\d+)?)|'(?P<str>(?:[^']|'')*)'"
    r"|(?P<op><>|!=|>=|<=|=|>|<|\(|\)|,)|(?P<word>[A-Za-z_][\w.\-]*))"
)
_KEYWORDS = frozenset(
    {
        "AND", "OR", "NOT", "BETWEEN", "IN", "IS", "NULL", "TRUE", "FALSE",
        "CONTAINS", "STARTSWITH", "ENDSWITH",
    }
)  # fmt: skip
_COMPARISONS = frozenset({"=", "<>", "!=", ">", ">=", "<", "<="})
_STRING_OPS = frozenset({"CONTAINS", "STARTSWITH", "ENDSWITH"})


def _tokenize(text: str) -> list[tuple[str, object]]:
    tokens: list[tuple[str, object]] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise SqlError(f"unexpected character at {pos}: {text[pos : pos + 10]!r}")
        pos = m.end()
        if m.group("num") is not None:
            tokens.append(("num", float(m.group("num"))))
        elif m.group("str") is not None:
            tokens.append(("str", m.group("str").replace("''", "'")))
        elif m.group("op") is not None:
            tokens.append(("op", m.group("op")))
        else:
            word = m.group("word")
            kind = "kw" if word.upper() in _KEYWORDS else "ident"
            tokens.append((kind, word.upper() if kind == "kw" else word))
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, object]], max_depth: int) -> None:
        self._tokens = tokens
        self._pos = 0
        self._max_depth = max_depth
        self._depth = 0

    def _deeper(self) -> None:
        """Called on entering a parenthesis or a NOT: refuses nesting past the limit
        before recursing, so no input reaches Python's recursion limit."""
        self._depth += 1
        if self._depth > self._max_depth:
            raise SqlError(f"expression nests deeper than {self._max_depth} levels")

    def _peek(self) -> tuple[str, object] | None:
        return self._tokens[self._pos] if self._pos < len(self._tokens) else None

    def _accept(self, kind: str, value: object = None) -> bool:
        token = self._peek()
        if token is not None and token[0] == kind and (value is None or token[1] == value):
            self._pos += 1
            return True
        return False

    def _take(self, kind: str) -> object:
        token = self._peek()
        if token is None or token[0] != kind:
            raise SqlError(f"expected {kind} at token {self._pos}, got {token}")
        self._pos += 1
        return token[1]

    def parse(self) -> Expression:
        expr = self._or()
        if self._peek() is not None:
            raise SqlError(f"unexpected {self._peek()} at token {self._pos}")
        return expr

    def _or(self) -> Expression:
        operands = [self._and()]
        while self._accept("kw", "OR"):
            operands.append(self._and())
        return operands[0] if len(operands) == 1 else Expression("OR", tuple(operands))

    def _and(self) -> Expression:
        operands = [self._not()]
        while self._accept("kw", "AND"):
            operands.append(self._not())
        return operands[0] if len(operands) == 1 else Expression("AND", tuple(operands))

    def _not(self) -> Expression:
        if self._accept("kw", "NOT"):
            self._deeper()
            expr = Expression("NOT", (self._not(),))
            self._depth -= 1
            return expr
        return self._comparison()

    def _literal(self) -> Literal:
        token = self._peek()
        if token is None:
            raise SqlError("expression ends early")
        self._pos += 1
        if token[0] == "num" or token[0] == "str":
            return token[1]  # type: ignore[return-value]
        if token == ("kw", "TRUE"):
            return True
        if token == ("kw", "FALSE"):
            return False
        raise SqlError(f"expected a literal, got {token}")

    def _comparison(self) -> Expression:
        if self._accept("op", "("):
            self._deeper()
            expr = self._or()
            self._take_op(")")
            self._depth -= 1
            return expr
        if self._accept("kw", "TRUE"):
            return Expression("CONST", (True,))
        if self._accept("kw", "FALSE"):
            return Expression("CONST", (False,))
        name = self._take("ident")
        if self._accept("kw", "IS"):
            negate = self._accept("kw", "NOT")
            self._take_kw("NULL")
            return Expression("NOTNULL" if negate else "NULL", (name,))
        negate = self._accept("kw", "NOT")
        token = self._peek()
        if token == ("kw", "BETWEEN"):
            self._pos += 1
            low = self._take("num")
            self._take_kw("AND")
            high = self._take("num")
            expr = Expression("BETWEEN", (name, low, high))
        elif token == ("kw", "IN"):
            self._pos += 1
            self._take_op("(")
            values = [self._take("str")]
            while self._accept("op", ","):
                values.append(self._take("str"))
            self._take_op(")")
            expr = Expression("IN", (name, frozenset(values)))
        elif token is not None and token[0] == "kw" and token[1] in _STRING_OPS:
            self._pos += 1
            expr = Expression(str(token[1]), (name, self._take("str")))
        elif not negate and token is not None and token[0] == "op" and token[1] in _COMPARISONS:
            self._pos += 1
            op = "<>" if token[1] == "!=" else str(token[1])
            return Expression(op, (name, self._literal()))
        else:
            raise SqlError(f"expected an operator after {name!r}, got {token}")
        return Expression("NOT", (expr,)) if negate else expr

    def _take_op(self, op: str) -> None:
        if not self._accept("op", op):
            raise SqlError(f"expected {op!r} at token {self._pos}")

    def _take_kw(self, kw: str) -> None:
        if not self._accept("kw", kw):
            raise SqlError(f"expected {kw} at token {self._pos}")


def parse(
    text: str, *, max_depth: int = DEFAULT_MAX_DEPTH, max_length: int = MAX_LENGTH
) -> Expression:
    """The expression's tree, or :class:`SqlError` (also for one longer than
    ``max_length`` characters or nesting deeper than ``max_depth``)."""
    if len(text) > max_length:
        raise SqlError(f"expression of {len(text)} characters exceeds the limit of {max_length}")
    if not text.strip():
        raise SqlError("empty SQL92 expression")
    return _Parser(_tokenize(text), max_depth).parse()


def _value(message: Message, name: str) -> str | None:
    if name == "TAGS":
        return message.tag
    raw = message.property(name)
    return raw.decode(errors="replace") if raw is not None else None


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _compare(op: str, value: str, literal: Literal) -> bool:
    if isinstance(literal, bool):
        flag = value.lower() == "true"
        return {"=": flag == literal, "<>": flag != literal}.get(op, False)
    if isinstance(literal, float):
        number = _number(value)
        return number is not None and _ordered(op, number, literal)
    return _ordered(op, value, literal)


def _ordered(op: str, left: float | str, right: float | str) -> bool:
    if op == "=":
        return left == right
    if op == "<>":
        return left != right
    if type(left) is not type(right):
        return False
    if op == ">":
        return left > right  # type: ignore[operator]
    if op == ">=":
        return left >= right  # type: ignore[operator]
    if op == "<":
        return left < right  # type: ignore[operator]
    return left <= right  # type: ignore[operator]


def evaluate(expr: Expression, message: Message) -> bool:
    op, args = expr.op, expr.args
    if op == "AND":
        return all(evaluate(a, message) for a in args)  # type: ignore[arg-type]
    if op == "OR":
        return any(evaluate(a, message) for a in args)  # type: ignore[arg-type]
    if op == "NOT":
        return not evaluate(args[0], message)  # type: ignore[arg-type]
    if op == "CONST":
        return bool(args[0])
    value = _value(message, str(args[0]))
    if op == "NULL":
        return value is None
    if op == "NOTNULL":
        return value is not None
    if value is None:
        return False
    if op == "BETWEEN":
        number = _number(value)
        return number is not None and args[1] <= number <= args[2]  # type: ignore[operator]
    if op == "IN":
        return bool(value in args[1])  # type: ignore[operator]
    if op == "CONTAINS":
        return str(args[1]) in value
    if op == "STARTSWITH":
        return value.startswith(str(args[1]))
    if op == "ENDSWITH":
        return value.endswith(str(args[1]))
    return _compare(op, value, args[1])  # type: ignore[arg-type]
