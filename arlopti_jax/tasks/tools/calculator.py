"""An exact calculator: a tokenizer and a recursive-descent parser over rational numbers.

    calculate("4821 * 93357 + 1/4").output      -> '450074097.25'
    calculate("(2 + 1) / 7 ** 2").output        -> '3/49'
    calculate("1 / (3 - 3)").error               -> 'division by zero'

Grammar (Python's precedence; ``^`` is a power, as people write it, not Python's xor):

    expr   := term (('+' | '-') term)*
    term   := unary (('*' | '/' | '//' | '%') unary)*
    unary  := ('+' | '-') unary | power
    power  := atom (('**' | '^') unary)?          right-associative: 2**3**2 = 2**9; -2**2 = -4
    atom   := number | '(' expr ')'
    number := 123 | 1.5 | .5 | 1e-3 | 1,234,567   (commas only as thousands separators)

Values are `fractions.Fraction`s, so every result is exact: an integer prints as one, a value whose
denominator has no prime factors but 2 and 5 as a finite decimal (``0.125``), any other as a
reduced fraction (``7/3``). ``//`` and ``%`` are floor division and its remainder, as in Python.
The text is only ever tokenized and parsed: no eval, exec or sympify. The unicode signs ×, ·, ÷
and − read as *, *, / and -, and a trailing ``=`` is ignored.

Every input finishes quickly and in little memory, because each limit (`CalculatorLimits`) is
checked before the work it bounds: the input's length, a number's digits (literals and every
intermediate result: a power's size is predicted from its base and exponent before it is
computed), the exponent, the parentheses' depth. Anything outside them, a parse error or a
division by zero is a `ToolResult` with ``error`` set, never an exception.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from fractions import Fraction

from arlopti_jax.tasks.tools.result import ToolResult


@dataclasses.dataclass(frozen=True)
class CalculatorLimits:
    max_chars: int = 2000  # the expression's length
    max_digits: int = 1000  # digits of any number, literal or intermediate (numerator and denominator)
    max_exponent: int = 10_000  # |n| in x ** n (the size check usually binds first)
    max_depth: int = 100  # nesting of parentheses and unary signs


class CalculatorError(ValueError):
    """The expression cannot be evaluated; the message is the tool's error line."""


_SIGNS = str.maketrans({"×": "*", "·": "*", "⋅": "*", "÷": "/", "−": "-", "–": "-"})
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)
  | (?P<op>\*\*|//|[-+*/%^()])
""", re.VERBOSE)
_LOG2_10 = math.log2(10)


def _tokens(text: str) -> list[tuple[str, int]]:
    """(token, position) pairs, numbers kept as their text; CalculatorError on any other character."""
    out, i = [], 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            raise CalculatorError(f"unexpected {text[i]!r} at position {i}")
        if m.lastgroup != "space":
            out.append((m.group(), i))
        i = m.end()
    return out


class _Parser:
    def __init__(self, text: str, limits: CalculatorLimits):
        self.tokens = _tokens(text)
        self.i = 0
        self.depth = 0
        self.limits = limits
        self.max_bits = int(limits.max_digits * _LOG2_10) + 1

    # ------------------------------------------------------------ helpers
    def peek(self) -> str | None:
        return self.tokens[self.i][0] if self.i < len(self.tokens) else None

    def position(self) -> str:
        return f"position {self.tokens[self.i][1]}" if self.i < len(self.tokens) else "the end"

    def take(self) -> str:
        token = self.tokens[self.i][0]
        self.i += 1
        return token

    def checked(self, value: Fraction) -> Fraction:
        if max(value.numerator.bit_length(), value.denominator.bit_length()) > self.max_bits:
            raise CalculatorError(f"a number has more than {self.limits.max_digits} digits")
        return value

    def nest(self) -> None:
        self.depth += 1
        if self.depth > self.limits.max_depth:
            raise CalculatorError(f"nested more than {self.limits.max_depth} deep")

    # ------------------------------------------------------------ grammar
    def parse(self) -> Fraction:
        if not self.tokens:
            raise CalculatorError("empty expression")
        value = self.expr()
        if self.peek() is not None:
            raise CalculatorError(f"unexpected {self.peek()!r} at {self.position()}")
        return value

    def expr(self) -> Fraction:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            right = self.term()
            value = self.checked(value + right if op == "+" else value - right)
        return value

    def term(self) -> Fraction:
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op = self.take()
            right = self.unary()
            if op == "*":
                value = self.checked(value * right)
                continue
            if right == 0:
                raise CalculatorError("division by zero" if op != "%" else "modulo by zero")
            quotient = value / right if op == "/" else Fraction(value // right) if op == "//" else value % right
            value = self.checked(quotient)
        return value

    def unary(self) -> Fraction:
        if self.peek() in ("+", "-"):
            op = self.take()
            self.nest()
            value = self.unary()
            self.depth -= 1
            return -value if op == "-" else value
        return self.power()

    def power(self) -> Fraction:
        base = self.atom()
        if self.peek() not in ("**", "^"):
            return base
        self.take()
        self.nest()
        exponent = self.unary()
        self.depth -= 1
        return self.raise_to(base, exponent)

    def raise_to(self, base: Fraction, exponent: Fraction) -> Fraction:
        if exponent.denominator != 1:
            raise CalculatorError(f"the exponent {_format(exponent)} is not an integer (results are exact rationals)")
        n = exponent.numerator
        if abs(n) > self.limits.max_exponent:
            raise CalculatorError(f"the exponent {n} is larger than {self.limits.max_exponent}")
        if base == 0 and n < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        # the result's size, bounded before it is computed: bits(a ** n) <= n * bits(a)
        bits = max(base.numerator.bit_length(), base.denominator.bit_length())
        if abs(base) != 1 and abs(n) * (bits - 1) > self.max_bits:
            raise CalculatorError(f"a number has more than {self.limits.max_digits} digits")
        return self.checked(base**n)

    def atom(self) -> Fraction:
        token = self.peek()
        if token is None:
            raise CalculatorError("the expression ends where a number or '(' should follow")
        if token == "(":
            self.take()
            self.nest()
            value = self.expr()
            if self.peek() != ")":
                raise CalculatorError(f"missing ')' at {self.position()}")
            self.take()
            self.depth -= 1
            return value
        if token[0].isdigit() or token[0] == ".":
            self.take()
            return self.number(token)
        raise CalculatorError(f"unexpected {token!r} at {self.position()}")

    def number(self, text: str) -> Fraction:
        mantissa, _, exp = text.replace(",", "").lower().partition("e")
        whole, _, frac = mantissa.partition(".")
        digits = (whole + frac).lstrip("0")
        if len(digits) > self.limits.max_digits:
            raise CalculatorError(f"a number has more than {self.limits.max_digits} digits")
        shift = (int(exp) if exp else 0) - len(frac)
        if abs(shift) > self.limits.max_digits:
            raise CalculatorError(f"the number {text[:30]} is out of range")
        value = Fraction(int(whole + frac or "0"))
        return self.checked(value * 10**shift if shift >= 0 else value / 10**-shift)


def _format(value: Fraction) -> str:
    """An integer, a finite decimal (denominator 2^a 5^b), or a reduced fraction p/q."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den, twos = den // 2, twos + 1
    while den % 5 == 0:
        den, fives = den // 5, fives + 1
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    sign = "-" if value < 0 else ""
    whole, frac = divmod(scaled, 10**places)
    return f"{sign}{whole}.{str(frac).rjust(places, '0').rstrip('0')}"


def evaluate(expression: str, limits: CalculatorLimits = CalculatorLimits()) -> Fraction:
    """The expression's exact value; CalculatorError (its message the tool's error) if it has none."""
    if len(expression) > limits.max_chars:
        raise CalculatorError(f"the expression is longer than {limits.max_chars} characters")
    text = expression.translate(_SIGNS).strip()
    return _Parser(text[:-1] if text.endswith("=") else text, limits).parse()


def calculate(expression: str, limits: CalculatorLimits = CalculatorLimits()) -> ToolResult:
    """The calculator tool: the value as text, or the reason there is none as the error."""
    start = time.perf_counter()
    try:
        output, error = _format(evaluate(expression, limits)), None
    except CalculatorError as e:
        output, error = "", str(e)
    except RecursionError:  # the depth limit binds first; this is a last line of defence
        output, error = "", "nested too deeply"
    return ToolResult(output, error, time.perf_counter() - start)
