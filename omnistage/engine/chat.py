"""Chat messages as a prompt for text models: `{"messages": [...]}` rendered with the
tokenizer's chat template, as vLLM's `LLM.chat` does. (A multimodal model's input processor
renders its own, with the media in the messages.)

    {"messages": [{"role": "user", "content": "Hi"}],     # content: a string or text parts
     "chat_template": None,                               # a Jinja template; None: the model's
     "chat_template_kwargs": {},                          # extra template variables
     "add_generation_prompt": True,                       # open the assistant's turn
     "continue_final_message": False}                     # or continue the last message
"""

from __future__ import annotations

from typing import Any

from omnistage.engine.inputs import ParsedPrompt

CHAT_KEYS = ("messages", "chat_template", "chat_template_kwargs", "add_generation_prompt",
             "continue_final_message")
# set by the renderer, not by the caller's template variables
_RESERVED = ("conversation", "messages", "tokenize", "chat_template", "return_dict",
             "add_generation_prompt", "continue_final_message")


def is_chat(prompt: object) -> bool:
    return isinstance(prompt, dict) and "messages" in prompt


def render_chat(prompt: dict[str, Any], tokenizer: Any) -> ParsedPrompt:
    """The templated text and its token ids (no special tokens added: the template has
    them); ValueError naming the problem."""
    unknown = sorted(set(prompt) - set(CHAT_KEYS))
    if unknown:
        raise ValueError(f"a chat prompt has unknown keys {unknown}; known: {', '.join(CHAT_KEYS)}")
    messages = text_messages(prompt["messages"])
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so it cannot chat: pass "
                         "prompt_token_ids to generate()")
    template = prompt.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template: pass chat_template= (a Jinja "
                         "template), or a plain prompt to generate()")
    add = bool(prompt.get("add_generation_prompt", True))
    cont = bool(prompt.get("continue_final_message", False))
    if add and cont:
        raise ValueError("continue_final_message continues the last message, "
                         "add_generation_prompt opens a new one: set one of them")
    if cont and messages[-1]["role"] != "assistant":
        raise ValueError("continue_final_message: the last message must be the assistant's")
    extra = dict(prompt.get("chat_template_kwargs") or {})
    for key in _RESERVED:
        if key in extra:
            raise ValueError(f"chat_template_kwargs.{key}: set by the chat call itself")
    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add,
            continue_final_message=cont, **extra)
    except Exception as exc:  # jinja errors, raise_exception() in the template, ...
        raise ValueError(f"messages: the chat template failed: {type(exc).__name__}: "
                         f"{exc}") from None
    return ParsedPrompt(text, tokenizer(text, add_special_tokens=False)["input_ids"], None)


def text_messages(messages: object) -> list[dict[str, Any]]:
    """Messages with text content only, each content a string (text parts joined by
    newlines, as vLLM's "string" content format does)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content} dicts")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ValueError(f"{where}: expected a dict with a string 'role'")
        content = msg.get("content")
        if content is None or isinstance(content, str):
            out.append({**msg, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise ValueError(f"{where}.content: expected a string or a list of text parts")
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}]: this model takes text only, got "
                                 f"{kind!r}")
            texts.append(part["text"])
        out.append({**msg, "content": "\n".join(texts)})
    return out
