"""Output parsers of the chat route: tool-call formats and reasoning formats (pure functions of
the model's text; no server state)."""

from radixserve.entrypoints.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from radixserve.entrypoints.parsers.tool_call import (
    TOOL_CALL_PARSERS,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    calls_of,
)

__all__ = [
    "REASONING_PARSERS", "ReasoningParser", "TOOL_CALL_PARSERS", "ToolCall", "ToolCallDelta",
    "ToolCallParser", "calls_of",
]
