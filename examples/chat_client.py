"""A chat request with a KV budget through the OpenAI client, against a running server.

    make serve                                  # in another shell
    .venv/bin/python examples/chat_client.py [--base-url http://127.0.0.1:8000/v1]

The kv_* options are top-level request fields: the OpenAI client sends them in ``extra_body``.
The response's ``usage.obcache`` says what happened to the request's cache.
"""

from __future__ import annotations

import argparse

from openai import OpenAI

from obcache_vllm.textgen import haystack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    question = haystack(20, seed=0) + "\n\nWhich town is named first?"
    reply = client.chat.completions.create(
        model=args.model, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": question}],
        extra_body={"kv_budget": 128, "kv_scorer": "obcache_key"},
    )
    print("answer:", reply.choices[0].message.content)
    print("usage.obcache:", reply.usage.model_extra["obcache"])


if __name__ == "__main__":
    main()
