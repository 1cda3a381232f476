"""Property-based fuzzing of the HTTP surface (issue #12, item 5): kv_* fields on both endpoints.

Every case is one raw HTTP request to the session's real server (`server`, tests/conftest.py):
``/v1/completions`` or ``/v1/chat/completions``, streaming or not, carrying kv_* fields at the
top level and/or in ``vllm_xargs`` with hostile values (wrong types, huge ints, 1e308, -0.0,
subnormals, NaN/Infinity tokens, unicode values and key names, nested JSON, duplicate keys in
the raw bytes, huge strings and lists), sometimes with abused generic parameters (``seed``,
``n``, ``stop``), sometimes with a prompt long enough for the budget to evict for real.

Properties:
* no response has a 5xx status, and a stream that started (200) ends with ``[DONE]`` and
  carries no error event;
* a 4xx of a request whose only unusual content is kv_* fields names one of its kv_* keys
  (``error.param`` or the message);
* the engine survives everything: ``/health`` after every case, and at the end a normal request
  succeeds and nothing is left running or holding blocks
  (``test_the_server_is_healthy_after_the_fuzzing``).

Bounded for CI (``OBCACHE_FUZZ_EXAMPLES`` cases per test, default below, derandomized: the same
cases every run); ``make fuzz`` runs many more with a random seed (``OBCACHE_FUZZ_RANDOM=1``).
No shrinking: the cases share one server, whose death would make every later case fail too;
the failing request is in the assertion message. Counts: ``-s`` prints them, and
``OBCACHE_FUZZ_REPORT=path.json`` writes them (``seconds``: since this module was imported,
the server's start included when it comes first).
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from support.server import MODEL_NAME, Server, healthy

from obcache_vllm.options import FIELDS, OPTIONS
from obcache_vllm.scoring import PIPELINE_NAMES, SCORER_NAMES
from obcache_vllm.textgen import haystack

EXAMPLES = int(os.environ.get("OBCACHE_FUZZ_EXAMPLES", "250"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=os.environ.get("OBCACHE_FUZZ_RANDOM", "") != "1",
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=list(HealthCheck),
)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
LONG_PROMPT = haystack(12, seed=7)  # ~400 tokens: budgets of 21-300 evict for real
STATS: Counter = Counter()
STARTED = time.monotonic()  # module import: the counts' time covers the fuzzing tests


# --- values -----------------------------------------------------------------------------

HUGE_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**100]
ODD_FLOATS = [1e308, -1e308, -0.0, 0.0, 5e-324, 2.2250738585072014e-308, 1e-9, 0.5, 1.0,
              1.0000000000000002, 1.5, 64.0, 64.5, 2048.0, 1e20,
              math.nan, math.inf, -math.inf]  # fmt: skip
WORDS = [*SCORER_NAMES, *PIPELINE_NAMES, "true", "false", "TRUE", "False", "", " ", "null",
         "64", "0.5", "NaN", "obcache_key\u0000", "obcache_kéy", "ＯＢＣＡＣＨＥ", "snapkv ",
         "\ud7ff", "😀", "a" * 10_000]  # fmt: skip

ints = st.one_of(st.integers(-3, 300), st.integers(-(2**70), 2**70), st.sampled_from(HUGE_INTS))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_FLOATS))
texts = st.one_of(st.sampled_from(WORDS), st.text(max_size=12))
scalars = st.one_of(st.none(), st.booleans(), ints, floats, texts)
nested = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
big = st.sampled_from([list(range(5_000)), {"k": "v" * 50_000}, [[[[[[[[[[1]]]]]]]]]]])

# Plausible values keep some cases valid enough to reach the engine and evict there: each
# option's own examples (obcache_vllm.options.OPTIONS), widened where a range exercises more.
PLAUSIBLE = {spec.field: st.sampled_from(spec.example_values())
             for spec in OPTIONS if spec.example_values()}  # fmt: skip
PLAUSIBLE.update({
    "kv_budget": st.one_of(st.integers(21, 300), st.floats(0.05, 1.0)),
    "kv_window": st.integers(1, 2048),
    "kv_recent": st.integers(0, 16),
    "kv_sinks": st.integers(0, 4),
    "kv_compress_at": st.integers(120, 350),  # long prompt only (360 tokens)
})  # fmt: skip
assert set(PLAUSIBLE) == set(FIELDS)
# Neither a session nor compression under pressure can carry h2o's sums, nor combine with
# kv_compress_at / kv_prefill_evict (or each other); adakv evicts once, into a per-head layout
# nothing else reads (options._refuse_heads_memory): (field, value that opts in) -> conflicts.
CONFLICTS = {
    ("kv_session", True): {"kv_pipeline": "h2o", "kv_compress_at": None, "kv_prefill_evict": True},
    ("kv_when", "pressure"): {
        "kv_pipeline": "h2o", "kv_compress_at": None, "kv_prefill_evict": True, "kv_session": True,
    },
    ("kv_pipeline", "adakv"): {
        "kv_decode": True, "kv_prefill_evict": True, "kv_session": True, "kv_when": "pressure",
    },
}


def _consistent(fields):
    """A plausible option set without the conflicts above (each would be a valid 400): the
    opt-in field is dropped where it clashes."""
    for (name, on), clashes in CONFLICTS.items():
        values = {k: _wire(k, v) for _, k, v in fields}
        if values.get(name) != on:
            continue
        if any(k in values and (want is None or values[k] == want) for k, want in clashes.items()):
            fields = [f for f in fields if f[1] != name]
    return fields


BOOLEANS = {"kv_decode", "kv_prefill_evict", "kv_session", "kv_per_head"}


def _wire(name: str, value):
    """A boolean option's value as the server reads it (``"true"``, ``1`` are true)."""
    if name in BOOLEANS:
        return str(value).lower() in ("true", "1")
    return value


def values_for(name: str):
    hostile = st.one_of(scalars, nested, big) if name in PLAUSIBLE else st.one_of(scalars, nested)
    plausible = PLAUSIBLE.get(name, st.nothing())
    return st.one_of(plausible, plausible, hostile)


kv_names = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(FIELDS),
    st.text(max_size=10).map(lambda s: "kv_" + s),
    st.sampled_from(["kv_", "kv_budget ", "kv_Budget", "kv_überbudget", "kv_\u0000", "kv_😀"]),
)


@st.composite
def kv_fields(draw, long: bool, plausible: bool) -> list[tuple[str, str, object]]:
    """(place, key, value) triples; place is "top" or "xargs".

    ``plausible``: known fields, values of the right type and range, so the request is valid
    (must be served) and reaches the engine, where the budget evicts for a long prompt.
    """
    places = st.sampled_from(["top", "top", "xargs"])
    if plausible:  # a budget and a consistent option set: a valid request
        budget = draw(st.one_of(st.integers(24, 300), st.floats(0.2, 1.0) if long else st.none()))
        out = [(draw(places), "kv_budget", budget if budget is not None else 64)]
        others = [f for f in FIELDS if f != "kv_budget" and (long or f != "kv_compress_at")]
        for name in draw(st.sets(st.sampled_from(others), max_size=4)):
            out.append((draw(places), name, draw(PLAUSIBLE[name])))
        return _consistent(out)
    out = []
    for _ in range(draw(st.integers(0, 5))):
        name = draw(kv_names)
        out.append((draw(places), name, draw(values_for(name))))
    if out and draw(st.booleans()) and "kv_budget" not in {k for _, k, _ in out}:
        out.append(("top", "kv_budget", draw(PLAUSIBLE["kv_budget"])))  # budgeted more often
    return out


# Valid whatever else a plausible case holds (kv_compress_at depends on the prompt: not here).
PLAUSIBLE_VALUE = {"kv_budget": 64, "kv_scorer": "attn", "kv_pipeline": "tova", "kv_window": 8,
                   "kv_recent": 4, "kv_sinks": 2, "kv_decode": False,
                   "kv_per_head": True, "kv_prefill_evict": False,
                   "kv_session": False}  # fmt: skip
DUPLICABLE = sorted(PLAUSIBLE_VALUE)

GENERIC = {
    "seed": st.sampled_from([-1, 0, 42, 2**31, -(2**63), 2**63 - 1, 2**63, 2**64, 1.5, "7"]),
    "n": st.sampled_from([0, -1, 1, 2, 3, 16, "2"]),
    "stop": st.sampled_from([[], [""], ["\u0000"], ["a" * 1000], "x", [["x"]], ["é"] * 20, None]),
    "temperature": st.sampled_from([0, 0.7, 2.0, -1, 1e308]),
}


@st.composite
def cases(draw) -> dict:
    long = draw(st.integers(0, 4)) == 0
    plausible = draw(st.integers(0, 4)) < 2
    fields = draw(kv_fields(long, plausible))
    generic = {}
    if draw(st.integers(0, 9)) == 0:  # low weight
        for key in draw(st.sets(st.sampled_from(sorted(GENERIC)), min_size=1)):
            generic[key] = draw(GENERIC[key])
    return {
        "endpoint": draw(st.sampled_from(ENDPOINTS)),
        "stream": draw(st.booleans()),
        "long": long,
        "plausible": plausible,
        "max_tokens": draw(st.sampled_from([1, 2])),
        "fields": fields,
        "generic": generic,
        # A kv key twice in the raw JSON (the parser keeps the last): a hostile value and a
        # plausible one, in either order.
        "duplicate": draw(
            st.one_of(
                *[st.none()] * 4,
                st.tuples(st.sampled_from(DUPLICABLE), scalars, st.booleans()),
            )
        ),
    }


# --- one request -----------------------------------------------------------------------


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=True)  # NaN / Infinity tokens


def encode(case: dict) -> tuple[bytes, dict[str, object]]:
    """Raw request bytes (duplicate keys kept) and the kv_* fields the server will see
    (``vllm_xargs`` first, top-level fields over them, the last of duplicate keys)."""
    chat = "chat" in case["endpoint"]
    text = LONG_PROMPT if case["long"] else "Hello"
    pairs: list[tuple[str, object]] = [
        ("model", MODEL_NAME),
        ("messages", [{"role": "user", "content": text}]) if chat else ("prompt", text),
        ("max_tokens", case["max_tokens"]),
        ("stream", case["stream"]),
    ]
    if case["stream"]:
        pairs.append(("stream_options", {"include_usage": True}))
    xargs = {}
    top: dict[str, object] = {}
    for place, key, value in case["fields"]:
        (xargs if place == "xargs" else top)[key] = value
    raw_top = [(k, _json(v)) for k, v in top.items()]
    if case["duplicate"] is not None:
        key, hostile, hostile_last = case["duplicate"]
        first, last = (
            (PLAUSIBLE_VALUE[key], hostile) if hostile_last else (hostile, PLAUSIBLE_VALUE[key])
        )
        raw_top = [(key, _json(first)), *raw_top, (key, _json(last))]
        top[key] = last
    pairs += list(case["generic"].items())
    if xargs:
        pairs.append(("vllm_xargs", xargs))
    body = ", ".join(f"{_json(k)}: {_json(v)}" for k, v in pairs)
    body += "".join(f", {_json(k)}: {v}" for k, v in raw_top)
    seen = {**xargs, **top}
    return ("{" + body + "}").encode(), {k: v for k, v in seen.items() if k.startswith("kv_")}




def send(server: Server, endpoint: str, data: bytes) -> tuple[int, str]:
    req = urllib.request.Request(
        f"{server.url}{endpoint}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def names_a_field(error: dict, keys: set[str], in_xargs: bool = False) -> bool:
    """``error.param`` is one of ``keys`` (or its path, e.g. ``vllm_xargs.kv_x``), or the message
    quotes one, possibly escaped as vLLM's pydantic messages do (``repr``, once or twice).

    ``in_xargs``: some of the keys came in ``vllm_xargs``, whose values vLLM's own request model
    checks first (``str | int | float | list``); its error names ``body.vllm_xargs`` and, for
    some keys (e.g. one holding ``{``), not the key: the field that holds it is named then.
    """
    param, message = error.get("param") or "", error.get("message") or ""
    if in_xargs and param == "body.vllm_xargs":
        return True
    for key in keys:
        once = repr(key)[1:-1]
        if param == key or param.endswith("." + key):
            return True
        if any(form in message for form in (key, once, repr(once)[1:-1])):
            return True
    return False


def check(server: Server, case: dict) -> None:
    data, kv_fields_seen = encode(case)
    kv_keys = set(kv_fields_seen)
    status, text = send(server, case["endpoint"], data)
    STATS["cases"] += 1
    STATS[f"{status // 100}xx"] += 1
    context = f"HTTP {status}: {text[:600]!r}\nrequest: {data[:1500]!r}"
    assert status < 500, context
    duplicate = case["duplicate"]
    if case["plausible"] and not case["generic"] and not (duplicate and duplicate[2]):
        assert status == 200, f"a valid request was refused\n{context}"
        STATS["valid cases served"] += 1
    if status >= 400:
        error = json.loads(text)["error"]
        if kv_keys and not case["generic"]:
            in_xargs = any(place == "xargs" for place, _, _ in case["fields"])
            named = names_a_field(error, kv_keys, in_xargs)
            assert named, f"a 4xx that names none of {kv_keys}\n{context}"
            STATS["4xx naming a kv field"] += 1
    elif case["stream"]:
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", context
        assert not any('"error"' in e[:20] for e in events), context
    assert healthy(server.url), f"the engine died\n{context}"


# --- the properties ----------------------------------------------------------------------


def case_of(fields, **overrides) -> dict:
    """A case for ``@example`` (regressions) and the explicit tests."""
    base = {"endpoint": ENDPOINTS[0], "stream": False, "long": False, "max_tokens": 1,
            "plausible": False, "generic": {}, "duplicate": None}  # fmt: skip
    return {**base, "fields": fields, **overrides}


@FUZZ
@given(case=cases())
# Regressions the fuzzer found, replayed first on every run:
# kv_window 1e308 is an integer-valued float: int(1e308) was accepted as a window.
@example(case=case_of([("top", "kv_budget", 64), ("top", "kv_window", 1e308)]))
# vLLM's own check of vllm_xargs values names "body.vllm_xargs" only, for a key holding "{".
@example(case=case_of([("xargs", "kv_{x", None), ("top", "kv_budget", 64)], stream=True))
# A 65-bit int in vllm_xargs was refused by vLLM's own check as "extra_args", naming no field.
@example(case=case_of([("xargs", "kv_budget", 2**64)], endpoint=ENDPOINTS[1]))
# vllm_xargs turns a JSON true into 1: kv_decode / kv_per_head there were refused (a 400).
@example(
    case=case_of(
        [("xargs", "kv_budget", 64), ("xargs", "kv_decode", True), ("xargs", "kv_per_head", 0)],
        plausible=True,
        long=True,
        stream=True,
        max_tokens=2,
    )
)
def test_kv_fields_never_5xx_and_4xx_names_the_field(server: Server, case: dict) -> None:
    check(server, case)


@pytest.mark.parametrize(
    "what, value",
    [
        pytest.param("kv_scorer", "x" * (16 << 20), id="16MB-string"),
        pytest.param("kv_budget", list(range(1 << 20)), id="1M-element-list"),
        pytest.param("kv_sinks", "deep", id="nested-100k-deep"),
    ],
)
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_huge_and_deep_bodies_are_refused_without_echo(server: Server, endpoint, what, value):
    if value == "deep":
        raw = "[" * 100_000 + "]" * 100_000
    else:
        raw = _json(value)
    data, _ = encode(case_of([("top", "kv_budget", 64)], endpoint=endpoint))
    data = data[:-1] + f', "{what}": {raw}}}'.encode()
    status, text = send(server, endpoint, data)
    STATS["cases"] += 1
    STATS[f"{status // 100}xx"] += 1
    assert 400 <= status < 500, (status, text[:500])
    assert len(text) < 4096, f"the error echoes the input ({len(text)} bytes)"
    if value != "deep":  # JSON nested this deep is refused by the parser (no field to name)
        assert names_a_field(json.loads(text)["error"], {what}), text[:500]
    assert healthy(server.url)


def test_the_server_is_healthy_after_the_fuzzing(server: Server) -> None:
    assert healthy(server.url)
    code, reply = server.post_json(
        "/v1/completions",
        {
            "model": MODEL_NAME,
            "prompt": "The capital of France is",
            "max_tokens": 4,
            "temperature": 0,
            "kv_budget": 64,
        },  # fmt: skip
    )
    assert code == 200 and reply["choices"][0]["text"], reply
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        busy = m.value("vllm:num_requests_running") + m.value("vllm:num_requests_waiting")
        usage = m.unheld_kv_usage()  # blocks held for compressed contexts are no request's
        if (busy, usage) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (busy, usage) == (0, 0), "requests or blocks left behind"
    summary = {"5xx": 0, **STATS, "seconds": round(time.monotonic() - STARTED)}
    print(f"\nfuzz: {json.dumps(summary, sort_keys=True)}")
    report = os.environ.get("OBCACHE_FUZZ_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump({"examples_per_test": EXAMPLES, **summary}, f, indent=1, sort_keys=True)
    if STATS["cases"]:
        assert STATS["5xx"] == 0


pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
