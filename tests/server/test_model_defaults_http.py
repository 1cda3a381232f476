"""A model's own shipped selection through the real server: ``obcache-vllm serve`` on Gemma 3
270M with the shipped ``default.yaml`` serves a request that sends only ``kv_budget`` with the
selection the defaults rule chose for Gemma 3 (``models``, written by
``make choose-defaults-gemma3 WRITE=1``), where the default model's server serves the default
model's (``tests/server/test_openai_server.py``); a request naming a selection field gets that
field over the model's selection; ``GET /v1/obcache/config`` names the model and its defaults.
How the selection is chosen and validated: tests/unit/test_model_defaults.py.
"""

from __future__ import annotations

import pytest
from support.server import Launch

from obcache_vllm import admission, config, extra_models

pytestmark = [pytest.mark.server]

GEMMA = extra_models.GEMMA3_270M


@pytest.fixture(scope="module")
def gemma_server(tmp_path_factory):
    path = extra_models.pull(GEMMA)
    # The test servers' settings but their pool, which is counted in the default model's blocks.
    args = ("--model", str(path), "--max-model-len", "2048", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--seed", "0")  # fmt: skip
    launch = Launch(tmp_path_factory.mktemp("gemma-server"), args)
    try:
        yield launch.ready(), path
    finally:
        launch.stop()


def test_a_gemma_server_serves_gemmas_own_selection(gemma_server) -> None:
    server, path = gemma_server
    shipped = config.load_policy({}, model=str(path))
    own = {k: shipped.defaults[k] for k in admission.SELECTION_FIELDS}
    default_model = config.load_policy({})
    assert own != {k: default_model.defaults[k] for k in admission.SELECTION_FIELDS}, \
        "the shipped file gives Gemma 3 no selection of its own: nothing to check here"
    document = server.get_json("/v1/obcache/config")
    assert document["policy"]["model"] == GEMMA.name
    assert {k: document["defaults"][k] for k in own} == own
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    words = " ".join(f"item {i} is {i * 7 % 13}." for i in range(160))
    prompt = tok(words).input_ids[:600]
    body = {"model": str(path), "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "kv_budget": 0.25}  # fmt: skip
    status, reply = server.post_json("/v1/completions", body)
    assert status == 200, reply
    kv = reply["usage"]["obcache"]
    assert (kv["pipeline"], kv["scorer"]) == (own["kv_pipeline"], own["kv_scorer"]), kv
    assert kv["freed_blocks"] > 0, kv  # it evicted, in the global layers
    other = next(s for s in ("attn", "obcache_key") if s != own["kv_scorer"])
    status, named = server.post_json("/v1/completions", {**body, "kv_scorer": other})
    assert status == 200, named
    kv = named["usage"]["obcache"]
    assert (kv["pipeline"], kv["scorer"]) == (own["kv_pipeline"], other), kv
