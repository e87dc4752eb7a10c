"""The operations routes answer to an admin key (issue 45): with --api-key A --admin-api-key B,
generation takes A only and the operations routes take B only; without an admin key a server on
a non-loopback address refuses them with a 403 that says how to enable them, while generation
and the read-only routes keep working (on loopback they answer as before: every other test)."""

from __future__ import annotations

import signal

import httpx
import pytest

from conftest import ServerProcess

ADMIN_ROUTES = [("POST", "/flush_cache", None), ("POST", "/pause_generation", {"mode": "abort"}),
                ("POST", "/continue_generation", {}), ("POST", "/get_weights_by_name", {"name": "model.norm.weight", "truncate_size": 2}),
                ("POST", "/set_internal_state", {"server_args": {"max_running_requests": 8}}),
                ("GET", "/dashboard/state", None)]
GENERATE = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def two_keys():
    srv = ServerProcess("--max-total-tokens", "2048", "--admin-api-key", "admin-B", api_key="gen-A")
    yield srv
    assert srv.stop(signal.SIGTERM) == 0


@pytest.mark.parametrize("method, path, body", ADMIN_ROUTES)
def test_operations_routes_take_the_admin_key_only(two_keys, method, path, body):
    with httpx.Client(base_url=two_keys.url, timeout=60) as c:
        for headers in ({}, _bearer("gen-A"), _bearer("wrong")):
            r = c.request(method, path, json=body, headers=headers)
            assert r.status_code == 401 and "admin key" in r.json()["error"]["message"], (headers, r.text)
        r = c.request(method, path, json=body, headers=_bearer("admin-B"))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, field", [
    ({"server_args": {"max_running_requests": 0}}, "server_args.max_running_requests"),
    ({"server_args": {"chunked_prefill_size": "big"}}, "server_args.chunked_prefill_size"),
    ({"server_args": {"context_length": 10}}, "server_args.context_length"),
    ({}, "server_args"),
])
def test_set_internal_state_bad_value_is_400_naming_the_field(two_keys, body, field):
    with httpx.Client(base_url=two_keys.url, timeout=60, headers=_bearer("admin-B")) as c:
        r = c.post("/set_internal_state", json=body)
        assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_set_internal_state_applies_and_reports(two_keys):
    with httpx.Client(base_url=two_keys.url, timeout=60) as c:
        r = c.put("/set_internal_state", json={"server_args": {"max_running_requests": 5, "chunked_prefill_size": 1024}},
                  headers=_bearer("admin-B"))
        assert r.status_code == 200, r.text
        assert r.json() == {"updated": True, "server_args": {"max_running_requests": 5, "chunked_prefill_size": 1024}}
        state = c.get("/get_server_info", headers=_bearer("gen-A")).json()["internal_states"][0]
        assert state["max_running_requests"] == 5 and state["chunked_prefill_size"] == 1024
        assert c.post("/generate", json=GENERATE, headers=_bearer("gen-A")).status_code == 200


def test_generation_takes_the_generation_key_only(two_keys):
    with httpx.Client(base_url=two_keys.url, timeout=60) as c:
        assert c.post("/generate", json=GENERATE, headers=_bearer("gen-A")).status_code == 200
        assert c.post("/generate", json=GENERATE, headers=_bearer("admin-B")).status_code == 401
        assert c.get("/health").status_code == 200  # no key, as before
        # the live view's page and files hold no data: no key (its data, /dashboard/state, takes the admin key)
        assert c.get("/dashboard").status_code == 200 and c.get("/dashboard/assets/dashboard.css").status_code == 200
        info = c.get("/get_server_info", headers=_bearer("gen-A")).json()
        assert "admin_api_key" not in info and "api_key" not in info


def test_without_an_admin_key_a_public_bind_refuses_the_operations_routes():
    srv = ServerProcess("--max-total-tokens", "2048", "--host", "0.0.0.0")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for method, path, body in ADMIN_ROUTES:
                r = c.request(method, path, json=body)
                assert r.status_code == 403, r.text
                assert "--admin-api-key" in r.json()["error"]["message"]
            assert c.post("/generate", json=GENERATE).status_code == 200
            assert c.get("/get_model_info").status_code == 200
    finally:
        assert srv.stop(signal.SIGTERM) == 0
