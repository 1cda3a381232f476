"""A multi-turn chat whose turns continue the previous turn's compressed cache (``kv_session``).

    make serve                                  # in another shell
    .venv/bin/python examples/session_chat.py [--base-url http://127.0.0.1:8000/v1]

Every turn resends the whole conversation, as OpenAI clients do; with ``"kv_session": true``
the server finds the cache the previous turn left (its tokens are a prefix of this prompt, same
options), continues from it and compresses again at the end of this turn's prompt.
``usage.obcache.session_turn`` is the turn's number in the session (2 for the first
continuation; absent on a turn that started afresh).
"""

from __future__ import annotations

import argparse

from openai import OpenAI

from obcache_vllm.textgen import haystack

TURNS = ["Which towns appear in the records?", "What did they trade in the winter?",
         "Summarize the oldest record in one sentence."]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="unused")
    messages = [{"role": "system", "content": haystack(30, seed=5)}]
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        reply = client.chat.completions.create(
            model=args.model, messages=messages, temperature=0, max_tokens=24,
            extra_body={"kv_budget": 0.25, "kv_session": True},
        )
        answer = reply.choices[0].message.content
        messages.append({"role": "assistant", "content": answer})
        usage = reply.usage.model_extra["obcache"]
        print(f"{turn!r} -> {answer!r}  session_turn={usage.get('session_turn')} "
              f"reused_tokens={usage.get('reused_tokens', 0)}")


if __name__ == "__main__":
    main()
