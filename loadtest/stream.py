"""One streamed OpenAI request, with what a multi-turn or prefix benchmark reads from it.

``post_streamed`` POSTs ``body`` with ``stream: true`` and usage in the last chunk, and returns
``(status, ttft, latency, usage, text)``: time to the first chunk with text (completions'
``text`` or chat's ``delta.content``), the whole request's time, the final ``usage`` object
(``usage.obcache`` included) and the generated text. A non-200 answer returns its body as the
text. Used by ``loadtest/multiturn.py`` and ``benchmarks/bench_prefix.py``.
"""

from __future__ import annotations

import json
import time


async def post_streamed(session, url: str, body: dict, headers: dict | None = None):
    """POST ``body`` to ``url`` (a full endpoint URL) streamed; see the module docstring."""
    import aiohttp

    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, usage, parts = None, {}, []
    async with session.post(url, json=body, headers=headers,
                            timeout=aiohttp.ClientTimeout(total=1800)) as r:  # fmt: skip
        if r.status != 200:
            return r.status, None, time.perf_counter() - start, {}, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return 200, ttft, time.perf_counter() - start, usage, "".join(parts)
