"""Load-test scenarios: a YAML file parsed once into a frozen, validated :class:`Scenario`, and
the deterministic request plan built from it.

A scenario names everything a run does (``loadtest/scenarios/*.yaml``)::

    name: mix                       # report title
    requests: 24                    # stop after this many requests ...
    duration_s: 600                 # ... or after this long (in-flight requests are cancelled)
    load: {concurrency: 8}          # closed loop; or {rate: 2.0} Poisson arrivals (req/s)
    prompt_tokens: {min: 600, max: 900}   # approximate, from obcache_vllm.textgen.haystack
    output_tokens: 64               # max_tokens (ignore_eos: true by default: exactly this many)
    stream: 1.0                     # fraction of requests streamed (the latency metrics need it)
    seed_fraction: 0.0              # fraction sent with a per-request "seed"
    n: {1: 1.0}                     # weights of the "n" parameter
    disconnect: {fraction: 0.1, after_chunks: {min: 2, max: 8}}   # of the streamed requests
    kinds:                          # the MIX: weighted request bodies (kv_* options, sampling)
      - {name: none, weight: 0.3}
      - {name: budget_0.1, weight: 0.5, body: {kv_budget: 0.1}}
      - {name: decode_256, weight: 0.2, body: {kv_budget: 256, kv_decode: true}}
    slo: {ttft_ms: 5000, tpot_ms: 200}    # goodput, as `vllm bench serve --goodput`
    server: {args: [...], env: {...}}     # only when the tool launches the server itself
    checks: {...}                          # end-of-run assertions (see Checks)

Same file + same seed = the same requests (prompts, lengths, kinds, seeds, disconnect points).
No vLLM import here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from obcache_vllm.textgen import haystack

# SmolLM2's tokenizer gives ~30.5 tokens per haystack sentence (measured on the completions
# endpoint: 20 sentences -> 610 prompt tokens, 24 -> 736). Other tokenizers differ: the report
# always shows the prompt tokens the server counted (usage.prompt_tokens).
TOKENS_PER_SENTENCE = 30.5
INSTRUCTION = "\nSummarize the trade records above in one sentence."


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Range(_Frozen):
    """An integer drawn uniformly from [min, max]; a plain integer in YAML means min = max."""

    min: int = Field(ge=0)
    max: int = Field(ge=0)

    @model_validator(mode="before")
    @classmethod
    def _from_int(cls, value: Any) -> Any:
        return {"min": value, "max": value} if isinstance(value, int) else value

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.min > self.max:
            raise ValueError(f"min {self.min} > max {self.max}")
        return self

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.min, self.max)


class Load(_Frozen):
    """Exactly one of: ``concurrency`` (closed loop) or ``rate`` (Poisson arrivals, req/s)."""

    concurrency: int | None = Field(default=None, ge=1, le=1024)
    rate: float | None = Field(default=None, gt=0)
    max_in_flight: int = Field(default=256, ge=1)  # cap for the open (rate) loop

    @model_validator(mode="after")
    def _one(self) -> Load:
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("load: give exactly one of concurrency or rate")
        return self


class Kind(_Frozen):
    """One request kind of the mix: a weight and the fields it adds to the request body."""

    name: str = Field(min_length=1)
    weight: float = Field(gt=0)
    body: dict[str, Any] = Field(default_factory=dict)
    n: dict[int, float] | None = None  # weights of "n" for this kind (default: the scenario's)
    output_tokens: Range | None = None  # this kind's max_tokens (default: the scenario's)
    expect_status: int = 200  # e.g. 400 for a kind made to be rejected

    @model_validator(mode="after")
    def _reserved(self) -> Kind:
        reserved = {"model", "prompt", "messages", "stream", "stream_options", "n", "max_tokens"}
        clash = sorted(reserved & set(self.body))
        if clash:
            raise ValueError(f"kind {self.name!r}: {clash[0]!r} is set by the scenario, not a kind")
        return self


class Disconnect(_Frozen):
    """Close the connection of this fraction of the streamed requests after k chunks."""

    fraction: float = Field(default=0.0, ge=0, le=1)
    after_chunks: Range = Range(min=2, max=8)


class Slo(_Frozen):
    """Goodput SLO in milliseconds (vLLM's ``--goodput ttft:MS tpot:MS e2el:MS``)."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2el_ms: float | None = Field(default=None, gt=0)

    def as_vllm(self) -> dict[str, float]:
        pairs = {"ttft": self.ttft_ms, "tpot": self.tpot_ms, "e2el": self.e2el_ms}
        return {k: v for k, v in pairs.items() if v is not None}


class ServerSpec(_Frozen):
    """How the tool starts the server when asked to (``--launch``, ``compare``)."""

    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)


class Checks(_Frozen):
    """End-of-run assertions (the soak's); each can be switched off."""

    healthy: bool = True  # GET /health answers 200 after the run
    # kv_cache_usage_perc back to 0 (less blocks held for compressed contexts), nothing
    # running or waiting
    idle: bool = True
    idle_timeout_s: float = Field(default=60, gt=0)
    no_5xx: bool = True  # no 5xx, no error event in a stream, no connection error
    expected_status: bool = True  # every answered request got its kind's expect_status
    obcache_usage: bool = True  # every completed budgeted request carries usage.obcache
    obcache_counters: bool = True  # usage.obcache sums vs the metric increases (see checks.py)
    server_counts: bool = True  # the client's counts vs the server's request/token counters
    min_preemptions: int = Field(default=0, ge=0)
    # Preemptions of requests that had already evicted (their KV recomputed, evicted again).
    min_compressed_preemptions: int = Field(default=0, ge=0)


class Scenario(_Frozen):
    """A whole load-test scenario (see the module docstring for the YAML shape)."""

    name: str
    description: str = ""
    endpoint: Literal["completions", "chat"] = "completions"
    model: str | None = None  # default: the server's first model
    requests: int = Field(ge=1, le=100_000)
    duration_s: float = Field(gt=0, le=24 * 3600)
    seed: int = 0
    load: Load
    prompt_tokens: Range
    output_tokens: Range
    ignore_eos: bool = True
    temperature: float = Field(default=0.0, ge=0)
    stream: float = Field(default=1.0, ge=0, le=1)
    seed_fraction: float = Field(default=0.0, ge=0, le=1)
    n: dict[int, float] = Field(default_factory=lambda: {1: 1.0})
    disconnect: Disconnect = Disconnect()
    kinds: list[Kind] = Field(min_length=1)
    slo: Slo = Slo()
    percentiles: list[float] = Field(default_factory=lambda: [50.0, 90.0, 99.0])
    scrape_interval_s: float = Field(default=1.0, gt=0)
    server: ServerSpec = ServerSpec()
    checks: Checks = Checks()

    @model_validator(mode="after")
    def _consistent(self) -> Scenario:
        names = [k.name for k in self.kinds]
        if len(set(names)) != len(names):
            raise ValueError(f"kind names must be unique: {names}")
        for where, dist in [("n", self.n)] + [(f"{k.name}.n", k.n) for k in self.kinds if k.n]:
            if any(n < 1 for n in dist) or any(w < 0 for w in dist.values()):
                raise ValueError(f"{where}: keys >= 1, weights >= 0")
            if not sum(dist.values()) > 0:
                raise ValueError(f"{where}: at least one positive weight")
        for k in self.kinds:
            greedy = k.body.get("temperature", self.temperature) == 0
            multi = any(n > 1 and w > 0 for n, w in (k.n or self.n).items())
            if greedy and multi and k.expect_status == 200:
                raise ValueError(f"kind {k.name!r}: n > 1 with greedy sampling (vLLM answers "
                                 "400: 'n must be 1 when using greedy sampling')")
        return self

    def without_budgets(self) -> Scenario:
        """The same scenario with every ``kv_*`` field removed from every kind (same kind names,
        same plan otherwise): the "no budget" and stock-vLLM arms of a comparison."""
        if any(k.expect_status != 200 for k in self.kinds):
            raise ValueError("a comparison scenario cannot hold kinds expected to be rejected")
        kinds = [
            k.model_copy(update={"body": {f: v for f, v in k.body.items() if f[:3] != "kv_"}})
            for k in self.kinds
        ]
        return self.model_copy(update={"kinds": kinds})


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ValueError(f"--set {dotted}: {key!r} is not a mapping")
    node[keys[-1]] = value


def load_scenario(path: str | Path, overrides: list[str] = ()) -> Scenario:
    """Parse ``path``; ``overrides`` are ``key.sub=value`` strings (value read as YAML), e.g.
    ``requests=24`` or ``load.concurrency=4``, applied before validation."""
    data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    return Scenario.model_validate(data)


@dataclass(frozen=True)
class RequestPlan:
    """One planned request: everything the client sends and what it expects back."""

    index: int
    kind: str
    prompt: str
    target_prompt_tokens: int
    max_tokens: int
    stream: bool
    n: int
    disconnect_after: int | None  # close after this many chunks (streamed requests only)
    body: dict[str, Any] = field(default_factory=dict)  # kind body + temperature/seed/ignore_eos
    expect_status: int = 200


def make_plan(scenario: Scenario) -> list[RequestPlan]:
    """The scenario's requests, in sending order; a pure function of the scenario."""
    rng = random.Random(scenario.seed)
    weights = [k.weight for k in scenario.kinds]
    plans = []
    for i in range(scenario.requests):
        kind = rng.choices(scenario.kinds, weights)[0]
        target = scenario.prompt_tokens.draw(rng)
        sentences = max(1, round(target / TOKENS_PER_SENTENCE))
        prompt = haystack(sentences, scenario.seed * 1_000_003 + i) + INSTRUCTION
        max_tokens = max(1, (kind.output_tokens or scenario.output_tokens).draw(rng))
        stream = rng.random() < scenario.stream
        n_dist = kind.n or scenario.n
        n = rng.choices(list(n_dist), list(n_dist.values()))[0]
        seeded = rng.random() < scenario.seed_fraction
        drop = rng.random() < scenario.disconnect.fraction
        after = scenario.disconnect.after_chunks.draw(rng)
        body: dict[str, Any] = {"temperature": scenario.temperature}
        if scenario.ignore_eos:
            body["ignore_eos"] = True
        if seeded:
            body["seed"] = scenario.seed * 1_000_003 + i
        body.update(kind.body)
        plans.append(
            RequestPlan(
                index=i,
                kind=kind.name,
                prompt=prompt,
                target_prompt_tokens=target,
                max_tokens=max_tokens,
                stream=stream,
                n=n,
                disconnect_after=max(1, after) if (stream and drop) else None,
                body=body,
                expect_status=kind.expect_status,
            )
        )
    return plans
