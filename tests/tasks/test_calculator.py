"""The calculator against Python's fractions on random expression trees, and hostile inputs as errors."""

import random
import time
from fractions import Fraction

import pytest

from arlopti_jax.tasks.tools.calculator import CalculatorLimits, calculate, evaluate

# (symbol, precedence); '**' is right-associative, the others left
BINARY = {"+": 1, "-": 1, "*": 2, "/": 2, "//": 2, "%": 2, "**": 4}
UNARY_PREC = 3
LEAF_PREC = 5


def _literal(rng: random.Random) -> tuple[str, Fraction]:
    """A non-negative number as text (integer, decimal, '.5', exponent form) and its exact value."""
    whole = rng.choice([0, 1, 2, 7, rng.randint(0, 99), rng.randint(0, 10**6), rng.randint(0, 10**12)])
    form = rng.randrange(4)
    if form == 0:
        return str(whole), Fraction(whole)
    frac = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 4)))
    if form == 1:
        return f"{whole}.{frac}", Fraction(f"{whole}.{frac}")
    if form == 2:
        return f".{frac}", Fraction(f"0.{frac}")
    exp = rng.randint(-3, 3)
    return f"{whole}e{exp}", Fraction(whole) * Fraction(10) ** exp


BY_ZERO = "division by zero"  # the value of an expression that divides (or takes a modulo) by zero


def _apply(op: str, left, right):
    if BY_ZERO in (left, right):
        return BY_ZERO
    if op in ("/", "//", "%") and right == 0:
        return BY_ZERO
    if op == "**":
        return BY_ZERO if left == 0 and right < 0 else left**right
    return {"+": lambda: left + right, "-": lambda: left - right, "*": lambda: left * right,
            "/": lambda: left / right, "//": lambda: Fraction(left // right), "%": lambda: left % right}[op]()


def _tree(rng: random.Random, depth: int) -> tuple[str, int, Fraction | str]:
    """(text with the fewest parentheses Python's precedence needs, its precedence, its value, or
    BY_ZERO where it divides by zero), computed with Fraction from the tree, not from the text."""
    if depth == 0 or rng.random() < 0.25:
        text, value = _literal(rng)
        return text, LEAF_PREC, value
    if rng.random() < 0.15:
        text, prec, value = _tree(rng, depth - 1)
        return "-" + (text if prec >= UNARY_PREC else f"({text})"), UNARY_PREC, value if value == BY_ZERO else -value
    op = rng.choice(list(BINARY))
    p = BINARY[op]
    ltext, lprec, left = _tree(rng, depth - 1)
    if op == "**":  # base: parenthesised unless a bare number; exponent: a small integer
        n = rng.randint(-3, 4)
        return f"{ltext if lprec == LEAF_PREC else f'({ltext})'} ** {n}", p, _apply(op, left, n)
    rtext, rprec, right = _tree(rng, depth - 1)
    ltext = ltext if lprec >= p else f"({ltext})"
    rtext = rtext if rprec > p else f"({rtext})"
    return f"{ltext} {op} {rtext}", p, _apply(op, left, right)


@pytest.mark.parametrize("seed", range(4))
def test_random_expressions_equal_fractions_exactly(seed):
    rng = random.Random(seed)
    checked, by_zero, too_big = 0, 0, 0
    for _ in range(500):
        text, _, expected = _tree(rng, rng.randint(1, 5))
        if rng.random() < 0.3:
            text = text.replace(" ", "")
        result = calculate(text)
        if expected == BY_ZERO:
            assert result.error is not None and "by zero" in result.error, (text, result)
            by_zero += 1
        elif result.error is not None:  # only the size limit may refuse a defined expression
            assert result.error == "a number has more than 1000 digits", (text, result.error)
            too_big += 1
        else:
            assert evaluate(text) == expected, text
            assert Fraction(result.output) == expected, (text, result.output)  # the printed form is exact
            checked += 1
    assert checked > 350 and by_zero > 5 and too_big < 25, (checked, by_zero, too_big)


@pytest.mark.parametrize("text,expected", [
    ("2**3**2", "512"), ("-2**2", "-4"), ("(-2)**2", "4"), ("2**-1", "0.5"), ("2^10", "1024"),
    ("7 // -2", "-4"), ("-7 % 3", "2"), ("7.5 % 2", "1.5"), ("1/3 + 1/6", "0.5"), ("1/3", "1/3"),
    ("-1/3 - 1", "-4/3"), ("0.1 + 0.2", "0.3"), ("1,234,567 * 2", "2469134"), ("3 × 4 ÷ 5", "2.4"),
    ("10 − 3 =", "7"), ("1e3 / 8", "125"), (".5e1", "5"), ("  12  ", "12"), ("+-+3", "-3"),
    ("48213 * 9071", str(48213 * 9071)), ("1/8", "0.125"), ("-1/40", "-0.025"), ("(1/2)**-2", "4"),
])
def test_known_values_and_formats(text, expected):
    result = calculate(text)
    assert (result.output, result.error) == (expected, None)


@pytest.mark.parametrize("text,error", [
    ("", "empty expression"), ("   ", "empty expression"), ("1 +", "ends where a number"), ("abc", "unexpected 'a'"),
    ("2 3", "unexpected '3'"), ("(1 + 2", "missing ')'"), ("1 + 2)", "unexpected ')'"), ("1/0", "division by zero"),
    ("5 // (2 - 2)", "division by zero"), ("5 % 0", "modulo by zero"), ("0 ** -1", "division by zero"),
    ("2 ** 0.5", "not an integer"), ("2 ** (1/2)", "not an integer"), ("__import__('os')", "unexpected '_'"),
    ("1,23", "unexpected ','"), ("x = 3", "unexpected 'x'"), ("\x00\xff", "unexpected"), ("2 ** * 3", "unexpected '*'"),
])
def test_malformed_expressions_are_errors(text, error):
    result = calculate(text)
    assert result.output == "" and result.error is not None and error in result.error, result


@pytest.mark.parametrize("text", [
    "9" * 10_000,  # a 10k-digit number (and longer than the input limit)
    "9" * 1_500,  # a 1.5k-digit number within the input limit
    "2 ** 99999999", "9 ** 9 ** 9", "10 ** 5000", "(10 ** 999) ** 2", "10 ** 999 * 10 ** 999",
    "1e999999999", "1e-5000", "(" * 990 + "1" + ")" * 990, "-" * 1990 + "1", "2 **" * 600 + "2",
    "(" * 100_000, "1" + "+1" * 100_000, "((((" * 2000,
])
def test_hostile_inputs_are_errors_returned_quickly(text):
    start = time.perf_counter()
    result = calculate(text)
    assert time.perf_counter() - start < 0.5
    assert result.output == "" and result.error, result
    assert len(result.error) < 200


def test_limits_are_parameters():
    assert calculate("10 ** 50", CalculatorLimits(max_digits=40)).error == "a number has more than 40 digits"
    assert calculate("10 ** 50", CalculatorLimits(max_digits=60)).output == "1" + "0" * 50
    assert "nested more than 3" in calculate("((((1))))", CalculatorLimits(max_depth=3)).error
    assert "longer than 4 characters" in calculate("1+2+3", CalculatorLimits(max_chars=4)).error
