"""A seeded, model-based stress of KV reuse on the real engine (requests in flight together).

Each *case* draws a mix of requests over shared documents: budgets, pipelines and scorers,
``kv_compress_at`` (donors and adopters), sessions whose next turn arrives as the previous one
finishes, unbudgeted requests, identical requests sent at once, cache salts, arrivals spread
over the steps around each compress step, aborts mid-prefill, resets of the prefix cache with
and without running requests, and enough requests that the pool runs out (preemption, held
entries given up). The engine runs the case step by step; then the model says what must hold:

* every request that was not aborted gets the tokens it gets **alone** (the same request, or
  the same chain of session turns, sent by itself under a cache salt of its own, so that it
  computes and compresses everything itself);
* the KV oracle (``OBCACHE_VLLM_VERIFY=1``) found no mismatch, and no other fault was counted;
* the pool is whole: every block's references are the compressed entries' holds and the
  copies still queued for the engine's next step, and nothing else.

Seeds: case ``i`` of seed ``s`` is drawn from ``Random(f"{s}:{i}")`` alone, so any failing
case replays by itself (``replay`` names it). Used by tests/engine/test_stress.py (a short run
on the shared engine) and scripts/stress.py (the long run and its report).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field

# Request options drawn for budgeted requests ("DOC" is replaced by the document's length).
ARMS: tuple[dict | None, ...] = (
    None,
    {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": "DOC"},
    {"kv_budget": 0.25, "kv_pipeline": "tova", "kv_compress_at": "DOC"},  # drawn twice as often
    {"kv_budget": 0.5, "kv_pipeline": "snapkv", "kv_window": 8, "kv_compress_at": "DOC",
     "kv_decode": True},
    {"kv_budget": 0.25, "kv_pipeline": "streaming", "kv_compress_at": "DOC"},
    {"kv_budget": 0.25, "kv_pipeline": "tova"},
    {"kv_budget": 96, "kv_pipeline": "snapkv", "kv_window": 8, "kv_scorer": "attn"},
    {"kv_budget": 0.3, "kv_pipeline": "tova", "kv_scorer": "value_norm", "kv_decode": True},
    {"kv_budget": 1000, "kv_scorer": "obcache_joint"},  # over the whole sequence
    {"kv_budget": 64, "kv_prefill_evict": True},
    {"kv_budget": 0.25, "kv_when": "pressure"},
    {"kv_budget": 0.25, "kv_session": True, "kv_pipeline": "tova"},
    {"kv_budget": 0.4, "kv_session": True, "kv_pipeline": "snapkv", "kv_window": 4,
     "kv_decode": True},
)  # fmt: skip
# Budgets by error target: a drawn arm without a compress point of its own (index in ARMS)
# becomes its target variant half the time, by a Random of its own, so the draws above (and
# what every seed exercises: hits, sessions, preemptions) are the same with or without them.
TARGET_VARIANTS: dict[int, dict] = {
    5: {"kv_budget": {"max_error": 0.01}, "kv_pipeline": "tova"},
    6: {"kv_budget": {"max_error": 0.05, "min": 0.2}, "kv_pipeline": "snapkv", "kv_window": 8,
        "kv_scorer": "attn", "kv_per_head": False},
}  # fmt: skip


# Options whose result depends, by design, on the traffic around the request: with
# kv_prefill_evict the eviction runs after each prefill chunk, and chunks are cut by the
# step's token budget that other requests share; kv_when "pressure" compresses only when the
# pool is short. Requests with them are checked for isolation, the oracle and the pool, but
# not for the same tokens as alone.
TRAFFIC_DEPENDENT = ("kv_prefill_evict", "kv_when")


def traffic_dependent(kv: dict | None) -> bool:
    return bool(kv) and any(kv.get(option) for option in TRAFFIC_DEPENDENT)


def recompute_differs(spec: Spec) -> bool:
    """Whether a preemption (by the pool, or a reset with running requests) may change the
    request's tokens by design: it recomputes its cache from its tokens, and with ``kv_decode``
    the evictions it made while decoding are not made again the same way (the generated tokens
    are prefilled), nor is a session turn's continuation when its entry is gone meanwhile."""
    return bool(spec.kv) and bool(spec.kv.get("kv_decode") or spec.follows)


@dataclass
class Spec:
    """One request of a case. ``follows``: the session turn it continues (its prompt is that
    turn's prompt and output, then ``prompt``); it then arrives ``arrive`` steps after it."""

    name: str
    prompt: list[int]
    max_tokens: int
    kv: dict | None
    arrive: int
    salt: str | None = None
    abort_at: int | None = None
    follows: str | None = None


@dataclass
class Case:
    seed: str
    specs: list[Spec]
    reset_at: int | None = None
    reset_running: bool = False

    def describe(self) -> str:
        parts = [f"{s.name}@{s.arrive}{'+' + s.follows if s.follows else ''}:"
                 f"{json.dumps(s.kv, sort_keys=True) if s.kv else 'stock'}"
                 f"{' salt' if s.salt else ''}{f' abort@{s.abort_at}' if s.abort_at else ''}"
                 for s in self.specs]  # fmt: skip
        if self.reset_at is not None:
            parts.append(f"reset@{self.reset_at}{'(running)' if self.reset_running else ''}")
        return "; ".join(parts)


def draw_case(seed: int | str, index: int, docs: list[list[int]], questions: list[list[int]],
              max_requests: int = 8) -> Case:  # fmt: skip
    """Case ``index`` of ``seed`` (its own Random: replayable alone)."""
    rng = random.Random(f"{seed}:{index}")
    variants = random.Random(f"{seed}:{index}:targets")
    doc_of = [rng.randrange(len(docs)) if rng.random() < 0.4 else 0 for _ in range(max_requests)]
    specs: list[Spec] = []
    for i in range(rng.randint(3, max_requests)):
        arm = rng.choice(ARMS)
        target = TARGET_VARIANTS.get(ARMS.index(arm)) if arm is not None else None
        if target is not None and variants.random() < 0.5:
            arm = target
        doc = docs[doc_of[i]]
        kv = None if arm is None else {
            k: (len(doc) if v == "DOC" else v) for k, v in arm.items()
        }  # fmt: skip
        if specs and specs[-1].follows is None and rng.random() < 0.15:  # the same, at once
            twin = specs[-1]
            specs.append(Spec(f"r{i}", twin.prompt, twin.max_tokens, twin.kv, twin.arrive,
                              twin.salt))  # fmt: skip
            continue
        spec = Spec(
            name=f"r{i}",
            prompt=doc + rng.choice(questions),
            max_tokens=rng.choice((4, 8)),
            kv=kv,
            arrive=rng.choice((0, 0, 1, 2, 3, 4, 5, 6, 8)),
            salt="s1" if rng.random() < 0.15 else None,
        )
        if rng.random() < 0.12:
            spec.abort_at = spec.arrive + rng.randint(0, 4)
        specs.append(spec)
        if kv and kv.get("kv_session") and spec.abort_at is None and rng.random() < 0.85:
            turn = Spec(f"r{i}t2", rng.choice(questions), rng.choice((4, 8)), kv,
                        arrive=rng.randint(0, 2), salt=spec.salt, follows=spec.name)  # fmt: skip
            specs.append(turn)
    case = Case(str(f"{seed}:{index}"), specs)
    if rng.random() < 0.15:
        case.reset_at = rng.randint(1, 10)
        case.reset_running = rng.random() < 0.5
    return case


@dataclass
class Outcome:
    """What one case showed (``problems`` empty: every check held)."""

    case: Case
    tokens: dict[str, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    stats: Counter = field(default_factory=Counter)


class Stress:
    """Runs cases on one engine (``support.engine.Internals``) through its LLMEngine."""

    def __init__(self, engine, pool_blocks: int) -> None:
        self.engine = engine
        self.pool_blocks = pool_blocks
        self._alone: dict[str, list[int] | None] = {}
        self._serial = 0
        self.preemptions = 0
        self.preempted: set[str] = set()  # engine request ids preempted in the current case
        self._external: dict[str, str] = {}
        self._queued_at_idle = 0
        self._usage: dict[str, dict | None] = {}  # engine request id -> usage.obcache
        self._prompts: dict[str, list[int]] = {}  # name -> the prompt it sent (last run)
        scheduler = engine.scheduler
        original = scheduler._preempt_request

        def counting(request, *args, **kwargs):
            self.preemptions += 1
            self.preempted.add(request.request_id)
            return original(request, *args, **kwargs)

        scheduler._preempt_request = counting

    # -- running -------------------------------------------------------------------------
    def _add(self, name: str, prompt: list[int], spec: Spec, salt: str | None) -> str:
        from vllm import SamplingParams

        self._serial += 1
        params = SamplingParams(temperature=0, max_tokens=spec.max_tokens,
                                extra_args=dict(spec.kv) if spec.kv else None)  # fmt: skip
        request = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        external = f"{name}#{self._serial}"  # what the engine's outputs and aborts name
        self.engine.llm.llm_engine.add_request(external, request, params)
        return external

    def _step(self, finished: dict[str, list[int]]) -> None:
        for out in self.engine.llm.llm_engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
                self._usage[out.request_id] = (out.kv_transfer_params or {}).get("obcache")

    def run(self, case: Case) -> tuple[dict, set]:
        """Run ``case`` concurrently: tokens by name, and the names that were aborted."""
        llm_engine = self.engine.llm.llm_engine
        by_name = {s.name: s for s in case.specs}
        internal: dict[str, str] = {}
        self._external = internal  # name -> the engine's external request id (last run)
        prompts: dict[str, list[int]] = {}
        finished_at: dict[str, int] = {}
        finished: dict[str, list[int]] = {}
        aborted: set[str] = set()
        step = 0
        while True:
            for spec in case.specs:
                if spec.name in internal:
                    continue
                if spec.follows is None:
                    due = spec.arrive <= step
                else:
                    due = spec.follows in finished_at and (
                        finished_at[spec.follows] + spec.arrive <= step)  # fmt: skip
                    if spec.follows in aborted:
                        aborted.add(spec.name)
                        internal[spec.name] = ""
                        continue
                if not due:
                    continue
                prompt = spec.prompt
                if spec.follows is not None:
                    prev = by_name[spec.follows]
                    prompt = prompts[prev.name] + finished[internal[prev.name]] + spec.prompt
                prompts[spec.name] = prompt
                self._prompts = prompts
                internal[spec.name] = self._add(spec.name, prompt, spec, spec.salt)
            for spec in case.specs:
                rid = internal.get(spec.name)
                if spec.abort_at == step and rid and rid not in finished:
                    llm_engine.abort_request([rid])
                    aborted.add(spec.name)
            if case.reset_at == step:
                self.engine.scheduler.reset_prefix_cache(
                    reset_running_requests=case.reset_running
                )
            pending = len(internal) < len(case.specs)
            if not pending and not llm_engine.has_unfinished_requests():
                break
            self._step(finished)
            for name, rid in internal.items():
                if rid in finished and name not in finished_at:
                    finished_at[name] = step
            step += 1
            if step > 3000:
                scheduler = self.engine.scheduler
                raise AssertionError(
                    f"case {case.seed} did not finish: arrived {sorted(internal)} of "
                    f"{len(case.specs)}, waiting {[r.request_id for r in scheduler.waiting]}, "
                    f"running {[r.request_id for r in scheduler.running]}, free "
                    f"{scheduler.kv_cache_manager.block_pool.get_num_free_blocks()}, held "
                    f"{scheduler.obcache_prefix.held_blocks}"
                )
        tokens = {n: finished[r] for n, r in internal.items() if r in finished and n not in aborted}
        return tokens, aborted

    def alone(self, case: Case, name: str, tokens: dict[str, list[int]]) -> list[int] | None:
        """The tokens ``name`` gets alone: its chain of session turns, each by itself, under
        a salt of their own (memoized by what the chain sends). A session turn that did not
        continue its predecessor's cache (its entry was gone: a reset, the LRU) recomputed its
        whole prompt, so alone it is that prompt by itself."""
        by_name = {s.name: s for s in case.specs}
        chain = []
        spec = by_name[name]
        usage = self._usage.get(self._external.get(name, ""))
        if spec.follows and (usage or {}).get("reused_from") != "session":
            spec = Spec(spec.name, self._prompts[name], spec.max_tokens, spec.kv, 0)
        while spec is not None:
            chain.append(spec)
            spec = by_name[spec.follows] if spec.follows else None
        chain.reverse()
        key = json.dumps([[s.prompt, s.max_tokens, s.kv] for s in chain])
        if key in self._alone:
            return self._alone[key]
        self._serial += 1
        salt = f"alone-{self._serial}"
        prompt: list[int] = []
        out: list[int] = []
        for spec in chain:
            prompt = prompt + out + spec.prompt if spec.follows else spec.prompt
            rid = self._add(f"alone-{spec.name}", prompt, spec, salt)
            finished: dict[str, list[int]] = {}
            while rid not in finished:
                self._step(finished)
            out = finished[rid]
            if spec.follows is None and spec is not chain[-1] and out != tokens.get(spec.name):
                break  # the turn it continues already differs: reported for that turn
        self._alone[key] = out
        return out

    # -- checking ------------------------------------------------------------------------
    def check(self, case: Case) -> Outcome:
        scheduler = self.engine.scheduler
        prefix = scheduler.obcache_prefix
        outcome = Outcome(case)
        failures = dict(scheduler.obcache_totals.failures)
        mismatches = len(scheduler.obcache_mismatches)
        counts = dict(prefix.counts)
        preemptions = self.preemptions
        self.preempted.clear()
        try:
            tokens, aborted = self.run(case)
        except Exception as exc:  # an engine error is a finding, not a crash of the stress
            outcome.problems.append(f"engine raised {type(exc).__name__}: {exc}")
            return outcome
        outcome.tokens = tokens
        found = list(scheduler.obcache_mismatches)[mismatches:]
        outcome.problems += [f"oracle: {m}" for m in found]
        new_failures = {k: v - failures.get(k, 0) for k, v in scheduler.obcache_totals.failures
                        .items() if v != failures.get(k, 0)}  # fmt: skip
        if new_failures:
            outcome.problems.append(f"faults counted: {new_failures}")
        problems = self._pool_problems()
        outcome.problems += problems
        stats = outcome.stats
        stats["blocks_queued_for_a_copy_at_idle"] += self._queued_at_idle
        for (kind, what), value in prefix.counts.items():
            gained = value - counts.get((kind, what), 0)
            if gained and what in ("hit", "miss", "created", "released", "evicted"):
                stats[f"{kind}_{what}"] += gained
        stats["preemptions"] += self.preemptions - preemptions
        stats["aborted"] += len(aborted)
        stats["requests"] += len(case.specs)
        stats["resets"] += case.reset_at is not None
        for spec in case.specs:
            if spec.name not in tokens or traffic_dependent(spec.kv):
                continue
            if recompute_differs(spec) and self._was_preempted(case, spec.name):
                stats["preempted_not_compared"] += 1
                continue
            alone = self.alone(case, spec.name, tokens)
            stats["compared"] += 1
            if tokens[spec.name] != alone:
                outcome.problems.append(
                    f"{spec.name} ({json.dumps(spec.kv) if spec.kv else 'stock'}): "
                    f"{tokens[spec.name]} together, {alone} alone"
                )
        if not problems:
            problems = self._pool_problems()  # after the alone runs too
            outcome.problems += problems
        return outcome

    def _was_preempted(self, case: Case, name: str) -> bool:
        """Whether ``name``, or a session turn it continues, was preempted in the last run."""
        by_name = {s.name: s for s in case.specs}
        while name is not None:
            external = self._external.get(name)
            if external and any(r == external or r.startswith(f"{external}-")
                                for r in self.preempted):  # fmt: skip
                return True
            name = by_name[name].follows
        return False

    def _pool_problems(self) -> list[str]:
        """With no request left, every block's references are the compressed entries' holds
        and the copies still queued for the next step (an entry made in a request's last step
        is copied by the engine's next step, whenever that comes), and nothing else."""
        scheduler = self.engine.scheduler
        prefix = scheduler.obcache_prefix
        pool = scheduler.kv_cache_manager.block_pool
        group = scheduler.obcache_pool.group
        expected: Counter = Counter()
        for _, blocks in prefix._held_blocks.values():
            expected.update(b.block_id for b in blocks)
        queued = [b.block_id for pair in group._pending_cow_copies for b in pair]
        expected.update(queued)
        wrong = [(b.block_id, b.ref_cnt, expected[b.block_id]) for b in pool.blocks[1:]
                 if b.ref_cnt != expected[b.block_id]]  # fmt: skip
        problems = []
        if wrong:
            problems.append(f"blocks with references no entry or queued copy explains "
                            f"(block, refs, expected): {wrong[:8]}")  # fmt: skip
        if scheduler.requests:
            problems.append(f"requests left in the scheduler: {list(scheduler.requests)}")
        self._queued_at_idle = len(set(queued))
        return problems


def replay(seed, index) -> str:
    return (f"replay: OBCACHE_STRESS_SEED={seed} OBCACHE_STRESS_CASES={index}:{index + 1} "
            "python scripts/stress.py")  # fmt: skip
