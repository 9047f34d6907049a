"""The realtime session's `truncation` against the shared tiny Qwen3-Omni server (a context of
`max_model_len` tokens; a thinker that never stops early, so an answer lasts exactly
max_output_tokens): "auto" keeps answering long past the context, "disabled" refuses the
response that no longer fits, a retention ratio cuts to its share of the budget and then
grows into the room it left (the prefix cache serving each turn between cuts). And the
policy itself (truncation.num_to_drop) on token counts."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import pytest
from websockets.sync.client import ClientConnection, connect

from omnistage.entrypoints.openai.realtime.protocol import RetentionRatio, Session, parse

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "tiny-omni"
WAIT_S = 60
SENTENCE = "The quick brown fox jumps over the lazy dog. "   # 28 tokens of the tiny tokenizer
TEXT_ONLY = {"output_modalities": ["text"], "max_output_tokens": 2}


@contextmanager
def session(server: Server, **update: Any) -> Iterator[tuple[ClientConnection, dict]]:
    """A session configured by `update`; yields it and its session as the server echoed it."""
    with connect(f"ws://127.0.0.1:{server.port}/v1/realtime?model={MODEL}",
                 open_timeout=WAIT_S) as ws:
        created = recv(ws)
        assert created["type"] == "session.created", created
        shown = created["session"]
        if update:
            send(ws, "session.update", session=update)
            ev = recv(ws)
            assert ev["type"] == "session.updated", ev
            shown = ev["session"]
        yield ws, shown


def send(ws: ClientConnection, kind: str, **fields: Any) -> None:
    ws.send(json.dumps({"type": kind, **fields}))


def recv(ws: ClientConnection) -> dict[str, Any]:
    return json.loads(ws.recv(timeout=WAIT_S))


def turn(ws: ClientConnection, num_sentences: int) -> dict[str, Any]:
    """A user text item, then a response: its `response.done`, or the `error` event."""
    item = {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": SENTENCE * num_sentences}]}
    send(ws, "conversation.item.create", item=item)
    send(ws, "response.create")
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        ev = recv(ws)
        if ev["type"] in ("response.done", "error"):
            return ev
    raise TimeoutError(f"no response.done in {WAIT_S} s")


def context_of(server: Server) -> int:
    return server.get("/v1/models").json()["data"][0]["max_model_len"]


def test_auto_keeps_answering_past_the_context(omni_server: Server) -> None:
    """Each turn adds about a sixth of the context: past the sixth turn every prompt is cut
    from its oldest items, and the session answers on and on, never over the input limit."""
    context = context_of(omni_server)
    per_turn = context // 6 // 28
    with session(omni_server, **TEXT_ONLY) as (ws, shown):
        assert shown["truncation"] == "auto"
        inputs, audio = [], False
        for _ in range(14):
            done = turn(ws, per_turn)
            assert done["type"] == "response.done", done
            response = done["response"]
            assert response["status"] == "incomplete", response["status_details"]
            assert response["usage"]["output_token_details"]["text_tokens"] == 2
            inputs.append(response["usage"]["input_tokens"])
        # and spoken: the talker follows the thinker's cut prompt
        send(ws, "response.create", response={"output_modalities": ["audio"]})
        while (ev := recv(ws))["type"] not in ("response.done", "error"):
            audio = audio or ev["type"] == "response.output_audio.delta"
        assert ev["type"] == "response.done" and ev["response"]["status"] == "incomplete", ev
        assert audio and ev["response"]["usage"]["input_tokens"] <= context - 2
    assert max(inputs) <= context - 2                     # room for the 2 output tokens
    cuts = [i for i in range(1, len(inputs)) if inputs[i] < inputs[i - 1] + per_turn * 28]
    assert len(cuts) >= 6, inputs                         # cut on every turn past the context
    assert all(inputs[i] > context - 2 - 2 * per_turn * 28 for i in cuts), inputs  # just fits


def test_disabled_refuses_the_response_that_does_not_fit(omni_server: Server) -> None:
    context = context_of(omni_server)
    per_turn = context // 5 // 28
    with session(omni_server, truncation="disabled", **TEXT_ONLY) as (ws, shown):
        assert shown["truncation"] == "disabled"
        for num_turns in range(1, 10):
            done = turn(ws, per_turn)
            if done["type"] == "error":
                break
            assert done["response"]["usage"]["input_tokens"] <= context - 2
        assert 4 <= num_turns <= 6, num_turns
        err = done["error"]
        assert err["code"] == "context_length_exceeded" and "disabled" in err["message"]
        # the session goes on: with truncation on, the same conversation is answered
        send(ws, "session.update", session={"truncation": "auto"})
        assert recv(ws)["type"] == "session.updated"
        send(ws, "response.create")
        while (ev := recv(ws))["type"] not in ("response.done", "error"):
            pass
        assert ev["type"] == "response.done" and ev["response"]["status"] == "incomplete", ev


def test_retention_ratio_cuts_to_its_share_and_grows_back(omni_server: Server) -> None:
    """post_instructions 900, ratio 0.4: past 900 tokens of items the oldest go until at most
    360 remain; the turns until the next cut keep the prefix (cached tokens)."""
    limit, ratio, per_turn = 900, 0.4, 3          # a turn: 84 tokens of text and the answer
    truncation = {"type": "retention_ratio", "retention_ratio": ratio,
                  "token_limits": {"post_instructions": limit}}
    with session(omni_server, truncation=truncation, instructions="Answer briefly.",
                 **TEXT_ONLY) as (ws, shown):
        assert shown["truncation"] == truncation
        usages = []
        for _ in range(22):
            done = turn(ws, per_turn)
            assert done["type"] == "response.done", done
            usages.append(done["response"]["usage"])
    inputs = [u["input_tokens"] for u in usages]
    growth = inputs[1] - inputs[0]                # one turn: its item and the answer before it
    overhead = inputs[0] - (growth - 2)           # instructions, template, generation prompt
    cuts = [i for i in range(1, len(inputs)) if inputs[i] < inputs[i - 1]]
    assert len(cuts) >= 2, inputs
    for i in cuts:
        kept = inputs[i] - overhead
        assert ratio * limit - 2 * growth < kept <= ratio * limit, (i, inputs)
        assert inputs[i - 1] - overhead <= limit, (i, inputs)
    # between cuts, each turn's prompt extends the last: served from the prefix cache
    between = [i for i in range(cuts[0] + 1, cuts[1])]
    assert len(between) >= 3, inputs
    for i in between:
        assert usages[i]["input_token_details"]["cached_tokens"] >= inputs[i - 1] // 16 * 16 - 16


@pytest.mark.parametrize("truncation, param", [
    ("sometimes", "session.truncation"),
    ({"type": "retention_ratio", "retention_ratio": 1.5}, "session.truncation.retention_ratio"),
    ({"type": "retention_ratio"}, "session.truncation.retention_ratio"),
    ({"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 0}},
     "session.truncation.token_limits.post_instructions"),
    ({"type": "retention_ratio", "retention_ratio": 0.5,
      "token_limits": {"post_instructions": 10**9}},
     "session.truncation.token_limits.post_instructions"),
])
def test_bad_truncation_is_refused(omni_server: Server, truncation: Any, param: str) -> None:
    with session(omni_server) as (ws, _):
        send(ws, "session.update", event_id="evt_t", session={"truncation": truncation})
        ev = recv(ws)
        assert ev["type"] == "error", ev
        assert ev["error"]["param"].startswith(param) and ev["error"]["event_id"] == "evt_t"


# -- the policy on token counts ------------------------------------------------------------------

def ratio(r: float, post_instructions: int | None = None) -> RetentionRatio:
    limits = None if post_instructions is None else {"post_instructions": post_instructions}
    return parse(Session, {"truncation": {"type": "retention_ratio", "retention_ratio": r,
                                          "token_limits": limits}}, "session").truncation


class WordProcessor:
    """A stand-in input processor: a message is [open, role, *words, close], the generation
    prompt [open, "assistant"]; `open` is <|im_start|> (ChatML) or another token."""

    def __init__(self, chatml: bool) -> None:
        self.open = "<|im_start|>" if chatml else "<turn>"
        self.vocab: dict[str, int] = {}
        self.tokenizer = self

    def convert_tokens_to_ids(self, token: str) -> int:
        return self.vocab.setdefault(token, len(self.vocab))

    def parse_request(self, prompt: dict[str, Any]) -> Any:
        import torch
        from types import SimpleNamespace

        words = [w for m in prompt["messages"]
                 for w in [self.open, m["role"], *m["content"].split(), "<end>"]]
        ids = [self.convert_tokens_to_ids(w) for w in words + [self.open, "assistant"]]
        return SimpleNamespace(input_ids=torch.tensor(ids), prompt=" ".join(words),
                               input_features=None, audio_feature_lens=None, pixel_values=None,
                               image_grid_thw=None, pixel_values_videos=None,
                               video_grid_thw=None, video_second_per_grid=None)

