"""A deterministic guard before the math answer parser: ``refusal(answer)`` says why an answer is
not handed to math-verify (None: it may be), from its text alone.

math-verify (its LaTeX grammar, then sympy) can take unbounded time on short answers, and a time
limit makes a score depend on the machine's speed and load: scored alone (the sandbox's limit) or
in a batch (the worker pool's), an answer that sometimes finishes in time scores differently on a
repeat. The guard refuses, before any parsing, the shapes that were measured to be slow (a worker
process, 2 CPU cores, math-verify 0.9; ``tests/tasks/test_math_guard.py`` keeps every accepted shape
fast):

- length and size: more than ``MAX_CHARS`` characters or ``MAX_TOKENS`` tokens;
- nesting: groups (``{ ( [ \\{``) deeper than ``MAX_DEPTH`` (the grammar's time grows steeply with
  depth: ten nested braces took 0.8 s, fourteen 5 s, twenty never finished); a power inside
  the exponent of a power inside an exponent (``MAX_POWER_NESTING``), or a double superscript;
- size of numbers: an upper bound of log10 |value| of the whole answer and of every part of it
  above ``MAX_DIGITS`` (``9^{9^{9}}`` has 370 million digits and sympy computes them; so do
  factorials and binomials of large numbers);
- expansion: a sum raised to a number above ``MAX_SUM_EXPONENT`` (``(x+1)^{1000}`` is expanded;
  ``(x+1)^{n}`` is not);
- commands outside ``ALLOWED_COMMANDS``, and derivatives (integrals, limits, sums, products and
  derivatives are evaluated:
  ``\\int e^{x^2}\\sin(x^3) dx`` ran past 10 s). No ground truth of the public math sets
  (10,613 answers) uses one, nests deeper than 3 or exceeds 159 characters.

An answer it refuses scores as a wrong one (it can still match the truth as a string, which is
compared before the guard). The bound on numbers is computed on tokens: a number literal is its
digits, a letter or constant at most 10, an operator 0, a group the sum of its parts (which bounds sums,
products and quotients alike), ``a^b`` size(a) x 10^size(b), ``n!`` log10(n!), ``\\binom{n}{k}``
n log10 2.
"""

from __future__ import annotations

import math
import re

MAX_CHARS = 256
MAX_TOKENS = 128
MAX_DEPTH = 4
MAX_POWER_NESTING = 2
MAX_DIGITS = 1000.0
MAX_SUM_EXPONENT = 8
ALLOWED_COMMANDS = frozenset("""
    frac dfrac tfrac cfrac sqrt cdot times div pm mp ast circ degree pi infty binom dbinom tbinom
    left right big Big bigg Bigg bigl bigr Bigl Bigr displaystyle
    text textbf textit textrm textnormal mathrm mathbf mathit mathbb mathcal mathsf operatorname mbox
    ln log lg sin cos tan cot sec csc arcsin arccos arctan tanh gcd lcm max min mod bmod pmod
    le leq ge geq lt gt ne neq approx equiv sim cong propto
    in notin cup cap setminus subset subseteq supset supseteq emptyset varnothing mid
    lfloor rfloor lceil rceil langle rangle lvert rvert vert Vert
    begin end pmatrix bmatrix matrix vmatrix array cases
    alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi omicron
    rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega
    quad qquad dots ldots cdots vdots ddots overline bar hat vec tilde dot prime
    to rightarrow Rightarrow leftrightarrow implies iff land lor lnot neg wedge vee angle triangle perp parallel
    """.split())
_CONSTANTS = frozenset("""pi infty alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda
    mu nu xi omicron rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi
    Psi Omega""".split())
_BINOMS = ("\\binom", "\\dbinom", "\\tbinom")
_TOKEN = re.compile(r"\\[a-zA-Z]+|\\.|[0-9]+(?:\.[0-9]*)?|\.[0-9]+|\S", re.DOTALL)
# \frac{d}{dx}, \frac{dy}{dx}
_DERIVATIVE = re.compile(r"\\[dtc]?frac\s*\{\s*(?:\\math[a-z]+\s*\{\s*)?d\s*[a-zA-Z]?\s*\}")
_OPEN, _CLOSE = {"{": "}", "(": ")", "[": "]", "\\{": "\\}"}, {"}", ")", "]", "\\}"}
_SUM_SIGNS = {"+", "-", "\\pm", "\\mp"}
_LOG2 = math.log10(2)


class _Refused(Exception):
    pass


def refusal(answer: str) -> str | None:
    """Why ``answer`` must not be parsed (one phrase), or None when it may be."""
    if len(answer) > MAX_CHARS:
        return f"longer than {MAX_CHARS} characters"
    tokens = _TOKEN.findall(answer)
    if len(tokens) > MAX_TOKENS:
        return f"more than {MAX_TOKENS} tokens"
    for t in tokens:
        if t[0] == "\\" and len(t) > 2 and t[1:] not in ALLOWED_COMMANDS:
            return f"command {t} is not allowed"
    if _DERIVATIVE.search(answer):
        return "a derivative"
    try:
        tree = _groups(tokens)
        size = _size(tree, 0)
    except _Refused as why:
        return str(why)
    if size > MAX_DIGITS:
        return f"its value may have more than {MAX_DIGITS:g} digits"
    return None


def _groups(tokens: list[str]) -> list:
    """The tokens as a tree: a group is a list [open, *contents, close]; an unmatched closer is
    an ordinary token (the parser's business, not the guard's)."""
    root: list = []
    stack = [root]
    for t in tokens:
        if t in _OPEN:
            if len(stack) > MAX_DEPTH:
                raise _Refused(f"groups nested deeper than {MAX_DEPTH}")
            group = [t]
            stack[-1].append(group)
            stack.append(group)
        elif t in _CLOSE and len(stack) > 1 and (_OPEN[stack[-1][0]] == t or {stack[-1][0], t} <= set("([])")):
            stack.pop().append(t)  # ( and [ close each other: half-open intervals, [0, 1)
        else:
            stack[-1].append(t)
    return root


def _number(token: str) -> float:
    """log10 of a literal's magnitude or of its inverse, whichever is larger (at least log10 2)."""
    whole, _, frac = token.partition(".")
    digits = len(whole.lstrip("0"))
    if digits:
        return max(_LOG2, digits - 1 + math.log10(int(whole.lstrip("0")[:15]) / 10 ** (min(digits, 15) - 1)))
    zeros = len(frac) - len(frac.lstrip("0"))
    return max(_LOG2, zeros + 1.0)


def _is_sum(atom) -> bool:
    return isinstance(atom, list) and any(_is_sum(t) if isinstance(t, list) else t in _SUM_SIGNS for t in atom)


def _is_numeric(atom) -> bool:
    """No variables or constants in it (a symbolic exponent leaves a power unexpanded)."""
    if isinstance(atom, list):
        return all(_is_numeric(t) for t in atom)
    return atom is None or not (atom.isalpha() or atom[1:] in _CONSTANTS or not atom.isascii())


def _size(items: list, powers: int) -> float:
    """Upper bound of log10 |value| of a sequence of atoms (a group's contents); ``powers``: how
    many exponents this sequence sits in."""
    sizes: list[float] = []
    raised: list[bool] = []  # whether each size is already a power (a second ^ is a double superscript)
    i = 0
    while i < len(items):
        atom = items[i]
        if atom == "^":
            if raised and raised[-1]:
                raise _Refused("a double superscript")
            if powers + 1 > MAX_POWER_NESTING:
                raise _Refused(f"powers nested deeper than {MAX_POWER_NESTING}")
            exponent = items[i + 1] if i + 1 < len(items) else None
            exp_size = _atom_size(exponent, powers + 1) if exponent is not None else 0.0
            base_atom = items[i - 1] if i > 0 else None
            base = max(sizes.pop(), _LOG2) if sizes else _LOG2  # an operator's 0: at least 2
            if raised:
                raised.pop()
            if _is_sum(base_atom) and _is_numeric(exponent) and exp_size > math.log10(MAX_SUM_EXPONENT):
                raise _Refused(f"a sum raised to a power above {MAX_SUM_EXPONENT}")
            if math.log10(base) + exp_size > math.log10(MAX_DIGITS):
                raise _Refused(f"a power with more than {MAX_DIGITS:g} digits")
            sizes.append(base * 10 ** exp_size)
            raised.append(True)
            i += 2
            continue
        if atom == "!" and sizes:
            n = sizes.pop()
            raised.pop()
            if n > 4:
                raise _Refused("a factorial of a number above 10^4")
            value = 10 ** n
            sizes.append(max(_LOG2, math.lgamma(value + 1) / math.log(10)))
            raised.append(False)
            i += 1
            continue
        if atom in _BINOMS:
            top = _atom_size(items[i + 1], powers) if i + 1 < len(items) else 0.0
            rest = _atom_size(items[i + 2], powers) if i + 2 < len(items) else 0.0
            if top > 4:
                raise _Refused("a binomial of a number above 10^4")
            sizes.append(10 ** top * _LOG2 + rest)
            raised.append(False)
            i += 3
            continue
        if atom == "_":  # a subscript names, it does not scale; it is still checked
            if i + 1 < len(items):
                _atom_size(items[i + 1], powers)
            i += 2
            continue
        sizes.append(_atom_size(atom, powers))
        raised.append(False)
        i += 1
    total = sum(sizes)
    if total > MAX_DIGITS:
        raise _Refused(f"a part whose value may have more than {MAX_DIGITS:g} digits")
    return total


def _atom_size(atom, powers: int) -> float:
    if isinstance(atom, list):
        closed = len(atom) > 1 and isinstance(atom[-1], str) and atom[-1] in _CLOSE
        inner = atom[1:-1] if closed else atom[1:]
        return _size(inner, powers)
    if "0" <= atom[0] <= "9" or (atom[0] == "." and len(atom) > 1):  # ASCII digits: the tokens' numbers
        return _number(atom)
    if atom.isalpha() or atom[1:] in _CONSTANTS or not atom.isascii():
        return 1.0  # a variable or constant: at most 10 in magnitude
    return 0.0  # an operator, sign or function name: its operands carry the size
