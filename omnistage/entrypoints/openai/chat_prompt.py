"""Chat messages -> what the engine takes as a prompt.

    a model with an input processor (Qwen3-Omni)   {"messages": [...]} with the media loaded;
                                                   the processor applies its own template
    a text model                                   the tokenizer's chat template, rendered and
                                                   tokenized here: {"prompt_token_ids": [...]}
    an image model                                 the last user message's text, and its image
                                                   (the start of an image-to-image request)

Media parts (`image_url`, `input_audio`, vLLM's `audio_url`, `video_url`) are fetched and
decoded by media.py; a failure names the part (`messages[0].content[1].image_url.url`).
`reasoning_effort` reaches a chat template that has a switch for it (`reasoning_effort` itself,
or Qwen3's `enable_thinking`, off for "none" and "minimal"); elsewhere it is ignored (logged).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from omnistage.entrypoints.openai.client import EngineClient
from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.media import MediaLoader
from omnistage.entrypoints.openai.params import ignore
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage

_RESERVED_KWARGS = ("conversation", "messages", "tokenize", "chat_template", "return_dict")


class ChatPrompts:
    def __init__(self, client: EngineClient, media: MediaLoader,
                 chat_template: str | None = None) -> None:
        self.client = client
        self.media = media
        self.chat_template = chat_template

    async def load(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        return await run_in_threadpool(self._load_messages, messages)

    def _load_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """Messages as chat-template dicts: content a string when it is all text, else parts
        with their media loaded and checked: {"type": "image", "image": PIL, "data": bytes},
        {"type": "audio", "audio": (waveform, rate)}, {"type": "video", "video": [PIL],
        "fps": ...}, {"type": "text", "text": ...}."""
        out: list[dict[str, Any]] = []
        for i, msg in enumerate(messages):
            role = "system" if msg.role == "developer" else msg.role
            if msg.content is None:
                if msg.role != "assistant":
                    raise bad_request(f"messages[{i}].content: required for role {msg.role}",
                                      f"messages[{i}].content")
                out.append({"role": role, "content": ""})
            elif isinstance(msg.content, str):
                out.append({"role": role, "content": msg.content})
            else:
                parts = [self._part(part, f"messages[{i}].content[{j}]")
                         for j, part in enumerate(msg.content)]
                if all(p["type"] == "text" for p in parts):   # plain templates take a string
                    out.append({"role": role, "content": "\n".join(p["text"] for p in parts)})
                else:
                    out.append({"role": role, "content": parts})
        return out

    def _part(self, part: Any, param: str) -> dict[str, Any]:
        if part.type == "text":
            return {"type": "text", "text": part.text}
        if part.type == "image_url":
            image, data = self.media.image(part.image_url.url, f"{param}.image_url.url")
            return {"type": "image", "image": image, "data": data}
        if part.type == "input_audio":
            return {"type": "audio", "audio": self.media.audio(
                part.input_audio.data, part.input_audio.format, f"{param}.input_audio.data")}
        if part.type == "audio_url":
            return {"type": "audio",
                    "audio": self.media.audio_url(part.audio_url.url, f"{param}.audio_url.url")}
        frames, fps = self.media.video(part.video_url.url, f"{param}.video_url.url")
        return {"type": "video", "video": frames, "fps": fps}

    async def text_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """A multimodal model's processor takes the messages as they are; a text model's
        prompt is its chat template rendered here and tokenized."""
        messages = await self.load(req.messages)
        if self.client.processor is not None:
            if req.chat_template_kwargs:
                raise bad_request("chat_template_kwargs: not supported for this model",
                                  "chat_template_kwargs")
            if req.reasoning_effort is not None:
                ignore("reasoning_effort", "this model's input processor has no reasoning "
                       "switch")
            for m in messages:
                if isinstance(m["content"], list):
                    for part in m["content"]:
                        part.pop("data", None)
            return {"messages": messages}
        media = sorted({p["type"] for m in messages if isinstance(m["content"], list)
                        for p in m["content"]} - {"text"})
        if media:
            raise bad_request(f"messages: this model takes text only, not {'/'.join(media)}",
                              "messages", "unsupported_input")
        return {"prompt_token_ids": self._render(req, messages)}

    def _render(self, req: ChatCompletionRequest, messages: list[dict[str, Any]]) -> list[int]:
        tokenizer = self.client.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer, so it cannot chat; use "
                              "/v1/completions with token ids", "messages", "no_tokenizer")
        template = self.chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise bad_request("this model has no chat template (start the server with "
                              "--chat-template FILE); /v1/completions takes raw prompts",
                              "messages", "no_chat_template")
        kwargs = dict(req.chat_template_kwargs or {})
        for reserved in _RESERVED_KWARGS:
            if reserved in kwargs:
                raise bad_request(f"chat_template_kwargs.{reserved}: set by the server",
                                  f"chat_template_kwargs.{reserved}")
        kwargs.setdefault("add_generation_prompt", messages[-1]["role"] != "assistant")
        for key, value in reasoning_kwargs(req.reasoning_effort, str(template)).items():
            kwargs.setdefault(key, value)             # chat_template_kwargs win
        try:
            text = tokenizer.apply_chat_template(messages, chat_template=template,
                                                 tokenize=False, **kwargs)
        except Exception as exc:  # jinja errors, raise_exception() in the template, ...
            raise bad_request(f"messages: the chat template failed: {type(exc).__name__}: "
                              f"{exc}", "messages", "chat_template_error") from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    async def image_prompt(self, messages: list[ChatMessage]) -> tuple[str, bytes | None]:
        """An image model draws what the last user message says, starting from the image in
        it if there is one."""
        loaded = await self.load(messages)
        users = [i for i, m in enumerate(loaded) if m["role"] == "user"]
        if not users:
            raise bad_request("messages: an image model draws what the last user message "
                              "says; there is none", "messages")
        content = loaded[users[-1]]["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")
        images = [p["data"] for p in parts if p["type"] == "image"]
        other = sorted({p["type"] for p in parts} - {"text", "image"})
        param = f"messages[{users[-1]}].content"
        if other:
            raise bad_request(f"{param}: an image model takes text and one image, not "
                              f"{'/'.join(other)}", param, "unsupported_input")
        if len(images) > 1:
            raise bad_request(f"{param}: one input image at most, got {len(images)}", param)
        if not text.strip():
            raise bad_request(f"{param}: an image model needs text saying what to draw", param)
        return text, (images[0] if images else None)


def reasoning_kwargs(effort: str | None, template: str) -> dict[str, Any]:
    """The chat-template switch for OpenAI's `reasoning_effort`, if the template has one."""
    if effort is None:
        return {}
    if "reasoning_effort" in template:          # gpt-oss style templates take it as is
        return {"reasoning_effort": effort}
    if "enable_thinking" in template:           # Qwen3: thinking on or off
        return {"enable_thinking": effort not in ("none", "minimal")}
    ignore("reasoning_effort", "this model's chat template has no reasoning switch")
    return {}
