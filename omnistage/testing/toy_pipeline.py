"""A toy generation model and the stage graph used to test the runtime: a tiny Qwen3 emitting
hidden states, a second tiny Qwen3 fed those as prompt and stream embeddings, and a generation
stage turning the second one's tokens into vectors.

Importing this module registers the "testing" model family (component `token_embedder`,
adapter `testing.fail_marked`); the production table in omnistage/registry.py knows nothing
of it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from omnistage.configs.options import NoOptions
from omnistage.payloads import TokenDelta
from omnistage.registry import Component, ModelFamily, register_family
from omnistage.stages.adapters import EdgeData, StageFeed, hidden_to_embeds, register_adapter


class TokenEmbedder(nn.Module):
    """Token ids -> fixed random vectors (seeded): a stand-in for a codec decoder. Its output
    for a token never depends on chunking, so chunked and whole edges must agree exactly."""

    Options = NoOptions

    def __init__(self, vocab_size: int = 512, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(vocab_size, dim, generator=gen),
                                  requires_grad=False)

    @classmethod
    def from_pretrained(cls, path: str | Path | None, component: str,
                        device: torch.device, dtype: torch.dtype | None,
                        options: NoOptions = NoOptions()) -> TokenEmbedder:
        return cls().to(device)

    def generate(self, inputs: list[dict[str, Tensor]], states: list[dict],
                 is_last: list[bool]) -> list[dict[str, Tensor]]:
        # one lookup over the whole batch, split back per request
        deltas = [TokenDelta.unpack(x) for x in inputs]
        ids = [torch.tensor(d.token_ids if d else [], dtype=torch.int64) for d in deltas]
        flat = torch.cat(ids).to(self.table.device)
        vecs = self.table[flat].split([len(i) for i in ids])
        return [{"vectors": v.cpu()} if len(v) else {} for v in vecs]

    info: dict[str, str | int | float] = {}

    def has_backlog(self, state: dict) -> bool:
        return False              # every call handles all of its input


def toy_graph_yaml(model: str | Path, *, chunked: bool, connector: str = "shm",
                   backend: str = "process", max_tokens: int = 16,
                   adapter: str = "hidden_to_embeds", second_replicas: int = 1) -> str:
    """`second_replicas`: copies of the middle stage (the router picks one per request)."""
    c = "true" if chunked else "false"
    return f"""
model: {model}
connector: {connector}
backend: {backend}
stages:
  - name: first
    kind: ar
    final: text
    ar:
      output_hidden_layers: [2]
      max_num_batched_tokens: 32
      sampling: {{temperature: 0.0, max_tokens: {max_tokens}, ignore_eos: true}}
  - name: second
    kind: ar
    placement:
      replicas: {second_replicas}
    inputs: [{{from: first, adapter: {adapter}, chunked: {c}}}]
    ar:
      sampling: {{temperature: 0.0, max_tokens: {max_tokens}, ignore_eos: true}}
  - name: vectors
    kind: generation
    component: token_embedder
    inputs: [{{from: second, adapter: tokens_to_tensor, chunked: {c}}}]
    final: tensor
"""


@register_adapter("testing.fail_marked")
def fail_marked(data: EdgeData, state: dict) -> StageFeed | None:
    """hidden_to_embeds, except that requests whose id starts with "fail-" raise here: a stage
    error for one request, to test that it fails alone and names its stage."""
    if data.request_id.startswith("fail-"):
        raise ValueError(f"request {data.request_id} is marked to fail")
    return hidden_to_embeds(data, state)


register_family(ModelFamily(
    "testing", adapters=__name__,
    components=(Component("generation", "token_embedder", f"{__name__}:TokenEmbedder"),)),
    module=__name__)
