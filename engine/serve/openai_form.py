"""The edit route's multipart form, read as it arrives: its text fields (strict UTF-8) and its reference
images (kept in memory within the upload limit), each part checked when it ends.

Why not Starlette's form parser: it hands a text part it cannot decode as UTF-8 over as Latin-1 (the
field then holds other text than the client sent, where the JSON routes refuse it), and a file sent
where a text field belongs only shows as its file name (a file named "a green star on black" became the
prompt; issue 44, item 5). Here a file part is a `FilePart`, which `parse_edit` refuses by its field
name, and text that is not UTF-8 is refused naming its field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from engine.runtime.request import MAX_IMAGES, MAX_PROMPT_CHARS, MAX_SYSTEM_PROMPT_CHARS
from engine.serve.openai_body import MAX_FORM_PARTS, UTF8_CHAR
from engine.serve.openai_errors import ApiError, invalid

IMAGE_FIELDS = ("image", "image[]")
MAX_TEXT_PART = max(MAX_PROMPT_CHARS, MAX_SYSTEM_PROMPT_CHARS) * UTF8_CHAR + 1024   # the longest text field
MAX_HEADER_BYTES = 4096     # a part's headers together


@dataclass(frozen=True)
class FilePart:
    """A file sent in a field that takes text (or one this server does not take): only its name is kept."""
    filename: str


@dataclass
class Form:
    fields: dict[str, str | FilePart] = field(default_factory=dict)
    images: list[bytes] = field(default_factory=list)
    image_count: int = 0                 # image files sent (those past MAX_IMAGES are counted, not kept)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")


class FormReader:
    """Feed it the body's chunks (`feed`), then `finish()` gives the form. Refusals are ApiErrors naming the
    field; an image over `max_image_bytes` is refused as soon as it passes that size."""

    def __init__(self, content_type: str, max_image_bytes: int):
        _, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if not boundary:
            raise ApiError(400, "the multipart body cannot be read: its Content-Type has no boundary", "image",
                           "invalid_multipart")
        self.max_image_bytes = max_image_bytes
        self.form = Form()
        self.parts = 0
        self._header, self._value = bytearray(), bytearray()
        self._headers: dict[bytes, bytes] = {}
        self._name: str | None = None
        self._filename: str | None = None
        self._data = bytearray()
        self._keep = False                    # whether this part's bytes are kept (text, or an image to keep)
        self.parser = MultipartParser(boundary, {
            "on_part_begin": self._begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_done, "on_part_data": self._part_data,
            "on_part_end": self._end})

    def feed(self, chunk: bytes) -> None:
        try:
            self.parser.write(chunk)
        except FormParserError as e:
            raise ApiError(400, f"the multipart body cannot be read ({e})", "image", "invalid_multipart") from None

    def finish(self) -> Form:
        try:
            self.parser.finalize()
        except FormParserError as e:
            raise ApiError(400, f"the multipart body cannot be read ({e})", "image", "invalid_multipart") from None
        if self._name is not None:
            raise ApiError(400, "the multipart body cannot be read: it ends inside a part", "image",
                           "invalid_multipart")
        if self.form.image_count > MAX_IMAGES:
            raise invalid("image", f"at most {MAX_IMAGES} reference images are taken (got {self.form.image_count})")
        return self.form

    # ---------------------------------------------------------------- the parser's callbacks
    def _begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_FORM_PARTS:
            raise ApiError(400, f"the form has more than {MAX_FORM_PARTS} parts", None, "invalid_multipart")
        self._headers, self._data = {}, bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]
        self._check_header_size()

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]
        self._check_header_size()

    def _check_header_size(self) -> None:
        if len(self._header) + len(self._value) + sum(map(len, self._headers.values())) > MAX_HEADER_BYTES:
            raise ApiError(400, f"a part's headers exceed {MAX_HEADER_BYTES} bytes", None, "invalid_multipart")

    def _header_end(self) -> None:
        self._headers[bytes(self._header).lower()] = bytes(self._value)
        self._header, self._value = bytearray(), bytearray()

    def _headers_done(self) -> None:
        kind, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if kind != b"form-data" or b"name" not in options:
            raise ApiError(400, "the multipart body cannot be read: a part has no form-data name", None,
                           "invalid_multipart")
        self._name = _text(options[b"name"])
        self._filename = _text(options[b"filename"]) if b"filename" in options else None
        if self._name in IMAGE_FIELDS:
            if self._filename is None:
                raise invalid("image", "send the reference images as files (this server fetches no URLs)")
            self.form.image_count += 1
            self._keep = self.form.image_count <= MAX_IMAGES
        else:
            self._keep = self._filename is None

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if not self._keep:
            return
        self._data += data[start:end]
        if self._filename is not None and len(self._data) > self.max_image_bytes:
            raise ApiError(413, f"reference image {self.form.image_count} is larger than {self.max_image_bytes} "
                                "bytes (the limit per image)", "image", "file_too_large")
        if self._filename is None and len(self._data) > MAX_TEXT_PART:
            raise invalid(self._name, f"the field is longer than {MAX_TEXT_PART} bytes")

    def _end(self) -> None:
        name, self._name = self._name, None
        if name in IMAGE_FIELDS:
            if self._keep:
                self.form.images.append(bytes(self._data))
        elif self._filename is not None:
            self.form.fields[name] = FilePart(self._filename)
        else:
            try:
                self.form.fields[name] = self._data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise invalid(name, f"is not valid UTF-8 text (byte {e.start}); send text fields as UTF-8") from None
        self._data = bytearray()
