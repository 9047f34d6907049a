"""Chat messages -> what the engine takes as a prompt.

    a model with an input processor (Qwen3-Omni)   {"messages": [...]} with the media loaded;
                                                   the processor applies its own template
    a text model                                   the tokenizer's chat template, rendered and
                                                   tokenized here: {"prompt_token_ids": [...]}
    an image model                                 the last user message's text, and its image
                                                   (the start of an image-to-image request)

Media parts (`image_url`, `input_audio`, vLLM's `audio_url`, `video_url`) are fetched and
decoded by media.py; a failure names the part (`messages[0].content[1].image_url.url`).
A video is sampled at 2 frames a second, or into `video_url.num_frames` frames spread over it
(vLLM's); with `mm_processor_kwargs.use_audio_in_video` (Qwen-Omni's mode) its audio track
comes with it (`"audio"` in the video part: the input processor interleaves the two).
`check` runs first, on the event loop, before anything is fetched: the parts per message, the
media parts per request, and the kinds of media the model takes (a text model refuses an
image without reading it). The rest is blocking work for the preparation pool.
`reasoning_effort` reaches a chat template that has a switch for it (`reasoning_effort` itself,
or Qwen3's `enable_thinking`, off for "none" and "minimal"); elsewhere it is ignored (logged).
"""

from __future__ import annotations

from typing import Any

from omnistage.entrypoints.openai.client import EngineClient
from omnistage.entrypoints.openai.errors import bad_request
from omnistage.entrypoints.openai.media import MediaBudget, MediaLoader
from omnistage.entrypoints.openai.params import ignore
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage

_RESERVED_KWARGS = ("conversation", "messages", "tokenize", "chat_template", "return_dict")
MEDIA_PARTS = ("image_url", "input_audio", "audio_url", "video_url")


class ChatPrompts:
    def __init__(self, client: EngineClient, media: MediaLoader,
                 chat_template: str | None = None) -> None:
        self.client = client
        self.media = media
        self.chat_template = chat_template

    def check(self, messages: list[ChatMessage], image_model: bool) -> None:
        """Before anything is fetched: at most max_message_parts parts in a message and
        max_media_parts media parts in the request, each of a kind this model takes (an
        input processor takes them all; an image model, images; a text model, none)."""
        policy = self.media.policy
        takes = (MEDIA_PARTS if self.client.processor is not None
                 else ("image_url",) if image_model else ())
        num_media = 0
        for i, msg in enumerate(messages):
            if not isinstance(msg.content, list):
                continue
            param = f"messages[{i}].content"
            if len(msg.content) > policy.max_message_parts:
                raise bad_request(f"{param}: {len(msg.content)} parts, at most "
                                  f"{policy.max_message_parts} (the server's "
                                  "--max-message-parts)", param, "too_many_parts")
            for j, part in enumerate(msg.content):
                if part.type == "text":
                    continue
                if part.type not in takes:
                    what = "text only" if not takes else "text and images only"
                    raise bad_request(f"{param}[{j}]: this model takes {what}, not "
                                      f"{part.type}", f"{param}[{j}]", "unsupported_input")
                if part.type == "video_url" and (part.video_url.num_frames or 0) > \
                        policy.max_video_frames:
                    where = f"{param}[{j}].video_url.num_frames"
                    raise bad_request(f"{where}: {part.video_url.num_frames} frames, at most "
                                      f"{policy.max_video_frames} (the server's "
                                      "--max-input-video-frames)", where, "invalid_video")
                num_media += 1
        if num_media > policy.max_media_parts:
            raise bad_request(f"messages: {num_media} media parts, at most "
                              f"{policy.max_media_parts} (the server's --max-media-parts)",
                              "messages", "too_many_parts")

    def load(self, messages: list[ChatMessage], budget: MediaBudget | None = None,
             audio_in_video: bool = False) -> list[dict[str, Any]]:
        """Messages as chat-template dicts: content a string when it is all text, else parts
        with their media loaded and checked against the request's `budget`:
        {"type": "image", "image": PIL, "data": bytes}, {"type": "audio", "audio":
        (waveform, rate)}, {"type": "video", "video": [PIL], "fps": ..., "audio": (waveform,
        rate), with `audio_in_video` and a track}, {"type": "text", "text": ...}."""
        budget = budget or MediaBudget(self.media.policy)
        return [self._message(i, msg, budget, audio_in_video) for i, msg in enumerate(messages)]

    def _message(self, i: int, msg: ChatMessage, budget: MediaBudget,
                 audio_in_video: bool = False) -> dict[str, Any]:
        role = "system" if msg.role == "developer" else msg.role
        if msg.content is None:
            if msg.role != "assistant":
                raise bad_request(f"messages[{i}].content: required for role {msg.role}",
                                  f"messages[{i}].content")
            return {"role": role, "content": ""}
        if isinstance(msg.content, str):
            return {"role": role, "content": msg.content}
        parts = [self._part(part, f"messages[{i}].content[{j}]", budget, audio_in_video)
                 for j, part in enumerate(msg.content)]
        if all(p["type"] == "text" for p in parts):   # plain templates take a string
            return {"role": role, "content": "\n".join(p["text"] for p in parts)}
        return {"role": role, "content": parts}

    def _part(self, part: Any, param: str, budget: MediaBudget, audio_in_video: bool = False
              ) -> dict[str, Any]:
        if part.type == "text":
            return {"type": "text", "text": part.text}
        if part.type == "image_url":
            image, data = self.media.image(part.image_url.url, f"{param}.image_url.url", budget)
            return {"type": "image", "image": image, "data": data}
        if part.type == "input_audio":
            return {"type": "audio", "audio": self.media.audio(
                part.input_audio.data, part.input_audio.format, f"{param}.input_audio.data",
                budget)}
        if part.type == "audio_url":
            return {"type": "audio", "audio": self.media.audio_url(
                part.audio_url.url, f"{param}.audio_url.url", budget)}
        clip = self.media.video_clip(part.video_url.url, f"{param}.video_url.url", budget,
                                     num_frames=part.video_url.num_frames,
                                     with_audio=audio_in_video)
        video = {"type": "video", "video": clip.frames, "fps": clip.fps}
        return video if clip.audio is None else {**video, "audio": clip.audio}

    def text_prompt(self, req: ChatCompletionRequest) -> dict[str, Any]:
        """A multimodal model's processor takes the messages as they are; a text model's
        prompt is its chat template rendered here and tokenized (blocking)."""
        audio_in_video = (req.mm_processor_kwargs or {}).get("use_audio_in_video") is True
        messages = self.load(req.messages, audio_in_video=audio_in_video)
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
            if req.think:           # checked by check_think
                messages = [*self.client.processor.think_prefix(["text"]), *messages]
            return {"messages": messages}
        return {"prompt_token_ids": self._render(req, messages)}

    def check_think(self, req: ChatCompletionRequest) -> None:
        """`think: true` (vLLM-Omni's BAGEL switch) where the model's input processor has
        messages to put first for the modalities asked (`think_prefix`); else a 400 naming it."""
        prefix = getattr(self.client.processor, "think_prefix", None)
        if req.think and (prefix is None or prefix(req.modalities or ["text"]) is None):
            raise bad_request("think: this model does not reason first per request for "
                              f"modalities {req.modalities or ['text']}", "think")

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
        self.client.counter.check(text, self.client.max_model_len, "messages")
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def image_prompt(self, messages: list[ChatMessage]) -> tuple[str, list[bytes]]:
        """An image model draws what the last user message says, starting from the images in
        it, in order (how many the model takes, its stage says: the engine checks); only that
        message is loaded (blocking)."""
        users = [i for i, m in enumerate(messages) if m.role == "user"]
        if not users:
            raise bad_request("messages: an image model draws what the last user message "
                              "says; there is none", "messages")
        last = users[-1]
        content = self._message(last, messages[last], MediaBudget(self.media.policy))["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        text = "\n".join(p["text"] for p in parts if p["type"] == "text")
        images = [p["data"] for p in parts if p["type"] == "image"]
        other = sorted({p["type"] for p in parts} - {"text", "image"})
        param = f"messages[{users[-1]}].content"
        if other:
            raise bad_request(f"{param}: an image model takes text and images, not "
                              f"{'/'.join(other)}", param, "unsupported_input")
        if not text.strip():
            raise bad_request(f"{param}: an image model needs text saying what to draw", param)
        return text, images


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
