"""The local engine's scheduler: requests in flight and the batch loop that runs the model.

One event loop owns every piece of state; each model step runs on the compute
thread (compute.py) while the loop awaits it, so liveness, aborts and arrivals
are answered during the step. Requests queued when the engine is
ready to start work run as one left-padded batch sharing a KV cache, each
sequence stopping on its own; requests arriving while it runs are prefilled
and join it at a step boundary while there is room (continuous batching).
Weight updates are applied between batches: a pending update lets the running
batch drain, and requests arriving meanwhile wait for the new weights. Pauses
follow SGLang's three modes: abort, retract, in_place (docs/ARCHITECTURE.md §10).
A request may name a LoRA adapter (adapters.py): rows of different adapters and
base rows share a batch, up to --max-loras-per-batch kinds of rows. With
--enable-priority-scheduling the queue is taken by priority and a running row
yields to a live request ranked well above it (priority.py).
As in SGLang, `SGLANG_REQ_WAITING_TIMEOUT` (seconds; unset or <= 0: off) aborts,
with status 503, a request left waiting for room in the batch that long.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import inspect
import logging
import os
import random
import time

import torch

from clawd import faults
from clawd.engine.local.adapters import Adapters
from clawd.engine.local.compute import Compute, Progress
from clawd.engine.local.model import Batch, WeightLoadError, copy_in, load_model
from clawd.engine.local.priority import Priorities
from clawd.engine.local.responses import decode
from clawd.engine.local.weight_sync import WeightSync
from clawd.engine.local.sampling import next_token_row, pick_token, prompt_logprobs, prompt_rows
from clawd.engine.local.sequences import Group, Req
from clawd.engine.local.wire import GenerateItem, RequestError, fit_to_context

log = logging.getLogger("clawd.engine.cpu")  # the engine's log namespace, as operators (and bench/swap.py) know it

GATHER_YIELDS = 4  # loop turns given to requests that arrived together before a batch starts

ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue", "status_code": None, "err_type": None}
TIMED_OUT = {"type": "abort", "status_code": 503, "message": "Request waiting timeout reached."}
WAITING_TIMEOUT_ENV = "SGLANG_REQ_WAITING_TIMEOUT"


# --------------------------------------------------------------------------
# The engine: model, queue and the batch loop

class Engine:
    """The model, the queue of requests and the loop that batches them; the HTTP side calls in."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.incremental = args.incremental_streaming_output
        self.model_path = args.model
        self.weight_version = args.weight_version
        self.model = None
        self.tokenizer = None
        self.loaded = asyncio.Event()
        self.waiting: collections.deque[Req] = collections.deque()
        self.live: dict[str, Req] = {}  # rid -> request, waiting or running
        self.updates: collections.deque[tuple[str, str | None, asyncio.Future]] = collections.deque()
        self.paused: str | None = None  # None or the pause mode
        self._kick = asyncio.Event()  # something changed: new work, abort, pause, update
        self.parked = asyncio.Event()  # the loop is waiting at a step boundary, not computing
        self._seeds = random.Random(args.seed)
        self.adapters = Adapters(args)  # LoRA: names, in-flight counts, the PEFT wrapper
        self.priorities = Priorities.from_args(args)
        self.weight_sync = WeightSync()  # weight-update groups (clawd.engine.local.weight_sync)
        self.compute = Compute()
        self.progress = Progress()  # what /health_generate watches
        timeout = float(os.environ.get(WAITING_TIMEOUT_ENV) or 0)
        self.waiting_timeout = timeout if timeout > 0 else None

    # ---- loading

    def load(self) -> None:
        """Load tokenizer and model (blocks the loop; nothing can run before this anyway)."""
        from transformers import AutoTokenizer
        t0 = time.perf_counter()
        self.tokenizer = AutoTokenizer.from_pretrained(self.args.model)
        self.model = load_model(self.args.model)
        cfg, gen = self.model.config, self.model.generation_config
        eos = set()
        for ids in (getattr(cfg, "eos_token_id", None), getattr(gen, "eos_token_id", None),
                    self.tokenizer.eos_token_id):
            eos.update([ids] if isinstance(ids, int) else (ids or []))
        self.eos_ids = frozenset(eos)
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.context_len = self.args.context_length or getattr(cfg, "max_position_embeddings", None) or 4096
        # transformers 5.x renamed the cache argument; accept either spelling.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.progress.watch(self.model)
        self.loaded.set()
        log.info("loaded %s (%s, vocab %d, context %d, eos %s) in %.1f s", self.args.model,
                 cfg.model_type, self.vocab_size, self.context_len, sorted(self.eos_ids),
                 time.perf_counter() - t0)

    async def progressing(self) -> bool:
        """SGLang's health check: whether the model computes anything in its wait (Progress.moving). At once
        when nothing is owed (no request live: nothing to be stuck on), and False at once while paused (the
        held requests cannot move; SGLang's own one-token request would wait out its timeout)."""
        if not self.live:
            return True
        return False if self.paused else await self.progress.moving()

    # ---- requests

    def submit(self, items: list[GenerateItem], stream: bool) -> Group:
        """Validate against the model and queue the items as one group (they batch together).

        A refusal by SGLang's tokenizer raises RequestError for the whole group; one by its
        scheduler (a prompt too long for the input limit) ends that sequence with an abort
        that carries status 400.
        """
        rids, checked = set(), []
        for it in items:
            if it.rid in self.live or it.rid in rids:
                raise RequestError(f"Duplicate request ID detected: {it.rid}")
            rids.add(it.rid)
            n = len(it.prompt)
            it, refused = fit_to_context(it, self.context_len)
            checked.append((it, refused))
            if it.return_logprob and not -1 <= it.logprob_start_len <= n:
                raise RequestError(f"logprob_start_len ({it.logprob_start_len}) must be -1 or between 0 and "
                                   f"the number of input tokens ({n}).")
            bad = [t for t in it.prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"input_ids hold {bad[0]}, outside the vocabulary [0, {self.vocab_size}).")
            self._check_logprob_rows(it)
            try:
                self.adapters.check(it.lora)
            except ValueError as exc:
                raise RequestError(str(exc)) from None
        group = Group(stream)
        for i, (it, refused) in enumerate(checked):
            seed = it.params.sampling_seed
            req = Req(it, group, i, self._seeds.getrandbits(63) if seed is None else seed)
            req.rank = self.priorities.rank(it.priority)
            group.reqs.append(req)
            self.adapters.acquire(it.lora)  # held until finish(): an unload waits for it
            if refused is not None:
                req.started = True  # the scheduler saw it: its meta_info has the token counts
                self.finish(req, refused)
                continue
            self.live[req.rid] = req
            self.waiting.append(req)
        self._kick.set()
        return group

    def _check_logprob_rows(self, it: GenerateItem) -> None:
        """SGLang's id check (made with or without return_logprob), and K > V refused: a deliberate
        deviation, as SGLang's scheduler crashes on topk(K > V) and takes the server down."""
        bad = [t for t in it.token_ids_logprob or () if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; "
                               f"valid range is [0, {self.vocab_size}).")
        if it.top_logprobs_num > self.vocab_size:
            raise RequestError(f"top_logprobs_num ({it.top_logprobs_num}) exceeds the vocabulary size "
                               f"({self.vocab_size}).")

    def finish(self, req: Req, reason: dict) -> None:
        if req.finish is None:
            self.adapters.release(req.item.lora)
        req.finish = reason
        self.live.pop(req.rid, None)
        req.notify(final=True)

    def abort(self, rid: str | None) -> int:
        """Abort requests whose rid starts with `rid` (all when None), as SGLang matches; return how many."""
        hits = [r for r in self.live.values() if rid is None or r.rid.startswith(rid)]
        for req in hits:
            self._abort_one(req)
        return len(hits)

    def abort_group(self, group: Group) -> None:
        """The client is gone (or its handler ended early): abort what it still waits for."""
        for req in group.reqs:
            if not req.done:
                log.debug("client disconnected; aborting %s", req.rid)  # one per hang-up: clawd counts them
                self._abort_one(req)

    def _abort_one(self, req: Req) -> None:
        if req in self.waiting:  # not computing: answer now
            self.waiting.remove(req)
            self.finish(req, ABORTED if req.started else ABORTED_WAITING)
        else:  # running: the batch loop ends it at the next step boundary
            req.abort_requested = True
        self._kick.set()

    # ---- control

    async def pause(self, mode: str) -> None:
        self.paused = mode
        if mode == "abort":
            self.abort(None)
        self._kick.set()
        await self.parked.wait()

    def resume(self) -> None:
        self.paused = None
        self._requeued()
        self._kick.set()

    def _requeued(self) -> None:
        """Requests held by a pause or an update reach the waiting queue only now, as in SGLang
        (whose tokenizer holds them): their waiting time starts here."""
        now = time.monotonic()
        for req in self.waiting:
            req.queued_at = now

    def _expire_waiting(self) -> None:
        """Abort requests that waited longer than SGLANG_REQ_WAITING_TIMEOUT for room in the batch."""
        if self.waiting_timeout is None or self.paused or self.updates:
            return
        deadline = time.monotonic() - self.waiting_timeout
        for req in [r for r in self.waiting if not r.started and r.queued_at < deadline]:
            self.waiting.remove(req)
            log.info("request %s waited over %.3g s; aborted", req.rid, self.waiting_timeout)
            self.finish(req, dict(TIMED_OUT))

    async def update_weights(self, path: str | dict, version: str | None) -> tuple[int, dict]:
        """Queue a swap for the loop to apply between batches (or now, if paused); await its result. `path`:
        a model directory, or named tensors received over a weight-update group (clawd.engine.weight_group)."""
        fut = asyncio.get_running_loop().create_future()
        self.updates.append((path, version, fut))
        self._kick.set()
        return await fut

    def _apply_update(self, path: str, version: str | None, fut: asyncio.Future) -> None:
        t0 = time.perf_counter()
        try:
            model = (copy_in(self.model, path) if isinstance(path, dict)
                     else self.adapters.rebase(load_model(path, like=self.model)))
        except Exception as exc:  # any failure is the caller's answer; the old weights keep serving
            log.warning("weight update from %s failed: %s", path, exc, exc_info=not isinstance(exc, WeightLoadError))
            result = (400, {"success": False, "num_paused_requests": 0,
                            "message": f"Failed to update weights: {exc}. Rolled back to the previous weights."})
        else:
            self.model = model
            self.model_path = self.model_path if isinstance(path, dict) else path
            for req in self.waiting:  # preempted rows recompute their KV under the new weights, as SGLang's do
                req.kv = None
            self.progress.watch(model)
            message = ("Succeeded to update parameter online." if isinstance(path, dict)
                       else "Succeeded to update model weights.")
            if version is not None:
                self.weight_version = version
                message += f" Weight version updated to {version}."
            log.info("weights now %s (version %s), loaded in %.2f s", f"{len(path)} tensors received" if
                     isinstance(path, dict) else path, self.weight_version, time.perf_counter() - t0)
            result = (200, {"success": True, "message": message, "num_paused_requests": 0})
        self._requeued()
        if not fut.done():
            fut.set_result(result)

    # ---- the loop

    async def _park(self, between_batches: bool) -> None:
        """Wait at a step boundary while paused or idle, applying weight updates when allowed.

        Between batches an update always applies; inside a batch only while paused
        (in_place), as SGLang skips its lock when paused.
        """
        while True:
            if self.updates and (between_batches or self.paused):
                self._apply_update(*self.updates.popleft())
                continue
            idle = between_batches and not self.waiting
            if not (self.paused or idle):
                return
            self.parked.set()
            self._kick.clear()
            await self._kick.wait()
            self.parked.clear()

    async def run(self) -> None:
        await self.loaded.wait()
        while True:
            await self._park(between_batches=True)
            for _ in range(GATHER_YIELDS):  # let requests that arrived together start together
                await asyncio.sleep(0)
            if self.paused or self.updates or not self.waiting:
                continue
            members = self._intake(self.args.max_batch_size, [])
            try:
                await self._run_batch(members)
            except Exception as exc:  # fail these requests, keep serving the next ones
                log.exception("batch of %d failed", len(members))
                for req in members:
                    if req in self.waiting:  # one that yielded (priority) waits there
                        self.waiting.remove(req)
                    if not req.done:
                        self.finish(req, {"type": "abort", "message": f"Internal error: {exc}",
                                          "status_code": 500, "err_type": "InternalServerError"})

    async def _forward(self, rows: list[Req], ids, mask, pos, cache, keep: int, prefill: bool = False) -> torch.Tensor:
        """One model step on the compute thread; the PEFT wrapper cannot change under it (adapters.stepping)."""
        names = [r.item.lora for r in rows]
        async with self.adapters.stepping:
            return await self.compute.run(self._step, names, ids, mask, pos, cache, keep, prefill)

    def _step(self, names, ids, mask, pos, cache, keep: int, prefill: bool) -> torch.Tensor:
        if prefill:
            faults.point("engine.local.prefill")  # tests: a step that is slow, or never returns
        with torch.inference_mode():  # each row with its own adapter (or none); thread-local, so set here
            out = self.adapters.forward(self.model, names, input_ids=ids, attention_mask=mask, position_ids=pos,
                                        use_cache=True, logits_to_keep=keep, **{self._cache_kw: cache})
        return out.logits.float()

    async def _run_batch(self, members: list[Req]) -> None:
        """Decode `members` to the end, one step per loop turn; newcomers join while there is room.

        Requests that join are appended to `members`, so the caller can fail them all.
        """
        batch = await self._start(members)
        while batch.rows:
            await asyncio.sleep(0)  # serve aborts, health checks and arrivals between steps
            if self.paused == "in_place":
                await self._park(between_batches=False)
            for req in batch.rows:
                if req.abort_requested and not req.done:
                    self.finish(req, ABORTED)
            batch.select([b for b, r in enumerate(batch.rows) if not r.done])
            if self.paused == "retract":  # back to the queue; KV recomputed on resume
                for req in reversed(batch.rows):
                    req.num_retractions += 1
                    self.waiting.appendleft(req)
                log.info("retracted %d requests", len(batch.rows))
                return
            if self.priorities.enabled and batch.rows:
                self._yield_outranked(batch)
            room = self.args.max_batch_size - len(batch.rows)
            # Continuous batching, but never past a pending update: the batch drains first.
            if batch.rows and room > 0 and self.waiting and not self.paused and not self.updates \
                    and batch.can_extend():
                newcomers = self._intake(room, batch.rows)
                members.extend(newcomers)
                if newcomers:
                    batch.extend(await self._start(newcomers))
            self._expire_waiting()
            if not batch.rows:
                return
            tokens = torch.tensor([[r.output_ids[-1]] for r in batch.rows], dtype=torch.long)
            batch.mask = torch.cat([batch.mask, torch.ones(len(batch.rows), 1, dtype=torch.long)], dim=1)
            last = (await self._forward(batch.rows, tokens, batch.mask, batch.next_pos, batch.cache, 1))[:, -1]
            batch.next_pos = batch.next_pos + 1
            self._sample(batch.rows, last)

    def _intake(self, room: int, running: list[Req]) -> list[Req]:
        """Up to `room` waiting requests to start beside `running`: by priority when scheduling by it, and only
        those no live request outranks."""
        if self.priorities.enabled and self.waiting:
            self.waiting = collections.deque(sorted(self.waiting, key=lambda r: -r.rank))  # stable: ties by arrival
            best = max(r.rank for r in self.live.values())
            room = min(room, self.priorities.eligible([r.rank for r in self.waiting], best))
        return self.adapters.take(self.waiting, room, running)

    def _yield_outranked(self, batch: Batch) -> None:
        """Rows that a live request outranks leave the batch for the queue, each with its KV where the cache can be
        re-padded (priority.py)."""
        out = self.priorities.yielding([r.rank for r in batch.rows], max(r.rank for r in self.live.values()))
        if not out:
            return
        keep_kv = batch.can_extend()
        for b in reversed(out):  # ahead of their equals that arrived after them, in their order
            req = batch.rows[b]
            req.kv, req.num_retractions = batch.row(b) if keep_kv else None, req.num_retractions + 1
            self.waiting.appendleft(req)
        batch.select([b for b in range(len(batch.rows)) if b not in out])
        log.debug("%d requests yielded to higher-priority ones", len(out))

    async def _start(self, reqs: list[Req]) -> Batch:
        """`reqs` as one batch: prefilled, or with the KV a preempted one kept."""
        fresh = [r for r in reqs if r.kv is None]
        batch = await self._prefill(fresh) if fresh else None
        for req in (r for r in reqs if r.kv is not None):
            if batch is None:
                batch = req.kv
            else:
                batch.extend(req.kv)
            req.kv = None
        return batch

    async def _prefill(self, rows: list[Req]) -> Batch:
        """Run the prompts (plus any output so far, after a retraction) and sample each first token.

        Rows are left-padded and right-aligned. The logits kept are the ones input
        log-probs need (the last len - logprob_start_len positions) plus the last.
        """
        from transformers import DynamicCache
        for req in rows:
            req.started = True
        seqs = [r.prompt + r.output_ids for r in rows]
        width = max(map(len, seqs))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for b, seq in enumerate(seqs):
            ids[b, width - len(seq):] = torch.tensor(seq)
            mask[b, width - len(seq):] = 1
        keep = max(max(1, len(seq) - r.item.logprob_start_len) if r.wants_input_logprobs else 1
                   for r, seq in zip(rows, seqs))
        cache = DynamicCache(config=self.model.config)
        logits = await self._forward(rows, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache, keep, prefill=True)
        for b, (req, seq) in enumerate(zip(rows, seqs)):
            if req.wants_input_logprobs:
                start = req.item.logprob_start_len
                window = logits[b, keep - (len(seq) - start):]
                req.input_logprobs = prompt_logprobs(window, seq, start)
                if start < len(seq):
                    req.keep_input_rows(prompt_rows(window, len(seq), start))
            if req.params.max_new_tokens == 0:  # prefill only: the scoring path
                if req.item.wants_rows:  # SGLang still reports one output row: the next-token distribution
                    req.keep_output_row(next_token_row(logits[b, -1], req.params, req.prompt))
                self.finish(req, {"type": "length", "length": 0})
        self._sample(rows, logits[:, -1])
        batch = Batch(list(rows), cache, mask, mask.sum(-1, keepdim=True))
        batch.select([b for b, r in enumerate(rows) if not r.done])
        return batch

    def _sample(self, rows: list[Req], last: torch.Tensor) -> None:
        """One token for every unfinished row from its row of `last` logits; report it."""
        for b, req in enumerate(rows):
            if req.done:
                continue
            tok, lp, row = pick_token(last[b], req.params, req.prompt, req.output_ids, self._banned(req),
                                      req.generator)
            req.append(tok, lp, self.weight_version, row)
            reason = self._stop_reason(req)
            if reason is not None:
                self.finish(req, reason)
            else:
                req.notify(final=False)

    def _banned(self, req: Req) -> list[int]:
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens or p.ignore_eos:
            return []
        return sorted(self.eos_ids | set(p.stop_token_ids))

    def _stop_reason(self, req: Req) -> dict | None:
        """SGLang's order: length first, then stop tokens, then stop strings."""
        p, out = req.params, req.output_ids
        if len(out) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if len(out) < p.min_new_tokens:
            return None
        if not p.ignore_eos and (out[-1] in self.eos_ids or out[-1] in p.stop_token_ids):
            return {"type": "stop", "matched": out[-1]}
        if p.stop:
            # A multi-byte character may take several tokens: look back far enough.
            window = 4 * max(map(len, p.stop)) + 4
            tail = decode(self.tokenizer, out[-window:], p)
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        return None

    def shutdown(self) -> None:
        """Answer everything still waiting so handlers finish and the server can close."""
        for req in list(self.live.values()):
            self.finish(req, ABORTED if req.started else ABORTED_WAITING)
        self.waiting.clear()
