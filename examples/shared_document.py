"""Compress a document once, ask several questions over it at once (``kv_compress_at``).

    make serve                                  # in another shell
    .venv/bin/python examples/shared_document.py [--base-url http://127.0.0.1:8000/v1]

The document's token ids come from the server's own tokenizer (vLLM's ``POST /tokenize``),
so the compress point is an exact token position: each prompt is the document's ids followed by
a question's ids, ``"kv_compress_at"`` = the document's length. The first request compresses
the document to a quarter; the others adopt that compressed cache (``reused_tokens`` in
``usage.obcache``) and answer exactly as they would alone, also when sent together.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from obcache_vllm.textgen import haystack

QUESTIONS = ["Which town is named first?", "What was traded most often?",
             "Which year comes first?", "Name two towns that traded."]  # fmt: skip


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = ap.parse_args()
    root = args.base_url.removesuffix("/v1")

    def tokens(text: str, special: bool) -> list[int]:
        body = {"model": args.model, "prompt": text, "add_special_tokens": special}
        return post(f"{root}/tokenize", body)["tokens"]

    document = tokens(haystack(40, seed=3), special=True)
    kv = {"kv_budget": 0.25, "kv_compress_at": len(document), "kv_pipeline": "tova"}

    def ask(question: str) -> dict:
        ids = document + tokens(f"\nQuestion: {question} Answer:", special=False)
        return post(f"{args.base_url}/completions", {"model": args.model, "prompt": ids,
                    "max_tokens": 16, "temperature": 0, **kv})  # fmt: skip

    first = ask(QUESTIONS[0])  # compresses the document and leaves the entry
    with ThreadPoolExecutor(len(QUESTIONS) - 1) as pool:  # the others at once
        rest = list(pool.map(ask, QUESTIONS[1:]))
    for question, reply in zip(QUESTIONS, [first, *rest], strict=True):
        usage = reply["usage"]["obcache"]
        print(f"{question!r} -> {reply['choices'][0]['text'].strip()!r}  "
              f"reused_tokens={usage.get('reused_tokens', 0)} "
              f"prompt_tokens_kept={usage['prompt_tokens_kept']}")


if __name__ == "__main__":
    main()
