"""What the model sees of a conversation's earlier turns: the history policy.

A turn is what a user asked (an instruction and 0-3 reference images) and what the model answered (its
reasoning and the image it made). A new turn's request carries the earlier turns (`Request.history`) and
a policy; `select` decides, from them, what goes into the new turn's sequence.

How the official code lays several turns out (HunyuanImage-3.0 Instruct, `apply_general_template` and
the chat app's `history2messages`; read, not copied): one sequence in the `instruct` template,

    <bos> [system \\n\\n]
    User: [its images] instruction \\n\\n  Assistant: [<think>..</think><recaption>..</recaption>] [its image] \\n\\n
    ...                                                     (every earlier turn, oldest first)
    User: [this turn's images] instruction \\n\\n  Assistant: <think> ...      (the turn being made)

- A user's reference images sit in its user message before the instruction (as in a single edit).
- The image an assistant made earlier is, in the history, a conditioning image like a reference (its
  VAE latent and ViT features, `<timestep>` at t = 0), placed in the assistant message after its
  reasoning; only the image being generated is wrapped in `<answer>..</answer>`.
- An assistant's reasoning with its tags is split into sections as the CoT of a single turn is;
  assistant text without them (a client's plain `reasoning_content`) is one `<answer>text</answer>`
  section, as the official template writes untagged assistant text.
- CFG's uncond branch replaces every instruction and every reasoning text by `<cfg>`, history included;
  images and tags stay.
- The official app offers two context modes: "single_round" (only the last user message) and
  "unlimited" (the whole history). Editing needs the last image, so single_round is not enough here.
- The model is trained for at most 3 images in one sequence (README: "up to 3 inputs"); every image in
  the sequence counts, history images included.

The policies (POLICIES; DEFAULT_POLICY is used when a request names none):
- "full": the official "unlimited" context within the 3-image limit: the most recent earlier turns,
  whole, whose images together with this turn's references fit in MAX_IMAGES; older turns are left out
  (oldest first). Where not even the last turn fits (it had references of its own), "last_image" applies.
- "last_image": no earlier turn; the last image the model made is this turn's first reference image,
  before the user's own (what "edit this result" did before conversations existed).
"last_image" is the default: it edits far better in the chained-edit measurement (docs/conversations.md:
chains of 3 edits on the embedded model); the official model is not trained for multi-turn editing either
(its roadmap's open item).
"full" stays for clients that want the whole conversation in the sequence (and it is what the prefix cache
saves on: "last_image" carries a new image each turn).

The images of earlier turns are decoded only when the policy shows them (the others' headers are checked),
each once, into what the model consumes (engine/runtime/images.py ModelImage, under the request's budget
of decoded pixels); they are encoded once: they come from the engine's encoding cache, as the turn that
showed them first encoded them, else with VAE noise seeded from their content (conditioning.py); and a
turn that keeps the earlier turns as the previous one laid them out takes their K/V from the prefix cache
(prefix_cache.py) up to the end of the previous turn's reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from engine.runtime.images import ImageError, ModelImage, check_image
from engine.runtime.sequence import PastTurnLayout
from engine.checkpoint.prompts import COT_TASKS

MAX_IMAGES = 3                       # images in one sequence, the model's limit (request.MAX_IMAGES)
POLICIES = ("full", "last_image")
DEFAULT_POLICY = "last_image"
MAX_TURNS = 32                       # earlier turns one request may carry (each is re-read and checked)
MAX_REASONING_CHARS = 65536          # a turn's reasoning: room for the longest CoT (8192 tokens) the engine writes


class HistoryError(ValueError):
    """A bad earlier turn; `where` names it (e.g. 'history[1].image') for the front end's message."""

    def __init__(self, message: str, where: str = "history"):
        super().__init__(message)
        self.where = where


@dataclass(frozen=True)
class Turn:
    """One earlier turn as given: images as bytes, paths or PIL images (like Request.images)."""
    prompt: str
    images: tuple = ()               # the user's reference images of that turn (0-3)
    reasoning: str = ""              # the model's reasoning as it wrote it (tags kept), or plain text, or ''
    image: Any = None                # the image the model made (None: the turn made none)

    @property
    def image_count(self) -> int:
        return len(self.images) + (self.image is not None)


@dataclass
class SeenTurn:
    """An earlier turn as the new turn's sequence shows it: its images read, nothing left to refuse."""
    prompt: str
    images: list[ModelImage] = field(default_factory=list)
    reasoning: str = ""
    image: ModelImage | None = None

    @property
    def all_images(self) -> list[ModelImage]:
        """In sequence order: the user's references, then the model's image."""
        return self.images + ([self.image] if self.image is not None else [])

    @property
    def layout(self) -> PastTurnLayout:
        return PastTurnLayout(self.prompt, tuple(i.layout for i in self.images), self.reasoning,
                              None if self.image is None else self.image.layout)


def _check(turns: tuple, max_prompt_chars: int) -> None:
    """Every turn well formed: its texts within their limits, its images readable by their headers (none
    decoded here: `read` decodes those the policy shows)."""
    if not isinstance(turns, (list, tuple)):
        raise HistoryError(f"history must be a list of turns (got {type(turns).__name__})")
    if len(turns) > MAX_TURNS:
        raise HistoryError(f"{len(turns)} earlier turns given; at most {MAX_TURNS} are kept")
    for i, t in enumerate(turns):
        where = f"history[{i}]"
        if not isinstance(t, Turn):
            raise HistoryError(f"{where} must be a Turn (got {type(t).__name__})", where)
        for name, text, limit in (("prompt", t.prompt, max_prompt_chars),
                                  ("reasoning", t.reasoning, MAX_REASONING_CHARS)):
            if not isinstance(text, str):
                raise HistoryError(f"{where}.{name} must be text (got {type(text).__name__})", f"{where}.{name}")
            if len(text) > limit:
                raise HistoryError(f"{where}.{name} is too long ({len(text)} characters; the limit is {limit})",
                                   f"{where}.{name}")
        if len(t.images) > MAX_IMAGES:
            raise HistoryError(f"{where} has {len(t.images)} reference images; at most {MAX_IMAGES}", f"{where}.images")
        try:
            for k, src in enumerate(t.images):
                check_image(src, f"{where} reference image {k + 1}")
        except ImageError as e:
            raise HistoryError(str(e), f"{where}.images") from None
        try:
            if t.image is not None:
                check_image(t.image, f"{where}'s image")
        except ImageError as e:
            raise HistoryError(str(e), f"{where}.image") from None


def select(turns: tuple, current_images: int, policy: str | None,
           max_prompt_chars: int = 8000) -> tuple[list[int], int | None]:
    """What the new turn's sequence shows of the earlier `turns` (each checked first), by `policy` (None:
    DEFAULT_POLICY): the indexes of the turns it shows whole, and the index of the turn whose image is
    carried into its own user message (placed before its references), or None. Raises HistoryError."""
    policy = policy or DEFAULT_POLICY
    if policy not in POLICIES:
        raise HistoryError(f"unknown history policy {policy!r}; choose one of {', '.join(POLICIES)}",
                           "history_policy")
    _check(turns, max_prompt_chars)
    last = next((i for i in range(len(turns) - 1, -1, -1) if turns[i].image is not None), None)
    if policy == "full":
        first, room = len(turns), MAX_IMAGES - current_images
        while first > 0 and room - turns[first - 1].image_count >= 0:
            first -= 1
            room -= turns[first].image_count
        # the model's last image is the thing being edited: a history without it is not kept
        if first < len(turns) and (last is None or last >= first):
            return list(range(first, len(turns))), None
    if last is None:
        return [], None
    if current_images + 1 > MAX_IMAGES:
        raise HistoryError(f"this turn has {current_images} reference images and the last image the model "
                           f"made is one more; at most {MAX_IMAGES} images fit in one turn", "images")
    return [], last


def read(turns: tuple, shown: list[int], carried: int | None, read_image: Callable[[Any, str], ModelImage]
         ) -> tuple[list[SeenTurn], list[ModelImage]]:
    """The turns `select` chose, their images read (`read_image(src, what)`, each decoded once), and the
    image it carries; HistoryError names the image that cannot be read."""
    def image(src: Any, what: str, where: str) -> ModelImage:
        try:
            return read_image(src, what)
        except ImageError as e:
            raise HistoryError(str(e), where) from None
    seen = []
    for i in shown:
        t, where = turns[i], f"history[{i}]"
        refs = [image(src, f"{where} reference image {k + 1}", f"{where}.images") for k, src in enumerate(t.images)]
        made = None if t.image is None else image(t.image, f"{where}'s image", f"{where}.image")
        seen.append(SeenTurn(t.prompt, refs, t.reasoning, made))
    if carried is None:
        return seen, []
    return seen, [image(turns[carried].image, f"history[{carried}]'s image", f"history[{carried}].image")]


def reasoning_of(bot_task: str, generated: str) -> str:
    """The CoT text the image phase reads, from the text the AR phase generated after its bot prefix:
    the prefix's opening tag, then everything up to the task's closing tag (what follows it, the forced
    ratio tokens, is not reasoning); '' for the tasks without a CoT."""
    if bot_task not in COT_TASKS:
        return ""
    end = "</recaption>" if "recaption" in bot_task else "</think>"
    cut = generated.find(end)
    return ("<think>" if bot_task.startswith("think") else "<recaption>") + \
        (generated if cut < 0 else generated[:cut + len(end)])
