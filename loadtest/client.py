"""One request against an OpenAI-compatible server, timed exactly as ``vllm bench serve`` times it.

The timing fields go into vLLM's own ``RequestFuncOutput`` with the semantics of vLLM's
``async_request_openai_completions`` (``vllm/benchmarks/lib/endpoint_request_func.py``):
``start_time``/``st`` when the POST starts, ``ttft`` at the first SSE message that has
``choices``, one ``itl`` entry per later such message, ``latency`` at the last one,
``output_tokens`` from the final usage chunk. Its SSE parser (``StreamedResponseHandler``) is
reused as is. What vLLM's request function does not do and this one adds: per-request bodies
(the scenario's mix), the HTTP status, ``usage`` (with ``usage.obcache``), non-streamed
requests, a client disconnect after k chunks, error events inside a stream.

With ``n > 1`` every message with ``choices`` counts as a token event, whatever its choice
index (what vLLM's function would record for such a request).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest.scenario import RequestPlan

# Outcome categories, in report order.
CATEGORIES = ("2xx", "4xx", "5xx", "disconnected", "cancelled", "error")


def _request_func_output() -> Any:
    """A fresh ``vllm.benchmarks.lib.endpoint_request_func.RequestFuncOutput`` (imported on first
    use: importing vLLM takes seconds, and the planning and checking code does not need it)."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput

    return RequestFuncOutput()


@dataclass
class Outcome:
    """What the client saw for one planned request.

    ``category``: ``2xx`` (answered and fully read), ``4xx``/``5xx`` (HTTP status, or an error
    event inside a stream for 5xx), ``disconnected`` (the client closed the stream after
    ``disconnect_after`` chunks, as planned), ``cancelled`` (still running when the run's
    deadline came), ``error`` (no HTTP answer: connection refused or reset).
    """

    plan: RequestPlan
    category: str = "error"
    status: int | None = None
    out: Any = field(default_factory=_request_func_output)  # vLLM's RequestFuncOutput
    usage: dict[str, Any] | None = None
    chunks: int = 0  # SSE messages with choices
    error: str = ""

    @property
    def obcache(self) -> dict[str, Any] | None:
        return (self.usage or {}).get("obcache")

    @property
    def completed(self) -> bool:
        return self.category == "2xx"


def build_payload(plan: RequestPlan, model: str, endpoint: str) -> dict[str, Any]:
    """The JSON body for ``plan`` (``endpoint``: ``completions`` or ``chat``)."""
    payload: dict[str, Any] = {"model": model, "max_tokens": plan.max_tokens, "n": plan.n}
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": plan.prompt}]
    else:
        payload["prompt"] = plan.prompt
    if plan.stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    payload.update(plan.body)
    return payload


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _category(status: int) -> str:
    return f"{status // 100}xx" if 200 <= status < 600 else "error"


async def send(
    session: aiohttp.ClientSession, base_url: str, model: str, endpoint: str, outcome: Outcome
) -> Outcome:
    """Send ``outcome.plan``, filling ``outcome`` in place (also returned). Never raises except
    on cancellation, which is recorded (``cancelled``) before it propagates."""
    plan = outcome.plan
    outcome.out.prompt_len = plan.target_prompt_tokens  # replaced by usage.prompt_tokens
    url = base_url.rstrip("/") + endpoint_path(endpoint)
    st = time.perf_counter()
    outcome.out.start_time = st
    try:
        async with session.post(url, json=build_payload(plan, model, endpoint)) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.category = _category(response.status)
                outcome.error = (await response.text())[:500]
                return outcome
            if plan.stream:
                await _read_stream(response, outcome, st)
            else:
                body = await response.json()
                outcome.out.latency = time.perf_counter() - st
                outcome.out.ttft = outcome.out.latency  # not observable: excluded from TTFT
                _take_usage(outcome, body.get("usage"))
                outcome.out.success = True
                outcome.category = "2xx"
    except asyncio.CancelledError:
        outcome.category = "cancelled"
        outcome.out.success = False
        raise
    except (aiohttp.ClientError, OSError, json.JSONDecodeError, ValueError) as exc:
        if outcome.category not in ("disconnected", "5xx"):
            outcome.category = "error"
            outcome.error = f"{type(exc).__name__}: {exc}"[:500]
    return outcome


async def _read_stream(response: aiohttp.ClientResponse, outcome: Outcome, st: float) -> None:
    from vllm.benchmarks.lib.endpoint_request_func import StreamedResponseHandler

    out, plan = outcome.out, outcome.plan
    handler = StreamedResponseHandler()
    recent = st
    async for chunk_bytes in response.content.iter_any():
        chunk_bytes = chunk_bytes.strip()
        if not chunk_bytes:
            continue
        for message in handler.add_chunk(chunk_bytes):
            if message.startswith(":"):
                continue  # SSE comment (keep-alive)
            data = message.removeprefix("data: ")
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:  # vLLM reports a failure inside the stream this way
                err = event["error"]
                # the request's effective status: the stream had already answered 200
                outcome.status = int(err.get("code") or 500)
                outcome.category = _category(outcome.status)
                outcome.error = str(err.get("message", err))[:500]
                return
            if event.get("choices"):
                now = time.perf_counter()
                if outcome.chunks == 0:
                    out.ttft = now - st
                else:
                    out.itl.append(now - recent)
                recent = now
                outcome.chunks += 1
                if plan.disconnect_after is not None and outcome.chunks >= plan.disconnect_after:
                    response.close()  # drop the connection: the server aborts the request
                    out.latency = recent - st
                    outcome.category = "disconnected"
                    return
            elif usage := event.get("usage"):
                _take_usage(outcome, usage)
    out.latency = recent - st
    if outcome.chunks:
        out.success = True
        outcome.category = "2xx"
    else:
        outcome.category = "error"
        outcome.error = "stream ended without a chunk with choices"


def _take_usage(outcome: Outcome, usage: dict | None) -> None:
    if not usage:
        return
    outcome.usage = usage
    outcome.out.output_tokens = int(usage.get("completion_tokens") or 0)
    if usage.get("prompt_tokens") is not None:
        outcome.out.prompt_len = int(usage["prompt_tokens"])
