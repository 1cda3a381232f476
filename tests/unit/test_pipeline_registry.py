"""A pipeline registered and nothing else: accepted, validated, evaluated and run.

Nothing outside ``obcache_vllm/scoring`` may switch on a pipeline's name: options validation,
the query window, the refusals, the evaluation grid and the HF reference ask the class
(``window``, ``running_mode``, ``scored``, ``takes_options``, ``sums_every_query``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from obcache_vllm.admission import parse_kv_options
from obcache_vllm.evidence.eval.cells import Cell
from obcache_vllm.evidence.eval.grid import grid
from obcache_vllm.options import KvOptionsError
from obcache_vllm.scoring import Pipeline, pipeline_names, register_pipeline, unregister_pipeline
from obcache_vllm.scoring.pipelines import _last_queries


@dataclass(frozen=True)
class LastTwo(Pipeline):
    """The score of the last two queries; at decode, the newest replaces it."""

    name = "last_two"
    running_mode = "last"

    @property
    def window(self) -> int:
        return 2

    def prefill_scores(self, scorer, q, k, v, geom, q_pos=None, k_pos=None):
        q, q_pos, k_pos = _last_queries(2, q, k, q_pos, k_pos)
        return scorer(q, k, v, geom, q_pos, k_pos)


@dataclass(frozen=True)
class EverySum(LastTwo):
    name = "every_sum"
    running_mode = "sum"
    sums_every_query = True

    @property
    def window(self) -> None:
        return None


@pytest.fixture
def registered():
    register_pipeline(LastTwo)
    register_pipeline(EverySum)
    yield
    unregister_pipeline("last_two")
    unregister_pipeline("every_sum")


def test_a_registered_pipeline_is_accepted_with_what_it_declares(registered):
    assert pipeline_names()[-2:] == ("last_two", "every_sum")
    opts = parse_kv_options({"kv_budget": 64, "kv_pipeline": "last_two"}, 200)
    assert opts.pipeline == "last_two" and opts.query_window == 2
    scorer, pipeline = opts.build_scoring()
    assert isinstance(pipeline, LastTwo) and pipeline.per_head
    # Scores from exactly its window, through the scorer the options name.
    q, k, v = torch.randn(8, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    from obcache_vllm.scoring import HeadGeometry

    geom = HeadGeometry(4, 2, 16, 0.25)
    q_pos, k_pos = torch.arange(12, 20), torch.arange(20)
    got = pipeline.prefill_scores(scorer, q, k, v, geom, q_pos, k_pos)
    assert torch.equal(got, scorer(q[-2:], k, v, geom, q_pos[-2:], k_pos))
    # kv_session: refused only for the one that sums every query, named in the reason.
    assert parse_kv_options({"kv_budget": 64, "kv_pipeline": "last_two", "kv_session": True},
                            200).session  # fmt: skip
    assert parse_kv_options({"kv_budget": 64, "kv_pipeline": "every_sum"}, 200).query_window == -1
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({"kv_budget": 64, "kv_pipeline": "every_sum", "kv_session": True}, 200)
    assert info.value.field == "kv_session" and "every_sum" in str(info.value)
    assert "last_two" in str(info.value) and "h2o" not in str(info.value).split("use ")[1]
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({"kv_budget": 64, "kv_pipeline": "every_sum", "kv_when": "pressure"}, 200)
    assert info.value.field == "kv_when"


def test_an_unregistered_pipeline_is_refused_naming_the_field():
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({"kv_budget": 64, "kv_pipeline": "last_two"}, 200)
    assert info.value.field == "kv_pipeline"


def test_a_registered_pipeline_is_evaluated(registered):
    cells = grid(tasks=["niah_single"], lengths=[512], samples=2, seed=0, chat=False,
                 pipelines=["last_two"], scorers=["attn", "obcache_key"], budgets=[0.2],
                 settings=["query_aware"], windows=[64], per_heads=[True], full=False,
                 prefill_evicts=[False], engine="vllm")  # fmt: skip
    assert [c.method for c in cells] == ["last_two/attn", "last_two/obcache_key"]
    args = Cell("niah_single", 512, "query_aware", "last_two", "attn", 0.2, 2, 0, False)
    assert args.extra_args(100) == {"kv_budget": 20, "kv_pipeline": "last_two",
                                    "kv_scorer": "attn"}  # fmt: skip
