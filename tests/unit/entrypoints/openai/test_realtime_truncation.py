"""The realtime session's `truncation` against the shared tiny Qwen3-Omni server (a context of
`max_model_len` tokens; a thinker that never stops early, so an answer lasts exactly
max_output_tokens): "auto" keeps answering long past the context, "disabled" refuses the
response that no longer fits, a retention ratio cuts to its share of the budget and then
grows into the room it left (the prefix cache serving each turn between cuts). And the
policy itself (truncation.num_to_drop) on token counts."""

from __future__ import annotations

import json
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator

import pytest
from websockets.sync.client import ClientConnection, connect

from omnistage.entrypoints.openai.errors import APIError
from omnistage.entrypoints.openai.realtime.protocol import RetentionRatio, Session, parse
from omnistage.entrypoints.openai.realtime.truncation import (PromptSize, measure, num_to_drop,
                                                              output_room)

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


# -- the policy on token counts ------------------------------------------------------------------

def ratio(r: float, post_instructions: int | None = None) -> RetentionRatio:
    limits = None if post_instructions is None else {"post_instructions": post_instructions}
    return parse(Session, {"truncation": {"type": "retention_ratio", "retention_ratio": r,
                                          "token_limits": limits}}, "session").truncation


def test_policy_within_the_budget_drops_nothing() -> None:
    size = PromptSize(instructions=20, items=[30, 30, 30])
    for truncation in ("auto", "disabled", ratio(0.1)):
        assert num_to_drop(size, max_input=110, truncation=truncation) == 0


def test_policy_auto_drops_just_enough() -> None:
    size = PromptSize(instructions=20, items=[40, 10, 25, 30])      # 105 after instructions
    assert num_to_drop(size, 20 + 95, "auto") == 1
    assert num_to_drop(size, 20 + 64, "auto") == 2
    assert num_to_drop(size, 20 + 30, "auto") == 3                  # the newest alone
    with pytest.raises(APIError) as refused:
        num_to_drop(size, 20 + 29, "auto")
    assert refused.value.code == "context_length_exceeded"


def test_policy_disabled_refuses() -> None:
    with pytest.raises(APIError) as refused:
        num_to_drop(PromptSize(20, [40, 10, 25, 30]), 20 + 104, "disabled")
    assert refused.value.code == "context_length_exceeded"


def test_policy_retention_ratio() -> None:
    size = PromptSize(instructions=20, items=[40, 10, 25, 30])      # 105 after instructions
    assert num_to_drop(size, 20 + 100, ratio(0.6)) == 2             # to <= 60: 55 kept
    assert num_to_drop(size, 20 + 100, ratio(0.0)) == 3             # the newest always stays
    assert num_to_drop(size, 20 + 100, ratio(1.0)) == 1             # as auto
    # token_limits lower the budget; the model's input still caps it
    assert num_to_drop(size, 20 + 1000, ratio(0.5, post_instructions=100)) == 3
    assert num_to_drop(size, 20 + 1000, ratio(0.5, post_instructions=200)) == 0
    assert num_to_drop(size, 20 + 100, ratio(1.0, post_instructions=5000)) == 1


def test_output_room() -> None:
    assert output_room(7, 4096) == 7
    assert output_room(None, 128_000) == 4096                      # "inf": OpenAI's cap ...
    assert output_room(None, 4096) == 1024                         # ... a quarter at most
    assert output_room(4000, 4096) == 1024


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


@pytest.mark.parametrize("chatml", [True, False])
def test_measure_prices_each_item(chatml: bool) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "one two three"},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "five <|im_start|> six"}]   # the marker, as text
    # split at the markers (ChatML), or each item priced by itself (any other template, or
    # a text holding the marker): the same counts
    assert measure(WordProcessor(chatml), messages[:3], has_system=True) == PromptSize(
        5 + 2, [6, 4])                                              # system message, gen. prompt
    assert measure(WordProcessor(chatml), messages, has_system=True) == PromptSize(
        5 + 2, [6, 4, 6])
    assert measure(WordProcessor(chatml), messages[1:2], has_system=False) == PromptSize(2, [6])
