"""`omnistage bench regress`: the headline figures rerun and held to committed baselines, so
that a release cannot lose speed silently (what happened to vLLM-Omni: Qwen3-TTS -28% in one
release, -57% in nightly CI).

A probe runs one benchmark at a small fixed shape and returns figures; a baseline file per GPU
model (`benchmarks/results/baselines/<gpu>.json`, e.g. `nvidia-h200.json`) holds each figure's
committed value and which way is better. A figure worse than its baseline by more than the
tolerance (default 5%: the spread of repeated runs on one machine, which `--repeats 2`
measures and reports as `noise`) fails the run, naming it:

    omnistage bench regress                       # every probe; exit 1 on a regression
    omnistage bench regress --probes omni25,tts   # some
    omnistage bench regress --update-baseline     # on purpose: today's figures become it

A figure the baseline lacks is reported as new (and written by --update-baseline); one the
probes did not run is skipped. Comparisons hold only within one GPU model, so the file is
chosen by the GPU's name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

LOWER, HIGHER = "lower", "higher"
DEFAULT_TOLERANCE = 0.05
BASELINE_DIR = Path("benchmarks/results/baselines")


@dataclass(frozen=True, slots=True)
class Verdict:
    figure: str
    value: float
    baseline: float | None
    better: str
    change: float | None            # relative, signed so that > 0 is worse
    regressed: bool

    def line(self) -> str:
        if self.baseline is None:
            return f"{self.figure}: {self.value:.4g} (new: no baseline)"
        word = "REGRESSED" if self.regressed else "ok"
        return (f"{self.figure}: {self.value:.4g} against {self.baseline:.4g} ({self.better} "
                f"is better; {self.change:+.1%} worse) {word}")


@dataclass(slots=True)
class Baseline:
    gpu: str
    figures: dict[str, dict[str, object]] = field(default_factory=dict)
    tolerance: float = DEFAULT_TOLERANCE

    @classmethod
    def load(cls, path: Path) -> Baseline | None:
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(data["gpu"], data["figures"], data.get("tolerance", DEFAULT_TOLERANCE))

    def save(self, path: Path, source: dict[str, object]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"gpu": self.gpu, "tolerance": self.tolerance,
                                    "figures": self.figures, "source": source},
                                   indent=1, sort_keys=True) + "\n")


def baseline_path(gpu: str, folder: Path = BASELINE_DIR) -> Path:
    """`NVIDIA H200` -> folder/nvidia-h200.json (`NVIDIA H100 80GB HBM3` -> nvidia-h100.json)."""
    words = gpu.lower().split()
    keep = [w for w in words if not re.fullmatch(r"\d+gb|hbm\d*e?|sxm\d*|pcie|nvl", w)]
    return folder / (re.sub(r"[^a-z0-9]+", "-", " ".join(keep)).strip("-") + ".json")


def judge(figures: dict[str, tuple[float, str]], baseline: Baseline | None,
          tolerance: float | None = None) -> list[Verdict]:
    """Each figure (value, which way is better) against the baseline's."""
    out = []
    for name, (value, better) in sorted(figures.items()):
        base = None if baseline is None else baseline.figures.get(name)
        if base is None:
            out.append(Verdict(name, value, None, better, None, False))
            continue
        ref = float(base["value"])
        tol = tolerance if tolerance is not None else float(
            base.get("tolerance", baseline.tolerance))
        change = (value - ref) / ref if better == LOWER else (ref - value) / ref
        out.append(Verdict(name, value, ref, better, change, change > tol))
    return out


def noise(runs: list[dict[str, tuple[float, str]]]) -> dict[str, float]:
    """Each figure's spread over repeated runs: (max - min) / min."""
    out = {}
    for name in runs[0]:
        values = [r[name][0] for r in runs if name in r]
        if len(values) > 1 and min(values) > 0:
            out[name] = (max(values) - min(values)) / min(values)
    return out


def best_of(runs: list[dict[str, tuple[float, str]]]) -> dict[str, tuple[float, str]]:
    """Each figure's best value over repeated runs (what the machine can do)."""
    out: dict[str, tuple[float, str]] = {}
    for run in runs:
        for name, (value, better) in run.items():
            old = out.get(name)
            if old is None or (value < old[0] if better == LOWER else value > old[0]):
                out[name] = (value, better)
    return out


# ---- probes: one benchmark each, at a small fixed shape -----------------------------------

Figures = dict[str, tuple[float, str]]


def probe_ar(device: str, tiny: bool = False) -> Figures:
    """Qwen3-0.6B's shape, one stream, 256 tokens: share of the weight-streaming limit."""
    if tiny:
        raise ValueError("the ar probe has no tiny size (it measures a GPU's memory bandwidth)")
    import random
    import tempfile

    from omnistage.benchmarks import ar_offline as ao

    with tempfile.TemporaryDirectory(prefix="omnistage-regress-ar-") as tmp:
        path = ao.build_checkpoint("qwen3-0.6b", Path(tmp) / "qwen3-0.6b")
        rng = random.Random(0)
        prompt = [rng.randrange(ao.PRESETS["qwen3-0.6b"]["vocab_size"]) for _ in range(128)]
        ours = ao.ours_decode_speed(path, prompt, 256)
        limit = ao.weight_streaming_limit(path)["limit_tokens_per_s"]
    return {"ar_decode_tokens_per_s_single_stream": (ours["decode_tokens_per_s"], HIGHER),
            "ar_share_of_limit_single_stream": (ours["decode_tokens_per_s"] / limit, HIGHER)}


def probe_omni(device: str, tiny: bool = False) -> Figures:
    """Qwen3-Omni's bench shape at 1 and 8 requests: first audio and its cliff."""
    from omnistage.benchmarks import omni

    cfg = omni.OmniBenchConfig.preset(_sizes(tiny), device=device, reference_requests=0,
                                      concurrency=(1, 8))
    by_c = omni.run(cfg)["omnistage"]["by_concurrency"]
    return _speech_figures(by_c, "")


def probe_omni25(device: str, tiny: bool = False) -> Figures:
    """Qwen2.5-Omni's bench shape at 1 and 8 requests: real-time factor and first audio."""
    from omnistage.benchmarks import omni, omni25

    cfg = omni.OmniBenchConfig.preset(_sizes(tiny), model="qwen2.5-omni", device=device,
                                      reference_requests=0, concurrency=(1, 8))
    by_c = omni25.run(cfg)["omnistage"]["by_concurrency"]
    return _speech_figures(by_c, "omni25_")


def probe_tts(device: str, tiny: bool = False) -> Figures:
    """Qwen3-TTS 1.7B's shape at 1, 8 and 64 requests: first audio, its cliff, audio seconds
    per second at 64."""
    from omnistage.benchmarks import tts

    cfg = tts.TTSBenchConfig.preset("tiny" if tiny else "1.7b", device=device,
                                    reference_requests=0,
                                    concurrency=(1, 8, 64))
    by_c = tts.run(cfg)["omnistage"]["by_concurrency"]
    out = _speech_figures(by_c, "tts_")
    out["tts_audio_s_per_s_c64"] = (float(_row(by_c, 64)["audio_s_per_s"]), HIGHER)
    return out


def probe_duplex(device: str, tiny: bool = False) -> Figures:
    """Moshi-7B's shape on the duplex runtime at 1 and 16 sessions, 100 ticks each: the
    tick's p99 at each (issue 45's figure is the sessions a GPU ticks within 80 ms)."""
    from omnistage.benchmarks import duplex

    cfg = duplex.DuplexBenchConfig(sizes="tiny" if tiny else "7b",
                                   sessions=(1, 2) if tiny else (1, 16),
                                   ticks=8 if tiny else 100, warmup_ticks=2 if tiny else 10,
                                   device=device)
    rows = duplex.run(cfg)["by_sessions"]
    return {f"duplex_tick_p99_ms_c{n}": (float(rows[str(n)]["tick_ms"]["p99"]), LOWER)
            for n in cfg.sessions}


def probe_agent(device: str, tiny: bool = False) -> Figures:
    """The voice agent (a Qwen3-1.7B-shaped LLM -> Qwen3-TTS 1.7B) at 1 and 8 requests:
    first audio from the request."""
    from omnistage.benchmarks import agent

    cfg = agent.config_from("qwen3-1.7b", tiny, None, None, (1, 8), device)
    ratios = agent.run(cfg)["ratios"]
    return {f"agent_first_audio_s_c{c}": (float(ratios[f"agent_first_audio_s_c{c}"]), LOWER)
            for c in (1, 8)}


def probe_speech(device: str, tiny: bool = False) -> Figures:
    """Voxtral-TTS's and MiMo-Audio's released shapes (issue 43) at 1 and 8 requests: first
    audio, its cliff and the real-time factor of each (`<family>_...`)."""
    from omnistage.benchmarks import speech

    out: Figures = {}
    for family in ("voxtral-tts", "mimo-audio"):
        cfg = speech.SpeechBenchConfig(family=family, tiny=tiny, concurrency=(1, 8),
                                       device=device)
        by_c = speech.run(cfg)["omnistage"]["by_concurrency"]
        out.update(_speech_figures(by_c, f"{cfg.key}_"))
    return out


def _sizes(tiny: bool) -> str:
    return "tiny" if tiny else "bench"


def _row(by_c: dict, c: int) -> dict:
    return by_c[str(c)] if str(c) in by_c else by_c[c]


def _speech_figures(by_c: dict, prefix: str) -> Figures:
    one, eight = _row(by_c, 1), _row(by_c, 8)
    first1, first8 = one["first_audio_s"]["median"], eight["first_audio_s"]["median"]
    return {f"{prefix}first_audio_s_c1": (first1, LOWER),
            f"{prefix}first_audio_s_c8": (first8, LOWER),
            f"{prefix}first_audio_c8_over_c1": (first8 / first1, LOWER),
            f"{prefix}rtf_c1": (one["rtf"]["median"], LOWER),
            f"{prefix}rtf_c8": (eight["rtf"]["median"], LOWER)}


PROBES: dict[str, Callable[[str, bool], Figures]] = {
    "ar": probe_ar, "omni": probe_omni, "omni25": probe_omni25, "tts": probe_tts,
    "duplex": probe_duplex, "agent": probe_agent, "speech": probe_speech}


def run(probes: tuple[str, ...], device: str, gpu: str, *, repeats: int = 1,
        folder: Path = BASELINE_DIR, update: bool = False, tolerance: float | None = None,
        tiny: bool = False, registry: dict[str, Callable[[str, bool], Figures]] | None = None
        ) -> dict[str, object]:
    """Run the probes (`repeats` times each; the best value counts, the spread is the noise),
    judge them against `gpu`'s baseline (`tiny`: toy sizes, judged against `<gpu>-tiny.json`:
    the mechanics on a CPU, no measurement), and with `update` write today's figures as it."""
    registry = registry or PROBES
    unknown = sorted(set(probes) - set(registry))
    if unknown:
        raise ValueError(f"unknown probe {unknown[0]!r} (probes: {', '.join(registry)})")
    runs: list[Figures] = [{} for _ in range(repeats)]
    for name in probes:
        for i in range(repeats):
            runs[i].update(registry[name](device, tiny))
    figures = best_of(runs)
    path = baseline_path(gpu + (" tiny" if tiny else ""), folder)
    baseline = Baseline.load(path)
    verdicts = judge(figures, baseline, tolerance)
    spread = noise(runs) if repeats > 1 else {}
    if update:
        kept = baseline.figures if baseline is not None else {}
        # a figure keeps its tolerance (and the noise it came from) unless this run measured
        # its noise again
        new = Baseline(gpu, {**kept, **{n: {**kept.get(n, {}), "value": v, "better": b,
                                            **({"noise": round(spread[n], 4)}
                                               if n in spread else {})}
                                        for n, (v, b) in figures.items()}},
                       baseline.tolerance if baseline is not None else DEFAULT_TOLERANCE)
        new.save(path, {"probes": list(probes), "repeats": repeats, "noise": spread})
    return {"benchmark": "regress", "gpu": gpu, "baseline": str(path),
            "baseline_found": baseline is not None, "updated": update,
            "figures": {n: v for n, (v, _) in figures.items()}, "noise": spread,
            "verdicts": [v.line() for v in verdicts],
            "regressed": [v.figure for v in verdicts if v.regressed]}
