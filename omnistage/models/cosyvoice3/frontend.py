"""CosyVoice3's reference-clip front end: the speech tokens (speech_tokenizer_v3.onnx over
Whisper's 128-bin log-mel) and the speaker embedding (campplus.onnx over the mean-normalised
80-bin Kaldi fbank), both ONNX files of the released folder run with onnxruntime (the
`cosyvoice3` extra; on CUDA its GPU provider when the installed wheel has one). The features are
ours (features.py), golden against upstream's feature calls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from omnistage.models.cosyvoice3.features import SAMPLE_RATE, speaker_features, whisper_log_mel

SPEECH_TOKENIZER = "speech_tokenizer_v3.onnx"
SPEAKER_ENCODER = "campplus.onnx"
MAX_SECONDS = 30


def _session(path: Path, device: str):
    try:
        import onnxruntime as ort
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise RuntimeError("CosyVoice3's front end needs onnxruntime: pip install "
                           "'omnistage[cosyvoice3]'") from e
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)


class ReferenceFrontEnd:
    """Turns a 16 kHz mono reference clip into (speech tokens, speaker embedding)."""

    def __init__(self, folder: str | Path, device: str = "cpu"):
        folder = Path(folder)
        self.tokenizer = _session(folder / SPEECH_TOKENIZER, device)
        self.speaker = _session(folder / SPEAKER_ENCODER, device)

    @staticmethod
    def check(wav: torch.Tensor) -> torch.Tensor:
        wav = wav.float().reshape(-1)
        if wav.numel() < SAMPLE_RATE // 10:
            raise ValueError("ref_audio: the reference clip is shorter than 0.1 s")
        if wav.numel() > MAX_SECONDS * SAMPLE_RATE:
            raise ValueError(f"ref_audio: the reference clip is longer than {MAX_SECONDS} s")
        return wav

    def speech_tokens(self, wav: torch.Tensor) -> torch.Tensor:
        feat = whisper_log_mel(self.check(wav))[None].numpy()          # (1, 128, T)
        ins = self.tokenizer.get_inputs()
        out = self.tokenizer.run(None, {ins[0].name: feat,
                                        ins[1].name: np.array([feat.shape[2]], dtype=np.int32)})
        return torch.from_numpy(np.asarray(out[0]).reshape(-1).astype(np.int64))

    def speaker_embedding(self, wav: torch.Tensor) -> torch.Tensor:
        feat = speaker_features(self.check(wav))[None].numpy()          # (1, T, 80)
        out = self.speaker.run(None, {self.speaker.get_inputs()[0].name: feat})
        return torch.from_numpy(np.asarray(out[0], dtype=np.float32).reshape(-1))

    def __call__(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.speech_tokens(wav), self.speaker_embedding(wav)
