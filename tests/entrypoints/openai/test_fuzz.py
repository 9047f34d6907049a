"""A bounded fuzzing run (schemathesis, offline) over the OpenAPI schema each server serves:
valid and invalid requests for every operation; none may get a 5xx.

Valid requests get the served model's name (else nearly all would stop at the 404 for an
unknown model) and small generation sizes (so that the run stays short on a CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.entrypoints.openai.conftest import Server

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = {"positive": 30, "negative": 30}
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "n": 2, "num_inference_steps": 3}


def _bounded(body: Any, model: str) -> None:
    if not isinstance(body, dict):
        return
    if "model" in body:
        body["model"] = model
    for key, cap in CAPS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap


def fuzz(server: Server, model: str) -> tuple[int, list[str]]:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    calls, failures = 0, []
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=EXAMPLES[mode.value], deadline=None, database=None,
                      derandomize=True, phases=[Phase.explicit, Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                nonlocal calls
                if mode is GenerationMode.POSITIVE:
                    _bounded(case.body, model)
                response = case.call(base_url=server.url, headers=server.headers, timeout=60)
                calls += 1
                if response.status_code >= 500:
                    failures.append(f"{op.label} [{mode.value}] -> {response.status_code}: "
                                    f"{response.content[:300]!r}\n  body: {case.body!r}"[:800])

            try:
                run()
            except Unsatisfiable:  # nothing invalid to send (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE, op.label
    return calls, failures


@pytest.mark.parametrize("which, model", [("text", "tiny-chat"), ("image", "omnistage-demo")])
def test_fuzzing_the_openapi_schema_finds_no_5xx(servers: dict[str, Server], which: str,
                                                 model: str) -> None:
    server = servers[which]
    calls, failures = fuzz(server, model)
    assert calls >= 8 * 2 * 5, calls      # every operation, both modes, a fair number each
    assert not failures, "\n".join(failures[:10])
    assert server.get("/health").status_code == 200
