"""CosyVoice3's reference front end (models/cosyvoice3/frontend.py) runs the released folder's
two ONNX files with onnxruntime: tiny stand-ins with the released input/output signature
(speech_tokenizer_v3.onnx: feats (1, 128, T) float32 + feats_length (1,) int32 -> tokens at a
quarter of the frame rate; campplus.onnx: (1, T, 80) float32 -> (1, 192)), exported with
torch.onnx.export into tmp_path, give what the same torch modules give on our features (the
features themselves are golden against upstream in test_cosyvoice3_features.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from omnistage.models.cosyvoice3.features import speaker_features, whisper_log_mel  # noqa: E402
from omnistage.models.cosyvoice3.frontend import ReferenceFrontEnd  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "cosyvoice3" / "frontend.pt"


class _Tokenizer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(128, 37, 4, stride=4)

    def forward(self, feats, feats_length):
        return self.conv(feats).argmax(dim=1).to(torch.int32) + feats_length[:, None] * 0


class _Speaker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(80, 192)

    def forward(self, x):
        return self.proj(torch.tanh(x)).mean(dim=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("cosy_onnx")
    tok, spk = _Tokenizer().eval(), _Speaker().eval()
    torch.onnx.export(tok, (torch.randn(1, 128, 40), torch.tensor([40], dtype=torch.int32)),
                      d / "speech_tokenizer_v3.onnx", input_names=["feats", "feats_length"],
                      output_names=["tokens"], dynamic_axes={"feats": {2: "T"}, "tokens": {1: "N"}},
                      dynamo=False)
    torch.onnx.export(spk, (torch.randn(1, 40, 80),), d / "campplus.onnx", input_names=["input"],
                      output_names=["embedding"], dynamic_axes={"input": {1: "T"}}, dynamo=False)
    return d, tok, spk


def test_front_end_runs_the_onnx_files_on_our_features(folder):
    d, tok, spk = folder
    wav = torch.load(FIXTURE)["pcm16k"].float() / 32768.0
    tokens, emb = ReferenceFrontEnd(d)(wav)
    with torch.no_grad():
        mel = whisper_log_mel(wav)[None]
        want_tokens = tok(mel, torch.tensor([mel.shape[2]], dtype=torch.int32)).reshape(-1)
        want_emb = spk(speaker_features(wav)[None]).reshape(-1)
    assert tokens.dtype == torch.int64 and tokens.shape == (mel.shape[2] // 4,)
    assert torch.equal(tokens, want_tokens.long()) and len(set(tokens.tolist())) > 3
    assert emb.shape == (192,) and emb.abs().mean() > 1e-2
    torch.testing.assert_close(emb, want_emb, atol=1e-5, rtol=1e-5)


def test_a_clip_over_30_s_is_refused_naming_ref_audio(folder):
    with pytest.raises(ValueError, match="ref_audio"):
        ReferenceFrontEnd(folder[0]).speech_tokens(torch.zeros(16000 * 31))
