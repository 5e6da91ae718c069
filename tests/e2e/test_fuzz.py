"""Schema-driven fuzzing of the HTTP API (schemathesis over /openapi.json) on the session
server: no input may cause a 5xx or take the server down."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

pytestmark = pytest.mark.e2e

# Generated token counts are capped so the run stays short on a CPU.
TOKEN_FIELDS = ("max_new_tokens", "max_tokens", "max_completion_tokens")
EXAMPLES_PER_OPERATION = 12
TIME_BUDGET_S = 90.0


def _cap_tokens(body: Any) -> None:
    if not isinstance(body, dict):
        return
    for name in TOKEN_FIELDS:
        if isinstance(body.get(name), int) and body[name] > 4:
            body[name] = 4
    if "messages" in body or "prompt" in body:
        body.setdefault("max_tokens", 4)
    if "inputs" in body:
        params = body.get("parameters")
        if params is None:
            body["parameters"] = params = {}
        if isinstance(params, dict):
            _cap_tokens(params)
            params.setdefault("max_new_tokens", 4)


def test_no_input_causes_a_server_error(ray_server: str) -> None:
    # NOTE: schemathesis' pytest plugin does not run under pytest 9, so each operation's
    # case strategy is driven by hypothesis directly: 12 examples per operation (about
    # 150 in all), and no new operation starts after TIME_BUDGET_S.
    schema = schemathesis.openapi.from_url(f"{ray_server}/openapi.json")
    started = time.monotonic()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    for operation in operations:
        if time.monotonic() - started > TIME_BUDGET_S:
            break

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            _cap_tokens(case.body)
            response = case.call(base_url=ray_server, timeout=60)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r}: {response.text}")

        check()
    assert not failures, failures[:5]


def test_server_answers_after_fuzzing(ray_server: str) -> None:
    body = {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{ray_server}/generate", json=body, timeout=60).status_code == 200
    assert httpx.get(f"{ray_server}/health", timeout=30).status_code == 200
