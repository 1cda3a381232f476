"""Teacher forcing inside vLLM: a logits processor that makes each request emit given tokens.

A request opts in with ``SamplingParams.extra_args = {"forced_tokens": [t0, t1, ...]}``: its
i-th generated token is ``t_i`` (every other logit is set to -inf). Requests without the key are
untouched. Used by :mod:`obcache_vllm.evidence.perplexity` to feed a known continuation through the
engine one decode step at a time, with decode-time eviction running as for any generation.

Why the returned logprob is the model's, not the forced one (vLLM 0.32, ``v1/sample/sampler.py``
``Sampler.forward``): with ``logprobs_mode="raw_logprobs"`` (the default) the logprobs are
computed from the logits *before* ``apply_logits_processors``, where non-argmax-invariant
processors such as this one run; the sampled (here: forced) token's raw logprob is then gathered.
So ``logprobs=0`` returns ``log p_model(t_i | context)``. The ``processed_*`` modes would return
0 (the forced distribution) and are refused by :func:`check_logprobs_mode`.

vLLM v1 logits processors are batch-level classes (``vllm.v1.sample.logits_processor``): one
instance per engine, told about requests joining, leaving and moving within the persistent batch
through :meth:`update_state`; per-request arguments come from ``SamplingParams.extra_args``. The
engine must be built with ``logits_processors=[FORCE_TOKENS_FQCN]`` (or the class).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

FORCED_TOKENS_KEY = "forced_tokens"
FORCE_TOKENS_FQCN = "obcache_vllm.evidence.forcing:ForceTokensProcessor"


def _forced_tokens(params: SamplingParams | None) -> list[int] | None:
    extra = getattr(params, "extra_args", None) or {}
    return extra.get(FORCED_TOKENS_KEY)


class ForceTokensProcessor(LogitsProcessor):
    """Forces the i-th output token of each opted-in request to its ``forced_tokens[i]``.

    State: batch row -> (targets, live output-token list). vLLM passes each added request's
    running output list by reference, so ``len(outputs)`` is the index of the token about to be
    sampled. Past the end of the targets the request samples freely (callers set
    ``max_tokens = len(forced_tokens)``).
    """

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[list[int], list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        tokens = _forced_tokens(sampling_params)
        if tokens is None:
            return
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens)
        ):
            raise ValueError(f"{FORCED_TOKENS_KEY}: must be a non-empty list of token ids >= 0")

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: must run before greedy sampling

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        track_rows(self.rows, batch_update, lambda params, outputs: (
            None if (tokens := _forced_tokens(params)) is None else (list(tokens), outputs)))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        for index, (targets, outputs) in self.rows.items():
            step = len(outputs)
            if step < len(targets) and index < logits.shape[0]:
                rows.append(index)
                tokens.append(targets[step])
        if rows:
            r = torch.tensor(rows, dtype=torch.long, device=logits.device)
            t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            logits[r] = float("-inf")
            logits[r, t] = 0.0
        return logits


def track_rows(rows: dict, batch_update: BatchUpdate | None, entry) -> None:
    """Keep ``rows`` (batch row -> state) in step with vLLM's persistent batch.

    ``entry(params, outputs)`` is an added request's state, or None when it does not opt in.
    The order is vLLM's ``BatchUpdate`` contract: removed, added (an added request may replace
    a tracked one in its row), moved (or swapped)."""
    if batch_update is None:
        return
    for index in batch_update.removed:
        rows.pop(index, None)
    for index, params, _prompt, outputs in batch_update.added:
        value = entry(params, outputs)
        if value is None:
            rows.pop(index, None)
        else:
            rows[index] = value
    for src, dst, direction in batch_update.moved:
        a, b = rows.pop(src, None), rows.pop(dst, None)
        if a is not None:
            rows[dst] = a
        if direction == MoveDirectionality.SWAP and b is not None:
            rows[src] = b


def check_logprobs_mode(mode: str) -> None:
    """Refuse logprob modes that would report the forced distribution instead of the model's."""
    if mode != "raw_logprobs":
        raise ValueError(
            f"teacher forcing needs logprobs_mode='raw_logprobs' (got {mode!r}): other modes "
            "report the logits after the forcing processor or unnormalised logits"
        )


def forced_params(tokens: Sequence[int], extra_args: dict | None = None) -> SamplingParams:
    """Greedy params that emit exactly ``tokens`` and return each one's raw logprob."""
    extra = dict(extra_args or {})
    extra[FORCED_TOKENS_KEY] = [int(t) for t in tokens]
    return SamplingParams(
        temperature=0,
        max_tokens=len(tokens),
        ignore_eos=True,
        logprobs=0,
        detokenize=False,
        extra_args=extra,
        # Deltas: cumulative outputs would copy every request's whole history at every step.
        output_kind=RequestOutputKind.DELTA,
    )


@dataclass(frozen=True)
class ForcedRequest:
    """One teacher-forced request: prompt ids, the ids to force, its kv_* options (or None)."""

    name: str
    prompt: list[int]
    target: list[int]
    kv: dict | None = None


@dataclass
class ForcedOutcome:
    """What one forced request produced and held."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    max_live_blocks: int = 0
    max_resident_tokens: int = 0  # for budgeted requests; 0 for unbudgeted
    evictions: int = 0


class ForcedRun(dict):
    """name -> ForcedOutcome, plus the number of engine steps taken."""

    steps: int = 0


def run_forced(llm, requests: Sequence[ForcedRequest], progress=None) -> ForcedRun:
    """Run all requests as one batch, stepping the engine by hand.

    Needs the in-process engine core (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): after each step it
    reads, for every request, the blocks it holds in vLLM's pool and (budgeted requests) the
    resident token count from the obcache scheduler, and at the end the scheduler's eviction
    record. ``progress(step, finished, total, outcome)`` is called after every step (the
    outcome so far: tokens and logprobs grow by one per step and request).
    """
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # AttributeError: multiprocess core
    # The group budgets evict in (a hybrid model's global layers), for stock runs as well.
    from obcache_vllm.vllm_ext.groups import evicting_group

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    manager = managers[evicting_group(scheduler.kv_cache_config).index or 0]
    resident = getattr(scheduler, "obcache_resident_tokens", lambda rid: None)
    internal: dict[str, str] = {}
    names: dict[str, str] = {}
    for r in requests:
        iid = engine.add_request(r.name, {"prompt_token_ids": list(r.prompt)},
                                 forced_params(r.target, r.kv))
        internal[r.name] = iid
        names[iid] = r.name
    outcome = ForcedRun({r.name: ForcedOutcome() for r in requests})
    done = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            comp = out.outputs[0]
            got = outcome[out.request_id if out.request_id in outcome else names[out.request_id]]
            got.tokens.extend(comp.token_ids)
            got.logprobs.extend(
                float(lp[t].logprob) for lp, t in zip(comp.logprobs, comp.token_ids, strict=True)
            )
            done += int(out.finished)
        outcome.steps += 1
        for name, iid in internal.items():
            got = outcome[name]
            blocks = sum(1 for b in manager.req_to_blocks.get(iid, []) if not b.is_null)
            got.max_live_blocks = max(got.max_live_blocks, blocks)
            held = resident(iid)
            if held is not None:
                got.max_resident_tokens = max(got.max_resident_tokens, held)
        if progress is not None:
            progress(outcome.steps, done, len(requests), outcome)
    records = {rec.req_id: rec for rec in getattr(scheduler, "obcache_finished", ())}
    for name, iid in internal.items():
        if iid in records:
            outcome[name].evictions = records[iid].evictions
    return outcome
