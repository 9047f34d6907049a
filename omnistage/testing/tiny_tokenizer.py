"""A tiny byte-level BPE tokenizer trained offline, for tests that need real tokenization.

Every byte is in the initial alphabet, so any UTF-8 text encodes; multi-byte characters
(accents, CJK, emoji) that the small corpus does not merge are split over several tokens,
which is exactly what incremental detokenization must cope with.

    ids 0..2    special tokens (<|endoftext|>, <|im_start|>, <|im_end|>)
    ids 3..258  the 256 byte tokens
    ids 259..   merges learned from CORPUS
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_MERGES = 160
TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256 + NUM_MERGES  # upper bound; len(tokenizer) is exact

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, this is a tiny tokenizer for tests.",
    "A language model predicts the next token from the previous ones.",
    "The engine schedules requests and batches them together.",
    "Each request has a prompt and generates output tokens.",
    "Sampling uses temperature, top-k and top-p to pick a token.",
    "The cache stores keys and values for every layer of the model.",
    "She sells sea shells by the sea shore.",
    "To be, or not to be, that is the question.",
    "It was the best of times, it was the worst of times.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "In the beginning there was the word, and the word was text.",
    "What is the capital of France? The capital of France is Paris.",
    "One, two, three, four, five, six, seven, eight, nine, ten.",
    "The sun rises in the east and sets in the west.",
    "Please write a short poem about the ocean and the moon.",
    "You are a helpful assistant. Answer the question briefly.",
    "The weather today is sunny with a light breeze.",
    "Numbers like 42, 3.14 and 1000 appear in text too.",
    "Streaming text arrives one token at a time.",
    "héllo wörld, café crème, naïve façade, señor niño.",
    "Grüße aus München und Zürich.",
    "日本語のテキストです。こんにちは世界。",
    "中文文本，你好世界。",
    "Привет, мир! Как дела?",
    "Emoji: 😀 🎉 🚀 👍🏽 ❤️",
)


def _train() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(CORPUS), trainer=trainer)
    return tok


def build_tiny_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Train the tiny tokenizer, save it to `path` (HF layout) and return it. Deterministic."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    assert len(tokenizer) <= 512, f"tiny vocab too large: {len(tokenizer)}"
    tokenizer.save_pretrained(str(path))
    return tokenizer
