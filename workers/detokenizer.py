"""Turn a request's generated tokens into text a client can show at once, cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import decoders

# Prompt tokens decoded ahead of the output: tokenizers such as SentencePiece drop the
# leading space of the first token they decode, so the first output token needs context.
_CONTEXT_TOKENS = 5
# What a decoder shows for bytes that do not (yet) form a whole UTF-8 character.
_REPLACEMENT = "\ufffd"
# Decoders whose text of a token sequence is its tokens' texts joined, wherever each
# token's text is whole characters (byte-level BPE joins bytes; Fuse joins pieces).
_JOINING_DECODERS = (decoders.ByteLevel, decoders.Fuse)


class IncrementalDetokenizer:
    """Decodes a short window of recent tokens per push (the "prefix offset / read offset" scheme).

    The window is `context + unread`: `context` are tokens whose text was already produced,
    decoded only so that `unread` decodes as it would inside the whole output. The text of
    `unread` is the window's text past the context's; it is held back while it ends in an
    incomplete character, and it becomes the next context once produced.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        token_texts: dict[int, str] | None = None,
    ) -> None:
        """`token_texts`, shared by every detokenizer of one tokenizer, caches the text of
        single tokens: after each release the context is one token, decoded alone."""
        self._tokenizer = tokenizer
        self._token_texts = {} if token_texts is None else token_texts
        # A fast tokenizer's Rust decoder, called directly: `tokenizer.decode` adds
        # several times its cost in Python argument handling, on the stepping thread.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # Then a token after released text is usually its own cached text: no decode at all.
        self._joins = isinstance(getattr(self._backend, "decoder", None), _JOINING_DECODERS)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(_REPLACEMENT):
            # A prompt ending mid-character would glue its bytes to the first output bytes.
            context, context_text = [], ""
        self._window = context
        self._num_context = len(context)
        self._context_text = context_text

        self._stop = tuple(stop)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._held = ""  # decoded text not yet released: it may be the start of a stop string
        self._released: list[str] = []  # a list, as appending to one long string copies it every time
        self.stopped = False  # a stop string appeared; the text ends just before it

    @property
    def text(self) -> str:
        """All text released so far."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text they made final (possibly empty)."""
        if self.stopped:
            return ""
        if self._joins and len(token_ids) == 1 and len(self._window) == self._num_context:
            text = self.token_text(token_ids[0])
            if text and _REPLACEMENT not in text:
                # What `_decode_unread` makes of it, read from the cache: the window's text
                # is the context's plus this token's, which then becomes the context.
                self._window, self._num_context, self._context_text = [token_ids[0]], 1, text
                return self._release(text, final=False)
        self._window.extend(token_ids)
        return self._release(self._decode_unread(final=False), final=False)

    def flush(self) -> str:
        """At the end of the request: release all text still held back, up to any stop string."""
        if self.stopped:
            return ""
        return self._release(self._decode_unread(final=True), final=True)

    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of spaces: it rewrites text across token boundaries, which no
        # incremental decoder can reproduce. Special tokens (EOS, chat markers) are not text.
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=True)
        return self._tokenizer.decode(token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _decode_unread(self, final: bool) -> str:
        """The text of the unread tokens, once it is complete; then slide the window over them."""
        window_text = self._decode(self._window)
        if not final and (len(window_text) <= len(self._context_text) or window_text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or the last character still misses bytes
        new_text = window_text[len(self._context_text) :]
        self._window = self._window[self._num_context :]
        self._num_context = len(self._window)
        self._context_text = self._decode_context(self._window)
        return new_text

    def _decode_context(self, token_ids: list[int]) -> str:
        return self.token_text(token_ids[0]) if len(token_ids) == 1 else self._decode(token_ids)

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (cached for every detokenizer of the tokenizer)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._decode([token_id])
        return text

    def _release(self, new_text: str, final: bool) -> str:
        if not self._stop:
            if new_text:
                self._released.append(new_text)
            return new_text
        pending = self._held + new_text
        stop_at = self._first_stop(pending)
        if stop_at is not None:
            self.stopped = True
            released, self._held = pending[:stop_at], ""
        else:
            keep = 0 if final else self._stop_prefix_length(pending)
            released, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        if released:
            self._released.append(released)
        return released

    def _first_stop(self, text: str) -> int | None:
        """Where the stop string that completes first in `text` starts; None if none does.

        Completing first (earliest end, then earliest start) is what a reader going through
        the text character by character would see, so the cut does not depend on how the
        text was split into tokens. Held text never holds a whole stop string, so every
        match involves the new text.
        """
        best: tuple[int, int] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of `text` that could still grow into a stop string."""
        for length in range(min(len(text), self._longest_stop - 1), 0, -1):
            tail = text[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0
