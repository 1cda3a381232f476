"""Engine checks of obcache-vllm on FLASH_ATTN (vLLM 0.32's CUDA build), one summary table.

NOT run by the project yet (no machine here can install vLLM's CUDA build). Installs nothing:
it needs vLLM 0.32.0 for CUDA, this source tree and the converted default model
(``obcache-vllm model pull``, or ``--model DIR``). Every engine runs in its own subprocess
(scripts/gpu_check_job.py); references are stock vLLM with the plugin disabled
(``VLLM_PLUGINS=``), same settings, same batches.

Settings: bf16, block size 16, FLASH_ATTN, synchronous scheduling (``async_scheduling=False``),
V1 model runner, PIECEWISE CUDA graphs (attention eager: what budgets need; full graphs are
refused, see obcache_vllm/vllm_ext/worker/backends/flash_attn.py), a 256-block pool, and
``VLLM_BATCH_INVARIANT=1`` on both sides so that a request's tokens do not depend on what
else is in its batch (without it, GPU kernels may legitimately differ in the last bits with
the batch shape, and "neighbour == stock" would be untestable).

Checks (rows of the table):
  classes           the plugin engine runs OBCacheScheduler, OBCacheGPUModelRunner, the FA
                    builder subclass
  identity          unbudgeted requests == stock, token for token
  no-op budget      a budget >= the prompt evicts nothing and == stock
  mixed batch       unbudgeted neighbours of budgeted requests == stock; one eviction per
                    budgeted request; freed blocks == the block arithmetic
  in-step free      after the prompt's step the request holds cdiv(n, bs) - dead blocks
  prefix cache      uncompressed requests after compressed ones sharing a prefix == stock
  blocks back       after every batch the pool is full again
  decode bound      kv_decode: never more than cdiv(budget + bs, bs) blocks while generating
  capacity          same pool: more requests running at once with budgets than stock
  full graphs       with the default FULL_AND_PIECEWISE graphs a budget is refused, an
                    unbudgeted request is served
  tensor parallel   TP > 1 (when the GPUs and the model's heads allow): neighbours == stock
                    at the same TP, budgeted requests evict (per-head and one ranking/layer)

    bash scripts/gpu_check.sh                  # everything; exit status 1 on a failure
    bash scripts/gpu_check.sh --skip-tp --pool-blocks 512
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from obcache_vllm.textgen import haystack, needle_prompt  # noqa: E402

BS = 16  # FLASH_ATTN kernels take multiples of 16 (32 with --cpu-dry-run: CPU_ATTN's)
CPU_DRY_RUN = False
ROWS: list[tuple[str, bool | None, str]] = []  # (check, ok | None = skipped, detail)


def record(check: str, ok: bool | None, detail: str) -> None:
    ROWS.append((check, ok, detail))
    print(f"[{'ok' if ok else 'skip' if ok is None else 'FAIL'}] {check}: {detail}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the converted model)")
    p.add_argument("--pool-blocks", type=int, default=256)
    p.add_argument("--tp", type=int, default=None, help="TP size for the TP check (auto)")
    p.add_argument("--tp-model", default=None, help="model for the TP check (default: --model)")
    p.add_argument("--skip-tp", action="store_true")
    p.add_argument("--no-batch-invariant", action="store_true")
    p.add_argument("--keep", default=None, help="keep job files and outputs in this directory")
    p.add_argument(
        "--cpu-dry-run", action="store_true",
        help="exercise this script on vLLM's CPU build (CPU_ATTN, block 32, fp32, eager; no "
        "full-graph or TP check): how the script's logic was checked here (run by hand, "
        "not in the suite: two engines of ~2 min)",
    )  # fmt: skip
    return p.parse_args()


def engine_kwargs(model: str, pool: int, graphs: str = "PIECEWISE", tp: int = 1) -> dict:
    if CPU_DRY_RUN:
        return dict(
            model=model, dtype="float32", block_size=BS, max_model_len=2048, seed=0,
            num_gpu_blocks_override=pool, max_num_batched_tokens=512, max_num_seqs=64,
            enforce_eager=True,
        )  # fmt: skip
    return dict(
        model=model, dtype="bfloat16", block_size=BS, max_model_len=2048, seed=0,
        num_gpu_blocks_override=pool, max_num_batched_tokens=512, max_num_seqs=64,
        attention_backend="FLASH_ATTN", async_scheduling=False, tensor_parallel_size=tp,
        compilation_config={"cudagraph_mode": graphs}, gpu_memory_utilization=0.5,
    )  # fmt: skip


def _req(rid, prompt, max_tokens, ignore_eos=False, **kv) -> dict:
    return {"id": rid, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": ignore_eos,
            "extra_args": kv or None}  # fmt: skip


def build_batches(tok) -> list[dict]:
    def ids(text):
        return tok(text).input_ids

    needles = [ids(needle_prompt(20 + 3 * i, seed=i)[0]) for i in range(5)]
    shared = haystack(24, seed=42)
    questions = ["Who traded salt?", "Name a town.", "Which year?"]
    prefix = [ids(shared + f"\nQuestion {i}: {q} Answer:") for i, q in enumerate(questions)]
    story = ids("Tell me a very long story about a lighthouse keeper and the sea.")
    long = [ids(haystack(22, seed=100 + i)) for i in range(12)]
    return [
        {"name": "identity", "requests": [_req(f"u{i}", needles[i], 24) for i in range(4)]},
        {"name": "no-op budget", "requests": [_req("n0", needles[0], 16, kv_budget=2000)]},
        {"name": "mixed", "requests": [
            _req("m0", needles[0], 24, kv_budget=0.25),
            _req("m1", needles[1], 24),
            _req("m2", needles[2], 24, kv_budget=100, kv_pipeline="h2o", kv_scorer="attn"),
            _req("m3", needles[3], 24),
            _req("m4", needles[4], 24, kv_budget=0.5, kv_pipeline="tova",
                 kv_scorer="obcache_joint", kv_per_head=False)]},
        {"name": "in-step free", "requests": [_req("f0", needles[3], 8, kv_budget=150)]},
        {"name": "prefix 1", "requests": [_req("p0", prefix[0], 16)]},
        {"name": "prefix 2", "requests": [_req("p1", prefix[1], 16, kv_budget=0.25)]},
        {"name": "prefix 3", "requests": [_req("p2", prefix[2], 16)]},
        {"name": "prefix 4", "requests": [
            _req("p3", prefix[0], 16, kv_budget=0.3, kv_scorer="obcache_value"),
            _req("p4", prefix[1], 16)]},
        {"name": "decode bound", "requests": [
            _req("d0", story, 600, ignore_eos=True, kv_budget=128, kv_decode=True,
                 kv_pipeline="h2o", kv_scorer="obcache_key")]},
        {"name": "capacity", "requests": [
            _req(f"c{i}", p, 64, ignore_eos=True, kv_budget=0.25) for i, p in enumerate(long)]},
    ]  # fmt: skip


def run_job(name: str, engine: dict, batches: list[dict], env: dict, workdir: Path) -> dict:
    job, out = workdir / f"{name}.job.json", workdir / f"{name}.out.json"
    job.write_text(json.dumps({"engine": engine, "batches": batches}))
    log = workdir / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "gpu_check_job.py"), str(job), str(out)],
            env={**os.environ, "PYTHONPATH": str(ROOT), **env}, stdout=f, stderr=subprocess.STDOUT,
            timeout=1800,
        )  # fmt: skip
    took = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"engine job {name} failed (exit {proc.returncode}); log tail:\n{tail}")
    print(f"  engine job {name}: {took:.0f} s", flush=True)
    return json.loads(out.read_text())


def tokens(result: dict, batch: str) -> dict:
    return {rid: o["tokens"] for rid, o in result["batches"][batch]["outputs"].items()}


def check_outputs(stock: dict, plugin: dict, batches: list[dict], pool: int) -> None:
    classes = plugin["classes"]
    want = ("OBCacheScheduler", "OBCacheGPUModelRunner", ["OBCacheFlashAttnMetadataBuilder"])
    if CPU_DRY_RUN:
        want = ("OBCacheScheduler", "OBCacheCPUModelRunner", ["OBCacheMetadataBuilder"])
    got = (classes.get("scheduler"), classes.get("runner"), classes.get("builders"))
    record("classes", got == want, f"{got}; backends {classes.get('backends')}")
    for batch in batches:
        err = plugin["batches"][batch["name"]]["error"] or stock["batches"][batch["name"]]["error"]
        if err:
            record(f"{batch['name']} (engine)", False, f"engine error: {err}")
    unbudgeted = [(b["name"], r["id"]) for b in batches for r in b["requests"]
                  if not r["extra_args"] and b["name"] != "capacity"]  # fmt: skip
    same = [(b, r) for b, r in unbudgeted if tokens(stock, b).get(r) == tokens(plugin, b).get(r)]
    record("identity", len(same) == len(unbudgeted),
           f"{len(same)}/{len(unbudgeted)} unbudgeted requests == stock (all batches)")  # fmt: skip
    prefix = [(f"prefix {i}", rid) for i, rid in ((1, "p0"), (3, "p2"), (4, "p4"))]
    same = sum(tokens(stock, b).get(r) == tokens(plugin, b).get(r) is not None for b, r in prefix)
    compressed = [plugin["batches"][b]["outputs"].get(r, {}).get("outcome") or {}
                  for b, r in (("prefix 2", "p1"), ("prefix 4", "p3"))]  # fmt: skip
    record("prefix cache", same == 3 and all(o.get("evictions") == 1 for o in compressed),
           f"{same}/3 uncompressed requests after compressed ones sharing their prefix == stock; "
           f"compressed ones evicted {[o.get('evictions') for o in compressed]}")  # fmt: skip
    noop = plugin["batches"]["no-op budget"]["outputs"].get("n0", {})
    ok = noop.get("tokens") == tokens(stock, "no-op budget").get("n0")
    record("no-op budget", ok and (noop.get("outcome") or {}).get("evictions") == 0,
           f"outcome {noop.get('outcome')}")  # fmt: skip
    mixed = plugin["batches"]["mixed"]["outputs"]
    budgeted = [r for r in batches[2]["requests"] if r["extra_args"]]
    details, ok = [], True
    for r in budgeted:
        n, budget = len(r["prompt"]), r["extra_args"]["kv_budget"]
        budget = budget if isinstance(budget, int) else math.ceil(budget * n)  # as options do
        outcome = (mixed.get(r["id"]) or {}).get("outcome") or {}
        ok &= outcome.get("evictions") == 1 and outcome.get("freed_blocks") == (n - budget) // BS
        ok &= len((mixed.get(r["id"]) or {}).get("tokens", [])) >= 1
        details.append(f"{r['id']}: freed {outcome.get('freed_blocks')} / {(n - budget) // BS}")
    record("mixed batch", ok, "; ".join(details) + " (neighbours: see identity)")
    trace = plugin["batches"]["in-step free"]["trace"]
    n = len(batches[3]["requests"][0]["prompt"])
    dead = (n - 150) // BS
    after = [s for s in trace if s["computed"].get("f0", 0) >= n]
    held = after[0]["held"].get("f0") if after else None
    want = -(-n // BS) - dead
    record("in-step free", held == want, f"held {held} blocks after the prompt's step, want {want}")
    full = [b["name"] for b in batches if (plugin["batches"][b["name"]]["trace"] or [{}])[-1]
            .get("free") not in (None, plugin["pool_blocks"])]  # fmt: skip
    record("blocks back", not full and plugin["pool_blocks"] is not None,
           f"pool full again after every batch ({plugin['pool_blocks']} free)"
           if not full else f"blocks still held after {full}")  # fmt: skip
    bound = -(-(128 + BS) // BS)
    held = [s["held"].get("d0", 0) for s in plugin["batches"]["decode bound"]["trace"]]
    out = plugin["batches"]["decode bound"]["outputs"].get("d0", {})
    record("decode bound", bool(held) and max(held) <= bound and len(out.get("tokens", [])) == 600,
           f"max {max(held, default=None)} blocks held (bound {bound}); "
           f"outcome {out.get('outcome')}")  # fmt: skip
    running = {k: max((s["running"] for s in r["batches"]["capacity"]["trace"]), default=0)
               for k, r in (("stock", stock), ("plugin", plugin))}  # fmt: skip
    record("capacity", running["plugin"] > running["stock"],
           f"{pool}-block pool, 12 requests: at most {running['stock']} running on stock, "
           f"{running['plugin']} with kv_budget 0.25")  # fmt: skip


def main() -> int:
    global BS, CPU_DRY_RUN
    args = parse_args()
    if args.cpu_dry_run:
        BS, CPU_DRY_RUN = 32, True
    from obcache_vllm import model as model_mod

    model = args.model or str(model_mod.default_model_path())
    if not (Path(model) / "config.json").exists():
        print(f"model not found at {model}: run `obcache-vllm model pull` or pass --model DIR")
        return 2
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    batches = build_batches(tok)
    invariant = "0" if args.no_batch_invariant or CPU_DRY_RUN else "1"
    base_env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_USE_BREAKABLE_CUDAGRAPH": "0", "VLLM_BATCH_INVARIANT": invariant}
    stock_env = {**base_env, "VLLM_PLUGINS": ""}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.keep or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        engine = engine_kwargs(model, args.pool_blocks)
        try:
            stock = run_job("stock", engine, batches, stock_env, workdir)
            plugin = run_job("plugin", engine, batches, base_env, workdir)
            check_outputs(stock, plugin, batches, args.pool_blocks)
        except Exception as exc:
            record("engine checks", False, str(exc)[-1500:])
        from gpu_check_tp import check_full_graphs, check_tensor_parallel

        if CPU_DRY_RUN:
            record("full graphs", None, "skipped (--cpu-dry-run)")
        else:
            check_full_graphs(model, args.pool_blocks, batches, base_env, workdir, run_job, record,
                              engine_kwargs)  # fmt: skip
        if args.skip_tp or CPU_DRY_RUN:
            record("tensor parallel", None, "skipped (--skip-tp or --cpu-dry-run)")
        else:
            check_tensor_parallel(args, model, batches, base_env, workdir, run_job, record,
                                  engine_kwargs)  # fmt: skip
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for check, ok, detail in ROWS:
        verdict = "ok" if ok else "skipped" if ok is None else "FAIL"
        print(f"| {check} | {verdict} | {detail} |")
    failed = [r for r in ROWS if r[1] is False]
    print(f"\n{sum(1 for r in ROWS if r[1])} ok, {len(failed)} failed, "
          f"{sum(1 for r in ROWS if r[1] is None)} skipped")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
