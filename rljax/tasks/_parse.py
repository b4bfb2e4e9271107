"""Exact parsing of numbers and arithmetic expressions out of model text.

Nothing here calls ``eval``: expressions are parsed with ``ast`` and walked
against a whitelist (integer literals, binary + - * /, parentheses), then
evaluated with ``fractions.Fraction`` so ``/`` is exact. Every function returns
``None`` on anything it does not accept instead of raising, because rewards are
computed on arbitrary model output.
"""

from __future__ import annotations

import ast
import fractions
import re
from typing import Optional

Fraction = fractions.Fraction

# An integer, optionally with thousands separators ("1,234") and an optional
# decimal part ("71.0" is the number 71; "71." is 71 followed by a period).
_NUMBER = r"-?(?:[0-9]{1,3}(?:,[0-9]{3})+(?![0-9])|[0-9]+)(?:\.[0-9]+)?"
_NUMBER_RE = re.compile(_NUMBER)
_NUMBER_FULL_RE = re.compile(rf"\s*({_NUMBER})\s*")
BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")
# Longer numerals cannot be an answer of ours, and Python refuses to convert
# very long digit strings; rejecting them keeps parsing cheap and total.
_MAX_DIGITS = 60
# Decoration a model may put around a bare answer: markdown, quotes, LaTeX $.
_DECORATION = " \t\r\n*_`'\"$"

# Characters an arithmetic expression may contain at all; checked before
# ``ast.parse`` so identifiers, calls, attributes, strings, "1_000" and
# "1e3" never reach the parser.
_EXPR_CHARS_RE = re.compile(r"[0-9+\-*/().\s]+")
_MAX_EXPR_CHARS = 200
_UNICODE_OPS = (
    ("\u2212", "-"), ("\u2013", "-"), ("\u00d7", "*"), ("\u00b7", "*"),
    ("\u22c5", "*"), ("\u00f7", "/"), ("\\times", "*"), ("\\cdot", "*"),
    ("\\div", "/"),
)
_BINOPS = {
        ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b,
}


def normalize_operators(text: str) -> str:
    """Maps Unicode and LaTeX operator spellings to ASCII (- * /)."""
    for src, dst in _UNICODE_OPS:
        text = text.replace(src, dst)
    return text


def to_fraction(numeral: str) -> Optional[Fraction]:
    """The exact value of a numeral matched by ``_NUMBER``, or None if too long."""
    digits = numeral.replace(",", "")
    if len(digits) > _MAX_DIGITS:
        return None
    return Fraction(digits)


def parse_number_strict(text: str) -> Optional[Fraction]:
    """The number iff ``text`` is just one number.

    Accepted: the number alone, with surrounding whitespace, markdown/quote/``$``
    decoration, a trailing period or ``!``, or wrapped in ``\\boxed{...}``.
    Anything else (words, a second number) gives None.
    """
    text = normalize_operators(text)
    core = text.strip(_DECORATION).rstrip(".!").strip(_DECORATION)
    boxed = BOXED_RE.fullmatch(core)
    if boxed:
        core = boxed.group(1)
    match = _NUMBER_FULL_RE.fullmatch(core)
    return to_fraction(match.group(1)) if match else None


def parse_number_last(text: str) -> Optional[Fraction]:
    """The last number inside the last ``\\boxed{}``, else the last in the text.

    "23 + 48 = 71" gives 71; "\\boxed{71}. Check: 70 + 1" gives 71; no number
    gives None. A minus sign directly before the digits belongs to the number.
    """
    text = normalize_operators(text)
    boxes = BOXED_RE.findall(text)
    scope = boxes[-1] if boxes else text
    numerals = _NUMBER_RE.findall(scope)
    return to_fraction(numerals[-1]) if numerals else None


def parse_expression(text: str) -> Optional[ast.Expression]:
    """The ``ast`` of ``text`` iff it is a whitelisted arithmetic expression.

    Whitelist: non-negative integer literals, binary ``+ - * /`` and
    parentheses. No unary minus, powers, floor division, names, calls or floats.
    """
    if len(text) > _MAX_EXPR_CHARS or not _EXPR_CHARS_RE.fullmatch(text):
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.BinOp)):
            continue
        if isinstance(node, tuple(_BINOPS)):
            continue
        if (isinstance(node, ast.Constant) and type(node.value) is int
                and node.value >= 0):
            continue
        return None
    return tree


def literals(tree: ast.Expression) -> list[int]:
    """The integer literals of a whitelisted expression, in source order."""
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.Constant)]
    nodes.sort(key=lambda n: (n.lineno, n.col_offset))
    return [n.value for n in nodes]


def evaluate(tree: ast.Expression) -> Optional[Fraction]:
    """Exact value of a whitelisted expression; None on division by zero."""

    def walk(node):
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        left, right = walk(node.left), walk(node.right)
        if left is None or right is None:
            return None
        if isinstance(node.op, ast.Div) and right == 0:
            return None
        return _BINOPS[type(node.op)](left, right)

    try:
        return walk(tree.body)
    except RecursionError:
        return None
