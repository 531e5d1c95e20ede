"""The AR (text) phase: prefill, KV-cached decode, the official stage machine, streaming.

Stage rules (official `generate_image`):
- think_recaption: `</think>` forces `<recaption>`.
- size auto: after the last CoT tag (`</recaption>`, or `</think>` for think) the tokens
  `<answer> <boi> <img_size_B>` are forced; the next token is restricted to the ratio tokens and taken
  greedily; generation stops on any ratio token.
- fixed size: stop at `</recaption>` (recaption tasks) or at `</think>` / `</recaption>` (think).
- auto (free chat): stop at eos.
Each transition fires once. Forced tokens are emitted and fed in the same forward as the token that
triggered them (the logits of a forced step are never needed).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator

import torch

from engine.runtime.events import Text
from engine.runtime.kv_pool import ARRow
from engine.runtime.needs import Decode
from engine.runtime.sampling import SamplingParams, choose
from engine.checkpoint.tokenizer import SpecialIds, TextStream, Tokenizer


@dataclass(frozen=True)
class StagePlan:
    first_task: str                        # bot prefix of the AR prompt: think | recaption | auto | img_ratio
    transitions: dict[int, tuple[int, ...]]
    stops: frozenset[int]
    ratio_trigger: int | None              # after this token the next one is a greedy ratio token

    @classmethod
    def for_task(cls, bot_task: str, need_ratio: bool, sp: SpecialIds) -> "StagePlan":
        if bot_task == "auto":
            return cls("auto", {}, frozenset([sp.eos]), None)
        if bot_task == "image":  # no CoT: only the one-step ratio pass (size auto)
            return cls("img_ratio", {}, frozenset(sp.ratio), sp.size)
        transitions: dict[int, tuple[int, ...]] = {}
        if bot_task == "think_recaption":
            transitions[sp.end_think] = (sp.recaption,)
        if need_ratio:
            last = sp.end_recaption if "recaption" in bot_task else sp.end_think
            transitions[last] = (sp.answer, sp.boi, sp.size)
            stops = frozenset(sp.ratio)
        elif "recaption" in bot_task:
            stops = frozenset([sp.end_recaption])
        else:
            stops = frozenset([sp.end_think, sp.end_recaption])
        return cls(bot_task.split("_")[0], transitions, stops, sp.size if need_ratio else None)


@dataclass
class TextResult:
    tokens: list[int] = field(default_factory=list)     # every generated id, forced ones included
    sampled: int = 0                                     # ids the model chose (the rest were forced)
    ratio_token: int | None = None
    prefill_ms: float = 0.0                              # the prompt's forward and the first choice
    decode_ms: float = 0.0                               # every later choice with its forward, no forced pass
    fed: int = 0                                         # sequence length whose K/V the cache now holds

    @property
    def ms_per_token(self) -> float:
        """Per sampled token after the first (each is one forward and one choice; the first comes with
        the prefill, forced tokens ride along in the forward of the token that forced them)."""
        n = self.sampled - 1
        return self.decode_ms / n if n > 0 else 0.0


class SectionTracker:
    """Turns generated ids into Text events: tags switch the section, other ids stream as text."""

    def __init__(self, tok: Tokenizer, first_section: str):
        sp = tok.special
        self.tok = tok
        self.section = first_section
        self.opens = {sp.think: "think", sp.recaption: "recaption", sp.answer: "answer"}
        self.closes = {sp.end_think, sp.end_recaption, sp.end_answer}
        self.silent = set(self.opens) | self.closes | {sp.boi, sp.size, *sp.ratio, sp.eos}
        self.stream = TextStream(tok)

    def push(self, token_id: int) -> Text | None:
        if token_id in self.silent:
            if token_id in self.opens:
                self.section = self.opens[token_id]
            elif token_id in self.closes:
                self.section = "answer"
            self.stream = TextStream(self.tok)
            return None
        delta = self.stream.push(token_id)
        return Text(delta, self.section) if delta else None


def generate_text(tok: Tokenizer, row: ARRow, prompt_embeds: torch.Tensor, plan: StagePlan, params: SamplingParams,
                  generator: torch.Generator | None, max_new_tokens: int,
                  agree: Callable[[torch.Tensor], int] = int) -> Generator[Text | Decode, int, TextResult]:
    """The AR phase of one request: yields Text events as tokens are produced and a `Decode` need for
    every decode step (the engine batches the decode steps of its requests and answers with the next
    token); returns the TextResult. prompt_embeds [1, L, H]: the embedded prompt (images instantiated);
    `row`: the request's AR slot (its positions, room for max_new_tokens more, the prefill and the
    forwards of forced tokens). The choices made here (the first token, and after a forward of forced
    tokens) go through `agree(token)`: every rank continues with rank 0's token (the one host read)."""
    L = prompt_embeds.shape[1]
    if L + max_new_tokens > row.length:
        raise ValueError(f"the prompt ({L} tokens) plus max_new_tokens ({max_new_tokens}) exceeds the "
                         f"sequence budget ({row.length})")
    vocab, sp = tok.vocab_size, tok.special
    res = TextResult()
    tracker = SectionTracker(tok, {"think": "think", "recaption": "recaption"}.get(plan.first_task, "answer"))
    allowed_ratio = torch.tensor(sp.ratio, device=prompt_embeds.device)
    done_transitions: set[int] = set()

    def choose_here(logits: torch.Tensor, restrict: torch.Tensor | None) -> int:
        logits[vocab:] = float("-inf")  # the embedding is padded past the tokenizer's vocabulary
        return agree(choose(logits, params, generator, restrict))

    def restriction(last: int | None) -> torch.Tensor | None:      # after the trigger: a ratio token, greedily
        return allowed_ratio if plan.ratio_trigger is not None and last == plan.ratio_trigger else None

    t0 = time.perf_counter()
    # the one-step ratio pass starts right after `<img_size_B>` (the end of its prompt)
    token = choose_here(row.prefill(prompt_embeds), restriction(plan.ratio_trigger if plan.first_task == "img_ratio"
                                                                else None))
    fed, t_first = L, time.perf_counter()
    res.prefill_ms = (t_first - t0) * 1e3
    while True:
        res.sampled += 1
        t_last = time.perf_counter()
        new = [token]
        if token in plan.transitions and token not in done_transitions:
            done_transitions.add(token)
            new += list(plan.transitions[token])[: max_new_tokens - len(res.tokens) - 1]
        for t in new:
            res.tokens.append(t)
            if (ev := tracker.push(t)) is not None:
                yield ev
        if token in plan.stops or len(res.tokens) >= max_new_tokens:
            res.ratio_token = token if token in plan.stops and token in sp.ratio else None
            break
        restrict = restriction(new[-1])
        if len(new) == 1:
            token = yield Decode(row.slot, token, fed, params, generator, restrict)
        else:  # a token and the tokens it forces: one causal forward of this request alone
            token = choose_here(row.feed(new, fed), restrict)
        fed += len(new)
    res.decode_ms = (t_last - t_first) * 1e3
    if plan.ratio_trigger is not None and res.ratio_token is None:
        fed, logits = _close_with_ratio(row, res, fed - L, fed, plan.ratio_trigger, sp)
        res.ratio_token = agree(choose(logits, params, None, allowed_ratio))
        res.tokens.append(res.ratio_token)
    res.fed = fed
    return res


def _close_with_ratio(row: ARRow, res: TextResult, fed_tokens: int, fed: int, trigger: int,
                      sp: SpecialIds) -> tuple[int, torch.Tensor]:
    """The budget ran out before the model chose a size: close with the forced ratio stage (`<answer> <boi>
    <img_size>` then a greedy ratio token) so the request still gets an image. The generated tokens not fed
    yet (past the first `fed_tokens`) and the forced ones go in one forward -> (positions fed, its logits)."""
    unfed = res.tokens[fed_tokens:]
    forced = [] if unfed[-1:] == [trigger] else [sp.answer, sp.boi, sp.size]
    res.tokens += forced
    feed = unfed + forced
    return fed + len(feed), row.feed(feed, fed)
