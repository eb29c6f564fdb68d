"""An environment's observation text -> the token ids a tool episode feeds after the turn.

    fmt = ObservationFormat(tokenizer, text_format="", max_tokens=128)    # the chat template's tool message
    ids, cut = fmt("4821 * 93357 = 450074097", after=last_token_of_the_turn)

Only observations are tokenized here: the policy's own tokens are never decoded and tokenized
again (``episodes.py``). The ids are those of ``head + observation + tail``:

- With a chat template that supports tools (its text mentions ``tools``: Qwen2.5's, Qwen3's),
  ``head`` and ``tail`` are what the template writes around a tool message's content after an
  assistant turn, up to and including the next assistant turn's opening: the text the template
  adds after the assistant turn's content, found once by rendering a probe conversation (a user
  message, an assistant message, a tool message, the generation prompt) with two different
  contents. For Qwen2.5 that is ``<|im_end|>\\n<|im_start|>user\\n<tool_response>\\n`` and
  ``\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n``: the turn's end, which the policy did
  not draw (its turn stopped at ``</tool_call>``), is part of the observation.
- ``tools_section_problem`` checks the other half of a template with tools: that the prompts' tools
  section it writes from the environment's schemas teaches the environment's call format.
- With a template without tool support (SmolLM2's), ``text_format`` (``env.observation_format``)
  says it, the observation standing for ``{observation}``: plain text between markers that the
  warm start teaches (``finetune/tool_traces.py``). Without one that is an error: nothing is guessed.

A turn that ended with the token the observation starts with (an EOS the template writes again)
does not get it twice (``after``). An observation longer than ``max_tokens`` is cut, characters
from its end, until it fits with ``TRUNCATED`` after it.
"""

from __future__ import annotations

TRUNCATED = " [... cut]"  # after an observation cut to the token cap
PLACEHOLDER = "{observation}"
_PROBES = ("PROBE_OBSERVATION_a1", "PROBE_OBSERVATION_b2")
_ASSISTANT = "PROBE_ASSISTANT_TURN"


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders tools (its text mentions ``tools``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = " ".join(str(t) for t in template.values())
    return "tools" in template


def tools_section_problem(tokenizer, tools: list[dict], stop: str) -> str | None:
    """Why the chat template cannot write a prompt's tools section for ``tools`` (JSON schemas, as
    ``apply_chat_template(tools=...)`` takes them) whose calls end at ``stop``: it raises on them,
    writes nothing for them, or teaches another call format (``stop`` is not in what it adds); None
    when it can."""
    probe = [{"role": "user", "content": "PROBE_QUESTION"}]
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        rendered = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template raised on the schemas
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"the chat template cannot write the environment's tools ({type(err).__name__}: {reason})"
    if rendered == plain:
        return "the chat template mentions tools but writes nothing for the environment's"
    if rendered.count(stop) <= plain.count(stop):
        return (f"the chat template's tools section teaches another call format than the environment's (its stop "
                f"string {stop!r} is not in it)")
    return None


def tool_message(tokenizer) -> tuple[str, str]:
    """(head, tail): the text the chat template writes around a tool message's content after an
    assistant turn's content, through the next generation prompt (module docstring). ValueError
    when the template does not render a tool message as head + content + tail."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _ASSISTANT}]

    def after_assistant(content: str) -> str:
        text = tokenizer.apply_chat_template(base + [{"role": "tool", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
        if _ASSISTANT not in text:
            raise ValueError("the chat template does not write an assistant message's content as it is")
        return text[text.index(_ASSISTANT) + len(_ASSISTANT):]

    first = after_assistant(_PROBES[0])
    if first.count(_PROBES[0]) != 1:
        raise ValueError("the chat template does not write a tool message's content once, as it is")
    head, tail = first.split(_PROBES[0])
    if after_assistant(_PROBES[1]) != head + _PROBES[1] + tail:
        raise ValueError("the chat template's tool message is not the same text around every content")
    return head, tail


class ObservationFormat:
    """Observation text -> the ids fed after a turn (module docstring)."""

    def __init__(self, tokenizer, text_format: str, max_tokens: int, where: str = "env.observation_format"):
        self.tokenizer, self.max_tokens = tokenizer, max_tokens
        if text_format:
            if text_format.count(PLACEHOLDER) != 1:
                raise ValueError(f"{where}={text_format!r}: must hold {PLACEHOLDER} once, where the tool's output goes")
            self.head, self.tail = text_format.split(PLACEHOLDER)
        elif not template_supports_tools(tokenizer):
            raise ValueError(f"{where} is empty and the model's chat template has no tool support (it never "
                             "mentions tools): set it to the plain text around a tool's output that the warm start "
                             "teaches, e.g. '\\n<output>{observation}</output>\\n'")
        else:
            try:
                self.head, self.tail = tool_message(tokenizer)
            except Exception as err:  # the template raised, or renders a tool message oddly
                raise ValueError(f"{where} is empty and the model's chat template cannot write a tool message "
                                 f"({err}): set {where}") from None
        smallest = len(self._encode(TRUNCATED))
        if smallest > max_tokens:
            raise ValueError(f"env.observation_tokens={max_tokens}: the observation's frame alone takes {smallest} "
                             f"tokens ({self.head + TRUNCATED + self.tail!r})")

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(self.head + text + self.tail, add_special_tokens=False)["input_ids"]

    def __call__(self, text: str, after: int | None = None) -> tuple[list[int], bool]:
        """(ids, whether the text was cut to fit ``max_tokens``)."""
        ids, cut = self._encode(text), False
        if len(ids) > self.max_tokens:
            lo, hi = 0, len(text)  # the most characters that fit with the marker
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if len(self._encode(text[:mid] + TRUNCATED)) <= self.max_tokens else (lo, mid - 1)
            ids, cut = self._encode(text[:lo] + TRUNCATED), True
        if after is not None and ids and ids[0] == after:
            ids = ids[1:]
        return ids, cut

    def text(self, observation: str) -> str:
        """The observation as fed, in text (the generations files')."""
        return self.head + observation + self.tail
