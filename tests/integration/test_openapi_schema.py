"""The OpenAPI schema (/openapi.json, /docs) describes every request body by a named model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def schema(http):
    r = http.get("/openapi.json")
    assert r.status_code == 200, r.text
    return r.json()


def body_schema(schema: dict, path: str) -> dict:
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]


@pytest.mark.parametrize("path, name, fields", [
    ("/generate", "GenerateRequest", {"text", "input_ids", "sampling_params", "rid", "stream", "session_params"}),
    ("/v1/completions", "CompletionRequest", {"model", "prompt", "max_tokens", "stream", "logprobs"}),
    ("/v1/chat/completions", "ChatCompletionRequest", {"model", "messages", "max_tokens", "response_format"}),
    ("/abort_request", "AbortRequest", {"rid", "abort_all"}),
    ("/open_session", "OpenSessionReqInput", {"capacity_of_str_len", "session_id"}),
    ("/close_session", "CloseSessionReqInput", {"session_id"}),
])
def test_request_bodies_are_named_schemas(schema, path, name, fields):
    described = body_schema(schema, path)
    assert described["title"] == name
    assert fields <= set(described["properties"])


def test_schema_lists_the_routes(schema):
    assert {"/generate", "/health", "/get_server_info", "/flush_cache", "/v1/models", "/v1/completions",
            "/v1/chat/completions"} <= set(schema["paths"])
    assert set(schema["paths"]["/flush_cache"]) == {"get", "post"}


def test_docs_page(http):
    r = http.get("/docs")
    assert r.status_code == 200 and "swagger" in r.text.lower()
