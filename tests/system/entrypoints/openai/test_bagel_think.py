"""BAGEL's think mode through chat completions (OpenAI SDK): `omnistage serve <folder>
--stage-config bagel_think` on the golden fixtures' tiny checkpoint answers a chat with
modalities ["text", "image"] in one message, the plan's text part then the image part; streamed,
text deltas then the image. The plan and the image equal our think mode run in-process (the
model's greedy plan after the upstream system prompt, BagelThinkPipeline given its ids), which
tests/golden/models/test_bagel_think.py and tests/golden/diffusion/test_bagel_pipeline.py
hold golden against the upstream's think mode. The prompt is not the fixture's: that plan's
bytes are lone UTF-8 continuation bytes, which a text answer holds back; this one's first two
tokens are ASCII ("eL")."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

import omnistage.configs
from omnistage.diffusion.engine import DiffusionEngine
from omnistage.diffusion.params import DiffusionParams
from omnistage.diffusion.pipelines.bagel import BagelThinkPipeline
from omnistage.models.bagel.generate import (GEN_THINK_SYSTEM_PROMPT, SpecialTokens,
                                             build_contexts, greedy_text)
from omnistage.models.bagel.model import Bagel
from omnistage.payloads import TOKEN_IDS
from omnistage.testing.diffusion import run_to_end
from tests.helpers.bagel import write_checkpoint
from tests.system.entrypoints.openai.test_bagel_chat import byte_tokenizer

if TYPE_CHECKING:
    from tests.system.entrypoints.openai.conftest import Server

MODEL = "bagel-think-tiny"
GRAPH = Path(omnistage.configs.__file__).parent / "bagel_think.yaml"
H, W, STEPS, GUIDANCE, SEED = 16, 24, 3, 3.5, 5
PROMPT, PLAN_TOKENS = "a red cube", 2


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = write_checkpoint(tmp_path_factory.mktemp("bagel") / "BAGEL-think")
    byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def server(start_server: Callable[..., Server], folder: Path) -> Server:
    return start_server([str(folder), "--served-model-name", MODEL, "--device", "cpu",
                         "--stage-config", str(GRAPH)])


@pytest.fixture(scope="module")
def loaded(folder: Path) -> tuple:
    return Bagel.from_pretrained(folder)


@pytest.fixture(scope="module")
def plan(loaded: tuple) -> list[int]:
    """Our think mode's greedy plan (byte ids: the fixture tokenizer's encode)."""
    model, vae = loaded
    tok = SpecialTokens(256, 257, 258, 259)
    ctxs = build_contexts(model, vae, [list(GEN_THINK_SYSTEM_PROMPT.encode()),
                                       list(PROMPT.encode())], tok, with_vae=False)
    return greedy_text(model, ctxs.main, tok, PLAN_TOKENS)


def _body() -> dict:
    return {"modalities": ["text", "image"], "height": H, "width": W,
            "num_inference_steps": STEPS, "guidance_scale": GUIDANCE,
            "sampling_params_list": [{"max_tokens": PLAN_TOKENS, "temperature": 0.0}, None]}


def _decode(url: str) -> np.ndarray:
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))


def _in_process(folder: Path, loaded: tuple, plan: list[int]) -> np.ndarray:
    model, vae = loaded
    pipe = BagelThinkPipeline(model, vae, PreTrainedTokenizerFast.from_pretrained(str(folder)),
                              torch.device("cpu"))
    engine = DiffusionEngine(pipe)
    engine.add_request("r", PROMPT, DiffusionParams(
        seed=SEED, guidance_scale=GUIDANCE, num_inference_steps=STEPS, height=H, width=W),
        parked=True)
    engine.set_conditioning("r", {TOKEN_IDS: torch.tensor(plan)})
    return run_to_end(engine)["r"].images[0].numpy()


def test_text_then_image_in_one_message(server: Server, folder: Path, loaded: tuple,
                                        plan: list[int]) -> None:
    out = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], seed=SEED,
        extra_body=_body())
    content = out.choices[0].message.content
    assert isinstance(content, list) and [p["type"] for p in content] == ["text", "image_url"]
    assert plan == [101, 76] and content[0]["text"] == "eL"
    assert out.usage.completion_tokens == len(plan)
    image = _decode(content[1]["image_url"]["url"])
    assert image.shape == (H, W, 3) and image.std() > 5
    assert np.array_equal(image, _in_process(folder, loaded, plan))


def test_streamed_text_deltas_then_the_image(server: Server) -> None:
    stream = server.openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], seed=SEED, stream=True,
        extra_body=_body())
    kinds = []
    for chunk in stream:
        for choice in chunk.choices:
            c = choice.delta.content
            if isinstance(c, str) and c:
                kinds.append("text")
            elif isinstance(c, list):
                kinds.append(json.dumps([p["type"] for p in c]))
    assert kinds and kinds[0] == "text" and kinds[-1] == '["image_url"]', kinds
    assert kinds.count('["image_url"]') == 1


def test_an_edit_in_think_mode_is_refused(server: Server) -> None:
    """The plan would not see the input image (the upstream's does): a 400 naming `image`."""
    from omnistage.testing.diffusion import png
    url = "data:image/png;base64," + base64.b64encode(png(16, 24, seed=0)).decode()
    content = [{"type": "text", "text": PROMPT}, {"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], extra_body=_body())
    body = info.value.body
    assert body["param"] == "image" and "think mode" in body["message"], body
