"""CosyVoice3's LM -> flow edge, chunked (configs/cosyvoice3.yaml), so that the flow stage can
speak while the LM still writes (generation/cosyvoice3.py streams in token hops).

The LM's first chunk carries the clone's voice (VoicePrompt) with its tokens, later ones
tokens only. The generation engine concatenates a request's pending chunks key by key and
wants every chunk to hold the same keys, so each later chunk carries an empty voice (no rows,
the first one's dtypes): concatenated after the first, the voice is the first's; alone, the
flow stage reads it as no voice (no x-vector values).
"""

from __future__ import annotations

from omnistage.payloads import Payload, TokenDelta, VoicePrompt
from omnistage.stages.adapters import EdgeData, StageFeed, register_adapter

_EMPTY = "cosyvoice3.empty_voice"


@register_adapter("cosyvoice3.tokens")
def tokens(data: EdgeData, state: dict) -> StageFeed:
    p = data.payload
    voice = p.voice_prompt
    if voice is not None:
        state[_EMPTY] = VoicePrompt(voice.tokens[:0], voice.mel[:0], voice.xvector[:0])
    else:
        voice = state.get(_EMPTY)
    delta = p.tokens if p.tokens is not None else TokenDelta(list(data.token_ids))
    return StageFeed(payload=Payload(tokens=delta, voice_prompt=voice))
