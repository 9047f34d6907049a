"""Tiny random checkpoints built with transformers' own model classes, and a small paged KV
cache to drive our models in tests without the engine.

    path = build_tiny_checkpoint(tmp_path / "qwen3")         # config.json, safetensors, tokenizer
    model, cfg, _ = load_model(path, torch.device("cpu"))
    cache = PagedCache(model, num_blocks=16, block_size=4)
    hidden, _ = cache.run(model, [(0, ids0), (1, ids1)])   # one pass: seq 0 and seq 1, new ids

`edit_checkpoint` rewrites a saved folder's weights for the strict-loading tests.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from transformers import (GenerationConfig, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from omnistage.layers.attention import AttentionMetadata, forward_context, paged_layers
from omnistage.testing.tiny_tokenizer import build_tiny_tokenizer

_ARCHITECTURES = {
    "Qwen3ForCausalLM": (Qwen3Config, Qwen3ForCausalLM),
    "Qwen2ForCausalLM": (Qwen2Config, Qwen2ForCausalLM),
}


def edit_checkpoint(folder: Path, edit: Callable[[dict[str, Tensor]], object]) -> None:
    """Rewrite the folder's one safetensors file after `edit` changed its {name: tensor} dict
    in place (a test drops, adds or reshapes a tensor)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    assert len(files) == 1, f"{folder}: expected one safetensors file, found {files}"
    tensors = load_file(files[0])
    edit(tensors)
    save_file(tensors, files[0], metadata={"format": "pt"})


@torch.no_grad()
def _randomize(model: nn.Module) -> None:
    """HF initialises norms to 1 and biases to 0, which would hide a swapped norm or a lost
    bias; draw everything, scaled so activations and logits stay O(1)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn_like(p))
        elif "embed_tokens" in name:
            p.copy_(torch.randn_like(p))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))


def build_tiny_checkpoint(path: str | Path, architecture: str = "Qwen3ForCausalLM", *,
                          tie_word_embeddings: bool = False, num_shards: int = 1, seed: int = 0,
                          **config_overrides: Any) -> Path:
    """Save a tiny random `architecture` checkpoint (float32, GQA 4:2 heads, 2 layers) with the
    tiny tokenizer and a generation config into `path`. Deterministic for a given seed."""
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: choose from {sorted(_ARCHITECTURES)}")
    config_cls, model_cls = _ARCHITECTURES[architecture]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(path)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=tie_word_embeddings, bos_token_id=None,
        eos_token_id=eos_ids[0], pad_token_id=tokenizer.pad_token_id)
    if architecture == "Qwen3ForCausalLM":
        kwargs["head_dim"] = 16   # Qwen3 states it; Qwen2 derives hidden / heads (also 16)
    kwargs.update(config_overrides)
    config = config_cls(**kwargs)
    config.architectures = [architecture]

    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    _randomize(model)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids,
                                               pad_token_id=tokenizer.pad_token_id)
    max_shard_size: int | str = "50GB"
    if num_shards > 1:
        num_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        max_shard_size = math.ceil(num_bytes / num_shards)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    if num_shards > 1:
        assert (path / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    return path


class PagedCache:
    """A KV cache bound to every Attention layer of `model`, with a block table per sequence
    that grows as tokens are added; `step` builds the AttentionMetadata for one forward pass."""

    def __init__(self, model: nn.Module, num_blocks: int = 64, block_size: int = 4) -> None:
        layers = paged_layers(model)
        param = next(model.parameters())
        self.block_size = block_size
        self.device = param.device
        for layer in layers:
            shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
            layer.v_cache = torch.zeros(shape, dtype=param.dtype, device=param.device)
        # Hand out blocks in a scrambled order so a wrong block-table lookup cannot pass.
        self.free_blocks = list(reversed(range(num_blocks)))
        self.block_tables: dict[int, list[int]] = {}
        self.num_tokens: dict[int, int] = {}

    def step(self, new_tokens: list[tuple[int, int]]) -> tuple[AttentionMetadata, Tensor]:
        """`new_tokens`: (seq id, number of new tokens) per batch row, in batch order.
        Returns the metadata and the positions (T,) of the new tokens."""
        bs = self.block_size
        slots: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for seq_id, n in new_tokens:
            start = self.num_tokens.get(seq_id, 0)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * bs < start + n:
                table.append(self.free_blocks.pop())
            for p in range(start, start + n):
                slots.append(table[p // bs] * bs + p % bs)
                positions.append(p)
            self.num_tokens[seq_id] = start + n
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        tables = [self.block_tables[s] for s, _ in new_tokens]
        width = max(len(t) for t in tables)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                      dtype=torch.int32, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens,
            max_query_len=max(n for _, n in new_tokens), max_seq_len=max(seq_lens))
        return md, torch.tensor(positions, dtype=torch.int64, device=dev)

    @torch.inference_mode()
    def run(self, model: nn.Module, batch: list[tuple[int, Tensor]],
            capture_layers: tuple[int, ...] = ()) -> tuple[list[Tensor], dict[int, list[Tensor]]]:
        """One forward pass over `batch` = (seq id, new token ids) rows; returns the final hidden
        states and the captured layers, split back per row."""
        md, positions = self.step([(seq_id, len(ids)) for seq_id, ids in batch])
        input_ids = torch.cat([ids for _, ids in batch]).to(self.device)
        with forward_context(md):
            hidden, captured = model(input_ids, positions, None, capture_layers)
        sizes = [len(ids) for _, ids in batch]
        return list(hidden.split(sizes)), {i: list(h.split(sizes)) for i, h in captured.items()}
