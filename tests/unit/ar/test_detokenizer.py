"""CPU tests of incremental detokenization and stop strings on the tiny byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from omnistage.ar.detokenizer import IncrementalDetokenizer
from omnistage.sampling_params import SamplingParams
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

TEXTS = [
    "Hello world, this is plain ASCII.",
    "héllo wörld, café crème",
    "日本語のテキストです",
    "emoji 😀🎉 and 👍🏽 mixed ❤️ end",
    "Привет, мир!",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


class SlowOnly:
    """The slow-tokenizer surface of a tokenizer, without the fast backend."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.inner = tokenizer
        self.all_special_ids = tokenizer.all_special_ids

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        return self.inner.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.inner.convert_tokens_to_string(tokens)


def stream(tok: object, prompt: list[int], output: list[int], params: SamplingParams,
           chunk: int = 1) -> tuple[list[str], bool, IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, prompt, params)  # type: ignore[arg-type]
    deltas: list[str] = []
    stopped = False
    for i in range(0, len(output), chunk):
        delta, stopped = detok.step(output[i:i + chunk])
        deltas.append(delta)
        if stopped:
            break
    deltas.append(detok.finish())
    return deltas, stopped, detok


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_decode(tokenizer: PreTrainedTokenizerBase, text: str,
                                      slow: bool) -> None:
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(text)
    # multi-byte characters really are split over tokens
    assert text.isascii() or any("\ufffd" in tokenizer.decode([t]) for t in output)
    tok = SlowOnly(tokenizer) if slow else tokenizer
    deltas, stopped, detok = stream(tok, prompt, output, SamplingParams())
    assert not stopped
    assert "".join(deltas) == tokenizer.decode(output) == text
    assert detok.text == text
    assert all("\ufffd" not in d for d in deltas), deltas


def test_incomplete_character_waits_for_its_last_byte(tokenizer: PreTrainedTokenizerBase) -> None:
    output = tokenizer.encode("😀")
    assert len(output) >= 2
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert [detok.step([t])[0] for t in output[:-1]] == [""] * (len(output) - 1)
    assert detok.step(output[-1:]) == ("😀", False)


def test_many_tokens_per_step(tokenizer: PreTrainedTokenizerBase) -> None:
    output = tokenizer.encode(TEXTS[3])
    deltas, _, _ = stream(tokenizer, [], output, SamplingParams(), chunk=3)
    assert "".join(deltas) == TEXTS[3]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tokenizer: PreTrainedTokenizerBase, include: bool) -> None:
    output = tokenizer.encode("The answer is 42. STOP here and more text")
    params = SamplingParams(stop=("STOP",), include_stop_str_in_output=include)
    deltas, stopped, detok = stream(tokenizer, [], output, params)
    expected = "The answer is 42. STOP" if include else "The answer is 42. "
    assert stopped
    assert deltas[-1] == ""  # finish() after a stop emits nothing
    assert "".join(deltas) == detok.text == expected


def test_stop_string_across_tokens_and_inside_a_token(tokenizer: PreTrainedTokenizerBase) -> None:
    text = "café crème brûlée"
    output = tokenizer.encode(text)
    # "è" is split over two byte tokens; "ème b" spans several tokens.
    cases = [("ème b", "café cr"), ("è", "café cr"), ("fé", "ca"), ("e", "café crèm")]
    for stop, expected in cases:
        deltas, stopped, detok = stream(tokenizer, [], output, SamplingParams(stop=(stop,)))
        assert stopped, stop
        assert "".join(deltas) == detok.text == expected, stop


def test_earliest_of_several_stop_strings_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    output = tokenizer.encode("one two three four")
    params = SamplingParams(stop=("four", "two th", "three"))
    deltas, stopped, _ = stream(tokenizer, [], output, params, chunk=100)
    assert stopped and "".join(deltas) == "one "


def test_possible_stop_prefix_is_withheld_then_released(tokenizer: PreTrainedTokenizerBase) -> None:
    params = SamplingParams(stop=("world!",))
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.step(tokenizer.encode("Hello")) == ("Hello", False)
    assert detok.step(tokenizer.encode(" wor")) == (" ", False)        # "wor" may start "world!"
    assert detok.step(tokenizer.encode("ld")) == ("", False)          # "world" still may
    assert detok.step(tokenizer.encode(".")) == ("world.", False)     # no longer
    assert detok.step(tokenizer.encode(" world")) == (" ", False)
    assert detok.finish() == "world"                                  # end of request
    assert detok.text == "Hello world. world"


def test_withheld_text_then_stop(tokenizer: PreTrainedTokenizerBase) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=("<END>",)))
    assert detok.step(tokenizer.encode("abc <E")) == ("abc ", False)
    assert detok.step(tokenizer.encode("ND> tail")) == ("", True)
    assert detok.step(tokenizer.encode("more")) == ("", True)
    assert detok.finish() == ""
    assert detok.text == "abc "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer: PreTrainedTokenizerBase, skip: bool) -> None:
    output = tokenizer.encode("Hi there") + [tokenizer.eos_token_id] + tokenizer.encode(" bye")
    params = SamplingParams(skip_special_tokens=skip)
    for tok in (tokenizer, SlowOnly(tokenizer)):
        deltas, _, _ = stream(tok, [], output, params)
        expected = "Hi there bye" if skip else "Hi there<|im_end|> bye"
        assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=skip) == expected


def test_prompt_context_is_not_emitted(tokenizer: PreTrainedTokenizerBase) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "héllo"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)
    output = tokenizer.encode(" wörld")
    deltas, _, _ = stream(tokenizer, list(prompt), output, SamplingParams())
    assert "".join(deltas) == " wörld"


def test_detokenize_false_emits_nothing(tokenizer: PreTrainedTokenizerBase) -> None:
    params = SamplingParams(detokenize=False, stop=("a",))
    detok = IncrementalDetokenizer(tokenizer, [], params)
    assert detok.step(tokenizer.encode("banana")) == ("", False)
    assert detok.finish() == ""
    assert detok.text == ""


def test_tiny_tokenizer_is_deterministic_and_small(tmp_path: Path) -> None:
    a = build_tiny_tokenizer(tmp_path / "a")
    b = build_tiny_tokenizer(tmp_path / "b")
    assert len(a) <= 512
    assert a.eos_token == "<|im_end|>" and a.pad_token == "<|endoftext|>"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert a.encode("日本語 😀") == b.encode("日本語 😀")
