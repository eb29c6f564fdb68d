"""The result every tool call gives (see the package docstring)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One tool call's outcome.

    output     the text the tool produced: the calculator's value, or the program's stdout
               followed by its stderr (capped; ``truncated`` says whether bytes were dropped)
    error      None when the call succeeded; otherwise one line saying why it did not (a parse
               error, 'division by zero', 'exit status 1', 'timed out after 5 s', ...)
    seconds    wall-clock seconds the call took
    timed_out  the call was stopped at its wall-clock or CPU-time limit
    truncated  the output was longer than the tool's cap and was cut
    """

    output: str
    error: str | None = None
    seconds: float = 0.0
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None
