"""BAGEL's text answers through chat completions (OpenAI SDK): `omnistage serve <folder>` on the
golden fixtures' tiny checkpoint (tests/helpers/bagel.py; a byte tokenizer whose ids are the
fixture's: byte b -> b, <|im_start|> 256, <|im_end|> 257) runs the graph's AR stage (the
understanding expert, the upstream prompt layout), and its greedy answer is the upstream
inferencer's text (tests/fixtures/bagel/, text case); text with an image in one answer is the
text part then the image part. Images in a text answer's messages are a 400 naming the
field."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

import openai
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from omnistage.testing.diffusion import png
from tests.helpers.bagel import expected, manifest, write_checkpoint

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "bagel-tiny"
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer writes)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def byte_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """Byte b is id b; the special tokens follow at 256.. (the fixture's ids)."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.save_pretrained(str(folder))
    return fast


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-fixture")
    tok = byte_tokenizer(path)
    s = manifest()["special_tokens"]
    assert tok.convert_tokens_to_ids(SPECIAL) == [s["bos_token_id"], s["eos_token_id"],
                                                  s["start_of_image"], s["end_of_image"]]
    return path


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder: Path) -> Server:
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu"])


def test_text_answer_is_the_upstream_greedy_text(server: Server, folder: Path) -> None:
    case = manifest()["cases"]["text"]
    want_ids = expected()["text.tokens"].tolist()[1:]          # after the fed <|im_start|>
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    assert tok(case["prompt"], add_special_tokens=False)["input_ids"] == list(
        case["prompt"].encode())
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": case["prompt"]}],
        max_tokens=len(want_ids), temperature=0.0, logprobs=True)
    # the answer's last token is a lone UTF-8 continuation byte (149), which the streamed
    # text holds back: the text is the other tokens' exactly, the token count all of them
    text = out.choices[0].message.content
    assert text == tok.decode(want_ids[:-1]) and len(set(want_ids)) > 3, (text, want_ids)
    assert tok.decode(want_ids).startswith(text) and want_ids[-1] == 149
    assert out.usage.completion_tokens == len(want_ids) == len(out.choices[0].logprobs.content)
    assert out.usage.prompt_tokens == len(case["prompt"].encode()) + 3   # bos .. eos bos


def _bad(call: Callable[[], object]) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    return info.value.body


def test_image_in_a_text_answer_is_refused(server: Server) -> None:
    url = "data:image/png;base64," + __import__("base64").b64encode(png(16, 16, seed=0)).decode()
    content = [{"type": "text", "text": "what is it?"},
               {"type": "image_url", "image_url": {"url": url}}]
    body = _bad(lambda: server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=4))
    assert body["param"] == "messages[0].content", body


def test_text_and_image_in_one_answer(server: Server) -> None:
    """Without think mode (bagel.yaml) the two stages answer side by side: the text answer
    (the upstream's greedy text), then an image of the same prompt (think mode, where the image
    follows the text: tests/system/entrypoints/openai/test_bagel_think.py)."""
    case = manifest()["cases"]["text"]
    want_ids = expected()["text.tokens"].tolist()[1:4]          # '"', ')', then a lead byte
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": case["prompt"]}],
        extra_body={"modalities": ["text", "image"], "height": 16, "width": 16,
                    "num_inference_steps": 2,
                    "sampling_params_list": [{"max_tokens": 3, "temperature": 0.0}, None]})
    content = out.choices[0].message.content
    assert [p["type"] for p in content] == ["text", "image_url"], content
    assert content[0]["text"] == bytes(want_ids[:2]).decode() and want_ids[2] >= 0xC0
    with pytest.raises(openai.BadRequestError) as info:     # video with text: still refused
        server.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a cube"}],
            extra_body={"modalities": ["text", "video"]})
    assert info.value.body["param"] == "modalities"


def test_think_text_answer_is_the_upstream_reasoning(server: Server) -> None:
    """`think: true` on a text answer (vLLM-Omni's BAGEL field, extra_body): the upstream's
    VLM_THINK_SYSTEM_PROMPT segment first, then the question (fixture case vlm_think: the
    upstream's interleave_inference(think=True, understanding_output=True)). Its tokens are
    mostly outside the byte tokenizer, so each distinct one is found by stopping at it: the
    answer stops exactly where the upstream's first shows it. Without think the text case's
    tokens come instead (checked by the first stop)."""
    case = manifest()["cases"]["vlm_think"]
    want = expected()["vlm_think.tokens"].tolist()[1:]         # after the fed <|im_start|>
    assert len(set(want)) > 5 and want[:4] != expected()["text.tokens"].tolist()[1:5]
    for tok in dict.fromkeys(want):
        out = server.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": case["prompt"]}],
            max_tokens=len(want), temperature=0.0,
            extra_body={"think": True, "stop_token_ids": [tok]})
        assert out.usage.completion_tokens == want.index(tok) + 1, (tok, want, out.usage)
        assert out.choices[0].finish_reason == "stop"
    # VLM_THINK_SYSTEM_PROMPT and the question, each <|im_start|> .. <|im_end|>, then <|im_start|>
    assert out.usage.prompt_tokens == 227 + len(case["prompt"]) + 5
    body = _bad(lambda: server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a cube"}],
        extra_body={"think": True, "modalities": ["image"]}))
    assert body["param"] == "think", body
