"""Which form a spoken chat answer takes: OpenAI's (one choice per completion, the text as the
audio's transcript, content null) or vLLM-Omni's (the text and the audio as two choices).

A request that tells decides: vLLM-Omni's own fields (a body-level `extra_body` object, its
`speaker`) ask for vLLM-Omni's form; OpenAI's `audio` object (which OpenAI requires for a
spoken answer, and vLLM-Omni's clients do not send) for OpenAI's. Any other request gets the
server's dialect (`ServerSettings.vllm_omni_answers`: `--api-dialect`, or started with
`--omni`). In vLLM-Omni's form an omni model speaks by default (no `modalities`: text and
audio), and a spoken answer with text is split:

    choices[i]       message.content = the text, finish_reason as the text ended
    choices[n + i]   message.audio = {id, data, expires_at, transcript}, content null, "stop"

(vLLM-Omni numbers both choices 0; its clients read them by position, so here they are
numbered as listed.) `modalities: ["audio"]` is one audio choice in both forms.
"""

from __future__ import annotations

from omnistage.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ResponseMessage,
)


def vllm_form(req: ChatCompletionRequest, vllm_omni_answers: bool) -> bool:
    """Whether this request gets vLLM-Omni's answer (see the module docstring)."""
    if req.extra_body is not None or req.speaker is not None:
        return True
    if req.audio is not None:
        return False
    return vllm_omni_answers


def split_spoken(choices: list[ChatChoice], num_completions: int) -> list[ChatChoice]:
    """OpenAI's spoken choices (content null, the text as the transcript) as vLLM-Omni's two
    choices per completion: the texts first, then the audios."""
    texts = [ChatChoice(index=c.index, message=ResponseMessage(
        content=c.message.audio.transcript if c.message.audio else c.message.content),
        finish_reason=c.finish_reason, logprobs=c.logprobs) for c in choices]
    audios = [ChatChoice(index=num_completions + c.index,
                         message=ResponseMessage(audio=c.message.audio), finish_reason="stop")
              for c in choices]
    return texts + audios
