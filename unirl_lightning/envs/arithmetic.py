"""Exact, safe arithmetic: the calculator environment's tool.

The calculator's evaluator (:func:`safe_eval`) never calls ``eval``: it checks the characters against a
whitelist, parses with :mod:`ast` and walks only number literals, ``+ - * /``, parentheses and unary
``-``/``+``, with exact rational arithmetic (:class:`fractions.Fraction`), a bounded expression
length and a bounded magnitude of every literal and intermediate result (so no exponent, name,
call, attribute or huge number gets through). Refusals raise :class:`CalculatorError`, which the
environment turns into an error observation, never an exception.
"""

from __future__ import annotations

import ast
from decimal import Decimal
from fractions import Fraction

__all__ = ["CalculatorError", "format_number", "safe_eval"]

_ALLOWED_CHARS = frozenset("0123456789.+-*/() ")
_BINARY_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}
_REFUSED_OPERATORS = {
    ast.Pow: "**",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.MatMult: "@",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitAnd: "&",
    ast.BitXor: "^",
}


class CalculatorError(ValueError):
    """An expression the calculator refuses: not plain arithmetic, too long, too large, or undefined."""


def safe_eval(expression: str, max_chars: int = 100, max_magnitude: int = 10**15) -> Fraction:
    """Evaluate plain arithmetic exactly: numbers, ``+ - * /``, parentheses, unary ``-`` and ``+``.

    Args:
        expression: e.g. ``"12*7+3"``, ``"-(1.5+2)/4"``.
        max_chars: longest expression accepted (after stripping spaces at the ends).
        max_magnitude: largest absolute value of any literal or intermediate result.

    Raises:
        CalculatorError: an empty or too long expression, a character outside ``0-9 . + - * / ( )``
            and space, a syntax error, any other syntax node (names, calls, ``**``, ``//``, ``%``,
            comparisons, ...), division by zero, or a value over ``max_magnitude``.

    Example::

        >>> safe_eval("12*7+3")
        Fraction(87, 1)
        >>> safe_eval("2**999")
        Traceback (most recent call last):
        ...
        unirl_lightning.envs.arithmetic.CalculatorError: operator '**' is not allowed; only + - * / and parentheses
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a str, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > max_chars:
        raise CalculatorError(f"the expression has {len(text)} characters; at most {max_chars} are allowed")
    refused = sorted(set(text) - _ALLOWED_CHARS)
    if refused:
        raise CalculatorError(
            f"character(s) {''.join(refused)!r} are not allowed; only digits, '.', + - * / ( ) and spaces"
        )
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"{text!r} is not a well-formed arithmetic expression") from None
    return _evaluate(tree.body, text, max_magnitude)


def _bounded(value: Fraction, max_magnitude: int) -> Fraction:
    if abs(value) > max_magnitude:
        raise CalculatorError(f"a value exceeds the calculator's limit of {max_magnitude:.0e} in magnitude")
    return value


def _evaluate(node: ast.AST, text: str, max_magnitude: int) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        # Exact decimal from the source text ("0.1" -> 1/10), not from the binary float.
        literal = ast.get_source_segment(text, node) or repr(node.value)
        return _bounded(Fraction(literal), max_magnitude)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, text, max_magnitude)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPERATORS:
        left = _evaluate(node.left, text, max_magnitude)
        right = _evaluate(node.right, text, max_magnitude)
        if isinstance(node.op, ast.Add):
            value = left + right
        elif isinstance(node.op, ast.Sub):
            value = left - right
        elif isinstance(node.op, ast.Mult):
            value = left * right
        else:
            if right == 0:
                raise CalculatorError("division by zero")
            value = left / right
        return _bounded(value, max_magnitude)
    if isinstance(node, ast.BinOp) and type(node.op) in _REFUSED_OPERATORS:
        symbol = _REFUSED_OPERATORS[type(node.op)]
        raise CalculatorError(f"operator {symbol!r} is not allowed; only + - * / and parentheses")
    raise CalculatorError(
        f"{type(node).__name__} is not allowed; only numbers, + - * /, parentheses and unary minus"
    )


def format_number(value: Fraction, decimals: int = 6) -> str:
    """An integer as is (``"87"``); otherwise a decimal rounded to ``decimals`` places, zeros stripped (``"0.333333"``)."""
    if value.denominator == 1:
        return str(value.numerator)
    rounded = round(value, decimals)
    text = format(Decimal(rounded.numerator) / Decimal(rounded.denominator), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text
