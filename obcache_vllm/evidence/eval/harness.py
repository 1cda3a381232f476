"""Run grid cells through one real vLLM engine (the obcache plugin active), resumably.

Every request goes through ``vllm.LLM.generate`` with its options in
``SamplingParams(extra_args=...)``, exactly as a user's would. Prompts are token ids: the
document part and the question part are tokenized separately and concatenated, so the
query-agnostic compression point (``kv_compress_at``) is an exact token boundary and both
settings see identical prompts.

Cells are packed into ``generate`` calls of up to ``max_batch`` requests (batching is much
cheaper per request on CPU); each finished cell is appended to the results file at once, so an
interrupted run resumes where it stopped. With ``lock`` set, the harness holds that file lock
(flock) only while the engine starts and while a batch runs, so other users of the core can
interleave between batches.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from obcache_vllm.evidence.eval import tasks
from obcache_vllm.evidence.eval.cells import FULL, Cell, append_result, kept_tokens, load_results

BLOCK_SIZE = 32
# Generated tokens per task: enough for the answer(s) after the answer prefix.
MAX_TOKENS = {"niah_single": 16, "niah_multikey": 16, "niah_multivalue": 48, "vt": 40}


@dataclass(frozen=True)
class Prompt:
    """A sample tokenized: document ids then question ids (the prompt is their concatenation)."""

    sample: tasks.Sample
    document_ids: tuple[int, ...]
    question_ids: tuple[int, ...]

    @property
    def ids(self) -> list[int]:
        return [*self.document_ids, *self.question_ids]


@contextlib.contextmanager
def file_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive flock on ``path`` (no-op for None): the same lock as flock(1)."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def chat_renderer(tokenizer):
    """``user message -> chat prompt text`` with the model's template and generation prompt."""

    def render(user: str) -> str:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )

    return render


def tokenize(samples: Sequence[tasks.Sample], tokenizer, chat: bool) -> list[Prompt]:
    renderer = chat_renderer(tokenizer) if chat else None
    out = []
    for s in samples:
        doc, question = tasks.render(s, renderer)
        out.append(
            Prompt(
                s,
                tuple(tokenizer.encode(doc, add_special_tokens=False)),
                tuple(tokenizer.encode(question, add_special_tokens=False)),
            )
        )
    return out


class Harness:
    """One engine, one results file; ``run(cells)`` computes the cells not in the file yet."""

    def __init__(
        self,
        results: Path,
        model: str | None = None,
        lock: str | None = None,
        max_batch: int = 64,
        max_model_len: int = 4096,
        progress: bool = True,
        llm=None,
        chunk: int = 2048,
    ) -> None:
        """``llm``: an existing ``vllm.LLM`` with the plugin active (else one is started)."""
        self.results = Path(results)
        self.model = model
        self.lock = lock
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.progress = progress
        self.chunk = chunk  # max_num_batched_tokens: the prefill chunk
        self._llm = llm
        self._own_llm = llm is None
        self._tokenizer = None
        self._prompts: dict[tuple, list[Prompt]] = {}

    # -- engine ---------------------------------------------------------------------------
    def _model_path(self) -> str:
        if self.model:
            return self.model
        from obcache_vllm import model

        return str(model.pull())

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._model_path())
        return self._tokenizer

    def _engine(self):
        if self._llm is None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
            from vllm import LLM

            with file_lock(self.lock):
                self._llm = LLM(
                    model=self._model_path(),
                    dtype="float32",
                    enforce_eager=True,
                    block_size=BLOCK_SIZE,
                    max_model_len=self.max_model_len,
                    max_num_batched_tokens=self.chunk,
                    max_num_seqs=self.max_batch,
                    seed=0,
                )
        return self._llm

    def close(self) -> None:
        """Shut the engine down if this harness started it."""
        if not self._own_llm:
            return
        core = getattr(getattr(self._llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self._llm = None

    # -- data -----------------------------------------------------------------------------
    def prompts(self, cell: Cell) -> list[Prompt]:
        key = (cell.task, cell.length, cell.samples, cell.seed, cell.chat)
        if key not in self._prompts:
            samples = tasks.generate(cell.task, cell.length, cell.samples, cell.seed)
            self._prompts[key] = tokenize(samples, self.tokenizer, cell.chat)
        return self._prompts[key]

    # -- running --------------------------------------------------------------------------
    def pending(self, cells: Sequence[Cell]) -> list[Cell]:
        done = load_results(self.results)
        seen: set[str] = set()
        out = []
        for c in cells:
            if c.key not in done and c.key not in seen:
                seen.add(c.key)
                out.append(c)
        return out

    def run(self, cells: Sequence[Cell]) -> list[dict]:
        """Compute the cells missing from the results file; returns the records written."""
        todo = [c for c in self.pending(cells) if c.engine == "vllm"]
        if not todo:
            return []
        batches: list[list[Cell]] = [[]]
        for cell in todo:
            if batches[-1] and sum(c.samples for c in batches[-1]) + cell.samples > self.max_batch:
                batches.append([])
            batches[-1].append(cell)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(c.samples for c in todo), unit="req", desc="eval", smoothing=0)
        written = []
        try:
            for batch in batches:
                written.extend(self._run_batch(batch))
                if bar is not None:
                    bar.update(sum(c.samples for c in batch))
        finally:
            if bar is not None:
                bar.close()
        return written

    def _run_batch(self, batch: Sequence[Cell]) -> list[dict]:
        from vllm import SamplingParams

        llm = self._engine()
        requests, params, owners = [], [], []
        for cell in batch:
            for p in self.prompts(cell):
                requests.append({"prompt_token_ids": p.ids})
                params.append(
                    SamplingParams(
                        temperature=0,
                        max_tokens=MAX_TOKENS[cell.task],
                        extra_args=cell.extra_args(len(p.document_ids)),
                    )
                )
                owners.append(cell)
        with file_lock(self.lock):
            start = time.perf_counter()
            outputs = llm.generate(requests, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        texts = [o.outputs[0].text for o in outputs]
        total = sum(len(r["prompt_token_ids"]) for r in requests)
        written = []
        for cell in batch:
            cell_texts = [t for t, c in zip(texts, owners, strict=True) if c is cell]
            prompts = self.prompts(cell)
            prompt_tokens = sum(len(p.ids) for p in prompts)
            share = seconds * prompt_tokens / total  # the batch's time, split by prompt tokens
            record = summarize(cell, prompts, cell_texts, share)
            written.append(append_result(self.results, cell, record))
        return written


def summarize(cell: Cell, prompts: Sequence[Prompt], texts: Sequence[str], seconds: float) -> dict:
    """The result record of one cell: per-sample scores, outputs, token and kept counts."""
    scores = [tasks.score(p.sample, t) for p, t in zip(prompts, texts, strict=True)]
    doc = [len(p.document_ids) for p in prompts]
    kept = []
    for p in prompts:
        n_doc, n_all = len(p.document_ids), len(p.ids)
        if cell.pipeline == FULL:
            kept.append(n_all)
        elif cell.setting == "query_agnostic":
            kept.append(kept_tokens(n_doc, cell.budget_tokens(n_doc), BLOCK_SIZE) + n_all - n_doc)
        else:
            kept.append(kept_tokens(n_all, cell.budget_tokens(n_doc), BLOCK_SIZE))
    return {
        "accuracy": sum(scores) / len(scores),
        "scores": scores,
        "outputs": list(texts),
        "document_tokens_mean": sum(doc) / len(doc),
        "prompt_tokens_mean": sum(len(p.ids) for p in prompts) / len(prompts),
        "kept_tokens_mean": sum(kept) / len(kept),
        "seconds": round(seconds, 2),
    }
