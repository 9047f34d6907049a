"""Tiny random Qwen3-TTS checkpoints and the `qwen-tts` reference's outputs on them, for the
golden tests of omnistage/models/qwen3_tts.

    ref = run_reference(tmp_path, requests)     # DIR/custom_voice, DIR/voice_design, DIR/base
    ref["0.codes0"], ref["0.wav0"]               # request 0's talker frames and waveform

The reference runs in its own environment (.venv-ref, made by scripts/setup.sh --test) by subprocess:
qwen_tts pins transformers 4.57.3. The checkpoints are built there, by its own classes
(qwen3_tts_reference.py), and saved as published: config.json, safetensors, tokenizer and
processor files, the speech tokenizer's sub-folder.

`greedy_speech` is the reference's greedy talker loop (repetition penalty, at least two frames,
suppressed specials) over our talker on a paged KV cache, several requests in one batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

import omnistage
from omnistage.layers.attention import forward_context
from omnistage.models.qwen3_tts.prompt import TalkerPrompt
from omnistage.models.qwen3_tts.talker import Qwen3TTSTalkerForCausalLM
from omnistage.testing.tiny_models import PagedCache
from omnistage.testing.tiny_omni import build_tiny_omni_tokenizer

REPO = Path(omnistage.__file__).resolve().parents[1]
REFERENCE_PYTHON = REPO / ".venv-ref" / "bin" / "python"
REFERENCE_SCRIPT = Path(__file__).with_name("qwen3_tts_reference.py")
REFERENCE_TIMEOUT_S = 300


def reference_missing() -> str | None:
    """Why the reference cannot run here (a skip reason), or None."""
    if not REFERENCE_PYTHON.is_file():
        return f"no reference environment {REFERENCE_PYTHON} (scripts/setup.sh --test makes it)"
    return None


def run_reference(root: Path, requests: list[dict[str, Any]], seed: int = 0
                  ) -> dict[str, np.ndarray]:
    """Build the three tiny checkpoints under `root` and run `requests` (see
    qwen3_tts_reference.py) through the reference; its outputs by name."""
    root.mkdir(parents=True, exist_ok=True)
    build_tiny_omni_tokenizer(root / "tokenizer")
    (root / "job.json").write_text(json.dumps(
        {"seed": seed, "requests": requests}))
    done = subprocess.run([str(REFERENCE_PYTHON), str(REFERENCE_SCRIPT), str(root)],
                          capture_output=True, text=True, timeout=REFERENCE_TIMEOUT_S)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise RuntimeError(f"the qwen-tts reference failed (exit {done.returncode}): "
                           f"{done.stderr.strip().splitlines()[-1:]}")
    with np.load(root / "reference.npz") as npz:
        return {k: npz[k] for k in npz.files}


MAX_TOKENS = 14         # talker steps of every golden case


def clip(seconds: float, freq: float, seed: int) -> np.ndarray:
    """A 24 kHz tone with noise: a reference clip for voice cloning."""
    t = np.arange(int(24000 * seconds)) / 24000
    noise = np.random.default_rng(seed).standard_normal(t.shape)
    return (0.3 * np.sin(2 * np.pi * freq * t) + 0.05 * noise).astype(np.float32)


LONG_CLIP, SHORT_CLIP = clip(2.0, 220.0, 1), clip(0.4, 330.0, 2)
# the golden cases: name -> (the model type, the request's fields); clones take CLIPS[name]
CASES = {
    "preset": ("custom_voice", dict(text="Hello world.", speaker="Vivian", language="English",
                                    instruct="Speak slowly and warmly.")),
    "dialect": ("custom_voice", dict(text="Numbers like 42 appear in text too.",
                                     speaker="Dylan", language="Chinese",
                                     non_streaming_mode=False)),
    "no_speaker": ("custom_voice", dict(text="The sun rises.", speaker="", language="Auto")),
    "design": ("voice_design", dict(text="The sun rises in the east and sets in the west.",
                                    instruct="A deep, calm voice.", language="English")),
    "design_streaming": ("voice_design", dict(text="One, two, three.", instruct="Bright.",
                                              language="Auto", non_streaming_mode=False)),
    "xvector": ("base", dict(text="The quick brown fox.", language="English")),
    "icl": ("base", dict(text="She sells sea shells.", language="Auto",
                         ref_text="Hello world.")),
    "icl_long_text": ("base", dict(text="To be, or not to be, that is the question.",
                                   language="English", ref_text="Hi.")),
    "icl_non_streaming": ("base", dict(text="Grüße aus München.", language="Auto",
                                       ref_text="Hello world.", non_streaming_mode=True)),
}
CLIPS = {"xvector": LONG_CLIP, "icl": LONG_CLIP, "icl_long_text": SHORT_CLIP,
         "icl_non_streaming": SHORT_CLIP}


def reference_request(name: str) -> dict:
    """A golden case as qwen3_tts_reference.py takes it."""
    mode, fields = CASES[name]
    req = {"mode": mode, "max_new_tokens": MAX_TOKENS, **fields}
    if name in CLIPS:
        req.update(ref_audio=CLIPS[name].tolist(), x_vector_only="ref_text" not in fields)
    return req


@torch.inference_mode()
def greedy_speech(talker: Qwen3TTSTalkerForCausalLM, prompts: list[TalkerPrompt],
                  max_new_tokens: int, repetition_penalty: float = 1.05,
                  min_new_tokens: int = 2) -> list[Tensor]:
    """Each prompt's frames (T, G), greedy, all prompts in one batch per step, as the
    reference's `generate`: a frame for every sampled code 0 but EOS and the last one
    (whose frame the reference never runs the code predictor for)."""
    eos = talker.config.codec.eos
    cache = PagedCache(talker, num_blocks=512, block_size=4)
    last = _forward(talker, cache, list(range(len(prompts))), [p.embeds for p in prompts])
    sampled: list[list[int]] = [[] for _ in prompts]
    frames: list[list[Tensor]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    step = 0
    while active:
        logits = talker.compute_logits(last)                                  # (B, V)
        for row, i in enumerate(active):
            _penalize(logits[row], sampled[i], repetition_penalty)
        if step < min_new_tokens:
            logits[:, eos] = float("-inf")
        code0 = logits.argmax(-1)
        keep = []
        for row, i in enumerate(active):
            sampled[i].append(int(code0[row]))
            if sampled[i][-1] != eos and len(sampled[i]) < max_new_tokens:
                keep.append(row)
        if not keep:
            break
        codes, embeds = talker.predict_codes(last[keep], code0[keep], greedy=True)
        active = [active[row] for row in keep]
        inputs = []
        for j, i in enumerate(active):
            frames[i].append(codes[j])
            p = prompts[i]
            inputs.append((embeds[j] + (p.trailing[step] if step < p.trailing.shape[0]
                                        else p.pad))[None])
        last = _forward(talker, cache, active, inputs)
        step += 1
    return [torch.stack(f) if f else torch.empty(0, talker.config.num_code_groups,
                                                   dtype=torch.long) for f in frames]


def _forward(talker: Qwen3TTSTalkerForCausalLM, cache: PagedCache, seq_ids: list[int],
             embeds: list[Tensor]) -> Tensor:
    """One flattened forward of `embeds` (n_i, H) for `seq_ids`; each row's last hidden."""
    md, positions = cache.step([(i, e.shape[0]) for i, e in zip(seq_ids, embeds)])
    x = torch.cat(embeds)
    with forward_context(md):
        hidden, _ = talker(torch.zeros(x.shape[0], dtype=torch.long), positions, x)
    ends = torch.tensor([e.shape[0] for e in embeds]).cumsum(0) - 1
    return hidden[ends]


def _penalize(logits: Tensor, tokens: list[int], penalty: float) -> None:
    """HF's repetition penalty, in place, over the tokens sampled so far."""
    if not tokens or penalty == 1.0:
        return
    idx = torch.tensor(sorted(set(tokens)))
    score = logits[idx]
    logits[idx] = torch.where(score < 0, score * penalty, score / penalty)
