"""Tool-call formats (`--tool-call-parser`): model text -> normal text + function calls.

Every format is one small state machine over a text buffer, so the one-shot `parse` and the
streaming `feed` share the code and give the same result whatever the chunking:

- text mode: emit text up to the earliest start marker; hold back a suffix that may be the
  beginning of a marker (e.g. "<tool_" while waiting for "call>").
- call mode (after a marker): wait until the calls are complete, then emit them; a call that is
  not valid JSON of the expected shape is given back as text, unchanged.

A call is emitted whole (name, then its arguments) once its JSON is complete: emitting argument
fragments earlier would need partial-JSON parsing and could not take back a malformed call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Type

from radixserve.utils import held_suffix_len

_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON string, as OpenAI's `function.arguments`


@dataclass
class ToolCallDelta:
    """A piece of a streamed call: the first for a call carries its name, the next its arguments."""

    index: int
    name: Optional[str] = None
    arguments: str = ""


def as_tool_call(obj: Any, args_keys: Tuple[str, ...] = ("arguments", "parameters")) -> Optional[ToolCall]:
    """{"name": str, "arguments" | "parameters": object} -> ToolCall; anything else -> None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = {}
    for key in args_keys:
        if key in obj:
            args = obj[key]
            break
    if isinstance(args, str):  # some models emit the arguments already encoded
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class _Step:
    """What call mode made of the buffer: `consumed` characters used; text to give back; calls."""

    consumed: int
    text: str = ""
    calls: List[ToolCall] = field(default_factory=list)
    done: bool = True  # False: stay in call mode, more calls may follow


class ToolCallParser:
    """Base state machine; a format sets its markers and `_call_step`."""

    start_markers: Tuple[str, ...] = ()
    bare_json_start = False  # a "{" as the first non-space character also opens call mode

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._marker = ""  # the marker that opened call mode ("" for a bare JSON start)
        self._block_calls = 0  # calls emitted since it opened
        self._at_start = True  # nothing but whitespace seen yet
        self._n_calls = 0

    # ---- public ---------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Tuple[str, List[ToolCall]]:
        p = cls()
        normal, deltas = p.feed(text)
        normal2, deltas2 = p.finish()
        return normal + normal2, calls_of(deltas + deltas2)

    def feed(self, delta: str) -> Tuple[str, List[ToolCallDelta]]:
        self._buf += delta
        return self._run(final=False)

    def finish(self) -> Tuple[str, List[ToolCallDelta]]:
        """The end of the output: flush held text; an unfinished call is parsed or given back."""
        return self._run(final=True)

    # ---- the machine ----------------------------------------------------------------------
    def _run(self, final: bool) -> Tuple[str, List[ToolCallDelta]]:
        out: List[str] = []
        deltas: List[ToolCallDelta] = []
        # At the end, call mode runs once more even on an empty buffer (a lone marker is text).
        while self._buf or (final and self._in_call):
            if self._in_call:
                step = self._call_step(self._buf, final)
                if step is None:  # incomplete: wait for more text
                    break
                self._buf = self._buf[step.consumed:]
                out.append(step.text)
                for call in step.calls:
                    deltas.append(ToolCallDelta(self._n_calls, name=call.name))
                    deltas.append(ToolCallDelta(self._n_calls, arguments=call.arguments))
                    self._n_calls += 1
                    self._block_calls += 1
                self._in_call = not step.done
                continue
            if self._at_start and self.bare_json_start:
                stripped = self._buf.lstrip()
                if not stripped and not final:
                    break  # only whitespace so far: cannot tell yet
                self._at_start = False
                if stripped.startswith("{"):
                    self._buf, self._in_call, self._marker, self._block_calls = stripped, True, "", 0
                    continue
            self._at_start = False
            pos, marker = self._find_marker(self._buf)
            if marker is not None:
                out.append(self._buf[:pos])
                self._buf = self._buf[pos + len(marker):]
                self._in_call, self._marker, self._block_calls = True, marker, 0
                continue
            keep = 0 if final else held_suffix_len(self._buf, self.start_markers)
            out.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(out), deltas

    def _find_marker(self, text: str) -> Tuple[int, Optional[str]]:
        best: Tuple[int, Optional[str]] = (-1, None)
        for m in self.start_markers:
            i = text.find(m)
            if i >= 0 and (best[1] is None or i < best[0]):
                best = (i, m)
        return best

    def _call_step(self, buf: str, final: bool) -> Optional[_Step]:
        raise NotImplementedError


class HermesParser(ToolCallParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, possibly several (Hermes, Qwen2.5)."""

    start_markers = ("<tool_call>",)
    end_marker = "</tool_call>"

    def _call_step(self, buf: str, final: bool) -> Optional[_Step]:
        end = buf.find(self.end_marker)
        if end < 0 and not final:
            return None
        body = buf if end < 0 else buf[:end]
        consumed = len(buf) if end < 0 else end + len(self.end_marker)
        try:
            call = as_tool_call(json.loads(body))
        except ValueError:
            call = None
        if call is None:  # malformed: the whole block stays text
            return _Step(consumed, self._marker + buf[:consumed])
        return _Step(consumed, calls=[call])


class Llama3Parser(ToolCallParser):
    """<|python_tag|>{"name": ..., "parameters": {...}} or a bare JSON object at the start;
    several separated by ";". Text after the last call is normal text."""

    start_markers = ("<|python_tag|>",)
    bare_json_start = True

    def _call_step(self, buf: str, final: bool) -> Optional[_Step]:
        calls: List[ToolCall] = []
        i = 0
        while True:
            j = i
            while j < len(buf) and (buf[j].isspace() or buf[j] == ";"):
                j += 1
            if j == len(buf) and final:
                return _Step(j, text=self._given_back(calls, ""), calls=calls)
            if j == len(buf):  # more calls may follow
                return _Step(i, calls=calls, done=False) if calls else None
            if buf[j] != "{":  # the rest is text, back in text mode
                return _Step(j, text=self._given_back(calls, ""), calls=calls)
            try:
                obj, end = _DECODER.raw_decode(buf, j)
            except ValueError:  # incomplete, or malformed once the output has ended
                if not final:
                    return _Step(i, calls=calls, done=False) if calls else None
                return _Step(len(buf), text=self._given_back(calls, buf[j:]), calls=calls)
            call = as_tool_call(obj, ("parameters", "arguments"))
            if call is None:
                return _Step(end, text=self._given_back(calls, buf[j:end]), calls=calls)
            calls.append(call)
            i = end

    def _given_back(self, calls: List[ToolCall], text: str) -> str:
        """Text that is not a call; the opening marker goes back with it if no call used it."""
        return text if calls or self._block_calls else self._marker + text


class MistralParser(ToolCallParser):
    """[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]"""

    start_markers = ("[TOOL_CALLS]",)

    def _call_step(self, buf: str, final: bool) -> Optional[_Step]:
        j = len(buf) - len(buf.lstrip())
        if j == len(buf):
            return None if not final else _Step(j, text=self._marker + buf)
        try:
            obj, end = _DECODER.raw_decode(buf, j)
        except ValueError:
            if not final:
                return None
            return _Step(len(buf), text=self._marker + buf)
        items = obj if isinstance(obj, list) else [obj]
        calls = [as_tool_call(o) for o in items]
        if not items or any(c is None for c in calls):
            return _Step(end, text=self._marker + buf[:end])
        return _Step(end, calls=calls)  # type: ignore[arg-type]


def calls_of(deltas: List[ToolCallDelta]) -> List[ToolCall]:
    """Assemble streamed deltas into whole calls."""
    calls: Dict[int, ToolCall] = {}
    for d in deltas:
        c = calls.setdefault(d.index, ToolCall("", ""))
        if d.name is not None:
            c.name = d.name
        c.arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


TOOL_CALL_PARSERS: Dict[str, Type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
}
