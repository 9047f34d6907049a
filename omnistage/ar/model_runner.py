"""Batch to tensors, one forward pass, logits to tokens.

The runner knows tensors and nothing about queues: it turns a `ScheduledBatch` into a flattened
input (prefill chunks and decodes together), publishes the attention metadata, runs the model
once, samples where a sequence reached its last token, and slices out the hidden states a
downstream stage asked for.

On CUDA, steps where every sequence decodes one output token replay a CUDA graph instead
(`DecodeGraphs`, cuda_graphs.py): one graph per batch-size bucket, captured at start-up over
static input buffers, the batch padded up to the bucket. Decodes fed embeddings (stream rows
added, the model's feedback embeddings) build their input rows eagerly and replay a variant
that reads them from a static buffer. Sampling and the feedback hook stay outside the graph.
Steps with prompt rows (prefill chunks, with or without decodes) of up to `max_graph_tokens`
rows replay graphs too (`PrefillGraphs`, prefill_graphs.py: one per token-count bucket, from
the same plan the other ranks receive); longer ones, and those with deepstack features, run
eagerly. `launch_decode` / `resolve` split a
graph-replayed decode step in two for the engine's async scheduling: launch and sample on the
device (the tokens' copies to the host started behind them), then read.

The plain graphs (no hidden-state outputs, fed token ids) are captured when the runner is
built; the variants with hidden-state outputs or fed embeddings when the stage asks for them
at start-up (`AREngine.capture_decode_graphs`), or else by the first step that needs each.

Tensor parallelism (issue 18): every rank of the stage builds a runner over its shard of the
model. Rank 0's turns each batch into host inputs (step_plan.py), shares them as a plan and
runs them; the others' `follow` runs each plan they receive: the same forward pass, graph
replay or capture, and logits, so that every collective inside finds its peers. Only rank 0
samples, runs the feedback hook and reads hidden states out.

Shadow sequences (shadows.py: a request's extra contexts) run in the same forward pass as
their owner; their last hidden states are kept before sampling, for the model's
`guide_logits(logits, seqs)` (optional: e.g. classifier-free guidance of the token choice)
and its feedback hook.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from omnistage.ar import shadows
from omnistage.ar.cuda_graphs import DecodeGraphs
from omnistage.ar.kv_cache import KVCacheLayout
from omnistage.ar.prefill_graphs import PrefillGraphs
from omnistage.ar.sampler import DeviceSample, Sampler, TokenLogprobs
from omnistage.ar.scheduler import ScheduledBatch
from omnistage.ar.sequence import Sequence
from omnistage.ar.step_plan import (DecodePlan, EmbedPlan, EmbedRows, ForwardPlan,
                                    decode_embed_rows, plan_forward)
from omnistage.layers.attention import (AttentionMetadata, forward_context, paged_layers,
                                        get_attention_backend)
from omnistage.layers.groups import stage_ranks
from omnistage.layers.parallel import broadcast
from omnistage.models.causal_lm import CausalLM
from omnistage.utils import trace
from omnistage.utils.host import array_tensor, int_array, int_tensor, to_device


@dataclass(slots=True)
class PendingStep:
    """A decode step launched on the device whose sampled tokens are not read yet."""
    seqs: list[Sequence]
    sampled: DeviceSample                      # token ids on the device, copies under way

    @property
    def token_ids(self) -> Tensor:
        return self.sampled.token_ids


@dataclass(slots=True)
class RunnerOutput:
    sampled: list[int | None]                      # per batch row: new token or None (mid-prompt)
    logprobs: list[TokenLogprobs | None]
    hidden_states: list[dict[int, Tensor] | None]  # per row: layer -> (n, hidden) new positions
    extras: list[dict[str, Tensor] | None] | None = None  # per row: the feedback hook's outputs


def capture_key(layers: Iterable[int]) -> tuple[int, ...]:
    """The hidden layers a step captures, as its CUDA graphs are keyed: sorted, each once."""
    return tuple(sorted(set(layers)))


class ModelRunner:
    def __init__(self, model: CausalLM, layout: KVCacheLayout, device: torch.device,
                 dtype: torch.dtype, attention_backend: str = "auto", seed: int = 0, *,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 enforce_eager: bool = False, max_graph_tokens: int = 0) -> None:
        """enforce_eager: never use CUDA graphs. max_num_seqs / max_model_len size the graphs'
        static buffers (the largest batch, the longest block table); max_graph_tokens: the
        largest step with prompt rows replayed from a graph (0: those run eagerly). Every rank
        of a tensor-parallel stage builds its runner in the same order (the graphs' capture
        communicates)."""
        self.model = model
        self.layout = layout
        self.device = device
        self.dtype = dtype
        self.ranks = stage_ranks()
        self.shares_plans = self.ranks.is_leader and self.ranks.world_size > 1
        self.sampler = Sampler(seed)
        self.eos_token_ids: tuple[int, ...] = ()
        self.attn_layers = paged_layers(model)
        if len(self.attn_layers) != layout.num_layers:    # each gets a whole cache: say so early
            raise RuntimeError(f"the model has {len(self.attn_layers)} paged attention layers, "
                               f"its KV cache layout {layout.num_layers}")
        group = (self.attn_layers[0].num_heads // self.attn_layers[0].num_kv_heads
                 if self.attn_layers else 1)
        self.backend = get_attention_backend(attention_backend, device, layout.block_size, group,
                                             layout.num_kv_heads)
        backend = self.backend
        shape = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        for layer in self.attn_layers:
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=device)
            layer.backend = backend
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        if (device.type == "cuda" and not enforce_eager
                and getattr(backend, "supports_cuda_graphs", False)):
            max_blocks = layout.num_blocks if max_model_len is None else min(
                layout.num_blocks, -(-max_model_len // layout.block_size))
            graphs = DecodeGraphs(model, backend, layout.block_size, max_num_seqs, max_blocks,
                                  device, model.uses_mrope)
            self.graphs = graphs if graphs.capture_all() else None
            if self.graphs is not None and max_graph_tokens and backend.supports_prefill_graphs:
                prefill = PrefillGraphs(model, backend, layout.block_size, max_num_seqs,
                                        max_blocks, max_graph_tokens, device,
                                        model.uses_mrope, self.graphs.pool)
                self.prefill_graphs = prefill if prefill.capture_all() else None

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> RunnerOutput:
        capture = capture_key(i for s in batch.seqs
                              for i in s.sampling_params.output_hidden_layers)
        rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        graphed = None
        graphed_rows = False       # hidden states in a graph's output buffer
        if self.graphs is not None and self.graphs.can_run(batch):
            # decodes fed embeddings (a talker's stream rows, feedback embeddings) replay the
            # graph variant that reads a static embedding buffer, built here eagerly
            embed_rows, pieces = (decode_embed_rows(batch) if DecodeGraphs.needs_embeds(batch)
                                  else (None, None))
            plan = DecodePlan(self.graphs.inputs(batch), capture, embed_rows, False, rows)
            self._share(plan)
            graphed = self._replay(plan, pieces)
        if graphed is not None:
            graphed_rows = True
            hidden, captured = graphed                          # (B, hidden): one row a seq
            qsl = list(range(len(batch.seqs) + 1))
            last = hidden if len(rows) == len(batch.seqs) else hidden[rows]
        else:
            plan, pieces, deep = plan_forward(batch, self.layout.block_size,
                                              self.model.uses_mrope, capture, rows)
            self._share(plan)
            feats = torch.cat(deep, dim=1).to(self.device, self.dtype) if deep else None
            hidden, captured, graphed_rows = self._forward(plan, pieces, feats)
            qsl = plan.query_start_loc
            if rows:
                last = hidden[torch.tensor(plan.logit_rows, device=self.device)]

        if any(s.owner is not None for s in batch.seqs):     # before the hook reads them
            shadows.record_hidden(batch.seqs, batch.num_new_tokens, hidden, qsl)
        sampled: list[int | None] = [None] * len(batch.seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(batch.seqs)
        extras = None
        if rows:
            seqs = [batch.seqs[i] for i in rows]
            logits = self.model.compute_logits(last)
            if (guide := getattr(self.model, "guide_logits", None)) is not None:
                logits = guide(logits, seqs)   # (B, V), the rows' seqs: may read shadows
            on_device = self.sampler.sample(logits, seqs, self.eos_token_ids, inplace=True)
            feedback = self.model.feedback
            if feedback is not None:
                # the model decides what its sampled tokens feed back (and may emit more per
                # row), launched behind the sampling: the host waits once, for both
                w0 = time.time()
                embeds_out, extra_rows = feedback(last, on_device.token_ids, seqs)
                trace.span("feedback", w0, rows=len(rows))
                extras = [None] * len(batch.seqs)
                for j, i in enumerate(rows):
                    batch.seqs[i].output_embeds.append(embeds_out[j])
                    extras[i] = extra_rows[j]
            out = self.sampler.to_host(on_device, seqs)
            for j, i in enumerate(rows):
                sampled[i] = out.token_ids[j]
                logprobs[i] = out.logprobs[j]
        hidden_out = self._slice_hidden(batch, qsl, captured, copy=graphed_rows)
        return RunnerOutput(sampled, logprobs, hidden_out, extras)

    @torch.inference_mode()
    def launch_decode(self, batch: ScheduledBatch, prev_tokens: Tensor | None = None
                      ) -> PendingStep:
        """Launch a decode step from its CUDA graph and sample on the device, reading nothing
        back (`resolve` does). prev_tokens: the step is the one after a launched step whose
        tokens (B,) are still on the device: they are its inputs, one position further on
        (the caller allocated the blocks). Only for batches `DecodeGraphs.can_run` takes,
        without embeddings, hidden-state outputs or a feedback hook."""
        ahead = prev_tokens is not None
        plan = DecodePlan(self.graphs.inputs(batch, ahead),  # type: ignore[union-attr]
                          (), None, ahead, list(range(len(batch.seqs))))
        self._share(plan)
        graphed = self._replay(plan, None, prev_tokens)
        assert graphed is not None
        logits = self.model.compute_logits(graphed[0])
        return PendingStep(batch.seqs, self.sampler.sample(
            logits, batch.seqs, self.eos_token_ids, inplace=True, pending=prev_tokens))

    def resolve(self, pending: PendingStep) -> RunnerOutput:
        """Read a launched step's tokens (waiting for the device) and logprobs."""
        out = self.sampler.to_host(pending.sampled, pending.seqs)
        return RunnerOutput(out.token_ids, out.logprobs, [None] * len(pending.seqs))

    @torch.inference_mode()
    def embed(self, input_ids: Tensor) -> Tensor:
        """Token embeddings (T,) -> (T, hidden) outside a step (a stage embedding a prompt as
        it arrives); the other ranks join in (`follow`)."""
        if self.shares_plans:
            self._share(EmbedPlan(int_array(input_ids.tolist())))
        return self.model.embed_input_ids(input_ids.to(self.device))

    # -- the other ranks ---------------------------------------------------------------------
    @torch.inference_mode()
    def follow(self, plan: ForwardPlan | DecodePlan | EmbedPlan) -> None:
        """Run rank 0's plan here (a rank > 0): what rank 0 runs on the device, up to the
        logits, so that this rank takes its part in every collective; nothing is kept."""
        if isinstance(plan, EmbedPlan):
            self.model.embed_input_ids(array_tensor(plan.input_ids).to(self.device))
            return
        if isinstance(plan, DecodePlan):
            graphed = self._replay(plan, None)
            if graphed is None:      # capture failed here as on rank 0: an eager plan follows
                return
            hidden = graphed[0]
        else:
            feats = None
            if plan.deepstack is not None:
                feats = torch.empty(plan.deepstack[1], dtype=self.dtype, device=self.device)
            hidden = self._forward(plan, None, feats)[0]
        if plan.logit_rows:
            self.model.compute_logits(hidden[to_device(plan.logit_rows, self.device)])

    # -- what every rank runs ----------------------------------------------------------------
    def _share(self, plan: ForwardPlan | DecodePlan | EmbedPlan) -> None:
        if self.shares_plans:
            self.ranks.share_plan(plan)

    def _forward(self, plan: ForwardPlan, pieces: list[Tensor] | None, feats: Tensor | None
                 ) -> tuple[Tensor, dict[int, Tensor], bool]:
        """A forward pass, replayed from a prefill graph where one takes the plan, else
        eager -> hidden, captured layers, whether they are a graph's output buffers. pieces:
        the embeddings of plan.embed_rows; feats: the deepstack features (L, K, hidden) (the
        other ranks: None, and a buffer)."""
        dev = self.device
        input_ids = embeds = None        # the graph copies the ids itself from the plan
        if plan.embed_rows is not None:
            input_ids = array_tensor(plan.input_ids).to(dev)
            embeds = self._embed(input_ids, plan.embed_rows, pieces)
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(plan):
            graphed = self.prefill_graphs.run(plan, embeds)
            if graphed is not None:       # None: the fed variant could not be captured
                return graphed[0], graphed[1], True
        if input_ids is None:
            input_ids = array_tensor(plan.input_ids).to(dev)
        return (*self._eager(plan, input_ids, embeds, feats), False)

    def _eager(self, plan: ForwardPlan, input_ids: Tensor, embeds: Tensor | None,
               feats: Tensor | None) -> tuple[Tensor, dict[int, Tensor]]:
        dev, qsl = self.device, plan.query_start_loc
        md = AttentionMetadata(
            slot_mapping=array_tensor(plan.slot_mapping).to(dev),
            query_start_loc=int_tensor(qsl, torch.int32).to(dev),
            seq_lens=int_tensor(plan.seq_lens, torch.int32).to(dev),
            block_tables=array_tensor(plan.block_tables).view(-1, plan.width).to(dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=plan.seq_lens,
            max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
            max_seq_len=max(plan.seq_lens))
        positions = plan.positions
        positions = (positions if isinstance(positions, Tensor)
                     else array_tensor(positions)).to(dev)                 # (T,) or (3, T)
        extra: dict = {}
        if plan.deepstack is not None:
            rows = array_tensor(plan.deepstack[0]).to(dev)
            extra["deepstack"] = (rows, broadcast(feats, self.ranks.tp))  # type: ignore[arg-type]
        self.backend.prepare(md, has_cache=True)
        with forward_context(md):
            return self.model(input_ids, positions, embeds, plan.capture, **extra)

    def _replay(self, plan: DecodePlan, pieces: list[Tensor] | None,
                prev_tokens: Tensor | None = None) -> tuple[Tensor, dict[int, Tensor]] | None:
        """A decode step from its CUDA graph (`DecodeGraphs.run`); the other ranks receive
        rank 0's `prev_tokens` (a step launched ahead)."""
        embeds = None
        if plan.embed_rows is not None:
            embeds = self._embed(plan.inputs.input_ids.to(self.device), plan.embed_rows, pieces)
        if plan.ahead and self.ranks.world_size > 1:
            if prev_tokens is None:
                prev_tokens = torch.empty(plan.inputs.num_seqs, dtype=torch.int64,
                                          device=self.device)
            prev_tokens = broadcast(prev_tokens.contiguous(), self.ranks.tp)
        return self.graphs.run(plan.inputs, plan.capture, embeds,  # type: ignore[union-attr]
                               prev_tokens)

    def _embed(self, input_ids: Tensor, rows: EmbedRows, pieces: list[Tensor] | None
               ) -> Tensor:
        """The token embeddings of input_ids with `rows.replace` replaced and `rows.add`
        added to (the embeddings `pieces`, in that order: rank 0's; the others receive them)."""
        embeds = self.model.embed_input_ids(input_ids)
        parts = self._shared_pieces(pieces, rows.sizes, embeds)
        for (row, n), e in zip(rows.replace, parts):
            embeds[row:row + n] = e
        for (row, n), e in zip(rows.add, parts[len(rows.replace):]):
            embeds[row:row + n] += e
        return embeds

    def _shared_pieces(self, pieces: list[Tensor] | None, sizes: list[int], like: Tensor
                       ) -> list[Tensor]:
        """Rank 0's pieces in `like`'s device and dtype, on every rank: one broadcast of
        them all."""
        if self.ranks.world_size == 1:
            return [p.to(device=like.device, dtype=like.dtype) for p in pieces]  # type: ignore
        if not sizes:
            return []
        if pieces is None:
            payload = like.new_empty(sum(sizes), like.shape[1])
        else:
            payload = torch.cat([p.to(device=like.device, dtype=like.dtype) for p in pieces])
        return list(broadcast(payload, self.ranks.tp).split(sizes))

    @staticmethod
    def _slice_hidden(batch: ScheduledBatch, qsl: list[int], captured: dict[int, Tensor],
                      copy: bool = False) -> list[dict[int, Tensor] | None]:
        """Hidden states of positions not sent before (recompute after preemption re-runs
        positions that were already sent; a downstream stage must see each exactly once).
        copy: the rows live in a CUDA graph's output buffer, which the next replay overwrites."""
        out: list[dict[int, Tensor] | None] = []
        for i, seq in enumerate(batch.seqs):
            layers = seq.sampling_params.output_hidden_layers
            if not layers:
                out.append(None)
                continue
            start = seq.num_computed_tokens
            skip = max(0, seq.num_hidden_emitted - start)
            lo, hi = qsl[i] + skip, qsl[i + 1]
            if lo >= hi:
                out.append(None)
                continue
            out.append({layer: captured[layer][lo:hi].clone() if copy else captured[layer][lo:hi]
                        for layer in layers})
            seq.num_hidden_emitted = start + (hi - qsl[i])
        return out
