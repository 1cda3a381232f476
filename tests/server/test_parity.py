"""Stock parity of every request option of vLLM's completions and chat APIs (the quick run).

Every field of vLLM's ``CompletionRequest`` and ``ChatCompletionRequest`` models, sent to the
session's plugin server and to stock vLLM (``VLLM_PLUGINS=``) from the same install: the same
status and the same response without kv_* fields; with a budget, never a 5xx and never a 4xx
without a reason. ``make parity`` runs every value and budget shape (results/parity/).
"""

from __future__ import annotations

from loadtest import parity


def test_every_request_option_behaves_as_in_stock_vllm(server, stock_server):
    report = parity.run(server.url, stock_server.url, quick=True, workers=4)
    assert report["fields_without_values"] == []
    differences = [r for r in report["results"] if r["same"] is False]
    assert report["stock_differences"] == 0, differences[:3]
    assert report["stock_cases"] >= 70  # 55 completion fields + the chat-only ones in vLLM 0.32
    bad = [r for r in report["results"] if r["case"]["budget"] and not r["plugin_status"] < 500]
    assert report["budgeted_5xx"] == 0 and report["budgeted_4xx_without_reason"] == 0, bad[:3]
    beam = [r for r in report["results"]
            if r["case"]["field"] == "use_beam_search" and r["case"]["budget"] is None]
    assert beam and all(r["plugin_status"] == 200 for r in beam)  # a 500 before this suite
