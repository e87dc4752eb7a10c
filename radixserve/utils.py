"""Small helpers shared across processes."""

from __future__ import annotations

from typing import Any, Callable, List, Tuple, Type


class TypeBasedDispatcher:
    """Route a message to the handler registered for its type (seed 000)."""

    def __init__(self, mapping: List[Tuple[Type, Callable[[Any], Any]]]):
        self._mapping = mapping

    def __call__(self, obj: Any) -> Any:
        for ty, fn in self._mapping:
            if isinstance(obj, ty):
                return fn(obj)
        raise ValueError(f"invalid object: {type(obj).__name__}")
