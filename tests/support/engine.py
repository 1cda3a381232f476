"""Engine-test helpers: settings shared with the stock reference, engine internals, a driver.

The shared engine runs vLLM's EngineCore and worker in the pytest process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that tests can read the scheduler, the block pool and
the worker's eviction state between steps. The real 3-process topology is covered by the
plugin-probe and server tests.

Stock vLLM references run in a subprocess with ``VLLM_PLUGINS=`` (plugin disabled), with the
same engine settings, topology and batch composition.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

# The scripts tests run in subprocesses (fresh engines, other topologies).
PROBES = Path(__file__).resolve().parent / "probes"

# Engine settings shared by the plugin engine and the stock reference. A deliberately small
# pool (96 blocks of 32 tokens = 3072 tokens) makes capacity measurable with short prompts
# (this 2-core machine prefills only a few hundred tokens per second); 256 batched tokens make
# every long prompt a chunked prefill.
POOL_BLOCKS = 96
# float32: this CPU has no bf16 matmul units (bf16 GEMMs measured ~4x slower than fp32 here).
ENGINE_KWARGS = dict(
    dtype="float32",
    enforce_eager=True,
    max_model_len=2048,
    block_size=32,
    seed=0,
    num_gpu_blocks_override=POOL_BLOCKS,
    max_num_batched_tokens=256,
    max_num_seqs=64,
)


@dataclass
class Internals:
    """Handles on the in-process engine's internals (scheduler, block pool, worker runner)."""

    llm: object

    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    @property
    def runner(self):
        return self.core.model_executor.driver_worker.worker.model_runner

    def free_blocks(self) -> int:
        """Blocks no request holds: vLLM's free blocks plus those compressed entries hold out
        of the LRU (released whenever a request needs them; see PrefixAdapter.reclaim)."""
        return self.pool.get_num_free_blocks() + self.scheduler.obcache_prefix.held_blocks

    def live_blocks(self, req_id: str) -> int:
        """Blocks the request holds in the pool (null blocks excluded)."""
        manager = self.scheduler.obcache_pool.group  # the group budgets evict in
        return sum(1 for b in manager.req_to_blocks.get(req_id, []) if not b.is_null)


class Held(NamedTuple):
    """What one request holds after a step: live blocks, resident tokens, logical tokens."""

    blocks: int
    resident: int | None
    computed: int


@dataclass
class Driver:
    """Adds requests and steps the engine by hand, recording what the scheduler holds."""

    engine: Internals
    outputs: dict = field(default_factory=dict)  # internal request id -> token ids
    internal: dict = field(default_factory=dict)  # the id given to add() -> vLLM's internal id
    max_running: int = 0
    trace: list = field(default_factory=list)

    def add(
        self, req_id: str, prompt_ids: list[int], max_tokens: int, ignore_eos=False,
        salt: str | None = None, **kv,
    ) -> str:  # fmt: skip
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos, extra_args=kv or None
        )
        prompt = {"prompt_token_ids": prompt_ids}
        if salt is not None:
            prompt["cache_salt"] = salt
        internal = self.engine.llm.llm_engine.add_request(req_id, prompt, params)
        self.internal[req_id] = internal
        return internal

    def step(self) -> None:
        for out in self.engine.llm.llm_engine.step():
            if out.finished:
                rid = self.internal.get(out.request_id, out.request_id)
                self.outputs[rid] = list(out.outputs[0].token_ids)
        sched = self.engine.scheduler
        self.max_running = max(self.max_running, len(sched.running))
        self.trace.append(
            {
                rid: Held(
                    self.engine.live_blocks(rid),
                    sched.obcache_resident_tokens(rid),
                    req.num_computed_tokens,
                )
                for rid, req in sched.requests.items()
            }
        )

    def run(self, max_steps: int = 10_000) -> dict:
        for _ in range(max_steps):
            if not self.engine.llm.llm_engine.has_unfinished_requests():
                return self.outputs
            self.step()
        raise AssertionError("engine did not finish")


def generate(engine: Internals, prompts: list[list[int]], kv: dict, max_tokens: int):
    """One greedy ``LLM.generate`` call (EOS ignored) with ``kv`` as every request's options:
    each request's token ids, ``usage.obcache`` (None: unbudgeted) and vLLM's internal id."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=dict(kv) or None)  # fmt: skip
    outs = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return (
        [list(o.outputs[0].token_ids) for o in outs],
        [(o.kv_transfer_params or {}).get("obcache") for o in outs],
        [o.request_id for o in outs],
    )


def record_preemptions(engine: Internals, monkeypatch) -> dict[str, list[int]]:
    """Every preemption vLLM makes from now on (``monkeypatch`` undoes the recording): vLLM's
    internal request id -> the output tokens the request had at each of its preemptions."""
    seen: dict[str, list[int]] = {}
    original = engine.scheduler._preempt_request

    def recording(request, *args, **kwargs):
        seen.setdefault(request.request_id, []).append(request.num_output_tokens)
        return original(request, *args, **kwargs)

    monkeypatch.setattr(engine.scheduler, "_preempt_request", recording)
    return seen


def kept_overlap(a, b) -> float:
    """|a ∩ b| / K per KV head, averaged over the heads (each row: one head's kept positions)."""
    per_head = [len(set(x.tolist()) & set(y.tolist())) / len(x) for x, y in zip(a, b, strict=True)]
    return sum(per_head) / len(per_head)


def run_pool(spec: dict, stock: bool, core: int | str, env: dict | None = None,
             timeout: float = 1500) -> dict:
    """One fresh engine in a subprocess (``probes/pool_runner.py``, see there for ``spec`` and
    what comes back), bound to ``core``; stock vLLM (plugin disabled) when ``stock``. A run
    that fails before writing its result raises with the end of its stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.json", Path(tmp) / "out.json"
        src.write_text(json.dumps(spec))
        run_env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core)}
        if spec.get("engine", {}).get("num_gpu_blocks_override"):
            # A pool of a few hundred blocks needs far less than the suite's 2 GiB default,
            # which vLLM checks against the node's free memory at start-up: a CI run with a
            # Gemma engine in the other lane left 1.95 GiB and a stock engine failed to start.
            run_env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        run_env.update(env or {})
        if stock:
            run_env["VLLM_PLUGINS"] = ""
        proc = subprocess.run(
            [sys.executable, str(PROBES / "pool_runner.py"), str(src), str(dst)],
            env=run_env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if proc.returncode != 0 or not dst.exists():
            raise AssertionError(f"pool_runner failed:\n{proc.stderr[-4000:]}")
        return json.loads(dst.read_text())


class StockReference:
    """Stock vLLM (plugin disabled) in a subprocess that stays up between calls.

    A fresh engine per reference cost an engine start-up (half a minute or more on 2 cores)
    each time, on the core the plugin engine waits on. This one starts once per engine
    setting (``stock_runner.py``, see there) and loads while the plugin engine starts; it
    stops itself between calls (SIGSTOP; an idle engine's wake-ups stall the plugin engine's
    OpenMP barriers) and empties its prefix cache before each, so a call sees what a fresh
    engine would: the same settings, topology, batch composition and numerics.
    """

    MARK = "@@stock@@"

    def __init__(self, engine_kwargs: dict) -> None:
        self._log = tempfile.NamedTemporaryFile("w+", prefix="stock-ref-", suffix=".log")
        # Same in-process topology as the plugin engine: same threads (torch's default, a
        # thread per core: it runs while the plugin engine waits), same numerics.
        env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, str(PROBES / "stock_runner.py"), json.dumps(engine_kwargs)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )  # fmt: skip

    def _await_stop(self, timeout_s: float = 1800) -> None:
        """Until the runner has stopped itself (loaded, or done with the last answer): a
        request written before that could meet its SIGSTOP after our SIGCONT."""
        stat = Path(f"/proc/{self.proc.pid}/stat")
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "T":
                return
            time.sleep(0.02)

    def run(self, batches: list[list[dict]]) -> list[list[list[int]]]:
        """Token ids for ``batches`` (each one ``LLM.generate`` call, in order)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._await_stop()
        try:
            self.proc.stdin.write(json.dumps(batches) + "\n")
            self.proc.stdin.flush()
            os.kill(self.proc.pid, signal.SIGCONT)
            line = self.proc.stdout.readline()
        except (BrokenPipeError, ProcessLookupError):
            line = ""
        if not line.startswith(self.MARK):
            self.close()
            self._log.seek(0)
            raise RuntimeError(f"stock vLLM run failed:\n{self._log.read()[-4000:]}")
        return json.loads(line[len(self.MARK):])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the runner exits at end of input
            os.kill(self.proc.pid, signal.SIGCONT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_stock: dict[str, StockReference] = {}


def start_stock(engine_kwargs: dict) -> StockReference:
    """The stock reference for these settings, started now if it is not up (it loads while
    the caller goes on: the session engine starts it beside its own start-up)."""
    key = json.dumps(engine_kwargs, sort_keys=True)
    ref = _stock.get(key)
    if ref is None or ref.proc.poll() is not None:
        ref = _stock[key] = StockReference(engine_kwargs)
    return ref


def close_stock() -> None:
    for ref in _stock.values():
        ref.close()
    _stock.clear()


def run_stock(engine_kwargs: dict, batches: list[list[dict]]) -> list[list[list[int]]]:
    """Token ids from stock vLLM (plugin disabled) for the given batches (see
    :class:`StockReference`).

    Results are cached in ``.cache/stock-refs`` (git-ignored) keyed on the request spec and the
    installed vLLM version, so repeated local runs skip the reference engine; CI, on a fresh
    clone, always computes them.
    """
    import hashlib

    import vllm

    threads = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    spec_text = json.dumps(
        {"engine": engine_kwargs, "batches": batches, "threads": threads}, sort_keys=True
    )
    key = hashlib.sha256((vllm.__version__ + spec_text).encode()).hexdigest()[:24]
    cache = Path(__file__).resolve().parents[2] / ".cache" / "stock-refs" / f"{key}.json"
    if cache.exists():
        return json.loads(cache.read_text())
    result = start_stock(engine_kwargs).run(batches)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result))
    return result


class KvEventLog:
    """Every KV-cache event batch the engine publishes (vLLM's ZMQ publisher), as a KV-aware
    router receives them: a SUB socket on a thread, decoding with vLLM's own event types.

    The SUB socket binds the loopback endpoint and the engine's publisher connects to it
    (vLLM binds only wildcard endpoints, and tests listen on loopback only), so it must be
    created before the engine."""

    def __init__(self, endpoint: str, topic: str) -> None:
        import threading

        import zmq

        self.batches: list = []
        self._lock = threading.Lock()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.setsockopt(zmq.RCVTIMEO, 200)
        self._socket.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._socket.recv_multipart()
            except zmq.Again:
                continue
            batch = decoder.decode(payload)
            with self._lock:
                self.batches.append(batch)

    def events(self) -> list:
        with self._lock:
            return [e for b in self.batches for e in b.events]

    def wait_for(self, predicate, timeout: float = 10.0) -> list:
        """The events once ``predicate(events)`` holds (the publisher sends from a thread)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if predicate(events) or time.monotonic() > deadline:
                return events
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=0)
