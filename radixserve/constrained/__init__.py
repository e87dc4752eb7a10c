"""Constrained decoding (structured output): grammar backends and helpers.

    base_grammar_backend.py   the grammar queue's backend interface, cache, token bitmask
    xgrammar_backend.py       the xgrammar implementation (JSON schema, regex, EBNF)
    factory.py                create_grammar_backend: the one --grammar-backend names

Nothing here imports xgrammar at import time.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Optional


def response_format_to_constraint(response_format: Any) -> Dict[str, str]:
    """OpenAI `response_format` -> the sampling parameters that enforce it.

        None / {"type": "text"}                          -> {}
        {"type": "json_object"}                          -> {"json_schema": '{"type": "object"}'}
        {"type": "json_schema", "json_schema": {"name": .., "schema": {...}, "strict": ..}}
                                                         -> {"json_schema": json.dumps(schema)}

    Accepts a dict or a pydantic model (anything with model_dump). A json_schema without a
    "schema" means any JSON object. Raises ValueError (-> HTTP 400) on anything else.
    """
    if response_format is None:
        return {}
    if hasattr(response_format, "model_dump"):
        response_format = response_format.model_dump(exclude_none=True)
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}.")
    kind = response_format.get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": json.dumps({"type": "object"})}
    if kind == "json_schema":
        spec: Optional[Any] = response_format.get("json_schema")
        if spec is None:
            raise ValueError("response_format of type json_schema needs a 'json_schema' field.")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object.")
        # OpenAI's field is "schema"; some clients send "schema_" (pydantic alias).
        schema = spec.get("schema", spec.get("schema_", {"type": "object"}))
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"response_format.json_schema.schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON object.")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in response_format.items() if k != "type"})}
    raise ValueError(f"Unsupported response_format type {kind!r}: use text, json_object, json_schema or structural_tag.")
