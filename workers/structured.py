"""Structured outputs: a request's constraint compiled to a grammar, each choice's grammar
state, and the token masks applied to the logits before sampling.

The grammar engine is llguidance (why, with the figures: docs/benchmarks.md, "llguidance against xgrammar").
A constraint (`json_schema`, `json_object`, `regex` or `choice`) compiles against the
tokenizer's vocabulary into a matcher; compiled matchers are cached by the constraint's
canonical text, and every choice of every request starts from a copy of the cached one.

The state of a choice is its matcher and the mask of the tokens it allows next. The
mask is computed as soon as the state changes: when the state is formed (at
`add_request`, on the caller's thread, after consuming any tokens a takeover resumes
from), and after each sampled token, for all the choices of a step in one call
(`advance`). A preempted request keeps its state, since it changes only when a token is
sampled. Masks are bitmasks (one bit per token, 32 to an int32).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.api import InvalidRequest, SamplingParams

if TYPE_CHECKING:
    import llguidance


class InvalidGrammar(InvalidRequest):
    """A constraint that cannot be compiled (bad schema or regex); that request's error only."""


@dataclass
class GrammarState:
    """One choice's place in its grammar."""

    matcher: llguidance.LLMatcher
    mask: torch.Tensor  # [words] int32: the tokens allowed next
    dead_end: bool = False  # nothing valid can follow: the choice must end
    complete: bool = False  # the grammar's end was sampled: the output is whole


# RFC 3339's full-date as a pattern, exactly the dates that exist: years 0001-9999 (as
# Python's `date` and so `jsonschema`'s format checker read them), each month's own
# days, and February 29 in leap years only. llguidance's own `date` format lets through
# year 0000 and February 29 of every year.
_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
FULL_DATE = f"^(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$"
# Schema keywords whose values are data, not schemas: left as they are.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


def grammar_source(params: SamplingParams) -> tuple[str, str] | None:
    """The constraint as (kind, text): the cache key, and what llguidance compiles."""
    if params.json_schema is not None:
        return "json", json.dumps(_exact_dates(params.json_schema), sort_keys=True, separators=(",", ":"))
    if params.json_object:
        return "json", '{"type":"object"}'
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        # Lark string literals take JSON's quoting, so any string is matched literally.
        return "lark", "start: " + " | ".join(json.dumps(c) for c in params.choice)
    return None


def _exact_dates(schema):
    """`schema` with each `"format": "date"` (and no pattern of its own) as `FULL_DATE`."""
    if isinstance(schema, list):
        return [_exact_dates(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    exact = {key: value if key in _DATA_KEYWORDS else _exact_dates(value) for key, value in schema.items()}
    if exact.get("format") == "date" and "pattern" not in exact:
        del exact["format"]
        exact["pattern"] = FULL_DATE
    return exact


class Grammars:
    """Compiles constraints (cached) and keeps grammar states' masks; `compile` and
    `start` may run on any thread, the rest on the stepping thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], cache_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._lock = threading.Lock()  # guards the cache; one compile at a time
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()  # or its error
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.num_compiled = 0  # compilations run (cache misses), for tests and the benchmark
        self.words = (vocab_size + 31) // 32

    def compile(self, params: SamplingParams) -> llguidance.LLMatcher:
        """The cached matcher of `params`' constraint, compiled on first use; raises
        `InvalidGrammar` (that too is cached)."""
        source = grammar_source(params)
        if source is None:
            raise ValueError("the request has no constraint to compile")
        kind, text = source
        with self._lock:
            compiled = self._cache.get((kind, text))
            if compiled is None:
                compiled = self._compile(kind, text)
                self.num_compiled += 1
                self._cache[(kind, text)] = compiled
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end((kind, text))
        if isinstance(compiled, str):
            raise InvalidGrammar(compiled)
        return compiled

    def start(self, params: SamplingParams, output_ids: Sequence[int] = ()) -> GrammarState:
        """A fresh state for one choice, past `output_ids` (tokens published before a
        takeover), with its first mask."""
        matcher = self.compile(params).deep_copy()
        state = GrammarState(matcher, torch.empty(self.words, dtype=torch.int32))
        if output_ids and not matcher.consume_tokens(list(output_ids)):
            state.dead_end = True  # the published tokens do not fit the grammar
            return state
        state.complete = bool(output_ids) and output_ids[-1] in self._eos_token_ids
        masks = torch.empty(1, self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(masks.data_ptr(), self.words * 4)  # not the stepping thread's executor
        self._check([state], masks)
        return state

    def advance(self, states: Sequence[GrammarState], token_ids: Sequence[int]) -> None:
        """Each state takes its sampled token; then the next masks, all in one pass."""
        going = []
        for state, token_id in zip(states, token_ids):
            if not state.matcher.consume_token(token_id):
                state.dead_end = True
            elif token_id in self._eos_token_ids:
                state.complete = True  # nothing follows the grammar's end
            else:
                going.append(state)
        if going:
            self._fill(going)

    @torch.inference_mode()  # the logits are an inference tensor
    def apply(self, logits: torch.Tensor, rows: Sequence[int], states: Sequence[GrammarState]) -> None:
        """Disallowed tokens of `logits[rows]` to -inf, in place (one pass for the batch)."""
        words = torch.stack([state.mask for state in states])
        vocab = logits.shape[-1]
        if logits.device.type == "cpu":  # numpy unpacks bits many times faster than torch ops on a CPU
            bits = np.unpackbits((~words).numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
            disallowed = torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bool)
        else:  # only the packed words cross to the device
            words = words.to(logits.device, non_blocking=True)
            shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
            disallowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(states), -1)[:, :vocab] == 0
        if len(rows) == logits.shape[0]:
            logits.masked_fill_(disallowed, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(disallowed, float("-inf"))

    # -- internals -----------------------------------------------------------------

    def _compile(self, kind: str, text: str) -> llguidance.LLMatcher | str:
        """A matcher, or the error message."""
        llguidance = _llguidance()
        tokenizer = self._llguidance_tokenizer()
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text)
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(text)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(text)
        except ValueError as error:
            return f"cannot compile the {_NAMES[kind]}: {error}"
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"cannot compile the {_NAMES[kind]}: {matcher.get_error().splitlines()[0]}"
        return matcher

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            backend = getattr(self._tokenizer, "backend_tokenizer", None)
            if backend is None:
                raise InvalidGrammar(
                    "this model's tokenizer cannot be used for structured output "
                    "(a fast Hugging Face tokenizer is needed)"
                )
            self._lltokenizer = _llguidance().LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_token_ids
            )
        return self._lltokenizer

    def _fill(self, states: list[GrammarState]) -> None:
        """Compute the masks of `states` in one call, on llguidance's thread pool."""
        masks = torch.empty(len(states), self.words, dtype=torch.int32)
        if self._executor is None:
            self._executor = _llguidance().LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(s.matcher, i) for i, s in enumerate(states)], masks.data_ptr(), self.words * 4, len(states)
        )
        self._check(states, masks)

    def _check(self, states: list[GrammarState], masks: torch.Tensor) -> None:
        """Keep each state's mask; mark those at a dead end: in error, or allowing the end
        while the grammar does not accept it (llguidance lets the end through there, so
        that generation stops)."""
        eos = self._eos_token_ids[0]
        ends = ((masks[:, eos >> 5] >> (eos & 31)) & 1).tolist()
        for state, mask, end_allowed in zip(states, masks, ends):
            state.mask = mask
            matcher = state.matcher
            if matcher.is_error() or (end_allowed and not matcher.is_accepting()):
                state.dead_end = True


_NAMES = {"json": "JSON schema", "regex": "regex", "lark": "choice"}


def _llguidance():
    """Imported at the first constraint: an engine that serves none (the GPU check's host,
    which lacks the package) runs without it."""
    import llguidance

    return llguidance
