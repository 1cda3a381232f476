"""Grid cells of the accuracy evaluation and their resumable results file (stdlib only).

A :class:`Cell` is one point of the grid: a task at a nominal length, a setting, a method
(pipeline + scorer + window) and a budget, evaluated on ``samples`` samples from ``seed``. Its
``key`` names everything that changes the result, so a results file (JSONL, one finished cell
per line) can be resumed: a cell whose key is already in the file is not computed again.

Settings:
  full            no eviction (the reference each budget is compared with)
  query_aware     the whole prompt (document + question) is compressed at the end of prefill
  query_agnostic  the document is compressed before the question is seen (``kv_compress_at``
                  = the document's token count); the question is prefilled on top

Prefill eviction: ``prefill_evict`` sends ``kv_prefill_evict: true`` (evict after every prefill
chunk; the engine's chunk is the harness's ``chunk``) and the method name gets ``+pe``.

Selection: ``per_head`` (the default, ``kv_per_head: true``) lets every KV head keep its own top
tokens; ``per_head=False`` sends ``kv_per_head: false`` (one ranking per layer, shared by its
heads) and the method name gets a ``/shared`` suffix. Position-only methods (full, streaming)
have no ranking and are always ``per_head=True``.

Budgets are fractions of the DOCUMENT's tokens in both settings, sent as an integer
``kv_budget = ceil(fraction * document tokens)``, so both settings (and kvpress) keep the same
count of cached tokens out of the same document.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

SETTINGS = ("full", "query_aware", "query_agnostic")
FULL = "full"


def ranks(pipeline: str) -> bool:
    """Whether ``pipeline`` ranks tokens by a score (the full cache and streaming do not)."""
    from obcache_vllm.scoring import pipeline_class

    return pipeline != FULL and pipeline_class(pipeline).scored


def takes_window(pipeline: str) -> bool:
    """Whether ``pipeline`` takes ``kv_window`` (snapkv's observation window)."""
    from obcache_vllm.scoring import pipeline_class

    return pipeline != FULL and "window" in pipeline_class(pipeline).takes_options


@dataclass(frozen=True)
class Cell:
    """One grid point. ``pipeline == "full"`` (with ``setting == "full"``) is the full cache."""

    task: str
    length: int
    setting: str
    pipeline: str
    scorer: str
    budget: float  # fraction of the document's tokens; 1.0 for the full cache
    samples: int
    seed: int
    chat: bool
    window: int = 0  # snapkv observation window (0: not applicable)
    engine: str = "vllm"  # "vllm" (this project) or "kvpress" (the reference)
    per_head: bool = True  # False: one ranking per layer (kv_per_head: false)
    prefill_evict: bool = False  # True: evict after every prefill chunk (kv_prefill_evict)

    def __post_init__(self) -> None:
        if self.setting not in SETTINGS:
            raise ValueError(f"unknown setting {self.setting!r}; known: {', '.join(SETTINGS)}")
        if (self.setting == FULL) != (self.pipeline == FULL):
            raise ValueError("the full cache is setting 'full' with pipeline 'full'")
        if not 0.0 < self.budget <= 1.0:
            raise ValueError(f"budget must be a fraction in (0, 1], got {self.budget}")
        if not self.per_head and not ranks(self.pipeline):
            raise ValueError(f"{self.pipeline!r} ranks nothing: per_head=False does not apply")
        if self.prefill_evict and self.pipeline == FULL:
            raise ValueError("the full cache evicts nothing: prefill_evict does not apply")

    @property
    def method(self) -> str:
        """``pipeline/scorer`` (``+w<window>`` for snapkv, ``/shared`` for one ranking per
        layer), e.g. ``snapkv/obcache_key+w16`` or ``tova/attn/shared``."""
        if self.pipeline == FULL:
            return FULL
        name = f"{self.pipeline}/{self.scorer}" if ranks(self.pipeline) else self.pipeline
        if takes_window(self.pipeline):
            name = f"{name}+w{self.window}"
        if self.prefill_evict:
            name = f"{name}+pe"
        return name if self.per_head else f"{name}/shared"

    @property
    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    def budget_tokens(self, document_tokens: int) -> int:
        return math.ceil(self.budget * document_tokens)

    def extra_args(self, document_tokens: int) -> dict | None:
        """``SamplingParams.extra_args`` of this cell's requests (None: a stock request)."""
        if self.pipeline == FULL:
            return None
        args = {"kv_budget": self.budget_tokens(document_tokens), "kv_pipeline": self.pipeline}
        if ranks(self.pipeline):  # streaming has no score
            args["kv_scorer"] = self.scorer
        if takes_window(self.pipeline):
            args["kv_window"] = self.window
        if self.setting == "query_agnostic":
            args["kv_compress_at"] = document_tokens
        if not self.per_head:
            args["kv_per_head"] = False
        if self.prefill_evict:
            args["kv_prefill_evict"] = True
        return args


def kept_tokens(compressed: int, budget: int, block_size: int) -> int:
    """KV tokens left of ``compressed`` ones by the engine's rule (planning.plan_eviction)."""
    from obcache_vllm.eviction.planning import plan_eviction

    order = plan_eviction(
        logical_len=compressed, budget=budget, dead_blocks=0, block_size=block_size
    )
    return compressed if order is None else order.kept


def load_results(path: Path) -> dict[str, dict]:
    """Finished cells of a results file, by key (a torn last line is ignored)."""
    done: dict[str, dict] = {}
    if not path.exists():
        return done
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # an interrupted write; that cell is recomputed
        done[Cell(**record["cell"]).key] = record
    return done


def append_result(path: Path, cell: Cell, result: dict) -> dict:
    """Append one finished cell (a full line, flushed) and return the record written."""
    record = {"cell": asdict(cell), **result}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
    return record
