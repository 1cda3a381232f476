"""End-of-run assertions on a :class:`~loadtest.runner.RunResult` (the soak's checks).

Each check returns a :class:`Check`: ``ok`` True/False, or None when it does not apply (e.g.
obcache checks against stock vLLM), with a one-line ``detail`` giving the numbers compared.

Accounting of evictions (``obcache_counters``): a completed budgeted request with ``n == 1``
reports its whole eviction in ``usage.obcache``, so over those requests
``sum(evicted_tokens) == increase of vllm:obcache_evicted_tokens_total`` (and the same for
freed blocks) must hold exactly. Some requests evict without a readable outcome: a budgeted
stream the client disconnected (or the deadline cancelled) may have been compressed before it
was aborted, and with ``n > 1`` usage shows the outcome of the last finished choice only. When
the run holds such requests the check is a bound, stated in the detail: the sum over fully
observed requests (plus the one reported choice of each ``n > 1`` request) <= increase <=
that sum + ``n x max_model_len`` per unobserved request (a request cannot evict more tokens
than it ever held; a freed block holds at least one token).
"""

from __future__ import annotations

from dataclasses import dataclass

from loadtest import scrape
from loadtest.client import Outcome
from loadtest.runner import RunResult


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: not applicable to this run
    detail: str


def _may_evict(result: RunResult, outcome: Outcome) -> bool:
    """The request asked for a budget, or the server applies a default budget to it."""
    if result.obcache_defaults is None:
        return False
    if "kv_budget" in outcome.plan.body:
        return outcome.plan.body["kv_budget"] is not None
    return result.obcache_defaults.get("kv_budget") is not None


def eviction_accounting(result: RunResult) -> dict:
    """Observed sums, the bound for unobserved requests, and the counter increases."""
    observed = {"evicted_tokens": 0, "freed_blocks": 0, "requests": 0}
    unobserved, bound = 0, 0
    max_len = result.max_model_len or 0
    for o in result.outcomes:
        if not _may_evict(result, o) or o.category == "4xx":
            continue
        usage = o.obcache
        if o.completed and usage is not None:
            observed["evicted_tokens"] += int(usage.get("evicted_tokens", 0))
            observed["freed_blocks"] += int(usage.get("freed_blocks", 0))
            if o.plan.n == 1:
                observed["requests"] += 1
                continue
        unobserved += 1
        bound += o.plan.n * max_len
    inc = {
        "evicted_tokens": scrape.increase(result.before, result.after, scrape.EVICTED_TOKENS),
        "freed_blocks": scrape.increase(result.before, result.after, scrape.FREED_BLOCKS),
    }
    return {"observed": observed, "unobserved_requests": unobserved, "unobserved_bound": bound,
            "counter_increase": inc}


def _check_counters(result: RunResult) -> Check:
    acc = eviction_accounting(result)
    obs, inc, bound = acc["observed"], acc["counter_increase"], acc["unobserved_bound"]
    parts, ok = [], True
    for key in ("evicted_tokens", "freed_blocks"):
        lo, hi = obs[key], obs[key] + bound
        if acc["unobserved_requests"] == 0:
            good = inc[key] == lo
            parts.append(f"{key}: usage sum {lo} == counter +{inc[key]:g}")
        else:
            good = lo <= inc[key] <= hi
            parts.append(f"{key}: {lo} <= counter +{inc[key]:g} <= {hi}")
        ok = ok and good
    unobs = acc["unobserved_requests"]
    scope = f"{obs['requests']} fully observed budgeted requests, {unobs} unobserved"
    return Check("obcache_counters", ok, f"{'; '.join(parts)} ({scope})")


def _check_usage(result: RunResult) -> Check:
    missing, unexpected = [], []
    for o in result.outcomes:
        if not o.completed:
            continue
        if _may_evict(result, o) and o.obcache is None:
            missing.append(o.plan.index)
        if not _may_evict(result, o) and o.obcache is not None:
            unexpected.append(o.plan.index)
    budgeted = sum(1 for o in result.outcomes if o.completed and _may_evict(result, o))
    ok = not missing and not unexpected
    detail = f"{budgeted} completed budgeted requests; missing usage.obcache: {missing[:10]}"
    return Check("obcache_usage", ok, f"{detail}; on unbudgeted requests: {unexpected[:10]}")


def _check_server_counts(result: RunResult) -> Check:
    """The client's requests and tokens against vLLM's own counters."""
    b, a = result.before, result.after
    finished = scrape.increase_by_label(b, a, scrape.REQUEST_SUCCESS, "finished_reason")
    server_all = sum(finished.values())
    server_done = server_all - finished.get("abort", 0.0)
    done = [o for o in result.outcomes if o.completed]
    reached = [o for o in result.outcomes if o.category not in ("2xx", "4xx")]
    client_done = sum(o.plan.n for o in done)
    client_max = client_done + sum(o.plan.n for o in reached)
    prompt = sum(o.plan.n * int((o.usage or {}).get("prompt_tokens", 0)) for o in done)
    gen = sum(int((o.usage or {}).get("completion_tokens", 0)) for o in done)
    srv_prompt = scrape.increase(b, a, scrape.PROMPT_TOKENS)
    srv_gen = scrape.increase(b, a, scrape.GENERATION_TOKENS)
    if not reached:
        ok = server_all == client_done and srv_prompt == prompt and srv_gen == gen
        rel = "=="
    else:  # aborted requests were counted by the server, but their tokens are not known here
        ok = client_done <= server_done and server_all <= client_max and srv_gen >= gen
        rel = "<="
    detail = (
        f"engine requests finished {server_all:g} (by reason {finished}) vs client {client_done}"
        f"{'' if not reached else f'..{client_max}'}; prompt tokens {srv_prompt:g} vs {prompt}; "
        f"generation tokens {srv_gen:g} {'==' if rel == '==' else '>='} {gen}"
    )
    return Check("server_counts", ok, detail)


def run_checks(result: RunResult) -> list[Check]:
    """Every check the scenario enables, in a fixed order."""
    cfg = result.scenario.checks
    cats = {c: sum(1 for o in result.outcomes if o.category == c) for c in ("5xx", "error")}
    plugin = result.obcache_defaults is not None
    out = []
    if cfg.healthy:
        out.append(Check("healthy", result.healthy, f"GET /health after the run: {result.healthy}"))
    if cfg.idle:
        snap = result.after
        detail = (
            f"after {result.idle_wait_s:.1f} s: kv_cache_usage_perc "
            f"{snap.value(scrape.KV_USAGE):g} ({snap.value(scrape.HELD_BLOCKS):g} blocks held "
            f"for compressed contexts), running {snap.value(scrape.RUNNING):g}, "
            f"waiting {snap.value(scrape.WAITING):g}"
        )
        out.append(Check("idle", result.idle, detail))
    if cfg.no_5xx:  # a kind expected to fail (an injected fault, expect_status 5xx) is not one
        unexpected = [o for o in result.outcomes if o.category == "error" or (
            o.category == "5xx" and o.plan.expect_status < 500)]  # fmt: skip
        injected = sum(1 for o in result.outcomes
                       if o.category == "5xx" and o.plan.expect_status >= 500)  # fmt: skip
        errs = [o.error for o in unexpected][:3]
        out.append(Check("no_5xx", not unexpected,
                         f"5xx {cats['5xx']} ({injected} from injected faults), connection "
                         f"errors {cats['error']} {errs if errs else ''}".strip()))  # fmt: skip
    if cfg.expected_status:
        wrong = [
            (o.plan.index, o.plan.kind, o.status)
            for o in result.outcomes
            if o.category not in ("disconnected", "cancelled") and o.status != o.plan.expect_status
        ]
        out.append(Check("expected_status", not wrong, f"unexpected statuses: {wrong[:10]}"))
    if cfg.obcache_usage:
        out.append(_check_usage(result) if plugin else Check("obcache_usage", None, "no plugin"))
    if cfg.obcache_counters:
        out.append(
            _check_counters(result) if plugin else Check("obcache_counters", None, "no plugin")
        )
    if cfg.server_counts:
        out.append(_check_server_counts(result))
    if cfg.min_preemptions:
        pre = scrape.increase(result.before, result.after, scrape.PREEMPTIONS)
        out.append(Check("preemptions", pre >= cfg.min_preemptions,
                         f"vllm:num_preemptions +{pre:g} (want >= {cfg.min_preemptions})"))
    if cfg.min_compressed_preemptions:
        pre = scrape.increase(result.before, result.after, scrape.COMPRESSED_PREEMPTIONS)
        out.append(Check("compressed_preemptions", pre >= cfg.min_compressed_preemptions,
                         f"{scrape.COMPRESSED_PREEMPTIONS} +{pre:g} "
                         f"(want >= {cfg.min_compressed_preemptions})"))  # fmt: skip
    return out
