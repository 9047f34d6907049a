"""Edge adapters: registered functions that turn an upstream stage's output (or one chunk of it)
into the downstream stage's input. YAML names them by registry key (`adapter: hidden_to_embeds`).

An adapter runs in the downstream stage's worker, once per chunk, with a `state` dict that lives
as long as the request on that edge:

    EdgeData (token ids, text, the Payload of one chunk)  --adapter(data, state)-->  StageFeed

A whole edge calls it once, with everything and `is_last=True`; a chunked edge calls it per
chunk. After the last chunk the worker closes the downstream request's input in any case.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable

from torch import Tensor

from omnistage import registry
from omnistage.payloads import Payload, TokenDelta
from omnistage.stages.speakable import SpeakableText


@dataclass(slots=True)
class EdgeData:
    request_id: str
    source: str
    chunk_idx: int
    is_last: bool
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    payload: Payload = field(default_factory=Payload)


@dataclass(slots=True)
class StageFeed:
    """Input for the downstream stage. AR stages read the prompt/stream fields (see
    `AREngine.extend_request`); generation and diffusion stages, and the Qwen-Omni talkers,
    read `payload`."""

    prompt_token_ids: list[int] | None = None
    prompt_embeds: Tensor | None = None
    close_prompt: bool = False
    stream_embeds: Tensor | None = None
    close_stream: bool = False
    payload: Payload | None = None
    text: str | None = None      # text for a stage that tokenizes its own input (a TTS talker)


Adapter = Callable[[EdgeData, dict], "StageFeed | None"]

# Generic adapters (below) by bare name; a model family's as "<family>.<name>", registered when
# the family's `adapters` module (omnistage.registry) is imported, on first use, so YAML can name
# adapters of model packages not yet imported.
ADAPTERS: dict[str, Adapter] = {}


def register_adapter(name: str) -> Callable[[Adapter], Adapter]:
    def wrap(fn: Adapter) -> Adapter:
        if name in ADAPTERS and ADAPTERS[name] is not fn:
            raise ValueError(f"adapter {name!r} is registered twice")
        ADAPTERS[name] = fn
        return fn
    return wrap


def get_adapter(name: str) -> Adapter:
    if name not in ADAPTERS and (module := registry.adapter_module(name)) is not None:
        importlib.import_module(module)
    try:
        return ADAPTERS[name]
    except KeyError:
        known = ", ".join(sorted(ADAPTERS)) or "none"
        raise ValueError(f"adapter {name!r} is not registered (known: {known})") from None


def registered() -> dict[str, Adapter]:
    """Every adapter, every family's adapter module imported: what `validate_graph(adapters=...)`
    checks."""
    for module in registry.adapter_modules():
        importlib.import_module(module)
    return ADAPTERS


# ---- generic adapters ---------------------------------------------------------------------------
@register_adapter("tokens_to_prompt")
def tokens_to_prompt(data: EdgeData, state: dict) -> StageFeed:
    """Upstream's generated tokens become the downstream prompt, complete when upstream ends."""
    return StageFeed(prompt_token_ids=list(data.token_ids), close_prompt=data.is_last)


@register_adapter("tensors")
def tensors(data: EdgeData, state: dict) -> StageFeed:
    """Upstream's payload as it is (an AR stage's includes its tokens), for stages that
    build their own input from it (the Qwen-Omni talkers, code2wav, a DiT)."""
    return StageFeed(payload=data.payload)


@register_adapter("tokens_to_tensor")
def tokens_to_tensor(data: EdgeData, state: dict) -> StageFeed:
    """Upstream's generated tokens, for a generation stage."""
    return StageFeed(payload=Payload(tokens=TokenDelta(list(data.token_ids))))


@register_adapter("hidden_to_embeds")
def hidden_to_embeds(data: EdgeData, state: dict) -> StageFeed | None:
    """Upstream hidden states (its highest captured layer) drive the downstream AR stage: rows of
    upstream prompt positions become the prompt embeddings; rows of generated positions become
    stream embeddings, added one per downstream decode step. The prompt is complete as soon as
    a generated position arrives."""
    rows = data.payload.hidden
    if rows is None:
        return None
    hidden = rows.last                                            # (n, hidden)
    split = int((rows.positions < rows.num_prompt_tokens).sum())  # positions (n,) ascending
    feed = StageFeed()
    if split > 0:
        feed.prompt_embeds = hidden[:split]
    if split < hidden.shape[0]:
        feed.close_prompt = True
        feed.stream_embeds = hidden[split:]
    return feed


@register_adapter("speakable_text")
def speakable_text(data: EdgeData, state: dict) -> StageFeed | None:
    """Upstream's text, released to a TTS talker piece by piece once safe to speak (whole
    words, markup removed: stages/speakable.py); the rest when upstream ends."""
    buffer = state.setdefault("speakable", SpeakableText())
    piece = buffer.append(data.text)
    if data.is_last:
        piece += buffer.finish()
    return StageFeed(text=piece) if piece else None
