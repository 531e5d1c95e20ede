"""The engine's scheduler: the requests admitted to the engine, advanced together one step at a time.

Each admitted request is a RequestState whose phase program (engine/runtime/program.py, made by the
factory the scheduler is given) runs its own forwards and yields a need (engine/runtime/needs.py) where
it shares the engine. The scheduler is given what it shares out (the KV pool's AR slots and its decode
step, the denoise batch, the ranks' agreement) and imports nothing above itself. One engine step:
1. The step's news, the same on every rank (rank 0 decides, engine/serve/worker.py broadcasts):
   cancelled requests end at once (their program is closed where it waits, which gives its AR slot and
   denoise rows back) with Error('cancelled'); new requests join and run until their first need. (The
   news' adapter changes are the engine's, applied before: engine/runtime/engine.py `Engine.step`.)
2. AR slots go to the requests that wait for one, first come first served (a request that does not fit
   yet keeps the ones behind it waiting: no overtaking). A request given its slot prefills inline.
3. One batched decode forward for every request in its decode stage (engine/runtime/decode_step.py);
   each row is sampled with its own request's parameters and generator (one `sample_rows` call for the
   step's rows), and every row's token is read at once (the step's one host read, agreed by all ranks);
   each program continues with its token. With `lookahead` (on a GPU), the next decode step is launched
   before that read, its tokens copied on the device: the device runs it while the host reads the
   tokens and runs the programs (the host's share of a token, hidden). The next step uses its logits if
   the requests in it are exactly those that went on with their tokens; else (a request ended, joined,
   was cancelled, fed forced tokens) it runs its own forward, writing the same positions again (the
   one launched ahead wrote each row's next position only, never read past a request's end: the hand-off
   and the prefix cache read the positions fed, engine/runtime/handoff.py).
4. A turn of heavy work, ONE of:
   - the denoise batch's forward: the denoise batch (engine/runtime/denoise_batch.py) holds up to
     `max_denoise_batch` requests of one step class (bucket and rows, whatever their prompt + CoT
     lengths), and one forward runs a step of every member (its step graph replayed: captured once per
     tail bucket and batch size for the engine's life). Each counts the requests that wait for rows of
     the same class (`denoise_company`): the room a larger batch would have;
   - a request's own work, first asked first served: joining the denoise batch (its hand-off from its
     AR slot and its image prefix's prefill; the first request waiting for rows goes first and, if it
     cannot join yet, the ones behind it wait too: no overtaking), or its VAE decode (`ImageDecode`;
     it has left the batch). Own work never rides inside a denoise turn that others wait on.
   When both wait, they alternate (own work after a denoise forward, a denoise forward after own work).

The step policy (`policy`, with `decode_steps_per_denoise`, K), each giving every request what it gives
alone (only the order of the work changes):
- interleave: decode steps come first, being cheap and batched; a turn of heavy work runs in every step
  where nothing decodes, and otherwise after every K decode steps, so neither starves. K trades the two: a
  denoise step costs tens of decode steps, so at K = 8 the decoding requests keep a readable stream while
  an image denoises and the denoising request runs somewhat slower than alone (the H200's figures:
  docs/benchmarks.md, serving).
- waves: the admitted requests' CoTs are decoded together at full width, then their images: no AR slot is
  granted while a request is in its image phase (waiting for rows, denoising, waiting for its VAE), and a
  turn of heavy work runs only when nothing decodes.
- overlap: interleave's order, with the image phase's work on a second CUDA stream (engine/runtime/lanes.py)
  so that the decode steps run beside a denoise step instead of after it (on the CPU: one lane, the same
  code, the same results). One GPU only: on several, the two streams would run two NCCL communicators'
  collectives at once, which NCCL does not order alike on every rank (parallel/plan.py check_step_policy
  refuses it).
An engine asked for no policy takes overlap on one GPU and interleave elsewhere (parallel/plan.py
default_step_policy: overlap was the fastest or level in every serving run measured on one GPU).
K counts steps, not seconds, and the turns are chosen from the requests' needs and counts only: every rank
makes the same decision without a clock.

A request's exception fails that request only (Error('engine'); its program's `finally` frees its
share). A failure of the shared decode forward fails the requests in it. On a multi-rank plan a failed
request leaves the ranks' collectives out of step: the worker reports it and the server restarts.
"""
from __future__ import annotations

import collections
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.runtime.agreement import Agreement
from engine.runtime.decode_step import DecodeStep
from engine.runtime.denoise_batch import DenoiseBatch
from engine.runtime.events import Error, Event
from engine.runtime.kv_pool import KVPool
from engine.runtime.lanes import Lanes
from engine.runtime.needs import ARSlot, Decode, DenoiseRows, DenoiseStep, ImageDecode
from engine.runtime.request import Prepared
from engine.runtime.request_state import Program, RequestState
from engine.runtime.sampling import choose_rows

DECODE_STEPS_PER_DENOISE = 8
POLICIES = ("interleave", "waves", "overlap")
NEEDS = (ARSlot, Decode, DenoiseRows, DenoiseStep, ImageDecode)


@dataclass(frozen=True)
class StepNews:
    """What changes at a step boundary, the same on every rank: requests that join (seq, prepared), in
    order, the seqs of requests to cancel, and LoRA adapters to load or unload first ((op, name, folder):
    the engine's, `Engine.change_adapter`; the scheduler takes the joins and cancels)."""
    join: tuple[tuple[int, Prepared], ...] = ()
    cancel: frozenset[int] = field(default_factory=frozenset)
    adapters: tuple[tuple[str, str, str | None], ...] = ()


class Scheduler:
    def __init__(self, programs: Callable[[Prepared], Program], pool: KVPool, denoising: DenoiseBatch,
                 agree: Agreement, vocab: int, decode_steps_per_denoise: int = DECODE_STEPS_PER_DENOISE,
                 policy: str = "interleave", lookahead: bool = False):
        """`programs(prepared)`: a joining request's phase program; `pool`: the KV pool whose AR slots and
        batched decode step it shares out; `denoising`: the requests holding denoise rows (one batch per
        scheduler: it owns their order); `agree`: the ranks' agreement on each decode step's tokens;
        `vocab`: the tokenizer's (the embedding is padded past it); `policy`: the step policy (module doc);
        `lookahead`: each decode step launches the next before its tokens are read (module doc, 3.)."""
        if decode_steps_per_denoise < 1:
            raise ValueError(f"decode_steps_per_denoise must be >= 1 (got {decode_steps_per_denoise})")
        if policy not in POLICIES:
            raise ValueError(f"the step policy is one of {', '.join(POLICIES)} (got {policy!r})")
        self.programs, self.pool, self.denoising, self.agree = programs, pool, denoising, agree
        self.k, self.policy, self.lookahead = decode_steps_per_denoise, policy, lookahead
        # the decode step launched ahead: (the step, its rows (slot, token, index), its logits)
        self._ahead: tuple[DecodeStep, list[tuple[int, int, int]], torch.Tensor] | None = None
        self.lanes = Lanes(pool.model.device if policy == "overlap" else None)
        self.requests: dict[int, RequestState] = {}          # admission order
        self.steps = 0                                       # engine steps run
        self._since_turn = 0                                 # decode steps since the last heavy turn
        self._last_turn = ""                                 # what it ran: "denoise" or "own"
        self._asked = 0                                      # needs asked so far (first asked first served)
        self._events: list[tuple[int, Event]] = []
        self._ended: list[int] = []
        # at each denoise forward, how many other requests waited for rows of the same step class: with them
        # (same class, any step) / (same class and step) one forward could have served them all (the room a
        # larger denoise batch would have: bench serving's `same-class company`)
        self.denoise_company: collections.Counter = collections.Counter()
        # what each step did, counted without a device read: decode steps and the rows they carried (the
        # mean decode batch), denoise forwards, AR slots granted (each prefilled inline), hand-offs (a join
        # of the denoise batch with its image prefix's prefill) and VAE decodes; `last` is the latest step's
        # own counts (bench serving --profile times the steps by what they held)
        self.totals: collections.Counter = collections.Counter()
        self.last: dict[str, int] = {}
        self._vocab = vocab

    @property
    def busy(self) -> bool:
        return bool(self.requests)

    def counts(self) -> dict[str, int]:
        """How many requests are in each stage (prefill, decode, handoff, denoise)."""
        out: dict[str, int] = {}
        for s in self.requests.values():
            out[s.stage] = out.get(s.stage, 0) + 1
        return out

    def drain(self) -> tuple[list[tuple[int, Event]], list[int]]:
        """The events produced since the last drain (seq, event), in order, and the seqs that ended."""
        events, ended, self._events, self._ended = self._events, self._ended, [], []
        return events, ended

    # ------------------------------------------------------------------ the step
    def step(self, news: StepNews = StepNews()) -> None:
        # the pool's slots given back on this scheduler's image lane drain (kv_pool.py `release_slot`); set every
        # step, since another scheduler of the engine (`Engine.run_prepared`: the warm-up, a request run on its
        # own) may have stepped the pool in between
        self.pool.fence = self.lanes.fence if self.lanes.side is not None else None
        with torch.no_grad(), self.lanes.step():
            if news.adapters:
                self._ahead = None       # launched on the adapter tables as they were before this change
            if news.cancel:
                self.lanes.merge()       # a cancel's clean-up may move or free rows the image lane works on
            for seq in sorted(news.cancel):
                if seq in self.requests:
                    self._cancel(self.requests[seq])
            for seq, prepared in news.join:
                state = self.requests[seq] = RequestState(seq, prepared, self.programs(prepared))
                self._advance(state, None)
            slots = 0 if self._image_wave() else self._grant_slots()
            decoded = self._decode()
            turn: dict[str, int] = {}
            self._since_turn += bool(decoded)
            if not decoded or (self.policy != "waves" and self._since_turn >= self.k):
                turn = self._turn()
                if turn:
                    self._since_turn = 0
        self.steps += 1
        self.last = {"joined": len(news.join), "slots": slots, "decode_rows": decoded, "denoise_rows": 0,
                     "handoffs": 0, "image_decodes": 0} | turn
        self.totals.update(self.last, decode_steps=int(decoded > 0),
                           denoise_forwards=int(self.last["denoise_rows"] > 0))

    def _image_wave(self) -> bool:
        """Waves: whether a request is in its image phase (no AR slot is granted until they are all done)."""
        return self.policy == "waves" and any(isinstance(s.need, (DenoiseRows, DenoiseStep, ImageDecode))
                                              for s in self.requests.values())

    def _grant_slots(self) -> int:
        """AR slots to the requests waiting for one, in order -> how many were granted."""
        pool, granted = self.pool, 0
        for state in [s for s in self.requests.values() if isinstance(s.need, ARSlot)]:
            slot = pool.take_slot(state.need.length)
            if slot is None:
                break                    # first come first served: the ones behind it wait too
            self._advance(state, slot)
            granted += 1
        return granted

    def _decode(self) -> int:
        """The step's batched decode forward -> its rows (0: none decoding)."""
        rows = [s for s in self.requests.values() if isinstance(s.need, Decode)]
        ahead, self._ahead = self._ahead, None
        if not rows:
            return 0

        def forward() -> list[int]:
            step, fed = self.pool.decode, [(s.need.slot, s.need.token, s.need.index) for s in rows]
            # the step launched ahead is this one if every request went on with its token, and only they
            logits = ahead[2] if ahead is not None and ahead[:2] == (step, fed) else step(fed)
            logits[:, self._vocab:] = float("-inf")      # the embedding is padded past the tokenizer's vocabulary
            needs = [s.need for s in rows]
            tokens = choose_rows(logits, [n.slot for n in needs], [n.params for n in needs],
                                 [n.generator for n in needs], [n.allowed for n in needs])
            read = self.agree.tokens_later(tokens)
            nxt = [(n.slot, n.index + 1) for n in needs]
            launched = self._launch_ahead(step, nxt, tokens) if self.lookahead else None
            answers = read()                              # the step's one host read
            if launched is not None:
                self._ahead = (step, [(s, t, i) for (s, i), t in zip(nxt, answers)], launched)
            return answers
        self._shared(rows, forward)
        return len(rows)

    @staticmethod
    def _launch_ahead(step: DecodeStep, rows: list[tuple[int, int]], tokens: torch.Tensor) -> torch.Tensor | None:
        """The next decode step, launched before this one's tokens are read (`lookahead`) -> its logits, or
        None if it could not be launched (the next step then runs its own forward, which reports why)."""
        try:
            return step.ahead(rows, tokens)
        except Exception:  # noqa: BLE001 - the step's own forward fails the requests if it fails again
            traceback.print_exc(file=sys.stderr)
            return None

    def _shared(self, states: list[RequestState], forward: Callable[[], list]) -> None:
        """One forward for `states`, each continuing with its own answer; if the forward fails, so did every
        request in it."""
        try:
            answers = forward()
        except Exception as e:  # noqa: BLE001 - reported on each request's stream
            for s in states:
                self._fail(s, e)
            return
        for s, answer in zip(states, answers):
            self._advance(s, answer)

    def _turn(self) -> dict[str, int]:
        """The step's heavy turn (module doc, 4.) -> what it ran, as `last` counts it ({}: nothing)."""
        own = self._next_own()
        if own is not None and (self._last_turn == "denoise" or not self.denoising.members):
            self._last_turn = "own"
            with self.lanes.image():
                # no merge after it: the AR slot a hand-off gives back is free once the image lane has read it
                # (kv_pool.py `release_slot`), and the AR-lane tensors the image phase reads are recorded on that
                # lane (program.py `_hand_off`), so the AR lane never waits for the image lane's queued steps
                return self._own_turn(own)
        if self.denoising.members:
            self._last_turn = "denoise"
            with self.lanes.image():
                return {"denoise_rows": self._denoise_forward()}
        return {}

    def _next_own(self) -> RequestState | None:
        """The request whose own work goes next: the first asked of those waiting for their VAE decode and
        the first waiting for denoise rows, if that one can join the batch now; None: none can."""
        waiting = sorted((s for s in self.requests.values() if isinstance(s.need, (DenoiseRows, ImageDecode))),
                         key=lambda s: s.asked)
        rows = next((s for s in waiting if isinstance(s.need, DenoiseRows)), None)
        return next((s for s in waiting if isinstance(s.need, ImageDecode)
                     or (s is rows and self.denoising.fits(s.need))), None)

    def _own_turn(self, state: RequestState) -> dict[str, int]:
        """`state`'s own work in a turn of its own: its join of the denoise batch (then its hand-off and
        image prefix's prefill, until it asks for its first step) or its VAE decode (to its end)."""
        if isinstance(state.need, DenoiseRows):
            self._advance(state, self.denoising.join(state))
            return {"handoffs": 1}
        self._advance(state, None)
        return {"image_decodes": 1}

    def _denoise_forward(self) -> int:
        """The denoise batch's one forward -> the requests it stepped."""
        batch = self.denoising
        members = list(batch.members)
        self._count_company(members[0])
        self._shared(members, lambda: batch.velocities([s.need.job for s in members]))
        return len(members)

    def _count_company(self, holder: RequestState) -> None:
        step: DenoiseStep = holder.need
        same = [s.need for s in self.requests.values() if isinstance(s.need, DenoiseRows) and s.need.key == step.key]
        self.denoise_company["turns"] += 1
        self.denoise_company["same_key"] += len(same)
        self.denoise_company["same_step"] += len(same) if step.step == 0 else 0   # a waiting one is before its step 0

    # ------------------------------------------------------------------ one request
    def _advance(self, state: RequestState, answer: Any) -> None:
        """Run the request's program until its next need (collecting its events), its end or its failure."""
        denoising = isinstance(state.need, DenoiseStep)
        try:
            item = state.program.send(answer)
            while not isinstance(item, NEEDS):
                self._events.append((state.seq, item))
                item = next(state.program)
            state.need, state.asked = item, self._asked
            self._asked += 1
            if denoising and not isinstance(item, DenoiseStep):
                self.denoising.leave(state)          # its denoise is done: its rows go to the batch's others
        except StopIteration:
            self._end(state)
        except Exception as e:  # noqa: BLE001 - a failure of this request, reported on its stream
            self._fail(state, e)

    def _fail(self, state: RequestState, e: Exception) -> None:
        traceback.print_exc(file=sys.stderr)
        self._events.append((state.seq, Error("engine", f"{type(e).__name__}: {e}")))
        self._end(state)

    def _cancel(self, state: RequestState) -> None:
        state.cancelled = True
        self._events.append((state.seq, Error("cancelled", "stopped by the user")))
        self._end(state)

    def _end(self, state: RequestState) -> None:
        try:
            state.program.close()        # where it waits: its `finally` gives its slot and rows back
        except Exception:  # noqa: BLE001 - a failing clean-up must not take the engine down
            traceback.print_exc(file=sys.stderr)
        self.denoising.leave(state)      # the batch's later requests move down into its rows
        state.need = None
        del self.requests[state.seq]
        self._ended.append(state.seq)
