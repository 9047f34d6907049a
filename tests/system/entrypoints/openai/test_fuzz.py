"""A bounded fuzzing run (schemathesis, offline) over the OpenAPI schema each server serves:
valid and invalid requests for every operation; none may get a 5xx.

Valid requests get the served model's name (else nearly all would stop at the 404 for an
unknown model) and small generation sizes (so that the run stays short on a CPU)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from omnistage.diffusion.params import DiffusionParams
from omnistage.ranges import numeric_fields
from omnistage.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")

EXAMPLES = {"positive": 30, "negative": 30}
JSON = {"content-type": "application/json"}
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

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json",
                                          headers=server.headers)
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


# ---- hostile values in every field -----------------------------------------------------------

# raw JSON literals no field may take: past 64 bits, non-standard numbers, an overflowing
# float, a lone surrogate; and a number as a string, where the field takes no string
HOSTILE = (b"18446744073709551616", b"-18446744073709551617", b"NaN", b"-Infinity", b"1e39",
           b'"\\ud800"')
NUMERIC_STRING = b'"1"'
# a small valid body per JSON route (the hostile value replaces one field at a time)
BASES = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "a 7"}],
                                  "max_tokens": 2},
         "/v1/completions": {"prompt": "a 7", "max_tokens": 2},
         "/v1/images/generations": {"prompt": "a 7", "num_inference_steps": 2},
         "/v1/audio/speech": {"input": "hi"},
         "/v1/audio/speech/batch": {"items": [{"input": "hi"}]},
         "/v1/videos": {"prompt": "a 7"}, "/v1/videos/sync": {"prompt": "a 7"},
         "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/no/such/lora"},
         "/v1/unload_lora_adapter": {"lora_name": "a"}}
SAMPLING_FIELDS = {"text": SamplingParams, "image": DiffusionParams}


def _json_routes(server: Server) -> dict[str, dict[str, bool]]:
    """POST route -> the top-level fields of its JSON body, each with whether it takes a
    string, from the served OpenAPI schema."""
    spec = server.get("/openapi.json").json()
    routes = {}
    for path, ops in spec["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {})
        schema = body.get("application/json", {}).get("schema")
        if schema is None:
            continue
        if "$ref" in schema:
            schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        routes[path] = {name: '"string"' in json.dumps(prop)
                        for name, prop in schema.get("properties", {}).items()}
    return routes


def _bodies(route: str, fields: dict[str, bool], model: str, stages: type) -> list[bytes]:
    """The route's base body with each field, then each numeric per-stage params field
    (chat), set to each hostile literal."""
    base = {**BASES[route], "model": model}
    targets = [({**base, name: "@@"}, takes_string) for name, takes_string in fields.items()]
    if route == "/v1/chat/completions":
        targets += [({**base, "sampling_params_list": [{name: "@@"}]}, False)
                    for name in sorted(numeric_fields(stages))]
    return [json.dumps(body).replace('"@@"', raw.decode()).encode()
            for body, takes_string in targets
            for raw in HOSTILE + (() if takes_string else (NUMERIC_STRING,))]


@pytest.mark.parametrize("which, model", [("text", "tiny-chat"), ("image", "omnistage-demo")])
def test_hostile_values_in_every_field_of_every_route_are_4xx(servers: dict[str, Server],
                                                              which: str, model: str) -> None:
    """Every field of every JSON route, and every numeric field of the per-stage params,
    given each hostile literal: a 4xx every time, never a 5xx, and the server still serves."""
    server = servers[which]
    routes = _json_routes(server)
    assert set(routes) == set(BASES), "a new JSON route: give it a base body here"
    failures, calls = [], 0
    with httpx.Client(base_url=server.url, headers={**server.headers, **JSON},
                      timeout=60) as client:
        for route, fields in routes.items():
            for body in _bodies(route, fields, model, SAMPLING_FIELDS[which]):
                r = client.post(route, content=body)
                calls += 1
                if not 400 <= r.status_code < 500:
                    failures.append(f"{route} {body[:200]!r} -> {r.status_code}: {r.text[:200]}")
    assert calls > 300, calls
    assert not failures, "\n".join(failures[:10])
    assert server.get("/health").status_code == 200
