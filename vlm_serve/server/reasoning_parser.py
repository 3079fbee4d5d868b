"""`--reasoning-parser`: splits a thinking model's output into `reasoning_content` and `content`.

Qwen3 thinking models write their reasoning before `</think>`; the Thinking checkpoints' chat template
already ends the generation prompt with `<think>\\n`, so the output usually holds only the closing tag.
`Qwen3ReasoningParser` behaves as vLLM's `Qwen3ReasoningParser` (and SGLang's `Qwen3Detector` with
`force_reasoning`, i.e. its `qwen3-thinking` parser):

- a `<think>` at the very start of the output is dropped and opens the reasoning; a `<think>` anywhere
  else is plain text (as SGLang; vLLM drops the first `<think>` anywhere, with the text before it);
- the reasoning runs up to the first `</think>`, which is dropped; everything after it is content, also
  any later `</think>`;
- with no `</think>` the output was cut short while thinking: all of it is reasoning;
- whitespace around the tags is kept as the model wrote it (neither vLLM nor SGLang strips it; Qwen3
  usually writes `reasoning\\n</think>\\n\\ncontent`).

`thinking=False` is for a prompt that did not open a think block (`enable_thinking=False`): the output
is then content unless it starts with `<think>` itself. Unlike newer vLLM/SGLang we do not end the
reasoning at a `<tool_call>` written before `</think>`: that is a Qwen3.5 habit, not Qwen3-VL's.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (text to hold back while
    streaming, since the next delta may complete the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class Qwen3ReasoningParser:
    """One request's parser: `split` for a whole answer, `feed`/`finish` for a stream."""

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        self._held = ""  # text received but not yet released
        self._phase = "start"  # "start" (may still be a leading <think>), "reasoning", "content"

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole answer; None where empty."""
        if text.startswith(THINK_START):
            text, in_reasoning = text[len(THINK_START) :], True
        else:
            in_reasoning = self.thinking
        if not in_reasoning:
            return None, text or None
        reasoning, _, content = text.partition(THINK_END)
        return reasoning or None, content or None

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning piece, content piece) released by one more delta of the answer. Text that may be
        the beginning of a tag is held back until the next delta (or `finish`) decides."""
        text = self._held + delta
        self._held = ""
        if self._phase == "start":
            if len(text) < len(THINK_START) and THINK_START.startswith(text):
                self._held = text
                return "", ""
            if text.startswith(THINK_START):
                text, self._phase = text[len(THINK_START) :], "reasoning"
            else:
                self._phase = "reasoning" if self.thinking else "content"
        if self._phase == "content":
            return "", text
        reasoning, end, content = text.partition(THINK_END)
        if end:
            self._phase = "content"
            return reasoning, content
        keep = partial_tag_len(text, THINK_END)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """Releases what was held back at the end of the stream (a partial tag is plain text)."""
        text, self._held = self._held, ""
        if self._phase == "content" or (self._phase == "start" and not self.thinking):
            return "", text
        return text, ""


REASONING_PARSERS: dict[str, type[Qwen3ReasoningParser]] = {"qwen3": Qwen3ReasoningParser}
