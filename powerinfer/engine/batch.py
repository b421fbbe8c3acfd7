"""The serving loop: one engine thread owns the model and runs every request's generation,
decoding all active sequences together in one batched step.

Each step: admit waiting requests up to `max_batch`; start their prompts, then run one
batched pass (`models/batch.batch_step`, each weight read once for the step) over one token
of every sequence that is decoding plus the whole prompt of each newly admitted sequence
whose prompt is short (a few rows sharing its cache: admission costs no extra pass over
the weights). Longer prompts run their own prefill, at most `prefill_chunk` tokens per step
(so a long prompt delays the others' next token by one chunk, not by its whole prefill).
Finished and cancelled sequences leave at the step boundary. Each sequence has its own KV
cache, sampler (and seed) and text stream, and a batch's rows equal the same tokens run
alone, so a request's output does not depend on what else runs with it.

Results reach the caller through the request's `emit` callback, called on the engine thread:
a `GenerationResponse` per token (finish_reason set on the last), an Exception if the
generation failed, then None.
"""

from __future__ import annotations

import atexit
import collections
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

import numba
import torch

from ..errors import NonFiniteError
from ..models.base import Model
from ..models.batch import batch_step, can_ride, decode_step, release
from ..models.cache import KVCache
from ..tokenizer import Tokenizer
from .generate import GenerationResponse, TextStream, check_context
from .sample import Sampler, SamplingParams, all_finite, finite_rows

PREFILL_CHUNK = 128  # prompt tokens per step: bounds how long one prompt stalls the others' decode

Emit = Callable[[GenerationResponse | Exception | None], None]


@dataclass
class Sequence:
    """One request inside the engine."""

    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    text: TextStream
    emit: Emit
    cancel: threading.Event = field(default_factory=threading.Event)
    cache: KVCache | None = None
    prefilled: int = 0  # prompt tokens in the cache
    generated: int = 0  # tokens sampled
    pending: int | None = None  # the last sampled token, fed at the next decode step
    seen: torch.Tensor | None = None  # prompt + sampled ids (repetition penalty)


def warm_up_batch(model: Model) -> float:
    """Run one batched decode step of two sequences on throwaway caches, then one where a
    new short prompt rides along (the per-layer kernels), so that the batch kernels are
    compiled (or loaded from numba's cache) before the first requests overlap: in a fresh
    install that compilation takes ~20 s, and a first riding prompt stalled every stream for
    ~12 s. Returns the seconds taken."""
    t0 = time.perf_counter()
    caches = [model.new_cache(4) for _ in range(2)]
    for c in caches:
        model.forward(torch.zeros(2, dtype=torch.long), c)
    decode_step(model, [0, 0], caches)
    joining = model.new_cache(2)
    if can_ride(model, 2, joining):
        batch_step(model, [[0], [0, 0]], [caches[0], joining])
    release(model)
    return time.perf_counter() - t0


class BatchEngine:
    """Runs generations on one thread, batching their decode steps. `submit` from any thread."""

    def __init__(self, model: Model, tokenizer: Tokenizer, max_batch: int = 8, prefill_chunk: int = PREFILL_CHUNK,
                 threads: int | None = None, own_thread: bool = True):
        """`own_thread=False`: no thread is started; the caller runs the loop with `run()` on
        its own thread (the main thread: numba's OpenMP kernels ran 3-4x slower from a
        second thread, measured in docs/BENCHMARKS.md "Serving")."""
        if max_batch < 1 or prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.threads = threads or numba.get_num_threads()  # numba's count is per thread: carried over
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._cv = threading.Condition()
        self._closed = False
        self.steps = 0  # decode steps run (for tests and statistics)
        self.batch_tokens = 0  # tokens those steps decoded
        self._thread = threading.Thread(target=self.run, name="powerinfer-engine", daemon=True)
        if own_thread:
            self._thread.start()
        ref = weakref.ref(self)  # stopped before the interpreter tears down numba's threads under it
        atexit.register(lambda: (engine := ref()) is not None and engine.close())

    # -- from any thread --------------------------------------------------------------------
    def submit(self, prompt: list[int], max_tokens: int, sampling: SamplingParams, stop: list[str] | None,
               emit: Emit, cancel: threading.Event | None = None) -> Sequence:
        """Queue a generation of up to `max_tokens` after `prompt` (the caller checked that it
        fits the context); set `cancel` to stop it at the next step."""
        max_tokens = check_context(self.model, len(prompt), max_tokens)
        seq = Sequence(list(prompt), max_tokens, Sampler(sampling), TextStream(self.tokenizer, len(prompt), stop), emit,
                       cancel or threading.Event())
        with self._cv:
            if self._closed:
                raise RuntimeError("the engine is closed")
            self._waiting.append(seq)
            self._cv.notify()
        return seq

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        """Stop the loop after its current step; unfinished requests get None."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    # -- the engine thread ------------------------------------------------------------------
    def run(self) -> None:
        """The loop: admit, prefill, decode, until `close()`. Started by the constructor on
        its own thread unless `own_thread=False`."""
        numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        while True:
            with self._cv:
                while not self._closed and not self._waiting and not self._active:
                    self._cv.wait()
                if self._closed:
                    for seq in [*self._active, *self._waiting]:
                        self._finish(seq)
                    return
                while self._waiting and len(self._active) < self.max_batch:
                    self._active.append(self._waiting.popleft())
            try:
                self._step()
            except Exception as e:  # a failed step fails the sequences in it, never the loop
                for seq in list(self._active):
                    self._finish(seq, e)

    def _step(self) -> None:
        for seq in [s for s in self._active if s.cancel.is_set()]:
            self._finish(seq)
        budget = self.prefill_chunk
        riders: list[Sequence] = []  # short prompts run as rows of this step's decode pass
        for seq in [s for s in self._active if s.prefilled < len(s.prompt)]:
            if budget == 0:
                break
            self._new_cache(seq)
            rest = len(seq.prompt) - seq.prefilled
            if seq.max_tokens > 0 and rest <= budget and can_ride(self.model, rest, seq.cache):
                riders.append(seq)
                budget -= rest
            else:
                budget -= self._prefill(seq, budget)
        ready = [s for s in self._active if s.pending is not None]
        if ready or riders:
            tokens = [[s.pending] for s in ready] + [s.prompt[s.prefilled:] for s in riders]
            logits = batch_step(self.model, tokens, [s.cache for s in ready + riders])
            self.steps += 1
            self.batch_tokens += len(ready) + len(riders)
            finite = finite_rows(logits)  # one check for the batch
            for seq in riders:
                seq.prefilled = len(seq.prompt)
            for seq, row, ok in zip(ready + riders, logits, finite):
                self._sample(seq, row, ok)
        if not self._active:
            release(self.model)  # the finished sequences' caches can go

    def _new_cache(self, seq: Sequence) -> None:
        """Give `seq` its KV cache and token history when it starts."""
        if seq.cache is None:
            seq.cache = self.model.new_cache(len(seq.prompt) + seq.max_tokens)
            seq.seen = torch.empty(len(seq.prompt) + seq.max_tokens, dtype=torch.long)
            seq.seen[: len(seq.prompt)] = torch.tensor(seq.prompt)

    def _prefill(self, seq: Sequence, budget: int) -> int:
        """Run up to `budget` more prompt tokens of `seq` (its cache made by `_step`); sample
        its first token when the prompt is done. Returns the tokens run."""
        if seq.max_tokens == 0:
            seq.prefilled = len(seq.prompt)
            self._finish(seq, seq.text.end())
            return 0
        start = seq.prefilled
        chunk = seq.prompt[start:start + budget]
        logits = self.model.forward(torch.tensor(chunk, dtype=torch.long), seq.cache)
        seq.prefilled += len(chunk)
        if seq.prefilled == len(seq.prompt):
            self._sample(seq, logits, all_finite(logits))
        return len(chunk)

    def _sample(self, seq: Sequence, logits: torch.Tensor, finite: bool) -> None:
        """Sample the next token from `logits` (`finite`: none is NaN or Inf), hand its text to
        the caller, and either queue it for the next decode step or end the sequence."""
        if not finite:
            self._finish(seq, NonFiniteError(f"the model's output became NaN or Inf at token {seq.generated} of the "
                                             "generation (corrupt weights, or activations overflowing the weights' "
                                             "dtype)"))
            return
        assert seq.seen is not None
        n_seen = len(seq.prompt) + seq.generated
        token = seq.sampler(logits, seq.seen[:n_seen])
        seq.seen[n_seen] = token
        seq.generated += 1
        r = seq.text.add(token)
        if r.finish_reason:
            self._finish(seq, r)
        elif seq.generated == seq.max_tokens:
            seq.emit(r)
            self._finish(seq, seq.text.end())
        else:
            seq.emit(r)
            seq.pending = token

    def _finish(self, seq: Sequence, last: GenerationResponse | Exception | None = None) -> None:
        """Take `seq` out of the engine; its last result (if any), then None, to the caller."""
        if seq in self._active:
            self._active.remove(seq)
        seq.pending = None
        seq.cache = None  # its memory goes back at once, not when the caller lets go
        try:
            if last is not None:
                seq.emit(last)
        finally:
            seq.emit(None)
