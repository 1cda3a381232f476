"""``kv_compress_at: "auto"``: the prefix index, the point it chooses, the policy applying it."""

from __future__ import annotations

import pytest

from obcache_vllm import admission, config, options
from obcache_vllm.eviction.sightings import MIN_SHARE, PrefixSightings, Sighting, auto_point
from obcache_vllm.vllm_ext.frontend import server


def _shared(index: PrefixSightings, tokens, seed=None) -> int:
    return index.observe(tokens, seed).shared


def test_the_longest_seen_prefix_in_whole_blocks_then_the_prompt_is_recorded() -> None:
    index = PrefixSightings(block_size=4)
    doc = list(range(100, 140))  # 10 blocks
    assert _shared(index, doc + [1, 2, 3]) == 0  # nothing seen yet
    assert _shared(index, doc + [7, 8, 9, 10, 11]) == 40  # the document's 10 blocks
    # a prompt that diverges inside block 3 shares blocks 0-2 only
    assert _shared(index, doc[:13] + [0] * 20) == 12
    # the whole of a repeated prompt: 43 tokens, 10 full blocks
    assert _shared(index, doc + [1, 2, 3]) == 40


def test_salts_and_adapters_never_match_each_other() -> None:
    index = PrefixSightings(block_size=4)
    doc = list(range(32))
    _shared(index, doc, seed=("salt-a", None))
    assert _shared(index, doc, seed=("salt-b", None)) == 0
    assert _shared(index, doc, seed=("salt-a", "lora-1")) == 0
    assert _shared(index, doc, seed=("salt-a", None)) == 32


def test_the_index_is_bounded_and_forgets_the_least_recently_seen() -> None:
    index = PrefixSightings(block_size=2, capacity=6)
    old, new = [1] * 8, [2] * 8  # 4 blocks each
    _shared(index, old)
    _shared(index, new)  # 8 hashes > 6: old's first two blocks go
    assert len(index) == 6
    # a chain hash covers every token before it: old's deepest blocks still prove its prefix
    assert _shared(index, old) == 8
    index = PrefixSightings(block_size=2, capacity=4)
    _shared(index, old)
    _shared(index, new)  # old is gone entirely
    assert _shared(index, old) == 0


@pytest.mark.parametrize(
    "shared, prompt, point",
    [
        (0, 100, None),  # nothing shared
        (32, 100, None),  # under half the prompt: a short common head leaves it whole
        (64, 100, 64),
        (100, 100, 99),  # a repeated prompt: one token is left for the question
    ],
)
def test_auto_point(shared: int, prompt: int, point: int | None) -> None:
    assert MIN_SHARE == 0.5
    assert auto_point(shared, prompt) == point


def test_a_repeated_prompt_compresses_where_it_was_compressed_before() -> None:
    index = PrefixSightings(block_size=16)
    prompt = list(range(1, 41))  # 2 whole blocks and an 8-token tail
    first = index.observe(prompt)
    assert (first.shared, first.continues, first.repeats, first.point) == (0, False, False, None)
    index.remember(prompt, None, 39)  # a first sighting: all but its last token
    again = index.observe(prompt)
    assert (again.shared, again.continues, again.repeats, again.point) == (32, False, True, 39)
    # not the shared blocks' end (32): where the first was compressed
    assert auto_point(again.shared, 40) == 32 and auto_point(again.shared, 40, again.point) == 39
    index.remember(prompt, None, None)  # compressed whole (no point): the usual rule
    assert index.observe(prompt).point is None
    # another salt, or one token more or less, is no repeat
    assert not index.observe(prompt, seed="salt").repeats
    assert not index.observe(prompt[:-1]).repeats and not index.observe([*prompt, 7]).repeats
    index.remember([5] * 40, None, 12)  # never observed: nothing recorded
    assert not index.observe([5] * 40).repeats


def test_auto_resolves_to_the_point_or_the_whole_prompt() -> None:
    request = admission.parse_request({"kv_budget": 0.25, "kv_compress_at": "auto"})
    assert request.compress_at == options.AUTO
    at = admission.resolve(request, 1000, auto_point=800)
    assert (at.compress_at, at.budget) == (800, 200)  # the fraction is of the shared prefix
    whole = admission.resolve(request, 1000)
    # compressed whole but its last token (computed on the compressed cache, so a repeat of
    # the prompt adopts this cache: options.FIRST_POINT); it may be a chat's first turn: a
    # tentative session
    assert (whole.compress_at, whole.budget) == (999, 250)
    assert (whole.session, whole.tentative) == (True, True)
    # where the budget leaves no room before the last token, the whole prompt as before
    tight_request = admission.parse_request({"kv_budget": 999, "kv_compress_at": "auto"})
    tight = admission.resolve(tight_request, 1000)
    assert (tight.compress_at, tight.session, tight.tentative) == (None, True, True)
    assert (at.session, at.tentative) == (False, False)
    # a continuation is a session of its own, not tentative
    turn = admission.resolve(request, 1000, auto_session=True)
    assert (turn.session, turn.tentative) == (True, False)
    # a pipeline whose running sums cannot travel with a cache starts no session
    h2o = admission.parse_request({"kv_budget": 0.25, "kv_compress_at": "auto",
                                 "kv_pipeline": "h2o"})  # fmt: skip
    h2o_whole = admission.resolve(h2o, 1000)
    assert (h2o_whole.session, h2o_whole.tentative) == (False, False)
    # the wire form carries it
    assert options.KvOptions.from_wire(whole.to_wire()).tentative is True
    # a point whose budget leaves no room beyond the sinks and recent tokens: the whole
    # prompt (but its last token), as a first sighting
    low = admission.resolve(request, 1000, auto_point=60)
    assert (low.compress_at, low.tentative) == (999, True)
    # a token budget at least the point: nothing to evict there, the whole prompt
    fixed = admission.parse_request({"kv_budget": 300, "kv_compress_at": "auto"})
    assert admission.resolve(fixed, 1000, auto_point=200).compress_at == 999
    assert admission.resolve(fixed, 1000, auto_point=800).compress_at == 800


@pytest.mark.parametrize("value", ["later", "Auto", ""])
def test_other_strings_are_refused_naming_the_field(value: str) -> None:
    with pytest.raises(options.KvOptionsError, match="auto") as info:
        admission.parse_request({"kv_budget": 64, "kv_compress_at": value})
    assert info.value.field == "kv_compress_at"


def test_auto_is_refused_where_a_compress_point_is() -> None:
    with pytest.raises(options.KvOptionsError) as info:
        admission.parse_request({"kv_budget": 64, "kv_compress_at": "auto", "kv_session": True})
    assert info.value.field == "kv_session"


def test_the_policy_budget_compresses_at_the_shared_prefix_and_a_clients_own_does_not() -> None:
    server.reset_defaults({**config.BUILTIN_DEFAULTS, "kv_budget": 0.25})
    try:
        assert server.parse_fields(None, {}).request.compress_at == options.AUTO
        # the client's own budget, point or opt-out are its own
        assert server.parse_fields(None, {"kv_budget": 0.25}).request.compress_at is None
        assert server.parse_fields(None, {"kv_compress_at": 500}).request.compress_at == 500
        assert server.parse_fields(None, {"kv_budget": None}) is None
        # options that allow no compress point keep the whole prompt
        assert server.parse_fields(None, {"kv_when": "pressure"}).request.compress_at is None
        assert server.parse_fields(None, {"kv_prefill_evict": True}).request.compress_at is None
    finally:
        server.reset_defaults()
    server.reset_defaults({**config.BUILTIN_DEFAULTS, "kv_budget": 0.25}, compress_at=None)
    try:
        assert server.parse_fields(None, {}).request.compress_at is None
    finally:
        server.reset_defaults()


def test_the_policy_key_from_file_environment_and_flag(tmp_path) -> None:
    assert config.load_policy({}).compress_at == options.AUTO
    path = tmp_path / "c.yaml"
    path.write_text("kv_budget: 0.25\ncompress_at: null\n")
    assert config.load_policy({config.CONFIG_ENV: str(path)}).compress_at is None
    env = {config.CONFIG_ENV: str(path), config.COMPRESS_AT_ENV: "auto"}
    assert config.load_policy(env).compress_at == options.AUTO
    with pytest.raises(config.ConfigError, match="OBCACHE_POLICY_COMPRESS_AT.*compress_at"):
        config.load_policy({config.COMPRESS_AT_ENV: "512"})
    from obcache_vllm import cli

    rest, env = cli.split_policy_args(["--default-compress-at", "null", "--port", "1"])
    assert rest == ["--port", "1"] and env == {config.COMPRESS_AT_ENV: "null"}
    assert config.load_policy(env).compress_at is None


def test_a_prompt_that_extends_a_whole_recorded_prompt_continues_it() -> None:
    index = PrefixSightings(block_size=4)
    turn1 = list(range(10))  # 2 full blocks and a 2-token tail
    assert index.observe(turn1) == Sighting(0, False)
    turn2 = turn1 + [50, 51, 52, 53, 54]  # the answer and the next message appended
    assert index.observe(turn2) == Sighting(8, True)
    # questions over one document: the earlier prompt is not a prefix (its question differs)
    doc = list(range(100, 124))
    index.observe(doc + [1, 2])
    assert index.observe(doc + [3, 4, 5]) == Sighting(24, False)
    # the same prompt again is no continuation (nothing was appended)
    assert index.observe(doc + [3, 4, 5]).continues is False
    # a continuation of a prompt with no tail (a multiple of the block size)
    index.observe(list(range(200, 208)))
    assert index.observe(list(range(200, 209))) == Sighting(8, True)
    # the seed separates them
    assert index.observe(turn2 + [9], seed="other").continues is False


def test_a_continuation_is_served_as_a_session_where_the_pipeline_allows() -> None:
    request = admission.parse_request({"kv_budget": 0.25, "kv_compress_at": "auto"})
    continued = admission.resolve(request, 1000, auto_point=800, auto_session=True)
    assert (continued.session, continued.compress_at, continued.budget) == (True, None, 250)
    h2o = admission.parse_request({"kv_budget": 0.25, "kv_compress_at": "auto",
                                 "kv_pipeline": "h2o"})  # fmt: skip
    at = admission.resolve(h2o, 1000, auto_point=800, auto_session=True)  # its sums cannot travel
    # ...and its cache never becomes an entry, so a shared point is no use: the whole prompt
    assert (at.session, at.compress_at) == (False, None)


@pytest.mark.parametrize("pipeline", ["h2o", "adakv"])
def test_auto_compresses_whole_prompts_for_pipelines_without_entries(pipeline) -> None:
    """A compress point pays only when the compressed prefix becomes an entry others adopt;
    h2o (running sums) and adakv (per-head memory) never leave one (found by the scheduler
    harness: they were compressed query-agnostically for nothing)."""
    request = admission.parse_request({"kv_budget": 0.25, "kv_compress_at": "auto",
                                     "kv_pipeline": pipeline})  # fmt: skip
    resolved = admission.resolve(request, 1000, auto_point=800)
    assert (resolved.compress_at, resolved.session, resolved.budget) == (None, False, 250)
    snapkv = admission.parse_request({"kv_budget": 0.25, "kv_compress_at": "auto"})
    assert admission.resolve(snapkv, 1000, auto_point=800).compress_at == 800


@pytest.mark.parametrize(
    "fields, joins",
    [
        ({}, True),
        ({"kv_compress_at": "auto"}, True),
        ({"kv_compress_at": 500}, False),  # a position of its own
        ({"kv_pipeline": "h2o"}, False),  # its running sums cannot travel with the cache
        ({"kv_prefill_evict": True}, False),
        ({"kv_when": "pressure"}, False),
    ],
)
def test_a_vllm_session_id_joins_a_session_where_the_options_allow(fields, joins) -> None:
    request = admission.parse_request({"kv_budget": 0.25, **fields})
    assert admission.joins_session(request) is joins
    got = admission.resolve(request, 1000, session_id="chat-1")
    assert got.session is joins
    alone = admission.resolve(request, 1000)  # no id: no session, but "auto" starts a tentative one
    assert alone.session is alone.tentative is (joins and request.compress_at == options.AUTO)
    assert got.tentative is False
    if joins:
        assert (got.compress_at, got.budget) == (None, 250)
