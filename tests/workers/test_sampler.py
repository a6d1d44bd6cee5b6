import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.api import SamplingParams
from workers.sampler import Sampler, make_generator

VOCAB = 1000
GREEDY = SamplingParams()


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def sample(logits, params, generators=None, sampler=None):
    sampler = sampler or Sampler(seed=0)
    return sampler.sample(logits, params, generators or [None] * len(params))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = random_logits(8).to(dtype)
    assert sample(logits, [GREEDY] * 8) == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_takes_the_first_of_tied_maxima_and_a_nan_as_argmax_does(dtype):
    logits = torch.randint(0, 3, (64, 4096), generator=torch.Generator().manual_seed(1)).to(dtype)  # ties everywhere
    logits[5, 17] = float("nan")
    logits[9, 4000] = float("inf")
    assert sample(logits, [GREEDY] * 64) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.1, 1.0, 5.0, 100.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = random_logits(16)
    params = [SamplingParams(temperature=temperature, top_k=1)] * 16
    assert sample(logits, params) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 50.0])
def test_tiny_top_p_is_greedy(temperature):
    logits = random_logits(16)
    params = [SamplingParams(temperature=temperature, top_p=1e-6)] * 16
    assert sample(logits, params) == logits.argmax(dim=-1).tolist()


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_top_k_never_picks_outside_the_top_k(data):
    vocab = data.draw(st.integers(2, 64), label="vocab")
    rows = data.draw(st.integers(1, 4), label="rows")
    values = st.lists(st.floats(-20, 20, width=32), min_size=vocab, max_size=vocab)
    logits = torch.tensor(data.draw(st.lists(values, min_size=rows, max_size=rows), label="logits"))
    params = [
        SamplingParams(
            temperature=data.draw(st.floats(0.05, 20.0)),
            top_k=data.draw(st.integers(1, 70)),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.5])),
            seed=data.draw(st.none() | st.integers(0, 2**32)),
        )
        for _ in range(rows)
    ]
    generators = [make_generator(p.seed) for p in params]
    sampler = Sampler(seed=0)
    for _ in range(5):
        for row, token, p in zip(logits, sampler.sample(logits, params, generators), params):
            # Ties at the k-th value may go either way, so compare values rather than positions.
            assert row[token] >= row.topk(min(p.top_k, vocab)).values[-1]


@settings(max_examples=40, deadline=None)
@given(
    logits=st.lists(st.floats(-10, 10, width=32), min_size=2, max_size=64),
    top_p=st.floats(0.01, 0.99),
    seed=st.integers(0, 2**32),
)
def test_top_p_picks_inside_the_nucleus(logits, top_p, seed):
    row = torch.tensor(logits)
    probs = row.softmax(dim=-1)
    ranked = probs.sort(descending=True).values
    # The nucleus ends at the first token where the mass reaches top_p; allow float slack.
    last = int((ranked.cumsum(dim=-1) < top_p + 1e-5).sum())
    threshold = ranked[min(last, len(logits) - 1)] - 1e-6
    token = sample(row[None], [SamplingParams(temperature=1.0, top_p=top_p)], [make_generator(seed)])[0]
    assert probs[token] >= threshold


def test_high_temperature_spreads_and_low_temperature_concentrates():
    logits = random_logits(1, vocab=50)
    best = int(logits.argmax())
    sampler = Sampler(seed=1)
    draws = 2000
    hot = [sample(logits, [SamplingParams(temperature=1e4)], sampler=sampler)[0] for _ in range(draws)]
    cold = [sample(logits, [SamplingParams(temperature=0.05)], sampler=sampler)[0] for _ in range(draws)]
    assert len(set(hot)) == 50  # near uniform: every token shows up
    assert max(hot.count(t) for t in set(hot)) < draws / 10
    assert cold.count(best) > 0.95 * draws


def test_temperature_one_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    sampler = Sampler(seed=2)
    draws = 4000
    tokens = torch.tensor([sample(logits, [SamplingParams(temperature=1.0)], sampler=sampler)[0] for _ in range(draws)])
    observed = torch.bincount(tokens, minlength=4) / draws
    assert torch.allclose(observed, logits.softmax(dim=-1)[0], atol=0.03)


def test_top_k_and_top_p_together_keep_the_renormalized_nucleus():
    # Probabilities ~ [0.64, 0.24, 0.09, 0.03]; top-k 3 renormalizes to [0.66, 0.24, 0.09],
    # then top-p 0.8 keeps the first two.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    params = [SamplingParams(temperature=1.0, top_k=3, top_p=0.8)]
    sampler = Sampler(seed=3)
    seen = {sample(logits, params, sampler=sampler)[0] for _ in range(500)}
    assert seen == {0, 1}


def nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """Reference top-p set by a full sort: tokens up to the first where the mass reaches top_p."""
    probs, ids = row.softmax(dim=-1).sort(descending=True)
    size = int((probs.cumsum(dim=-1) < top_p).sum()) + 1
    return set(ids[:size].tolist())


@pytest.mark.parametrize("temperature", [0.7, 3.0, 30.0])  # narrow to wider than the candidates
def test_top_p_draws_stay_in_the_nucleus(temperature):
    logits = random_logits(4)
    params = [SamplingParams(temperature=temperature, top_p=p) for p in (0.5, 0.8, 0.9, 0.95)]
    allowed = [nucleus(row / temperature, p.top_p) for row, p in zip(logits, params)]
    copies = 50  # each row many times per batch: many draws in few calls
    seen = [set() for _ in params]
    sampler = Sampler(seed=4)
    for _ in range(8):
        tokens = sample(
            logits.repeat_interleave(copies, dim=0), [p for p in params for _ in range(copies)], sampler=sampler
        )
        for row in range(len(params)):
            seen[row].update(tokens[row * copies : (row + 1) * copies])
    for row in range(len(params)):
        # Float slack may move the boundary token only.
        assert len(seen[row] - allowed[row]) <= 1
        assert len(seen[row]) > min(len(allowed[row]), 400) // 3
    if temperature == 30.0:
        assert max(len(s) for s in seen) > 256  # the wide nucleus was sampled beyond the candidates


SEEDED_MIX = [
    SamplingParams(temperature=0.8, seed=7),
    SamplingParams(temperature=1.0, top_k=20, seed=7),
    SamplingParams(temperature=1.3, top_p=0.9, seed=7),
    SamplingParams(temperature=8.0, top_p=0.9, seed=7),  # a nucleus wider than the ranked candidates
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7),
]


@pytest.mark.parametrize("params", SEEDED_MIX)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_seeded_tokens_do_not_depend_on_the_batch(params, dtype):
    steps = 30
    # The request's logits each step; bf16 adds plenty of exact ties.
    own = [random_logits(1, seed=100 + s).to(dtype) for s in range(steps)]

    def run(position: int, neighbours: list[SamplingParams]) -> list[int]:
        sampler = Sampler()  # unseeded rows draw from an unpredictable generator
        generator = make_generator(params.seed)
        others = [make_generator(p.seed) for p in neighbours]
        batch_size = len(neighbours) + 1
        tokens = []
        for step in range(steps):
            logits = random_logits(batch_size, seed=step + 1000 * batch_size).to(dtype)
            logits[position] = own[step][0]
            row_params = list(neighbours)
            row_params.insert(position, params)
            row_generators = list(others)
            row_generators.insert(position, generator)
            tokens.append(sampler.sample(logits, row_params, row_generators)[position])
        return tokens

    alone = run(0, [])
    same_rule = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    assert run(2, [same_rule] * 3) == alone  # the rest of its rule is unseeded
    assert run(len(SEEDED_MIX), [GREEDY, *SEEDED_MIX]) == alone  # the same seed elsewhere in the batch
    assert run(0, [SamplingParams(temperature=2.0, top_k=5), GREEDY]) == alone
    assert len(set(alone)) > 1  # it did sample


def test_different_seeds_differ_and_same_seed_repeats():
    logits = random_logits(1)
    params = SamplingParams(temperature=1.0)

    def draws(seed):
        generator = make_generator(seed)
        return [sample(logits, [params], [generator])[0] for _ in range(20)]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_make_generator_without_seed_is_none():
    assert make_generator(None) is None
    assert isinstance(make_generator(2**63 - 1), torch.Generator)


def test_mixed_batch_of_greedy_and_sampled_rows():
    logits = random_logits(6)
    params = [
        GREEDY,
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_k=5),
        GREEDY,
        SamplingParams(temperature=1.0, top_p=0.5, seed=3),
        SamplingParams(temperature=2.0),
    ]
    generators = [make_generator(p.seed) for p in params]
    argmax = logits.argmax(dim=-1).tolist()
    top5 = logits.topk(5).indices.tolist()
    sampler = Sampler(seed=0)
    for _ in range(50):
        tokens = sampler.sample(logits, params, generators)
        assert len(tokens) == 6 and all(isinstance(t, int) for t in tokens)
        assert tokens[0] == argmax[0] and tokens[3] == argmax[3] and tokens[1] == argmax[1]
        assert tokens[2] in top5[2]
        assert 0 <= tokens[5] < VOCAB


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError):
        sample(random_logits(2), [GREEDY])
