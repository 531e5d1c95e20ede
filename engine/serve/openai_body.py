"""A /v1 request's body, read with a budget: how large each route's body may be, and a streaming check of a
JSON body's structure before any Python object is built from it.

Why a budget: a body is read by the event loop that answers everyone (/health included). Parsed whole on
the loop, an 80 MB body of 40 M zeros in an unknown field held every route for 20-30 s and 3.5 GB
(issue 44, item 2). So:
- each route's limit is what its largest legal request needs (`BodyLimit`, computed from the engine's
  limits below), said in the 413;
- a JSON body is scanned as its chunks arrive (`JsonScan`: a regex pass, C-speed, over each chunk): its
  nesting, its number of values, and which field each value belongs to. An unknown field is refused as
  soon as its name is read; a field that takes a single value (anything but `messages` and the fields
  inside `extra_body`) may hold at most FIELD_VALUES values, so 20 000 numbers in the ignored `metadata`
  are refused at the 65th; the whole body at most MAX_JSON_VALUES;
- a refused body is read to its end without being kept (so the client, still sending, reads the answer),
  and only a body that passed is parsed: by `json.loads` in a thread (`JsonParser`), at most PARSERS at
  once;
- the bodies held at once, from their first byte until their request is built, are together at most
  HELD_BODIES of the largest route's limit (`HeldBodies`): a body past that is refused with 503 and
  Retry-After, so many large bodies at once cannot take the server's memory.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Iterator

from engine.runtime.history import MAX_REASONING_CHARS, MAX_TURNS
from engine.runtime.request import MAX_IMAGES, MAX_PROMPT_CHARS, MAX_SYSTEM_PROMPT_CHARS
from engine.serve.openai_errors import ApiError, invalid
from engine.serve.openai_fields import unknown_parameter

MAX_JSON_DEPTH = 64        # nesting a route's JSON may have (the deepest legal request, a chat, needs 6)
# Values (array items, object members) in one body. The largest legal request, a chat of MAX_TURNS earlier
# turns each with MAX_IMAGES references and an image, holds 977 (tests/test_api_input.py counts them).
MAX_JSON_VALUES = 16_384
FIELD_VALUES = 64          # in a field that takes one value, or a few (metadata: OpenAI allows 16 pairs)
PARSERS = 2                # bodies parsed at once (each in a thread)
HELD_BODIES = 4            # bodies of the largest route's limit held at once, by all requests together

ESCAPED_CHAR = 12          # the most JSON text one character takes: an astral one as two \uXXXX escapes
UTF8_CHAR = 4              # the most UTF-8 bytes of one character (multipart text)
FIELDS_ALLOWANCE = 64 * 1024   # every other field of a request together (numbers, names, options, metadata)
PART_OVERHEAD = 512        # a multipart part's boundary and headers
MAX_FORM_PARTS = 64        # parts of an edit's form (it has about 40 fields)
MESSAGE_OVERHEAD = 1024    # a chat message's JSON around its texts and images


@dataclass(frozen=True)
class BodyLimit:
    """The most a route's body may be, and what that room is for (said in the 413)."""
    bytes: int
    room_for: str

    def refusal(self, size: int | None) -> ApiError:
        said = f"is {size} bytes" if size is not None else f"exceeds {self.bytes} bytes"
        return ApiError(413, f"the request body {said}; the limit on this route is {self.bytes} bytes (room for "
                             f"{self.room_for})", None, "request_too_large")


def generation_limit() -> BodyLimit:
    texts = (MAX_PROMPT_CHARS + MAX_SYSTEM_PROMPT_CHARS) * ESCAPED_CHAR
    return BodyLimit(texts + FIELDS_ALLOWANCE, f"a prompt of {MAX_PROMPT_CHARS} and a system prompt of "
                                               f"{MAX_SYSTEM_PROMPT_CHARS} characters, and the other fields")


def edit_limit(image_bytes: int) -> BodyLimit:
    """The multipart form: the reference images as files, the texts as UTF-8."""
    texts = (MAX_PROMPT_CHARS + MAX_SYSTEM_PROMPT_CHARS) * UTF8_CHAR
    return BodyLimit(MAX_IMAGES * image_bytes + texts + FIELDS_ALLOWANCE + MAX_FORM_PARTS * PART_OVERHEAD,
                     f"{MAX_IMAGES} reference images of {image_bytes} bytes, the texts and the other fields")


def chat_limit(image_bytes: int) -> BodyLimit:
    """A chat carries its whole conversation: every image of it as a data URL (base64: 4/3; together at most
    `chat_image_bytes`), this turn's and MAX_TURNS earlier turns' texts and reasoning, a system message."""
    texts = ((MAX_TURNS + 1) * MAX_PROMPT_CHARS + MAX_TURNS * MAX_REASONING_CHARS + MAX_SYSTEM_PROMPT_CHARS) \
        * ESCAPED_CHAR
    messages = (2 * MAX_TURNS + 2) * MESSAGE_OVERHEAD
    return BodyLimit(chat_image_bytes(image_bytes) * 4 // 3 + texts + messages + FIELDS_ALLOWANCE,
                     f"images of {chat_image_bytes(image_bytes)} bytes together (base64), the texts of "
                     f"{MAX_TURNS} earlier turns with their reasoning, and the other fields")


def chat_image_bytes(image_bytes: int) -> int:
    """The images of one chat request together, history included: the model sees at most MAX_IMAGES of
    them (engine/runtime/history.py), so room for that many at the upload limit."""
    return MAX_IMAGES * image_bytes


def declared_size(headers) -> int | None:
    try:
        return int(headers.get("content-length") or 0) or None
    except ValueError:
        raise ApiError(400, "the Content-Length header is not a number", None, "invalid_request") from None


class HeldBodies:
    """The body bytes that requests being read and parsed hold, together, within `limit`. Used on the event
    loop only (no lock): `hold()` gives a request its counter, returned when its block ends."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    @contextmanager
    def hold(self) -> Iterator[Callable[[int], None]]:
        mine = 0

        def add(n: int) -> None:
            nonlocal mine
            if self.held + n > self.limit:
                raise ApiError(503, f"the server is reading {self.held} bytes of other request bodies, its limit "
                                    "for all of them at once; send it again in a moment", None, "server_busy",
                               retry_after=1)
            self.held += n
            mine += n
        try:
            yield add
        finally:
            self.held -= mine


async def read_body(chunks: AsyncIterator[bytes], limit: BodyLimit, declared: int | None,
                    feed: Callable[[bytes], None]) -> None:
    """Hand the body to `feed` chunk by chunk, refusing it (413) past the limit, declared or not. What `feed`
    refuses is raised once the body has been read (and dropped) to its end: a client that is still
    sending reads the answer instead of a reset connection."""
    if declared is not None and declared > limit.bytes:
        raise limit.refusal(declared)
    seen, refused = 0, None
    async for chunk in chunks:
        seen += len(chunk)
        if seen > limit.bytes:
            raise refused or limit.refusal(None)
        if refused is None:
            try:
                feed(chunk)
            except ApiError as e:
                refused = e
    if refused is not None:
        raise refused


# ------------------------------------------------------------------------------------------- JSON
@dataclass(frozen=True)
class JsonFields:
    """What a route's JSON object may hold, for the scan: its fields (`known`), those that hold the
    request's bulk (`whole`: the body's budget, not FIELD_VALUES) and those whose members are fields
    themselves (`nested`: the chat's `extra_body`, with the fields it may hold)."""
    known: frozenset[str]
    whole: frozenset[str] = frozenset()
    nested: tuple[tuple[str, frozenset[str]], ...] = ()


_PLAIN = re.compile(rb'[^"\[\]{},:]*')                # outside strings: numbers, literals, blanks
_STRING = re.compile(rb'[^"\\]*(?:\\.[^"\\]*)*', re.S)  # a string's text up to its closing quote
QUOTE, COMMA, COLON, LBRACE = ord('"'), ord(","), ord(":"), ord("{")
OPENERS, CLOSERS = frozenset(b"[{"), frozenset(b"]}")
MAX_NAME_BYTES = 256       # a field name is kept this far (a longer one is unknown anyway)
SLICE = 64 * 1024          # bytes scanned in one regex pass


class JsonScan:
    """The structure of a JSON text fed in chunks, checked as it comes: nesting at most `max_depth`, at most
    `max_values` values (each array item and object member: the openers and commas), the fields of the
    top-level object (and of its nested ones) known, each within its budget. Strings are skipped by a
    regex, so the Python work per chunk is per structural token, and stops at the first refusal.
    Whether the text is valid JSON is left to the parser that runs after it."""

    def __init__(self, fields: JsonFields, max_values: int = MAX_JSON_VALUES, max_depth: int = MAX_JSON_DEPTH):
        self.fields, self.max_values, self.max_depth = fields, max_values, max_depth
        self.nested = dict(fields.nested)
        self.stack: list[int] = []          # the open containers' opening bytes
        self.in_string, self.carry = False, b""
        self.name: bytearray | None = None  # a field name being read
        self.expect_name = False
        self.top: str | None = None         # the top-level field the scan is in
        self.sub: str | None = None         # the field of a nested object (extra_body's) it is in
        self.values = self.field_values = 0

    # the field whose budget a value counts against
    def _field(self) -> str | None:
        return self.sub if self.top in self.nested and self.sub is not None else self.top

    def _fields_here(self) -> bool:
        """Whether the innermost open object's members are request fields (their names are checked)."""
        depth = len(self.stack)
        return self.stack[-1] == LBRACE and (depth == 1 or (depth == 2 and self.top in self.nested))

    def feed(self, chunk: bytes) -> None:
        # in slices: the string regex keeps a little state per escape it passes, bounded by the slice
        for at in range(0, len(chunk), SLICE):
            self._feed(chunk[at:at + SLICE])

    def _feed(self, chunk: bytes) -> None:
        data = self.carry + chunk if self.carry else chunk
        self.carry = b""
        pos, end = 0, len(data)
        while pos < end:
            if self.in_string:
                stop = _STRING.match(data, pos).end()
                if self.name is not None and len(self.name) < MAX_NAME_BYTES:
                    self.name += data[pos:stop]
                if stop == end:
                    return
                if data[stop] != QUOTE:         # a backslash at the chunk's end: its escape comes next
                    self.carry = data[stop:]
                    return
                self.in_string, pos = False, stop + 1
                if self.name is not None:
                    self._named(bytes(self.name))
                continue
            pos = _PLAIN.match(data, pos).end()
            if pos < end:
                self._token(data[pos])
                pos += 1

    def _token(self, c: int) -> None:
        if c == QUOTE:
            self.in_string = True
            self.name = bytearray() if self.expect_name else None
            self.expect_name = False
        elif c in OPENERS:
            self._count()
            self.stack.append(c)
            if len(self.stack) > self.max_depth:
                raise ApiError(400, f"the request body must be a JSON object nested at most {self.max_depth} "
                                    "levels deep", None, "invalid_json")
            self.expect_name = self._fields_here()
        elif c in CLOSERS:
            if self.stack:
                self.stack.pop()
            depth = len(self.stack)
            if depth <= 1:
                self.sub = None
            if depth == 0:
                self.top = None
            self.expect_name = False
        elif c == COMMA:
            depth = len(self.stack)
            if depth == 1:
                self.top = self.sub = None
            elif depth == 2 and self.top in self.nested:
                self.sub = None
            self._count()
            self.expect_name = bool(self.stack) and self._fields_here()
        elif c == COLON:
            self.expect_name = False

    def _named(self, raw: bytes) -> None:
        """A field name was read: refused if the route does not know it; its values are counted from here."""
        try:
            name = json.loads(b'"' + raw + b'"')
        except ValueError:
            if len(raw) < MAX_NAME_BYTES:
                raise ApiError(400, "the request body is not valid JSON (a field name cannot be read)", None,
                               "invalid_json") from None
            name = raw.decode("utf-8", "replace")      # cut in the middle of an escape: unknown all the same
        if len(self.stack) == 1:
            self.top, known = name, self.fields.known
        else:
            self.sub, known = name, self.nested[self.top]
        if name not in known:
            raise unknown_parameter(name)
        self.field_values = 0

    def _count(self) -> None:
        self.values += 1
        field = self._field()
        if self.values > self.max_values:
            raise ApiError(400, f"the request body holds more than {self.max_values} JSON values (the largest "
                                "request this API takes holds about 1 000)", field,
                           "too_many_values")
        if field is not None and field not in self.fields.whole:
            self.field_values += 1
            if self.field_values > FIELD_VALUES:
                raise invalid(field, f"holds more than {FIELD_VALUES} values; this field takes one value (or a "
                                     "few)", "too_many_values")


class JsonParser:
    """`json.loads` in a thread, at most PARSERS at once (the others wait in their threads): the scan has
    bounded what it builds, and the event loop keeps answering meanwhile."""

    def __init__(self, parse_int: Callable[[str], object]):
        self.parse_int, self.gate = parse_int, threading.BoundedSemaphore(PARSERS)

    def _loads(self, body: bytes | bytearray) -> object:
        with self.gate:
            return json.loads(body, parse_int=self.parse_int)

    async def __call__(self, body: bytes | bytearray) -> object:
        return await asyncio.to_thread(self._loads, body)
