"""Request bookkeeping and parameter validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.api import InvalidRequest, SamplingParams
from workers.request import Request


@given(st.lists(st.integers(0, 9), min_size=1, max_size=20), st.lists(st.integers(0, 9), max_size=20), st.data())
def test_token_slice_reads_prompt_then_output(prompt, output, data):
    request = Request("r", prompt, SamplingParams(), 0.0, output_token_ids=list(output))
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    assert request.token_slice(start, end) == (prompt + output)[start:end]


def test_decoding_means_only_the_last_sampled_token_is_left_to_run():
    request = Request("r", [1, 2, 3], SamplingParams(), 0.0)
    assert not request.is_decoding  # prompt not yet run
    request.num_computed = 3
    request.output_token_ids.append(4)
    assert request.is_decoding
    request.num_computed = 0  # preempted: prompt and output are recomputed as a prefill
    assert not request.is_decoding


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=True),
        SamplingParams(max_tokens=2.5),
        SamplingParams(temperature=float("inf")),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=1.0),
        SamplingParams(seed=-1),
        SamplingParams(seed="7"),
        SamplingParams(stop=["a"] * 17),
        SamplingParams(stop="stop"),
        SamplingParams(stop_token_ids=(-1,)),
    ],
)
def test_invalid_sampling_params_are_refused_with_a_reason(params):
    with pytest.raises(InvalidRequest, match=r"\w+"):
        params.validate()


def test_valid_params_pass():
    SamplingParams(
        max_tokens=1, temperature=0.7, top_k=40, top_p=0.9, seed=3, stop=("\n",), stop_token_ids=(2,)
    ).validate()
