"""Every refusal the package makes is admission's, and each one is reachable and names its field.

Two checks over the source and one over the behaviour:

* every ``KvOptionsError`` the package constructs is in :mod:`obcache_vllm.admission`, or in
  one of the option table's value parsers (a single field's own domain), and the only
  ``VLLMValidationError`` it makes is the intake's conversion of a refusal into a 400;
* the table below drives admission through every refusal it has: each construction of a
  ``KvOptionsError`` in the module, and each reason an engine or platform check returns, is
  executed by at least one case (traced line by line), and each case gets the field (or the
  reason) it names. A refusal added without a case fails the trace check.
"""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support.engine_config import engine_config

from obcache_vllm import admission
from obcache_vllm.admission import CAPABILITIES, Admission, Admitted, Prompt, Requested
from obcache_vllm.eviction.sightings import PrefixSightings
from obcache_vllm.options import KvOptionsError

PACKAGE = Path(admission.__file__).resolve().parent
ADMISSION = Path(admission.__file__).resolve()
# The option table's value parsers: each refuses a value outside one field's own domain.
VALUE_PARSERS = {"parse", "boolean", "_target_items", "error_target", "budget", "point",
                 "_check_scalar", "parse_request"}  # fmt: skip
GEMMA3 = ["sliding_attention"] * 5 + ["full_attention"]
# Functions whose non-None returns are refusal reasons (admission turns them into a 400).
REASON_FUNCTIONS = {"platform_refusal", "scheduler_refusal", "_window_reason", "engine_refusal",
                    "speculative_refusal", "hybrid_refusal", "heads_memory_refusal"}  # fmt: skip


# -- the source ---------------------------------------------------------------------------------
def _calls(tree: ast.AST, name: str):
    """(enclosing function, statement line) of every call of ``name``."""
    found = []

    def visit(node, function, statement):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.stmt):
            statement = node.lineno
        if isinstance(node, ast.Call):
            callee = node.func
            called = callee.attr if isinstance(callee, ast.Attribute) else getattr(callee, "id", "")
            if called == name:
                found.append((function, statement))
        for child in ast.iter_child_nodes(node):
            visit(child, function, statement)

    visit(tree, None, None)
    return found


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_every_refusal_of_the_package_is_admissions_or_a_fields_own_domain():
    outside = []
    for path, tree in _sources():
        for function, line in _calls(tree, "KvOptionsError"):
            if path == ADMISSION:
                continue
            if path.name == "options.py" and function in VALUE_PARSERS:
                continue
            outside.append(f"{path.relative_to(PACKAGE.parent)}:{line} in {function}")
    assert not outside, "refusals outside obcache_vllm/admission.py:\n" + "\n".join(outside)
    made = [(p.relative_to(PACKAGE.parent).as_posix(), f) for p, tree in _sources()
            for f, _ in _calls(tree, "VLLMValidationError")]  # fmt: skip
    assert made == [("obcache_vllm/vllm_ext/frontend/intake.py", "rejected")]


def _refusal_sites() -> set[int]:
    """Lines of admission where a refusal is made: each KvOptionsError constructed, and each
    ``return`` of a reason in the engine and platform checks."""
    tree = ast.parse(ADMISSION.read_text())
    sites = {line for _, line in _calls(tree, "KvOptionsError")}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in REASON_FUNCTIONS:
            for ret in ast.walk(node):
                if (isinstance(ret, ast.Return) and ret.value is not None
                        and not (isinstance(ret.value, ast.Constant) and ret.value.value is None)
                        and not isinstance(ret.value, (ast.Name, ast.Call))):  # fmt: skip
                    sites.add(ret.lineno)
    return sites


# -- an engine configuration, as admission reads it ---------------------------------------------
engine = engine_config


def interleaved(**over):
    return engine(**{"model_config.get_sliding_window": lambda: 512,
                     "model_config.hf_text_config": SimpleNamespace(layer_types=GEMMA3),
                     **over})  # fmt: skip


def admit(fields, length=1000, backend="cpu", config=None, **prompt):
    gate = Admission(config or engine(), CAPABILITIES[backend], PrefixSightings(16))
    return gate.admit(admission.parse(fields), Prompt(length, **prompt))


def full_graphs():
    return SimpleNamespace(has_full_cudagraphs=lambda: True, name="FULL")


def _unimportable():
    raise ImportError("no module named mine")


def _users_scheduler():
    from vllm.v1.core.sched.scheduler import Scheduler

    class Mine(Scheduler):
        pass

    return Mine


B = {"kv_budget": 64}
TARGET = {"kv_budget": {"max_error": 0.1}}
# A KL target with the selection the default model's calibration was measured with.
KL = {"kv_budget": {"max_kl": 0.2}, "kv_pipeline": "snapkv", "kv_window": 32,
      "kv_per_head": True, "kv_scorer": "obcache_key"}  # fmt: skip


def hints(*actions):
    return SimpleNamespace(actions=list(actions))


def action(payload=None, version="1"):
    return SimpleNamespace(action_type=admission.HINT_ACTION_TYPE, action_version=version,
                           payload={"kv_budget": 64} if payload is None else payload)


# (id, a call that refuses, the field the refusal names, a phrase of its message)
CASES = [
    # option combinations (the prompt not known yet)
    ("no-room", lambda: admission.parse({"kv_budget": 20, "kv_sinks": 4, "kv_recent": 16}),
     "kv_budget", "must exceed"),
    ("target-unscored", lambda: admission.parse({**TARGET, "kv_pipeline": "streaming"}),
     "kv_budget", "no scored queries"),
    ("target-h2o-score", lambda: admission.parse({**TARGET, "kv_pipeline": "h2o"}),
     "kv_budget", "share of attention"),
    ("target-prefill", lambda: admission.parse({**TARGET, "kv_prefill_evict": True}),
     "kv_budget", "kv_prefill_evict"),
    ("kl-target-h2o", lambda: admission.parse({**KL, "kv_pipeline": "h2o", "kv_scorer": "attn"}),
     "kv_budget", "no window of queries"),
    ("kl-target-point", lambda: admission.parse({**KL, "kv_compress_at": 9}), "kv_budget",
     "kv_compress_at"),
    ("target-floor-room", lambda: admission.parse(
        {"kv_budget": {"max_error": 0.1, "min": 10}, "kv_sinks": 4}), "kv_budget", "exceed"),
    ("adakv-prefill", lambda: admission.parse({**B, "kv_pipeline": "adakv",
                                               "kv_prefill_evict": True}),
     "kv_prefill_evict", "per-head layout"),
    ("adakv-pressure", lambda: admission.parse({**B, "kv_pipeline": "adakv",
                                                "kv_when": "pressure"}), "kv_when", "pressure"),
    ("adakv-target", lambda: admission.parse({**TARGET, "kv_pipeline": "adakv"}),
     "kv_budget", "error target"),
    ("session-h2o", lambda: admission.parse({**B, "kv_session": True, "kv_pipeline": "h2o"}),
     "kv_session", "running sums"),
    ("session-point", lambda: admission.parse({**B, "kv_session": True, "kv_compress_at": 9}),
     "kv_session", "kv_compress_at"),
    ("pressure-h2o", lambda: admission.parse({**B, "kv_when": "pressure", "kv_pipeline": "h2o"}),
     "kv_when", "every query"),
    ("pressure-session", lambda: admission.parse({**B, "kv_when": "pressure",
                                                  "kv_session": True}), "kv_when", "kv_session"),
    # resolution on the prompt
    ("point-before-start", lambda: admit({**B, "kv_compress_at": -2000}), "kv_compress_at",
     "before the start"),
    ("point-past-prompt", lambda: admit({**B, "kv_compress_at": 2000}), "kv_compress_at",
     "exceeds the prompt"),
    ("budget-past-context", lambda: admit({"kv_budget": 5000}, length=6000), "kv_budget",
     "context length"),
    ("window-past-context", lambda: admit({**B, "kv_window": 5000}), "kv_window",
     "context length"),
    ("fraction-no-room", lambda: admit({"kv_budget": 0.01}, length=100), "kv_budget", "exceed"),
    # the platform's adapter, by its declared capabilities
    ("no-adapter", lambda: admit(B, backend="none"), "kv_budget", "CPU and CUDA"),
    ("quantized-cache", lambda: admit(B, config=engine(**{"cache_config.cache_dtype": "fp8_inc"})),
     "kv_budget", "quantized KV cache"),
    ("cuda-backend-unnamed", lambda: admit(B, backend="cuda", config=engine(
        **{"attention_config.backend": SimpleNamespace(name="TRITON_ATTN")})),
     "kv_budget", "--attention-backend"),
    ("cuda-full-graphs", lambda: admit(B, backend="cuda", config=engine(
        **{"compilation_config.cudagraph_mode": full_graphs()})), "kv_budget", "CUDA graphs"),
    ("cuda-block-size", lambda: admit(B, backend="cuda", config=engine(
        **{"cache_config.block_size": 24})), "kv_budget", "multiple of 16"),
    ("cuda-dbo", lambda: admit(B, backend="cuda", config=engine(
        **{"parallel_config.enable_dbo": True})), "kv_budget", "dual-batch"),
    ("cuda-alibi", lambda: admit(B, backend="cuda", config=engine(
        **{"model_config.hf_text_config": SimpleNamespace(alibi=True)})), "kv_budget", "ALiBi"),
    ("cuda-rswa", lambda: admit(B, backend="cuda", config=engine(
        **{"model_config.rswa_window": 128})), "kv_budget", "R-SWA"),
    # the engine configuration
    ("kv-connector", lambda: admit(B, config=engine(kv_transfer_config=object())),
     "kv_budget", "KV connectors"),
    ("pipeline-parallel", lambda: admit(B, config=engine(
        **{"parallel_config.pipeline_parallel_size": 2})), "kv_budget", "pipeline parallelism"),
    ("context-parallel", lambda: admit(B, config=engine(
        **{"parallel_config.decode_context_parallel_size": 2})), "kv_budget",
     "context parallelism"),
    ("state-space", lambda: admit(B, config=engine(**{"model_config.is_hybrid": True})),
     "kv_budget", "state-space"),
    ("window-everywhere", lambda: admit(B, config=engine(
        **{"model_config.get_sliding_window": lambda: 512})), "kv_budget", "interleaving"),
    ("hybrid-manager-off", lambda: admit(B, config=interleaved(
        **{"scheduler_config.disable_hybrid_kv_cache_manager": True})), "kv_budget",
     "hybrid KV-cache manager"),
    ("groups-on-cuda", lambda: admit(B, backend="cuda", config=interleaved()), "kv_budget",
     "CPU attention backend only"),
    ("mla", lambda: admit(B, config=engine(**{"model_config.use_mla": True})), "kv_budget",
     "MLA"),
    ("kv-sharing", lambda: admit(B, config=engine(**{"model_config.hf_text_config":
                                                     SimpleNamespace(num_kv_shared_layers=2)})),
     "kv_budget", "KV-sharing"),
    ("fast-prefill", lambda: admit(B, config=engine(
        **{"cache_config.kv_sharing_fast_prefill": True})), "kv_budget", "fast prefill"),
    ("v2-runner", lambda: admit(B, config=engine(use_v2_model_runner=True)), "kv_budget",
     "V2 model runner"),
    ("async-scheduling", lambda: admit(B, config=engine(
        **{"scheduler_config.async_scheduling": True})), "kv_budget", "async scheduling"),
    ("users-scheduler", lambda: admit(B, config=engine(
        **{"scheduler_config.get_scheduler_cls": _users_scheduler})), "kv_budget",
     "OBCacheScheduler"),
    ("unimportable-scheduler", lambda: admit(B, config=engine(
        **{"scheduler_config.get_scheduler_cls": _unimportable,
           "scheduler_config.scheduler_cls": "mine.Scheduler"})), "kv_budget",
     "could not be checked"),
    # the request against this engine
    ("prompt-embeds", lambda: admit(B, embeds=True), "kv_budget", "prompt embeddings"),
    ("target-tensor-parallel", lambda: admit(TARGET, config=engine(
        **{"parallel_config.tensor_parallel_size": 2})), "kv_budget", "tensor parallelism"),
    ("kl-target-uncalibrated-model", lambda: admit(KL, config=engine(
        **{"model_config.model": "/models/gemma-3-270m"})), "kv_budget", "needs a calibration"),
    ("kl-target-uncalibrated-window", lambda: admit({**KL, "kv_window": 64}), "kv_window",
     "measured with"),
    ("adakv-tensor-parallel", lambda: admit({**B, "kv_pipeline": "adakv"}, config=engine(
        **{"parallel_config.tensor_parallel_size": 2})), "kv_pipeline", "tensor parallelism"),
    ("adakv-on-cuda", lambda: admit({**B, "kv_pipeline": "adakv"}, backend="cuda"),
     "kv_pipeline", "per-head memory"),
    ("drafts-decode", lambda: admit({**B, "kv_decode": True}, config=engine(
        speculative_config=object())), "kv_decode", "speculative decoding"),
    ("drafts-pressure", lambda: admit({**B, "kv_when": "pressure"}, config=engine(
        speculative_config=object())), "kv_when", "speculative decoding"),
    ("drafts-session", lambda: admit({**B, "kv_session": True}, config=engine(
        speculative_config=object())), "kv_session", "speculative decoding"),
    ("drafts-adakv", lambda: admit({**B, "kv_pipeline": "adakv"}, config=engine(
        speculative_config=object())), "kv_pipeline", "speculative decoding"),
    ("groups-session", lambda: admit({**B, "kv_session": True}, config=interleaved()),
     "kv_session", "sliding-window layers"),
    ("session-no-prefix-cache", lambda: admit({**B, "kv_session": True}, config=engine(
        **{"cache_config.enable_prefix_caching": False})), "kv_session", "prefix caching"),
    # the pool's capacity (5 blocks of 16 tokens)
    ("stock-too-big", lambda: admission.check_fits(
        engine(**{"cache_config.num_gpu_blocks": 6}), 100, 16, None), "max_tokens", "pool"),
    ("prompt-alone-too-big", lambda: admit(B, length=100, max_tokens=4, config=engine(
        **{"cache_config.num_gpu_blocks": 6})), "kv_prefill_evict", "prompt alone"),
    ("peak-too-big", lambda: admit({**B, "kv_prefill_evict": True}, length=100, max_tokens=64,
                                   config=engine(**{"cache_config.num_gpu_blocks": 6})),
     "kv_budget", "lower kv_budget"),
    # the front end's own keys and paths
    ("reserved-key", lambda: admission.refuse_reserved({"obcache": 1}), "vllm_xargs",
     "reserved"),
    ("foreign-slot", lambda: admission.refuse_foreign({"obcache": ("obcache/1", 64)}), "obcache",
     "reserved"),
    ("beam-search", lambda: admission.refuse_beam_search({"kv_budget": 64}), "kv_budget",
     "use_beam_search"),
    ("hints-twice", lambda: admission.hinted_fields(hints(action(), action())), "kv_hints",
     "more than one"),
    ("hints-version", lambda: admission.hinted_fields(hints(action(version="2"))), "kv_hints",
     "version"),
    ("hints-payload", lambda: admission.hinted_fields(hints(action(payload=[1]))), "kv_hints",
     "object"),
    ("hints-field", lambda: admission.hinted_fields(hints(action(payload={"budget": 1}))),
     "kv_hints", "kv_* fields only"),
    ("streaming-input", lambda: Admission(engine(), CAPABILITIES["cpu"]).streaming(
        Admitted(admission.parse_kv_options(B, 1000))), "kv_budget", "streaming-input"),
]  # fmt: skip


@pytest.mark.parametrize("name, call, field, phrase", CASES, ids=[c[0] for c in CASES])
def test_each_refusal_names_its_field(name, call, field, phrase):
    with pytest.raises(KvOptionsError) as info:
        call()
    assert info.value.field == field, (name, str(info.value))
    assert phrase in str(info.value), (name, str(info.value))


def test_the_cases_reach_every_refusal_admission_makes():
    """Trace admission line by line through every case: each refusal site is executed."""
    hit: set[int] = set()
    target = str(ADMISSION)

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != target:
            return None

        def lines(frame, event, arg):
            if event == "line":
                hit.add(frame.f_lineno)
            return lines

        return lines

    sys.settrace(tracer)
    try:
        for _, call, _, _ in CASES:
            try:
                call()
            except KvOptionsError:
                pass
    finally:
        sys.settrace(None)
    missed = sorted(_refusal_sites() - hit)
    lines = ADMISSION.read_text().splitlines()
    assert not missed, "refusals no case reaches:\n" + "\n".join(
        f"admission.py:{n}: {lines[n - 1].strip()}" for n in missed)


def test_a_kl_target_with_the_calibrated_selection_is_admitted():
    admitted = admit(KL)
    assert admitted is not None and admitted.options.kl_target
    assert admitted.options.max_error == 0.2


def test_a_policy_budget_is_waived_not_refused_where_admission_would_refuse():
    """The client asked for no budget: what would refuse the policy's serves the request as
    stock vLLM (None), on every refusal of the engine."""
    policy = admission.Policy({"kv_budget": 64, "kv_pipeline": "snapkv"}, compress_at=None)
    requested = admission.parse({}, policy)
    assert requested.waived_below == 0
    gate = Admission(engine(kv_transfer_config=object()), CAPABILITIES["cpu"])
    assert gate.admit(requested, Prompt(1000)) is None
    assert gate.streaming(Admitted(admission.parse_kv_options(B, 1000), from_policy=True)) is None


def test_the_scheduler_names_are_the_classes():
    """Admission checks the scheduler class by name (it imports no EngineCore class)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from obcache_vllm.vllm_ext.engine.scheduler import OBCacheScheduler

    assert admission._qualified(Scheduler) == admission.VLLM_SCHEDULER
    assert admission._qualified(OBCacheScheduler) == admission.OUR_SCHEDULER
    ours = SimpleNamespace(get_scheduler_cls=lambda: OBCacheScheduler, scheduler_cls=None)
    assert admission.scheduler_refusal(ours) is None


def test_each_of_the_front_ends_keys_holds_one_type():
    """A Requested under its key, an Admitted under its own, the wire tuple only after the
    input processor's step: anything else under one of them is refused, and each is
    reserved in a client's vllm_xargs."""
    requested = Requested(admission.parse_request(B))
    admitted = Admitted(admission.parse_kv_options(B, 1000))
    admission.refuse_foreign({admission.REQUESTED_KEY: requested,
                              admission.CHECKED_KEY: admitted})  # fmt: skip
    for key, value in ((admission.REQUESTED_KEY, admitted), (admission.CHECKED_KEY, requested),
                       ("obcache", admitted), ("obcache", admitted.options.to_wire())):
        with pytest.raises(KvOptionsError) as info:
            admission.refuse_foreign({key: value})
        assert info.value.field == key
    for key in admission.RESERVED_KEYS:
        with pytest.raises(KvOptionsError, match=key):
            admission.refuse_reserved({key: 1})
    assert dataclasses.is_dataclass(Admitted) and dataclasses.is_dataclass(Requested)
