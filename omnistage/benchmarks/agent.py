"""The voice agent (configs/voice_agent.yaml: a text LLM's answer spoken by Qwen3-TTS while the
LLM writes it) on our stage runtime: first audio counted from the request, at concurrency 1 and
8, on random weights of the real shapes (issue 45: `agent_first_audio_s_c1`, target <= 0.25 s).

    llm        a Qwen3 of a published shape (`--llm`: qwen3-0.6b, qwen3-1.7b, qwen3-8b), random
               weights, the tiny test tokenizer; its head keeps only whole ASCII words (every
               other row zero), so its greedy text is speakable words as a real answer is (a
               random head's argmax over byte pieces would be one word never closed until the
               end); `llm_tokens` tokens an answer, eos ignored
    talker     Qwen3-TTS-12Hz-1.7B-CustomVoice's sizes, built by qwen-tts in its interpreter as
               `omnistage bench tts` builds it (tts.py: $OMNISTAGE_TTS_REF_PYTHONPATH on the
               device), greedy, the voice Ryan; code2wav streams a 2-frame first chunk, then 25
    measured   per request (submitted all at once at concurrency c; at 1 one after another):
               first audio from submission, end-to-end seconds, real-time factor; and whether
               the first audio came before the LLM's last text

    OMNISTAGE_TTS_REF_PYTHONPATH=/tmp/ref-site omnistage bench agent --out-dir DIR
    omnistage bench agent --tiny --concurrency 1,2 --out-dir DIR      # CPU, CI
    (or python -m omnistage.benchmarks.agent with the same flags)

`--tiny`: the golden tests' tiny Qwen3 LLM and tiny CustomVoice checkpoint, float32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import queue
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from omnistage.benchmarks.common import environment, free_device_memory, summary
from omnistage.benchmarks.speech import collect_audio
from omnistage.benchmarks.tts import TTSBenchConfig, VOICE, build_and_reference
from omnistage.utils.device import resolve_device

PROMPTS = ("Tell me a story about the sea.", "What is the capital of France?",
           "Explain why the sky is blue.", "Give me three reasons to learn music.")
LLM_SHAPES = {   # the published config.json's sizes
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8),
}


@dataclass(frozen=True)
class AgentBenchConfig:
    llm: str = "qwen3-8b"
    tiny: bool = False
    llm_tokens: int = 64
    talker_frames: int = 200          # the most talker steps (it stops at the text's end)
    concurrency: tuple[int, ...] = (1, 8)
    sequential: int = 3               # requests one after another at concurrency 1
    device: str = "auto"
    first_chunk_frames: int = 2

    def __post_init__(self) -> None:
        if not self.tiny and self.llm not in LLM_SHAPES:
            raise ValueError(f"llm={self.llm!r}: choose from {sorted(LLM_SHAPES)}")
        if min(self.llm_tokens, self.talker_frames, self.sequential, *self.concurrency) < 1:
            raise ValueError("llm_tokens, talker_frames, sequential and concurrency: >= 1")


def build_llm(path: Path, cfg: AgentBenchConfig, device: torch.device) -> Path:
    """A random Qwen3 of the chosen shape with the tiny tokenizer, its head rows (tied to the
    embeddings only in the tiny model) zero except whole ASCII words."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from omnistage.testing.tiny_models import build_tiny_checkpoint, build_tiny_tokenizer

    if cfg.tiny:
        build_tiny_checkpoint(path, "Qwen3ForCausalLM")
        model = Qwen3ForCausalLM.from_pretrained(path)
        tokenizer = build_tiny_tokenizer(path)
    else:
        path.mkdir(parents=True, exist_ok=True)
        tokenizer = build_tiny_tokenizer(path)
        config = Qwen3Config(**LLM_SHAPES[cfg.llm], head_dim=128, vocab_size=151936,
                             max_position_embeddings=40960, rope_theta=1000000.0,
                             rms_norm_eps=1e-6, tie_word_embeddings=False,
                             eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
        config.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    words = [i for s, i in tokenizer.get_vocab().items()
             if s.startswith("Ġ") and s[1:].isascii() and s[1:].isalpha() and len(s) > 2]
    keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool,
                       device=model.lm_head.weight.device)
    keep[words] = True
    with torch.no_grad():
        model.lm_head.weight[~keep] = 0
    model.save_pretrained(path)
    del model
    free_device_memory(device)
    return path


def _requests(engine, prompts: list[str], params: list, tag: str, timeout_s: float = 600.0
              ) -> list[dict]:
    """Submit all at once; per request: first audio, the LLM's last text, end to end (seconds
    from its submission) and audio seconds."""
    events: queue.Queue = queue.Queue()
    start, rate = {}, {}
    for i, p in enumerate(prompts):
        rid = f"{tag}-{i}"
        start[rid] = time.perf_counter()
        out = engine.submit(p, params, request_id=rid,
                            sink=lambda ev: events.put((time.perf_counter(), ev)))
        rate[rid] = out.sample_rate
    return collect_audio(events, start, rate, timeout_s, text_stage="llm")


def _row(stats: list[dict], makespan: float) -> dict:
    audio = [s["audio_s"] for s in stats]
    firsts = [s["first_audio_s"] for s in stats if s["first_audio_s"] is not None]
    return {"requests": len(stats), "makespan_s": makespan, "first_audio_s": summary(firsts),
            "last_text_s": summary([s["last_text_s"] for s in stats if s["last_text_s"]]),
            "e2e_s": summary([s["e2e_s"] for s in stats]),
            "rtf": summary([s["e2e_s"] / a for s, a in zip(stats, audio) if a > 0]),
            "audio_s": audio, "audio_s_per_s": sum(audio) / makespan,
            "audio_before_last_text": sum(1 for s in stats if s["first_audio_s"] is not None
                                          and s["first_audio_s"] < s["last_text_s"])}


def bench_ours(llm: Path, tts: Path, cfg: AgentBenchConfig, device: torch.device,
               dtype: torch.dtype) -> dict:
    from omnistage import Omni, SamplingParams

    speaker, language = VOICE["tiny" if cfg.tiny else "1.7b"]
    params = [SamplingParams(temperature=0.0, max_tokens=cfg.llm_tokens, ignore_eos=True),
              SamplingParams(temperature=0.0, repetition_penalty=1.05, min_tokens=2,
                             max_tokens=cfg.talker_frames, detokenize=False,
                             extra={"voice": speaker, "language": language}), None]
    kw = {"backend": "inproc", "connector": "inproc"} if cfg.tiny else {}
    overrides = [f"talker.model={tts}", f"code2wav.model={tts}",
                 f"code2wav.generation.options.first_chunk_frames={cfg.first_chunk_frames}"]
    t0 = time.perf_counter()
    with Omni(str(llm), stage_config="voice_agent", device=str(device),
              dtype=str(dtype).removeprefix("torch."), stage_overrides=overrides, **kw) as omni:
        startup = time.perf_counter() - t0
        _requests(omni.engine, [PROMPTS[0]], params, "warm")
        _requests(omni.engine, [PROMPTS[i % len(PROMPTS)] for i in range(max(cfg.concurrency))],
                  params, "warm-batch")
        by_c = {}
        for c in cfg.concurrency:
            t1 = time.perf_counter()
            if c == 1:
                stats = [s for i in range(cfg.sequential)
                         for s in _requests(omni.engine, [PROMPTS[i % len(PROMPTS)]], params,
                                            f"c1-{i}")]
            else:
                stats = _requests(omni.engine, [PROMPTS[i % len(PROMPTS)] for i in range(c)],
                                  params, f"c{c}")
            by_c[str(c)] = _row(stats, time.perf_counter() - t1)
    return {"startup_s": startup, "by_concurrency": by_c}


def run(cfg: AgentBenchConfig) -> dict:
    device = resolve_device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with tempfile.TemporaryDirectory(prefix="omnistage-bench-agent-") as tmp:
        tts_cfg = TTSBenchConfig.preset("tiny" if cfg.tiny else "1.7b", reference_requests=0,
                                        device=str(device))
        tts, _ = build_and_reference(Path(tmp) / "tts", tts_cfg, device)
        llm = build_llm(Path(tmp) / "llm", cfg, device)
        ours = bench_ours(llm, tts, cfg, device, dtype)
        free_device_memory(device)
    by_c = ours["by_concurrency"]
    ratios: dict[str, float | None] = {}
    for c, row in by_c.items():
        ratios[f"agent_first_audio_s_c{c}"] = row["first_audio_s"]["median"]
        ratios[f"agent_rtf_c{c}"] = row["rtf"]["median"]
    if "1" in by_c and "8" in by_c:
        ratios["agent_first_audio_c8_over_c1"] = (by_c["8"]["first_audio_s"]["median"]
                                                  / by_c["1"]["first_audio_s"]["median"])
    return {"benchmark": "agent", **environment(device),
            "dtype": str(dtype).removeprefix("torch."), "config": asdict(cfg),
            "omnistage": ours, "ratios": ratios, "targets": {"agent_first_audio_s_c1": 0.25},
            "notes": "first audio: seconds from a request's submission to its first audio "
                     "chunk (the LLM's prompt, its first whole words, the talker's prompt and "
                     "first frames, code2wav's first chunk). last_text_s: to the LLM's last "
                     "token; audio_before_last_text counts requests whose speech began "
                     "before their text ended. Random weights: the LLM writes llm_tokens "
                     "whole words, the talker speaks until the text's end or talker_frames."}


def config_from(llm: str, tiny: bool, llm_tokens: int | None, talker_frames: int | None,
                concurrency: tuple[int, ...], device: str) -> AgentBenchConfig:
    """The command line's choices, with the tiny or the real defaults filled in."""
    return AgentBenchConfig(
        llm=llm, tiny=tiny, llm_tokens=llm_tokens or (12 if tiny else 64),
        talker_frames=talker_frames or (24 if tiny else 200), concurrency=concurrency,
        sequential=1 if tiny else 3, device=device)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llm", default="qwen3-8b", choices=sorted(LLM_SHAPES))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--llm-tokens", type=int, default=None)
    ap.add_argument("--talker-frames", type=int, default=None)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out-dir", type=Path, default=Path("."))
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    cfg = config_from(args.llm, args.tiny, args.llm_tokens, args.talker_frames,
                      tuple(int(c) for c in args.concurrency.split(",")), args.device)
    result = run(cfg)
    name = args.name or f"agent_{'tiny' if cfg.tiny else cfg.llm}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({"ratios": result["ratios"], "result": str(args.out_dir / f"{name}.json")},
                     indent=1))


if __name__ == "__main__":
    main()
