"""Adversarial responses for the rewards (``adversarial_set``): what a policy could learn to emit
to stall or confuse the scorer, with the ground truths they are scored against.

Math answers (in ``\\boxed{}`` after an assistant marker): power towers alone and beside other
terms, huge powers, factorials and binomials, sums raised to large powers, deep nesting of every
group kind, long sums, calculus operators, random LaTeX soup, malformed boxes, and ordinary
answers (right and wrong) so that grading itself is exercised. K&K responses: tags repeated,
missing or out of order, answer blocks with extra, missing or repeated roles, long runs of text.
Deterministic in ``seed``.
"""

from __future__ import annotations

import random

MATH_TRUTHS = ("1", "\\frac{1}{2}", "2\\sqrt{3}", "x^2+1", "(1,2)", "\\infty", "3\\pi", "10", "-4", "0.25",
               "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\left( -\\frac{9}{2}, -2 \\right)")
# (answer, truth) pairs math-verify finds equal though their strings differ
EQUAL = (("0.5", "\\frac{1}{2}"), ("\\sqrt{12}", "2\\sqrt{3}"), ("1+x^2", "x^2+1"), ("\\frac{3\\pi}{1}", "3\\pi"),
         ("\\frac{1}{4}", "0.25"), ("\\dfrac{20}{2}", "10"), ("-\\frac{8}{2}", "-4"), ("2^{2}", "4"))
SOUP = ("x", "y", "2", "9", "10", "0.5", "+", "-", "\\cdot", "\\times", "/", "^", "_", "!", "(", ")", "{", "}",
        "[", "]", "\\frac", "\\sqrt", "\\pi", "\\infty", "\\left(", "\\right)", "=", ",", "\\int", "\\sum", "\\lim",
        "\\binom", "e", "\\ln", "\\sin", "|", "\\{", "\\}", "&", "\\\\", "\\begin{pmatrix}", "\\end{pmatrix}", " ")
KK_TRUTH = {"solution_text_format": "(1) Alice is a knight\n(2) Bob is a knave\n(3) Carol is a knight"}
KK_RIGHT = "(1) Alice is a knight\n(2) Bob is a knave\n(3) Carol is a knight"


def _tower(rng: random.Random, depth: int, braced: bool) -> str:
    digits = [str(rng.randint(2, 9)) for _ in range(depth + 1)]
    if braced:
        out = digits[-1]
        for d in reversed(digits[:-1]):
            out = f"{d}^{{{out}}}"
        return out
    return "^".join(digits)


def _nested(rng: random.Random, depth: int) -> str:
    kind = rng.choice(("brace", "paren", "frac", "sqrt", "left", "bracket", "set", "mixed"))
    out = str(rng.randint(1, 9))
    for _ in range(depth):
        k = rng.choice(("brace", "paren", "frac", "sqrt")) if kind == "mixed" else kind
        out = {"brace": f"{{{out}}}", "paren": f"({out})", "frac": f"\\frac{{1}}{{{out}}}", "sqrt": f"\\sqrt{{{out}}}",
               "left": f"\\left({out}\\right)", "bracket": f"[{out}]", "set": f"\\{{{out}\\}}"}[k]
    return out


def math_answer(rng: random.Random) -> str:
    kind = rng.randrange(12)
    if kind == 0:  # power towers, alone or beside other terms
        tower = _tower(rng, rng.randint(1, 5), rng.random() < 0.7)
        return rng.choice(("@", "\\sqrt{2}@", "x^2@", "@+1", "2@", "\\frac{@}{3}", "(@)!")).replace("@", tower)
    if kind == 1:  # large powers
        base = rng.choice(("2", "10", "9", "x", "e", "\\pi", "(x+1)", "(x+y+z)", "(1+\\sqrt{2})", "(-1)"))
        exponent = rng.choice((str(rng.randint(2, 40)), str(rng.randint(100, 5000)), str(10 ** rng.randint(3, 9)),
                               f"10^{{{rng.randint(2, 12)}}}", "n", "2n+1",
                               f"{rng.randint(1, 9)}\\cdot 10^{{{rng.randint(1, 6)}}}"))
        return f"{base}^{{{exponent}}}"
    if kind == 2:  # factorials and binomials
        n = rng.choice((rng.randint(0, 20), rng.randint(100, 500), rng.randint(1000, 10 ** 7),
                        10 ** rng.randint(6, 30)))
        return rng.choice((f"{n}!", f"({n})!", f"{n}!!", f"\\binom{{{n}}}{{{max(1, n // 2)}}}", f"\\frac{{{n}!}}{{2}}",
                           f"(10^{{{rng.randint(1, 8)}}})!"))
    if kind == 3:  # deep nesting
        return _nested(rng, rng.randint(1, 30))
    if kind == 4:  # long sums and products
        term = rng.choice(("x", "x_{{{i}}}", "{i}", "\\frac{{1}}{{{i}}}", "\\sqrt{{{i}}}", "x^{{{i}}}"))
        sep = rng.choice(("+", "-", "\\cdot", "", "*"))
        return sep.join(term.format(i=i) for i in range(rng.randint(5, 400)))
    if kind == 5:  # calculus, evaluated by sympy
        body = rng.choice(("e^{x^2}\\sin(x^3)", "\\frac{\\sin x}{x}", "x^{x}", "\\frac{1}{n^2}", "k!", "\\ln(1+x)"))
        return rng.choice((f"\\int {body} dx", f"\\int_0^{{\\infty}} {body} dx", f"\\lim_{{x\\to 0}} {body}",
                           f"\\sum_{{k=1}}^{{{rng.choice(('10^9', 'n', 'infty', '100'))}}} {body}",
                           f"\\prod_{{k=1}}^{{{rng.randint(2, 10 ** 6)}}} k", f"\\frac{{d}}{{dx}} {body}"))
    if kind == 6:  # LaTeX soup
        return "".join(rng.choice(SOUP) for _ in range(rng.randint(1, 150)))
    if kind == 7:  # huge literals
        return rng.choice(("9" * rng.randint(20, 3000), "0." + "0" * rng.randint(10, 900) + "1",
                           f"1e{rng.randint(10, 10 ** 6)}", "1" + "0" * rng.randint(100, 2000),
                           "-" * rng.randint(1, 500)))
    if kind == 8:  # functions of huge arguments
        inner = rng.choice((f"10^{{{rng.randint(10, 3000)}}}", f"2^{{{rng.randint(10, 9000)}}}", "9^{9^{9}}", "x"))
        return rng.choice(("\\sin", "\\cos", "\\ln", "\\sqrt", "\\tan", "e^")) + f"{{{inner}}}"
    if kind == 9:  # ordinary answers, right and wrong
        return rng.choice(EQUAL)[0] if rng.random() < 0.5 else rng.choice(MATH_TRUTHS + ("7", "x^2", "\\frac{2}{3}"))
    if kind == 10:  # matrices and sets
        n = rng.randint(1, 12)
        rows = " \\\\ ".join(" & ".join(rng.choice(("1", "x", "2^{100}", "\\frac{1}{2}")) for _ in range(n))
                             for _ in range(n))
        return rng.choice((f"\\begin{{pmatrix}} {rows} \\end{{pmatrix}}",
                           "\\{" + ",".join(str(i) for i in range(rng.randint(1, 300))) + "\\}"))
    # hostile text: Python, control characters, unicode
    return rng.choice(("__import__('os').system('true')", "lambda: 1", "\x00\x01\x02", "∞ + √2 + π", "ｘ²＋１",
                       "\\text{" + "a" * rng.randint(1, 2000) + "}", "\\boxed{\\boxed{1}}", "\\\\" * 300))


def math_response(rng: random.Random) -> str:
    answer = math_answer(rng)
    wrap = rng.randrange(10)
    if wrap == 0:  # malformed boxes
        return rng.choice((f"\\boxed{{{answer}", f"\\boxed {answer}", f"\\boxed{{}}{answer}", "\\boxed" * 50,
                           f"\\fbox{{{answer}}}"))
    prefix = rng.choice(("", "<|im_start|>assistant\n", "<think>" + "so " * rng.randint(0, 3000) + "</think>",
                         "The answer is "))
    if wrap == 1:  # the box inside the reasoning, which is not graded
        return f"<think>\\boxed{{{answer}}}</think>"
    return f"{prefix}\\boxed{{{answer}}}" + rng.choice(("", ".", " \\boxed{3}", " Done."))


def kk_response(rng: random.Random) -> str:
    kind = rng.randrange(6)
    answer = KK_RIGHT
    if kind == 1:
        answer = KK_RIGHT.replace("knave", "knight")
    elif kind == 2:
        answer = (KK_RIGHT + "\n") * rng.randint(2, 500)
    elif kind == 3:
        answer = "Alice" + " " * rng.randint(1, 20000) + "is a knight " + "Bob is " * rng.randint(1, 2000)
    elif kind == 4:
        answer = "".join(rng.choice(("knight", "knave", "Alice", "Bob", "Carol", " is a ", "\n", "(1)")) for _ in
                         range(rng.randint(1, 3000)))
    tags = ["<think>", "reasoning " * rng.randint(0, 500), "</think>", "<answer>", answer, "</answer>"]
    if kind == 5:
        rng.shuffle(tags)
    if rng.random() < 0.2:
        tags = tags * rng.randint(2, 50)
    return "<|im_start|>assistant\n" + "".join(tags[1:] if rng.random() < 0.5 else tags)


def adversarial_set(n: int = 1200, seed: int = 0) -> tuple[list[str], list[str], list]:
    """(data sources, responses, ground truths): about four in five math, the rest K&K."""
    rng = random.Random(seed)
    sources, responses, truths = [], [], []
    for _ in range(n):
        if rng.random() < 0.8:
            response = math_response(rng)
            truth = rng.choice(MATH_TRUTHS)
            for answer, equal in EQUAL:  # the right truth for an ordinary answer, half the time
                if f"{{{answer}}}" in response:
                    truth = equal
            sources.append(rng.choice(("math_dsr", "aime_dsr", "arith")))
            responses.append(response)
            truths.append(truth)
        else:
            sources.append("kk_logic3")
            responses.append(kk_response(rng))
            truths.append(KK_TRUTH)
    return sources, responses, truths
