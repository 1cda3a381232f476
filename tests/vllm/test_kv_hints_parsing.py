"""kv_hints: the obcache.kv_options action of vLLM's KvHintsEnvelope, parsed and refused."""

from __future__ import annotations

import pytest
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from obcache_vllm.admission import (
    HINT_ACTION_TYPE,
    HINT_ACTION_VERSION,
    hinted_fields,
)
from obcache_vllm.options import KvOptionsError


def _envelope(*actions: KvHintAction) -> KvHintsEnvelope:
    return KvHintsEnvelope(protocol_version="1", message_id="m-1", actions=list(actions))


def _ours(payload, version=HINT_ACTION_VERSION, action_id="a-1") -> KvHintAction:
    return KvHintAction(action_id, HINT_ACTION_TYPE, version, payload)


def test_the_action_payload_is_the_requests_kv_fields_and_others_are_ignored() -> None:
    other = KvHintAction("x", "offload.prefetch", "3", {"tier": "cpu"})
    env = _envelope(other, _ours({"kv_budget": 0.25, "kv_session": True}))
    assert hinted_fields(env) == {"kv_budget": 0.25, "kv_session": True}
    assert hinted_fields(_envelope(other)) == {}
    assert hinted_fields(None) == {}


@pytest.mark.parametrize(
    "env, reason",
    [
        (_envelope(_ours({"kv_budget": 64}, version="2")), "version '2'"),
        (_envelope(_ours(["kv_budget", 64])), "payload must be an object"),
        (_envelope(_ours({"temperature": 0.5})), "kv_\\* fields only"),
        (_envelope(_ours({"kv_budget": 64}), _ours({"kv_budget": 32}, action_id="a-2")),
         "more than one"),
    ],
)  # fmt: skip
def test_a_malformed_hint_is_refused_with_its_reason(env, reason) -> None:
    with pytest.raises(KvOptionsError, match=reason) as info:
        hinted_fields(env)
    assert info.value.field == "kv_hints"
