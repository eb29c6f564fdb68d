"""Knights-and-Knaves puzzles: statement logic, solver, worked solutions, generator.

A puzzle has N people; person i makes statement i. A statement is a nested tuple,
the grammar of the public K&K data's `statements` column:

    leaf := ('telling-truth', j) | ('lying', j)          "j is a knight" / "j is a knave"
    stmt := leaf | ('not', leaf)
          | (op, leaf, leaf)   with op in 'and', 'or', '->', '<=>'

An assignment gives every person a role (True = knight). It is consistent when every
knight's statement is true and every knave's statement is false. `solve` enumerates
all 2**N assignments and returns the consistent ones; a puzzle is kept only when
exactly one exists.

The text forms (quiz, claims, chain-of-thought steps, answer key) reproduce the
public data's, so generated rows are interchangeable with the reference files.
"""

from __future__ import annotations

import ast
import dataclasses
import random
from collections.abc import Sequence

LEAF_OPS = ("telling-truth", "lying")
BINARY_OPS = ("and", "or", "->", "<=>")
MIN_PEOPLE, MAX_PEOPLE = 2, 8

NAMES = (
    "Abigail", "Aiden", "Alexander", "Amelia", "Aria", "Aurora", "Ava", "Avery",
    "Benjamin", "Charlotte", "Chloe", "Daniel", "David", "Elizabeth", "Ella", "Emily",
    "Emma", "Ethan", "Evelyn", "Grace", "Harper", "Henry", "Isabella", "Jack",
    "Jackson", "Jacob", "James", "Joseph", "Liam", "Lily", "Logan", "Lucas", "Luke",
    "Mason", "Matthew", "Mia", "Michael", "Noah", "Oliver", "Olivia", "Owen",
    "Penelope", "Riley", "Samuel", "Scarlett", "Sebastian", "Sofia", "Sophia",
    "Victoria", "William", "Zoey",
)  # fmt: skip

QUIZ_INTRO = (
    "A very special island is inhabited only by knights and knaves. "
    "Knights always tell the truth, and knaves always lie. "
)
QUIZ_QUESTION = "So who is a knight and who is a knave?"
# How a speaker's claim is reported in the quiz; {n} = speaker, {c} = claim.
SPEECH_TEMPLATES = (
    '{n} was heard saying, "{c}".',
    'According to {n}, "{c}".',
    'In a statement by {n}: "{c}".',
    '{n} commented, "{c}".',
    "{n} expressed that {c}.",
    '{n} asserted: "{c}".',
    '{n} stated, "{c}".',
    "In {n}'s words: \"{c}\".",
    "{n} said that {c}.",
    'As {n} put it, "{c}".',
    '{n} said, "{c}."',
    "{n} told you that {c}.",
    '{n} remarked, "{c}".',
    '{n} noted, "{c}".',
    '"{c}," {n} declared.',
    '"{c}," {n} claimed.',
    '"{c}," {n} mentioned.',
    '"{c}" - {n}.',
)
COT_HEAD = (
    "Let's think step by step, by considering whether each person is lying "
    "and if that leads to contradiction."
)
COT_FOOT = "This leads to a feasible solution."
KNIGHT_KNAVE = {
    "Knave": "Knave", "Knight": "Knight", "a_knave": "a knave",
    "a_knight": "a knight", "knave": "knave", "knight": "knight",
}  # fmt: skip


def role(is_knight: bool) -> str:
    return "knight" if is_knight else "knave"


def join_names(items: Sequence[str]) -> str:
    """'A', 'A and B', 'A, B, and C' (the data's list style)."""
    items = list(items)
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


# ---------------------------------------------------------------- statement logic
def parse_statements(text: str) -> tuple:
    """Parse the `statements` column with a literal parser (never eval) and validate it."""
    stmts = ast.literal_eval(text)
    if not isinstance(stmts, tuple):
        raise ValueError(f"statements must be a tuple, got {type(stmts).__name__}")
    for s in stmts:
        _check_statement(s, len(stmts))
    return stmts


def _check_statement(s, n: int, depth: int = 0) -> None:
    if not isinstance(s, tuple) or not s or depth > 2:
        raise ValueError(f"malformed statement {s!r}")
    op = s[0]
    if op in LEAF_OPS:
        if len(s) != 2 or not isinstance(s[1], int) or not 0 <= s[1] < n:
            raise ValueError(f"malformed leaf {s!r}")
    elif op == "not" and len(s) == 2:
        _check_statement(s[1], n, depth + 1)
    elif op in BINARY_OPS and len(s) == 3:
        _check_statement(s[1], n, depth + 1)
        _check_statement(s[2], n, depth + 1)
    else:
        raise ValueError(f"unknown operator in statement {s!r}")


def evaluate(s: tuple, assignment: Sequence[bool]) -> bool:
    """Truth value of statement `s` when person i is a knight iff assignment[i]."""
    op = s[0]
    if op == "telling-truth":
        return bool(assignment[s[1]])
    if op == "lying":
        return not assignment[s[1]]
    if op == "not":
        return not evaluate(s[1], assignment)
    a, b = evaluate(s[1], assignment), evaluate(s[2], assignment)
    return {"and": a and b, "or": a or b, "->": (not a) or b, "<=>": a == b}[op]


def people_in(s: tuple) -> list[int]:
    """Indices a statement mentions, in order of first mention."""
    if s[0] in LEAF_OPS:
        return [s[1]]
    out: list[int] = []
    for sub in s[1:]:
        out += [p for p in people_in(sub) if p not in out]
    return out


def solve(statements: Sequence[tuple]) -> list[tuple[bool, ...]]:
    """All consistent assignments, found by checking each of the 2**N assignments.

    Assignment number a gives person i the role bit i of a (1 = knight), so the
    result is ordered by a. A puzzle is well posed when exactly one is returned.
    """
    n = len(statements)
    found = []
    for a in range(2**n):
        assignment = tuple(bool((a >> i) & 1) for i in range(n))
        if all(evaluate(s, assignment) == assignment[i] for i, s in enumerate(statements)):
            found.append(assignment)
    return found


# ---------------------------------------------------------------- text rendering
def render_claim(s: tuple, names: Sequence[str]) -> str:
    op = s[0]
    if op in LEAF_OPS:
        return f"{names[s[1]]} is a {role(op == 'telling-truth')}"
    if op == "not":
        leaf = s[1]
        return f"{names[leaf[1]]} is not a {role(leaf[0] == 'telling-truth')}"
    a, b = render_claim(s[1], names), render_claim(s[2], names)
    if op == "->":
        return f"If {a} then {b}"
    if op == "<=>":
        return f"{a} if and only if {b}"
    return f"{a} {op} {b}"


def render_quiz(statements: Sequence[tuple], names: Sequence[str], templates: Sequence[int]) -> str:
    parts = [f"{QUIZ_INTRO}You meet {len(names)} inhabitants: {join_names(names)}."]
    for i, s in enumerate(statements):
        parts.append(SPEECH_TEMPLATES[templates[i]].format(n=names[i], c=render_claim(s, names)))
    parts.append(QUIZ_QUESTION)
    return " ".join(parts)


def solution_text(names: Sequence[str], solution: Sequence[bool]) -> str:
    return join_names([f"{n} is a {role(k)}" for n, k in zip(names, solution)]) + "."


def solution_text_format(names: Sequence[str], solution: Sequence[bool]) -> str:
    """The answer key: '(1) NAME is a knight\\n(2) ...'."""
    return "\n".join(f"({i + 1}) {n} is a {role(k)}" for i, (n, k) in enumerate(zip(names, solution)))


# ---------------------------------------------------------------- worked solution
def search_order(statements: Sequence[tuple]) -> list[int]:
    """People in depth-first order over 'who mentions whom', starting at person 0."""
    order: list[int] = []

    def visit(i: int) -> None:
        order.append(i)
        for j in people_in(statements[i]):
            if j not in order:
                visit(j)

    for i in range(len(statements)):
        if i not in order:
            visit(i)
    return order


def cot_steps(statements: Sequence[tuple], names: Sequence[str]) -> list[str]:
    """Backtracking search narrated step by step (the data's cot_repeat_steps form).

    People are tried in `search_order`, knight first. A role is rejected when some
    statement whose speaker is decided, and that mentions the new person or is theirs,
    now has a fixed truth value (the same for every choice of the undecided people)
    that contradicts its speaker's role; statements are checked in speaker order. This
    reproduces the public data's cot_repeat_steps exactly.
    """
    order = search_order(statements)
    claims = [render_claim(s, names) for s in statements]
    assign: dict[int, bool] = {}
    steps: list[str] = []
    exhausted: list[int] = []  # people whose both roles failed, since the last decision

    def violated(p: int) -> int | None:
        for i in range(len(statements)):
            if i in assign and p in [i, *people_in(statements[i])]:
                if _determined_value(statements[i], assign, len(names)) not in (None, assign[i]):
                    return i
        return None

    def search(depth: int) -> bool:
        if depth == len(order):
            return True
        p = order[depth]
        for value in (True, False):
            if exhausted:
                names_out = join_names([names[q] for q in exhausted])
                steps.append(
                    f"We have exhausted all possibilities for {names_out}, "
                    f"so let us go back and reconsider {names[p]}."
                )
                exhausted.clear()
            assign[p] = value
            bad = violated(p)
            if bad is None:
                false = "" if value else "false "
                steps.append(
                    f"Assume {names[p]} is a {role(value)}. "
                    f"No contradiction is found in their {false}claim that {claims[p]}."
                )
                if search(depth + 1):
                    return True
            else:
                whose = "their own" if bad == p else names[bad]
                false = "" if assign[bad] else "false "
                steps.append(
                    f"{names[p]} cannot be a {role(value)}, because this would contradict "
                    f"the {false}claim of {whose} that {claims[bad]}."
                )
            del assign[p]
        exhausted.append(p)
        return False

    if not search(0):
        raise ValueError("puzzle has no consistent assignment")
    return steps


def _determined_value(s: tuple, assign: dict[int, bool], n: int) -> bool | None:
    """The statement's value if every completion of the undecided people agrees, else None."""
    free = [q for q in people_in(s) if q not in assign]
    values = set()
    for bits in range(2 ** len(free)):
        full = [assign.get(q, False) for q in range(n)]
        for k, q in enumerate(free):
            full[q] = bool((bits >> k) & 1)
        values.add(evaluate(s, full))
    return values.pop() if len(values) == 1 else None


@dataclasses.dataclass(frozen=True)
class Puzzle:
    names: tuple[str, ...]
    statements: tuple
    solution: tuple[bool, ...]
    templates: tuple[int, ...]  # index into SPEECH_TEMPLATES for each speaker

    @property
    def quiz(self) -> str:
        return render_quiz(self.statements, self.names, self.templates)

    @property
    def answer(self) -> str:
        return solution_text_format(self.names, self.solution)

    def cot(self) -> list[str]:
        return cot_steps(self.statements, self.names)


def worked_solution(puzzle: Puzzle, open_think: bool = True) -> str:
    """SFT target: '<think>reasoning</think>\\n<answer>(1) X is a knight\\n...</answer>'.

    With open_think=False the leading '<think>' is left out, for prompts that already
    open it (the embedded-template prompt style ends with '<think>').
    """
    reasoning = "\n".join([COT_HEAD, *puzzle.cot(), COT_FOOT])
    return ("<think>" if open_think else "") + f"{reasoning}</think>\n<answer>{puzzle.answer}</answer>"


# ---------------------------------------------------------------- generator
def random_statement(rng: random.Random, speaker: int, n: int) -> tuple:
    """One statement; top-level forms are equally likely: leaf, not, and, or, ->, <=>.

    A leaf or negation about the speaker is never drawn: "I am a knave" has no
    consistent reading and "I am a knight" says nothing.
    """
    others = [j for j in range(n) if j != speaker]

    def leaf(pool: Sequence[int]) -> tuple:
        return (rng.choice(LEAF_OPS), rng.choice(pool))

    kind = rng.choice(("leaf", "not", *BINARY_OPS))
    if kind == "leaf":
        return leaf(others)
    if kind == "not":
        return ("not", leaf(others))
    a = leaf(range(n))
    b = leaf(range(n))
    while b == a:
        b = leaf(range(n))
    return (kind, a, b)


def random_puzzle(rng: random.Random, n_people: int, max_tries: int = 10_000) -> Puzzle:
    """Draw statements until exactly one assignment is consistent."""
    if not MIN_PEOPLE <= n_people <= MAX_PEOPLE:
        raise ValueError(f"n_people must be in [{MIN_PEOPLE}, {MAX_PEOPLE}], got {n_people}")
    names = tuple(rng.sample(NAMES, n_people))
    for _ in range(max_tries):
        statements = tuple(random_statement(rng, i, n_people) for i in range(n_people))
        solutions = solve(statements)
        if len(solutions) == 1:
            templates = tuple(rng.randrange(len(SPEECH_TEMPLATES)) for _ in range(n_people))
            return Puzzle(names, statements, solutions[0], templates)
    raise RuntimeError(f"no uniquely solvable {n_people}-person puzzle in {max_tries} draws")


def generate_puzzles(n_people: int, count: int, seed: int) -> list[Puzzle]:
    """`count` distinct, uniquely solvable puzzles; the same arguments give the same list."""
    rng = random.Random(f"kk:{n_people}:{seed}")
    puzzles: list[Puzzle] = []
    seen: set[str] = set()
    attempts = 0
    while len(puzzles) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise RuntimeError(f"could not find {count} distinct {n_people}-person puzzles")
        p = random_puzzle(rng, n_people)
        if p.quiz not in seen:
            seen.add(p.quiz)
            puzzles.append(p)
    return puzzles
