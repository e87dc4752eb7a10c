"""Reasoning formats (`--reasoning-parser`): model text -> (reasoning_content, content).

- deepseek-r1: everything before `</think>` is reasoning; `<think>` at the start is optional
  (the R1 chat template already ends the prompt with it), so no `</think>` means all reasoning.
- qwen3: `<think>...</think>` at the start is reasoning; output without the tag is all content
  (enable_thinking=False puts an empty think block in the prompt instead).

One state machine for `parse` and streaming `feed`, holding back text that may be the start of a
tag, so the result does not depend on the chunking. Whitespace right after a tag is dropped.
"""

from __future__ import annotations

from typing import Dict, Tuple, Type

from radixserve.utils import held_suffix_len

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    force_reasoning = False  # no <think> at the start: reasoning (True) or content (False)

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start -> reasoning -> content
        self._strip = True  # drop whitespace at the beginning of the current mode

    @classmethod
    def parse(cls, text: str) -> Tuple[str, str]:
        p = cls()
        r1, c1 = p.feed(text)
        r2, c2 = p.finish()
        return r1 + r2, c1 + c2

    def feed(self, delta: str) -> Tuple[str, str]:
        """(reasoning delta, content delta)"""
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> Tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> Tuple[str, str]:
        reasoning, content = "", ""
        while True:
            if self._strip:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    break
                self._strip = False
            if self._mode == "start":
                if self._buf.startswith(THINK_START):
                    self._buf, self._mode, self._strip = self._buf[len(THINK_START):], "reasoning", True
                    continue
                if THINK_START.startswith(self._buf) and not final:
                    break  # maybe "<thi": wait
                self._mode = "reasoning" if self.force_reasoning else "content"
                continue
            if self._mode == "reasoning":
                end = self._buf.find(THINK_END)
                if end >= 0:
                    reasoning += self._buf[:end]
                    self._buf, self._mode, self._strip = self._buf[end + len(THINK_END):], "content", True
                    continue
                keep = 0 if final else held_suffix_len(self._buf, (THINK_END,))
                reasoning += self._buf[:len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content += self._buf
            self._buf = ""
            break
        return reasoning, content


class DeepSeekR1Parser(ReasoningParser):
    force_reasoning = True


class Qwen3Parser(ReasoningParser):
    force_reasoning = False


REASONING_PARSERS: Dict[str, Type[ReasoningParser]] = {
    "deepseek-r1": DeepSeekR1Parser,
    "qwen3": Qwen3Parser,
}
