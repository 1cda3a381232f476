"""Fidelity through any OpenAI-compatible server: an estimate from top-k log-probabilities.

:mod:`obcache_vllm.evidence.fidelity` compares whole next-token distributions inside the
worker. A client of a server sees at most ``k`` log-probabilities per position (vLLM's
``--max-logprobs``, 20 by default), so this module measures the same three things from what
the API returns:

1. **The reference**: ``/v1/completions`` with the prompt's token ids, greedy, EOS ignored,
   ``max_tokens`` T: the full cache's continuation.
2. **Every arm** (the full cache again as the reference and as a control, then each option
   set): the prompt followed by the continuation, sent as one prompt with ``max_tokens`` 1 and
   ``prompt_logprobs`` k, plus the arm's ``kv_*`` fields and ``kv_compress_at`` at the prompt's
   end (query-aware) or at the question (query-agnostic). The cache is compressed there and the
   continuation is prefilled on the compressed cache, which is what decoding the continuation
   would attend to (without ``kv_decode``: eviction between decode steps cannot be forced over
   HTTP, so decode arms are refused). vLLM turns prefix-cache reads off for requests with
   ``prompt_logprobs``, so no arm reads another's cache.
3. **Per position** (:func:`position_estimate`): top-1 agreement and the first divergence are
   exact (both rank-1 tokens are always returned). The KL is the KL of the two distributions
   coarsened to the tokens both lists contain plus one bin for everything else. Coarsening
   never increases a KL (the data-processing inequality), so the estimate is a **lower bound**
   on KL(full || arm) over the whole vocabulary; ``covered`` is the reference's probability mass
   inside the named bins (near 1: the bound is tight).

How close the estimate comes to the whole-vocabulary KL is measured by ``eval fidelity
--check-topk K`` (both measures on one in-process engine; ``make fidelity-topk``: 0.91 of the
KL pooled on the default model, the same agreement and first divergence in every request) and
checked by ``tests/engine/test_fidelity.py``.

Usage::

    obcache-vllm eval fidelity --server http://127.0.0.1:8000 --top-k 20 --samples 4

The parsing and the estimate are pure and tested in ``tests/unit/test_fidelity_units.py``.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

# A position's log-probabilities as the API returns them: token id -> (logprob, rank).
Position = dict[int, tuple[float, int]]
# One answer to a prompt_logprobs request: its positions and its usage.obcache (None: no budget).
Answer = tuple[list[Position | None], dict | None]


def parse_position(entry: dict | None) -> Position | None:
    """One element of a completion's ``prompt_logprobs`` (JSON keys are token ids)."""
    if entry is None:
        return None
    return {int(t): (float(v["logprob"]), int(v["rank"])) for t, v in entry.items()}


def top1(position: Position) -> int:
    """The most likely token: rank 1 (the highest log-probability on a tie of ranks)."""
    return min(position, key=lambda t: (position[t][1], -position[t][0]))


def position_estimate(ref: Position, arm: Position) -> dict:
    """The KL of ``ref`` and ``arm`` coarsened to the tokens both lists name plus one bin for
    the rest (a lower bound on the whole-vocabulary KL), whether their top-1 tokens agree,
    the reference's mass the named bins cover, and the arm's log-probability of the
    reference's top-1 token (None when the arm did not return it)."""
    shared = [t for t in ref if t in arm]
    kl = 0.0
    p_named = q_named = 0.0
    for t in shared:
        lp, lq = ref[t][0], arm[t][0]
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_named += p
        q_named += math.exp(lq)
    p_rest, q_rest = max(0.0, 1.0 - p_named), max(0.0, 1.0 - q_named)
    if p_rest > 1e-12:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-30)))
    best = top1(ref)
    return {
        "kl": max(0.0, kl),  # rounding of the returned logprobs can leave -1e-9
        "agree": top1(arm) == best,
        "covered": p_named,
        "logprob": arm[best][0] if best in arm else None,
    }


def request_positions(prompt_logprobs: Sequence[Position | None], start: int,
                      tokens: int) -> list[Position]:  # fmt: skip
    """The ``tokens`` positions that predict the continuation: entry ``start + s`` is the
    distribution over token ``start + s`` (``start``: the prompt's length)."""
    out = []
    for s in range(tokens):
        got = prompt_logprobs[start + s] if start + s < len(prompt_logprobs) else None
        if got is None:
            raise ValueError(f"no prompt_logprobs for continuation position {s}")
        out.append(got)
    return out


def compare(ref: list[Position], arm: list[Position]) -> dict:
    """Per request: the estimate at each position and the means the offline report uses."""
    rows = [position_estimate(r, a) for r, a in zip(ref, arm, strict=True)]
    kls = [r["kl"] for r in rows]
    first = next((s for s, r in enumerate(rows) if not r["agree"]), len(rows))
    return {
        "kl": sum(kls) / len(rows),
        "kl_max": max(kls),
        "agree": sum(r["agree"] for r in rows) / len(rows),
        "first_divergence": first,
        "covered": sum(r["covered"] for r in rows) / len(rows),
        "kl_by_position": [round(k, 6) for k in kls],
        "logprobs": [r["logprob"] for r in rows],
    }


# ---------------------------------------------------------------------------------------------
# Clients: the server over HTTP, or the in-process engine (the tests compare both measures).


class HttpClient:
    """``/v1/completions`` of an OpenAI-compatible server, ``concurrency`` requests at once."""

    def __init__(self, url: str, model: str | None = None, concurrency: int = 8,
                 timeout: float = 600.0) -> None:  # fmt: skip
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.concurrency = concurrency
        self.model = model or self._get("/v1/models")["data"][0]["id"]

    def _get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + "/v1/completions", data=json.dumps({"model": self.model, **body}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read())

    def _map(self, fn, items):
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(fn, items))

    def greedy(self, prompts: Sequence[Sequence[int]], tokens: int,
               ignore_eos: bool = True) -> list[list[int]]:  # fmt: skip
        body = {"max_tokens": tokens, "temperature": 0, "ignore_eos": ignore_eos,
                "return_token_ids": True}  # fmt: skip
        return self._map(
            lambda p: self._post({**body, "prompt": list(p)})["choices"][0]["token_ids"], prompts
        )

    def prompt_logprobs(self, requests: Sequence[tuple[Sequence[int], dict | None]],
                        k: int) -> list[Answer]:  # fmt: skip
        def one(request):
            ids, kv = request
            body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0,
                    "prompt_logprobs": k, **(kv or {})}  # fmt: skip
            resp = self._post(body)
            positions = [parse_position(e) for e in resp["choices"][0]["prompt_logprobs"]]
            return positions, (resp.get("usage") or {}).get("obcache")

        return self._map(one, requests)


class EngineClient:
    """The same two calls on an in-process ``vllm.LLM`` (what the server would run)."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def greedy(self, prompts: Sequence[Sequence[int]], tokens: int,
               ignore_eos: bool = True) -> list[list[int]]:  # fmt: skip
        from vllm import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=ignore_eos)
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params,
                                 use_tqdm=False)  # fmt: skip
        return [list(o.outputs[0].token_ids) for o in outs]

    def prompt_logprobs(self, requests: Sequence[tuple[Sequence[int], dict | None]],
                        k: int) -> list[Answer]:  # fmt: skip
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k,
                                 extra_args=dict(kv) if kv else None)  # fmt: skip
                  for _, kv in requests]  # fmt: skip
        outs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids, _ in requests],
                                 params, use_tqdm=False)  # fmt: skip
        return [
            ([None if e is None else {t: (float(v.logprob), int(v.rank)) for t, v in e.items()}
              for e in o.prompt_logprobs],
             (o.kv_transfer_params or {}).get("obcache"))  # fmt: skip
            for o in outs
        ]


def arm_fields(arm, sample, prompt_len: int) -> dict | None:
    """The arm's ``kv_*`` fields for the prompt followed by its continuation: compressed at
    the prompt's end (aware) or at the question (agnostic, the sample's point)."""
    kv = arm.kv(sample)
    if kv is None:
        return None
    if arm.decode:
        raise ValueError("kv_decode arms need forcing inside the engine: use the offline run")
    if arm.max_error is not None:
        raise ValueError("error targets do not combine with kv_compress_at (the estimate's "
                         "way to evict at the prompt's end): use the offline run")  # fmt: skip
    kv["kv_compress_at"] = sample.point if arm.setting == "agnostic" else prompt_len
    return {k: v for k, v in kv.items() if v is not None}


def run(client, samples, arm_list, tokens: int, k: int,
        progress: Callable[[str], None] | None = None) -> dict[str, dict[str, dict]]:  # fmt: skip
    """``{arm: {sample: request stats}}``, the offline run's shape plus ``covered``. The
    reference is its own pass (the full cache, read as every arm is); the "full" arm reads it
    again, as a control."""
    greedy = client.greedy([s.ids for s in samples], tokens)
    continuation = {s.name: ids for s, ids in zip(samples, greedy, strict=True)}
    requests, keys = [], []
    for s in samples:  # the reference: the full cache, read the same way as every arm
        requests.append(([*s.ids, *continuation[s.name]], None))
        keys.append((None, s))
    for arm in arm_list:
        for s in samples:
            requests.append(([*s.ids, *continuation[s.name]], arm_fields(arm, s, len(s.ids))))
            keys.append((arm, s))
    if progress:
        progress(f"{len(samples)} prompts x {len(arm_list)} arms: {len(requests)} requests")
    answers = client.prompt_logprobs(requests, k)
    reference: dict[str, list[Position]] = {}
    result: dict[str, dict[str, dict]] = {}
    for (arm, s), (got, usage) in zip(keys, answers, strict=True):
        positions = request_positions(got, len(s.ids), tokens)
        if arm is None:
            reference[s.name] = positions
            continue
        stats = compare(reference[s.name], positions)
        stats["continuation"] = continuation[s.name]
        # The continuation was prefilled after the compression point: not part of the prompt.
        kept = (usage or {}).get("prompt_tokens_kept", len(s.ids) + tokens) - tokens
        stats["kept_fraction"] = kept / len(s.ids)
        stats["usage"] = usage
        result.setdefault(arm.name, {})[s.name] = stats
    return result


def replies(client, tokenizer, max_tokens: int):
    """A chat's assistant turns from the server: greedy, stopping at EOS."""

    def reply(prompts: list[list[int]]) -> list[str]:
        outs = client.greedy(prompts, max_tokens, ignore_eos=False)
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in outs]

    return reply


def main(args, tokenizer, make_samples, arm_list) -> dict:
    """The results dictionary of ``obcache-vllm eval fidelity --server`` (``make_samples``:
    reply -> samples, so chats are written by the server's model)."""
    from obcache_vllm.evidence.fidelity import CHAT_REPLY_TOKENS

    client = HttpClient(args.server, concurrency=args.max_batch)
    samples = make_samples(replies(client, tokenizer, CHAT_REPLY_TOKENS))
    per_request = run(client, samples, arm_list, args.tokens, args.top_k,
                      progress=lambda m: print(f"fidelity: {m}", flush=True))  # fmt: skip
    return {
        "estimate": f"top-{args.top_k} over HTTP ({args.server})",
        "samples": samples,
        "per_request": per_request,
    }
