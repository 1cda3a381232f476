"""The simulated engine: vLLM's scheduler on a real block pool, the front end's admission, and
the symbolic worker (see the package docstring).

:class:`Sim` is one engine: ``add`` (through obcache-vllm's ``admit_engine_request``, as the
input processor runs it, then ``Request.from_engine_core_request`` with vLLM's block hasher),
``step``, ``abort``, ``reset``, ``stream`` (a streaming-input chunk under a known id). After
every step :func:`~.checks.check_step` runs; every broken invariant is a
:class:`~.worker.Violation` in ``violations``. ``trace`` records each step's scheduling
decisions, so two engines fed the same operations can be compared step by step.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from obcache_vllm.admission import Admission
from obcache_vllm.eviction.entries import HeldEntries
from obcache_vllm.eviction.oracle import VERIFY_ENV
from obcache_vllm.options import admitted_options
from obcache_vllm.vllm_ext.engine.scheduler import OBCacheScheduler
from obcache_vllm.vllm_ext.frontend import intake
from obcache_vllm.vllm_ext.wire import OUTCOME_KEY

from . import checks
from .worker import LAYER, SymbolicWorker, Violation


@dataclass(frozen=True)
class SimConfig:
    """One simulated engine. ``plugin``: obcache-vllm's scheduler (else vLLM's own, the stock
    reference); ``share``/``share_max``: the held entries' shares of the pool
    (``OBCACHE_ENTRY_POOL_SHARE``/``_MAX``); ``victims``: which held entry goes first."""

    num_blocks: int = 40
    block_size: int = 8
    max_num_seqs: int = 4
    max_batched_tokens: int = 48
    max_model_len: int = 512
    prefix_caching: bool = True
    plugin: bool = True
    share: float = 0.25
    share_max: float = 0.5
    victims: str = "reuse"  # HeldEntries.victims (OBCACHE_ENTRY_VICTIMS)
    verify: bool = True


@functools.cache
def _model_dir() -> str:
    """A model directory holding only a config (the scheduler never loads weights)."""
    path = tempfile.mkdtemp(prefix="obcache-sim-model-")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 1, "vocab_size": 512, "max_position_embeddings": 8192,
        "torch_dtype": "float32",
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


@functools.cache
def _model_config(max_model_len: int) -> ModelConfig:
    return ModelConfig(model=_model_dir(), max_model_len=max_model_len,
                       skip_tokenizer_init=True, dtype="float32")  # fmt: skip


def vllm_config(cfg: SimConfig) -> VllmConfig:
    """The engine configuration of ``cfg`` (one per distinct setting: building one logs)."""
    return _vllm_config(cfg.block_size, cfg.num_blocks, cfg.prefix_caching, cfg.max_num_seqs,
                        cfg.max_batched_tokens, cfg.max_model_len)  # fmt: skip


@functools.cache
def _vllm_config(block_size, num_blocks, prefix_caching, max_num_seqs, max_batched_tokens,
                 max_model_len) -> VllmConfig:  # fmt: skip
    cfg = SimConfig(num_blocks, block_size, max_num_seqs, max_batched_tokens, max_model_len,
                    prefix_caching)  # fmt: skip
    cache = CacheConfig(block_size=cfg.block_size, enable_prefix_caching=cfg.prefix_caching)
    cache.num_gpu_blocks = cfg.num_blocks
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    return VllmConfig(model_config=_model_config(cfg.max_model_len), scheduler_config=sched,
                      cache_config=cache, device_config=DeviceConfig("cpu"))  # fmt: skip


@dataclass
class Result:
    """What a request got: its tokens, finish reason, KV outcome; or why it was refused."""

    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    outcome: dict | None = None
    refused: str | None = None


class Sim:
    """One simulated engine (see the module docstring)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.config = vllm_config(cfg)
        # Admission for this engine: its own index of recent prompts ("auto"), as a new
        # server starts with (else a case would depend on the last).
        self.gate = Admission.for_engine(self.config, "cpu")
        spec = FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float32)  # fmt: skip
        kv_config = KVCacheConfig(num_blocks=cfg.num_blocks, kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)])  # fmt: skip
        cls = OBCacheScheduler if cfg.plugin else Scheduler
        saved = os.environ.get(VERIFY_ENV)
        os.environ[VERIFY_ENV] = "1" if cfg.verify else "0"
        try:
            self.scheduler = cls(vllm_config=self.config, kv_cache_config=kv_config,
                                 structured_output_manager=StructuredOutputManager(self.config),
                                 block_size=cfg.block_size, log_stats=True)  # fmt: skip
        finally:
            if saved is None:
                os.environ.pop(VERIFY_ENV, None)
            else:
                os.environ[VERIFY_ENV] = saved
        self.pool = self.scheduler.kv_cache_manager.block_pool
        if cfg.plugin:
            usable = cfg.num_blocks - 1
            self.scheduler.obcache_prefix.held = HeldEntries(
                int(cfg.share_max * usable), base=int(cfg.share * usable), victims=cfg.victims
            )
        self.worker = SymbolicWorker(self.scheduler, cfg.block_size, cfg.num_blocks, cfg.plugin)
        self._poison_fresh_blocks()
        self.hasher = None
        if cfg.prefix_caching:
            fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
            init_none_hash(fn)
            self.hasher = get_request_block_hasher(cfg.block_size, fn)
        self.results: dict[str, Result] = {}
        self.trace: list[tuple] = []
        self.pressure: list[int] = []  # per step: pressure events so far (plugin only)
        self.steps = 0
        self.expected_stock: dict = {}  # block hash -> expected contents (checks.registered)

    @property
    def violations(self) -> list[Violation]:
        return self.worker.violations

    def _poison_fresh_blocks(self) -> None:
        """A block the pool hands out holds nothing its new owner may read."""
        original = self.pool.get_new_blocks
        worker = self.worker

        def get_new_blocks(num_blocks):
            blocks = original(num_blocks)
            worker.allocated([b.block_id for b in blocks])
            return blocks

        self.pool.get_new_blocks = get_new_blocks

    # -- operations ---------------------------------------------------------------------------
    def add(self, req_id: str, prompt, max_tokens: int, fields: dict | None = None, *,
            session_id: str | None = None, cache_salt: str | None = None,
            resumable: bool = False) -> Result:  # fmt: skip
        """Admit a request as the front end would, then add it to the scheduler. A refusal
        (vLLM's 400) is recorded in the result; nothing reaches the engine then."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                extra_args=dict(fields) if fields else None)  # fmt: skip
        request = EngineCoreRequest(
            request_id=req_id, prompt_token_ids=list(prompt), mm_features=None,
            sampling_params=params, pooling_params=None, arrival_time=time.time(),
            lora_request=None, cache_salt=cache_salt, data_parallel_rank=None,
            resumable=resumable, session_id=session_id,
        )  # fmt: skip
        result = self.results.setdefault(req_id, Result())
        try:
            intake.admit_engine_request(self.gate, request)
        except VLLMValidationError as exc:
            result.refused = str(exc)
            return result
        if self.cfg.plugin:
            checks.check_admitted(self, req_id, dict(fields or {}),
                                  admitted_options(params.extra_args))  # fmt: skip
        self.scheduler.add_request(Request.from_engine_core_request(request, self.hasher))
        return result

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache`` (``/reset_prefix_cache``): refused while blocks are in
        use, as in vLLM."""
        return self.scheduler.reset_prefix_cache()

    def step(self) -> None:
        scheduler = self.scheduler
        checks.before_step(self)
        out = scheduler.schedule()
        self.steps += 1
        checks.learn_hashes(self)  # every request alive in this step, even if it ends in it
        mro = self.worker.execute(out)
        live = dict(scheduler.requests)  # a request freed by the update keeps its tokens here
        outputs = scheduler.update_from_output(out, mro)
        finished = []
        for eco in outputs.values():
            for o in eco.outputs:
                result = self.results.setdefault(o.request_id, Result())
                result.tokens.extend(o.new_token_ids)
                if o.kv_transfer_params and OUTCOME_KEY in o.kv_transfer_params:
                    result.outcome = o.kv_transfer_params[OUTCOME_KEY]
                if o.finish_reason is not None:
                    result.finish = str(o.finish_reason)
                    finished.append(o.request_id)
        for req_id in finished:
            if req_id in live:
                self.worker.snapshot_finished(req_id, live[req_id].all_token_ids)
        self.trace.append(_decisions(out, scheduler))
        if self.cfg.plugin:  # compressions and admissions under pressure so far
            self.pressure.append(scheduler.obcache_pressure.counts.compressions
                                 + scheduler.obcache_pool.pressure_admissions)  # fmt: skip
        checks.check_step(self, out)

    def drain(self, max_steps: int) -> bool:
        """Step until every request has finished; False if that takes over ``max_steps``."""
        for _ in range(max_steps):
            if not self.scheduler.requests:
                return True
            self.step()
        return not self.scheduler.requests


def _decisions(out, scheduler) -> tuple:
    """One step's scheduling decisions (what two engines fed alike must agree on)."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    tables = tuple(
        (r, tuple(b.block_id for b in manager.req_to_blocks.get(r, ())))
        for r in sorted(out.num_scheduled_tokens)
    )
    return (
        tuple(sorted(n.req_id for n in out.scheduled_new_reqs)),
        tuple(sorted(out.num_scheduled_tokens.items())),
        tuple(sorted(out.preempted_req_ids or ())),
        tuple(sorted(out.finished_req_ids)),
        tables,
        tuple(tuple(c) for c in (out.kv_cache_block_copies or ())),
    )
