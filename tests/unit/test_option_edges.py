"""Edges of the kv_* options found by the HTTP fuzzer (tests/server/test_fuzz.py), pure Python."""

from __future__ import annotations

import pytest

from obcache_vllm import admission
from obcache_vllm.admission import parse_kv_options, resolve
from obcache_vllm.options import KvOptionsError, bounded
from obcache_vllm.vllm_ext.frontend import server

BUDGET = {"kv_budget": 64}


@pytest.mark.parametrize("field", ["kv_decode", "kv_per_head"])
@pytest.mark.parametrize(
    "value, expected",
    [
        pytest.param(True, True, id="json-true"),
        pytest.param("False", False, id="string"),
        pytest.param(1, True, id="one"),  # what vllm_xargs makes of a JSON true
        pytest.param(0, False, id="zero"),
    ],
)
def test_booleans_accept_what_vllm_xargs_makes_of_them(field, value, expected):
    opts = parse_kv_options({**BUDGET, field: value}, 500)
    assert getattr(opts, field.removeprefix("kv_")) is expected


@pytest.mark.parametrize("value", [2, -1, 1.0, "yes", None])
def test_other_values_are_not_booleans(value):
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({**BUDGET, "kv_decode": value}, 500)
    assert info.value.field == "kv_decode"


def test_window_is_bounded_by_the_context():
    assert parse_kv_options({**BUDGET, "kv_window": 2048}, 500, max_model_len=2048).window == 2048
    for window in (2049, 1e308):  # 1e308 is an integer-valued float: int(1e308) before
        with pytest.raises(KvOptionsError) as info:
            parse_kv_options({**BUDGET, "kv_window": window}, 500, max_model_len=2048)
        assert info.value.field == "kv_window" and len(str(info.value)) < 200
    assert parse_kv_options({**BUDGET, "kv_window": 4096}, 500).window == 4096  # no context known


def test_errors_never_echo_a_huge_value():
    huge = "x" * (1 << 20)
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({**BUDGET, "kv_scorer": huge}, 500)
    assert len(str(info.value)) < 300 and "1048578 chars" in str(info.value)
    assert info.value.value is huge  # the exception keeps it; responses show .shown_value
    assert len(str(info.value.shown_value)) < 120
    assert bounded(64) == 64 and bounded("attn") == "attn"


def test_vllm_xargs_values_are_checked_on_their_own():
    """The server checks them before vLLM's own extra_args check (which names no field)."""
    xargs = {"kv_budget": 2**64, "other": 2**64}
    with pytest.raises(KvOptionsError) as info:
        server.parse_fields(xargs, None)
    assert info.value.field == "kv_budget"
    assert server.parse_fields({"kv_budget": 64, "other": 2**64}, None).request.budget == 64


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({"kv_pipeline": "h2o"}, id="h2o"),
        pytest.param({"kv_compress_at": 100}, id="compress-at"),
        pytest.param({"kv_prefill_evict": True}, id="prefill-evict"),
    ],
)
def test_sessions_refuse_what_a_continued_cache_cannot_carry(extra):
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({**BUDGET, "kv_session": True, **extra}, 500)
    assert info.value.field == "kv_session"
    assert parse_kv_options({**BUDGET, "kv_session": False, **extra}, 500) is not None


def test_the_wire_form_round_trips_and_refuses_what_it_does_not_know():
    from obcache_vllm.options import KvOptions, WireError, admitted_options

    opts = parse_kv_options({"kv_budget": 0.25, "kv_session": True, "kv_decode": 1}, 500)
    wire = opts.to_wire()
    assert KvOptions.from_wire(list(wire)) == opts  # msgspec turns the tuple into a list
    assert KvOptions.from_wire(wire).requested_budget == 0.25
    assert admitted_options({"obcache": wire, "other": 1}) == opts
    assert admitted_options({"other": 1}) is None
    for broken in (wire[:-1], ("obcache/0", *wire[1:]), (wire[0], "x", *wire[2:]), 7):
        with pytest.raises(WireError):
            KvOptions.from_wire(broken)
    with pytest.raises(WireError, match="bypassed"):  # kv_* fields but never admitted
        admitted_options({"kv_budget": 64})


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        pytest.param({"kv_prefill_evict": True}, "kv_prefill_evict", id="prefill-evict"),
        pytest.param({"kv_when": "pressure"}, "kv_when", id="pressure"),
        pytest.param({"kv_budget": {"max_error": 0.05}}, "kv_budget", id="error-target"),
    ],
)
def test_adakv_refuses_what_would_read_or_rewrite_its_per_head_layout(extra, field):
    with pytest.raises(KvOptionsError) as info:
        parse_kv_options({**BUDGET, "kv_pipeline": "adakv", **extra}, 500)
    assert info.value.field == field
    assert "adakv" in str(info.value)
    # The same options on the uniform host are served.
    assert parse_kv_options({**BUDGET, "kv_pipeline": "snapkv", **extra}, 500) is not None


def test_adakv_takes_decode_time_eviction():
    # Decode-time orders re-select every head over its own entries (tests/engine/test_adakv.py).
    opts = parse_kv_options({**BUDGET, "kv_pipeline": "adakv", "kv_decode": True}, 500)
    assert opts.decode and opts.heads_own_memory


def test_adakv_takes_a_layer_ranking_default_without_effect():
    # The shipped server default is one ranking per layer (kv_per_head false): adakv ignores it.
    assert parse_kv_options({**BUDGET, "kv_pipeline": "adakv", "kv_per_head": False}, 500)


def test_adakv_takes_sessions_but_auto_never_starts_one():
    """A session carries adakv's per-head layout (``kv_session``, or vLLM's ``session_id``);
    ``kv_compress_at: "auto"`` never starts one for it, tentative or continued (its caches
    become no entry to share at a compress point)."""
    from obcache_vllm.admission import parse_request

    assert parse_kv_options({**BUDGET, "kv_pipeline": "adakv", "kv_session": True}, 500).session
    request = parse_request({**BUDGET, "kv_pipeline": "adakv", "kv_compress_at": "auto"})
    assert admission.joins_session(request)  # vLLM's session_id
    assert resolve(request, 500, session_id="chat-1").session
    first = resolve(request, 500, auto_point=None, auto_session=True)
    assert not first.session and not first.tentative
    again = resolve(request, 500, auto_point=None, auto_session=False)
    assert not again.session and not again.tentative and again.compress_at is None
    assert parse_kv_options({**BUDGET, "kv_pipeline": "adakv", "kv_compress_at": 300}, 500)


def test_adakv_is_refused_where_per_head_memory_is_not_built():
    """Admission reads the platform adapter's declared capabilities, not the device type."""
    from types import SimpleNamespace

    from obcache_vllm.admission import CAPABILITIES, heads_memory_refusal

    def config(tp=1):
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp))

    cpu, cuda = CAPABILITIES["cpu"], CAPABILITIES["cuda"]
    ada = parse_kv_options({**BUDGET, "kv_pipeline": "adakv"}, 500)
    snap = parse_kv_options(BUDGET, 500)
    assert heads_memory_refusal(config(), cpu, ada) is None
    assert "tensor parallelism" in heads_memory_refusal(config(tp=2), cpu, ada)
    assert "FlashAttention" in heads_memory_refusal(config(), cuda, ada)
    assert heads_memory_refusal(config(tp=2), cuda, snap) is None


def test_a_session_id_never_joins_an_error_target_to_a_session():
    """Found by the scheduler harness: vLLM's ``session_id`` made an error target a session
    (an explicit ``kv_session`` is refused with it): its turns would have estimated their
    error on a cache earlier turns compressed already."""
    from obcache_vllm.admission import parse_request

    target = parse_request({"kv_budget": {"max_error": 0.01}})
    assert not admission.joins_session(target)
    resolved = resolve(target, 500, session_id="s1")
    assert not resolved.session and resolved.max_error == 0.01
    assert resolve(parse_request({"kv_budget": 64}), 500, session_id="s1").session
