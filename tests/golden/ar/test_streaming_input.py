"""Streamed input into an AR request: a prompt that grows chunk by chunk, and per-decode stream
embeddings from an upstream stage (how a talker follows a thinker)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from omnistage.ar.inputs import StreamInput
from omnistage.ar.engine import AREngine
from omnistage.configs.schema import ARConfig
from omnistage.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_qwen3: Path) -> AREngine:
    return AREngine(ARConfig(model=str(tiny_qwen3), device="cpu"))


def drain(engine: AREngine, rid: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests:
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


def test_prompt_streamed_in_chunks_equals_whole(engine: AREngine) -> None:
    prompt = list(range(3, 43))
    engine.add_request("whole", prompt, GREEDY)
    whole = drain(engine, "whole")

    engine.add_request("chunks", None, GREEDY, prompt_open=True)
    assert engine.step() == []                       # parked: nothing to compute
    for i in range(0, 40, 15):
        engine.extend_request("chunks", prompt_token_ids=prompt[i:i + 15])
        outs = engine.step()                         # prefills what arrived, samples nothing
        assert all(not o.new_token_ids for o in outs)
    engine.extend_request("chunks", close_prompt=True)
    assert drain(engine, "chunks") == whole


def reference_with_stream(path: Path, prompt: list[int], stream: torch.Tensor,
                          num_tokens: int) -> list[int]:
    """Greedy decoding where the t-th fed-back output token gets stream[t] added to its
    input embedding, computed without any cache."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    emb = hf.get_input_embeddings()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            x = emb(torch.tensor(prompt + out))
            for t in range(len(out)):
                if t < stream.shape[0]:
                    x[len(prompt) + t] += stream[t]
            out.append(int(hf(inputs_embeds=x[None]).logits[0, -1].argmax()))
    return out


def test_stream_embeds_follow_upstream(engine: AREngine, tiny_qwen3: Path) -> None:
    torch.manual_seed(0)
    prompt = list(range(10, 30))
    stream = torch.randn(5, engine.model_config.hidden_size)  # shorter than the output
    expected = reference_with_stream(tiny_qwen3, prompt, stream, 8)

    engine.add_request("s", prompt, GREEDY, stream=StreamInput())
    got: list[int] = []
    for t in range(5):  # upstream delivers one embedding at a time, a few steps apart
        for _ in range(3):
            for o in engine.step():
                got += o.new_token_ids
        assert len(got) == t + 1, "a decode ran ahead of its stream embedding"
        engine.extend_request("s", stream_embeds=stream[t:t + 1])
    engine.extend_request("s", close_stream=True)
    got += drain(engine, "s")
    assert got == expected


def test_stream_errors(engine: AREngine) -> None:
    engine.add_request("e", [1, 2, 3], GREEDY, stream=StreamInput())
    with pytest.raises(ValueError, match="stream_embeds has shape"):
        engine.extend_request("e", stream_embeds=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="prompt is already closed"):
        engine.extend_request("e", prompt_token_ids=[4])
    with pytest.raises(KeyError):
        engine.extend_request("nope", close_prompt=True)
    engine.add_request("p", None, GREEDY, prompt_open=True)
    out = engine.abort_request("p")
    assert out.finish_reason.value == "abort"
    engine.abort_request("e")
    assert not engine.has_unfinished_requests
