"""Worker-side per-request eviction state and the per-step plan handed to the attention layers.

Lifecycle of :class:`RequestKvState` (one per budgeted request, in the worker process): created
when the request first reaches the worker, reset when it is resumed after preemption (its KV is
recomputed from scratch), dropped when it finishes or is aborted.

Glossary: ``W`` window queries, ``N`` resident tokens, ``Hq``/``Hkv`` heads, ``D`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from obcache_vllm.options import KvOptions
from obcache_vllm.planning import EvictionOrder
from obcache_vllm.scoring import Pipeline, RunningScores, Scorer

# Decode queries buffered per layer before they are scored in one call (bounds the memory of a
# request whose budget is far away; evictions score the buffer anyway).
DECODE_BUFFER = 64


@dataclass
class RequestKvState:
    """What the worker remembers about one budgeted request between steps."""

    options: KvOptions
    scorer: Scorer
    pipeline: Pipeline
    # Dead head blocks committed after the last step that ran (worker's view of the scheduler's).
    dead: int = 0
    # Last prompt queries per layer [<= W, Hq, D], kept across prefill chunks (window pipelines).
    queries: dict[str, torch.Tensor] = field(default_factory=dict)
    # Running scores per layer (h2o at prefill; every pipeline with kv_decode at decode).
    running: dict[str, RunningScores] = field(default_factory=dict)
    # Decode queries per layer [n, Hq, D] not yet folded into the running scores.
    decode_queries: dict[str, torch.Tensor] = field(default_factory=dict)
    evictions: int = 0
    tokens_evicted: int = 0
    # Debug/verification only (OBCACHE_VLLM_RECORD_KEEP=1): kept indices per layer [Hkv, K]
    # of the last eviction, relative to the resident tokens before it.
    record: dict[str, torch.Tensor] | None = None

    @classmethod
    def create(cls, options: KvOptions) -> RequestKvState:
        scorer, pipeline = options.build_scoring()
        return cls(options=options, scorer=scorer, pipeline=pipeline)

    def reset(self) -> None:
        """Forget everything: the request's KV is being recomputed from position 0."""
        self.dead = 0
        self.queries.clear()
        self.running.clear()
        self.decode_queries.clear()

    def buffer_decode_query(self, layer: str, q: torch.Tensor) -> bool:
        """Append this step's decode query; True when the buffer must be scored now."""
        prev = self.decode_queries.get(layer)
        q = q.detach().clone()
        self.decode_queries[layer] = q if prev is None else torch.cat([prev, q], dim=0)
        return self.decode_queries[layer].shape[0] >= DECODE_BUFFER

    def remember_queries(self, layer: str, q: torch.Tensor, window: int) -> None:
        """Keep the last ``window`` queries of the prompt seen so far (q [n, Hq, D])."""
        prev = self.queries.get(layer)
        q = q.detach()
        if prev is not None and q.shape[0] < window:
            q = torch.cat([prev, q], dim=0)
        self.queries[layer] = q[-window:].clone()


@dataclass(frozen=True)
class RowPlan:
    """One budgeted request in this step: where its queries are and what to do after attention.

    ``logical_len`` is the request's token count in the cache at the end of the step;
    ``prefill`` is True while prompt tokens are being computed (also the prompt's last chunk).
    """

    row: int
    req_id: str
    block_size: int
    state: RequestKvState
    q_start: int
    q_end: int
    logical_len: int
    prompt_len: int
    prefill: bool
    order: EvictionOrder | None


@dataclass(frozen=True)
class StepPlan:
    """Everything the attention path of one step needs; built by the model runner.

    ``dead`` [num_reqs] is each row's dead-block count *before* the step (the read shift).
    """

    dead: tuple[int, ...]
    rows: tuple[RowPlan, ...]
    block_size: int
    # Filled by the attention layers: seconds spent scoring and compacting in this step.
    timings: list[float] = field(default_factory=list)
    # Flat cache offsets of each row's resident tokens (row -> (k, v)), shared by all layers.
    offsets: dict = field(default_factory=dict)

    @property
    def shifts_reads(self) -> bool:
        return any(self.dead)
