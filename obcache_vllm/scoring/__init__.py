"""Scoring and token selection for KV-cache eviction: pure torch, no vLLM.

score (``make_scorer``) -> pipeline (``make_pipeline``: which queries, pooling) -> kept indices
(``select_keep``) -> decode-time ``RunningScores``. The OBCache formulas (arXiv 2510.07651)
are in the docstring of :mod:`obcache_vllm.scoring.scores`.
"""

from obcache_vllm.scoring.attention import WindowAttention
from obcache_vllm.scoring.geometry import HeadGeometry
from obcache_vllm.scoring.pipelines import (
    PIPELINE_NAMES,
    Pipeline,
    make_pipeline,
    pipeline_class,
    pipeline_names,
    pool_positions,
    register_pipeline,
    unregister_pipeline,
)
from obcache_vllm.scoring.running import RunningScores
from obcache_vllm.scoring.scores import SCORER_NAMES, Scorer, make_scorer
from obcache_vllm.scoring.selection import select_keep, share_across_heads

__all__ = [
    "PIPELINE_NAMES",
    "SCORER_NAMES",
    "HeadGeometry",
    "Pipeline",
    "RunningScores",
    "Scorer",
    "WindowAttention",
    "make_pipeline",
    "make_scorer",
    "pipeline_class",
    "pipeline_names",
    "pool_positions",
    "register_pipeline",
    "select_keep",
    "share_across_heads",
    "unregister_pipeline",
]
