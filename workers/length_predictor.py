"""Output-length prediction from the prompt alone, before it runs.

The queue orders requests before any of them is computed, so the prediction cannot wait
for a hidden state: it reads only the prompt's token ids. The model is a ridge
regression of log(1 + output tokens) on the mean input embedding of the whole prompt,
the mean of its last `TAIL` tokens (where a chat template puts the user's request) and
log(1 + prompt tokens), trained offline on the served model's own outputs
(`inflight train-length-predictor`, `bench/length_training.py`).

Since the model is linear in mean embeddings, it is folded into one score per
vocabulary token for each mean (`embeddings @ weights`), so a prediction is two table
lookups over the prompt's ids and a sum: no tensor, nothing the scheduler would wait on.

A trained file goes into the model cache; the bundled SmolLM2's ships in
`workers/length_predictors/`. A model with neither gets no predictor, and the scheduler
falls back to first come, first served.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.config import ModelConfig, SchedulerConfig

TAIL = 32
# Predictions are read on a log scale up to this length: the head start a prediction buys
# (`head_start_s`) falls from the whole bound at one token to none here and beyond.
LONGEST_PREDICTION = 2048
FILE_SUFFIX = ".length-predictor.npz"
SHIPPED = Path(__file__).parent / "length_predictors"


@dataclass(frozen=True)
class LengthRegression:
    """What a predictor file holds: the regression's weights over the model's hidden size."""

    whole: np.ndarray  # [hidden] on the whole prompt's mean embedding
    tail: np.ndarray  # [hidden] on the last TAIL tokens' mean embedding
    length_weight: float  # on log(1 + prompt tokens)
    bias: float

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as file:
            np.savez(file, whole=self.whole, tail=self.tail, length_weight=self.length_weight, bias=self.bias)

    @classmethod
    def load(cls, path: Path) -> LengthRegression:
        with np.load(path) as data:
            return cls(data["whole"], data["tail"], float(data["length_weight"]), float(data["bias"]))

    def fold(self, embeddings: np.ndarray) -> LengthPredictor:
        """The predictor for a model with these input `embeddings` [vocab, hidden]."""
        if embeddings.shape[1] != self.whole.shape[0]:
            raise ValueError(f"a predictor for hidden size {self.whole.shape[0]}, the model has {embeddings.shape[1]}")
        whole = (embeddings @ self.whole).astype(np.float32)
        return LengthPredictor(whole, (embeddings @ self.tail).astype(np.float32), self.length_weight, self.bias)


@dataclass(frozen=True)
class LengthPredictor:
    token_scores: np.ndarray  # [vocab] float32: each token's weight in the whole prompt's mean
    tail_scores: np.ndarray  # [vocab] float32: the same for the last TAIL tokens' mean
    length_weight: float
    bias: float

    def predict(self, prompt_token_ids: list[int]) -> float:
        """The expected number of output tokens (at least 1)."""
        if not prompt_token_ids:
            return 1.0
        ids = np.asarray(prompt_token_ids, dtype=np.int64)
        log_len = (
            self.bias
            + float(self.token_scores[ids].mean())
            + float(self.tail_scores[ids[-TAIL:]].mean())
            + self.length_weight * math.log1p(len(ids))
        )
        return max(1.0, math.expm1(min(log_len, 20.0)))


class OracleLengths:
    """True output lengths, measured in an earlier run, by prompt: the `oracle` policy,
    for benchmarks. The file is JSON: {"lengths": {prompt_key(ids): tokens}}."""

    def __init__(self, lengths: dict[str, int]) -> None:
        self.lengths = lengths

    @classmethod
    def load(cls, path: Path) -> OracleLengths:
        return cls(json.loads(Path(path).read_text())["lengths"])

    def predict(self, prompt_token_ids: list[int]) -> float:
        """The measured length; a prompt it never saw counts as the longest."""
        return float(self.lengths.get(prompt_key(prompt_token_ids), LONGEST_PREDICTION))


def prompt_key(prompt_token_ids: list[int]) -> str:
    return hashlib.blake2b(np.asarray(prompt_token_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def head_start_s(predicted_len: float, bound_s: float) -> float:
    """The seconds of waiting a request predicted to produce `predicted_len` tokens is
    credited with in the queue's order: `bound_s` at one token, none from LONGEST_PREDICTION."""
    return bound_s * max(0.0, 1.0 - math.log(max(predicted_len, 1.0)) / math.log(LONGEST_PREDICTION))


def prompt_features(embeddings: np.ndarray, prompt_token_ids: list[int]) -> np.ndarray:
    """The regression's inputs for one prompt: [mean embedding, tail mean embedding, log1p(length)]."""
    ids = np.asarray(prompt_token_ids, dtype=np.int64)
    rows = embeddings[ids]
    return np.concatenate([rows.mean(0), rows[-TAIL:].mean(0), [math.log1p(len(ids))]])


def fit(features: np.ndarray, output_lens: np.ndarray, ridge: float) -> LengthRegression:
    """Ridge regression of log1p(output_lens) on `features` (rows of `prompt_features`)."""
    target = np.log1p(np.asarray(output_lens, dtype=np.float64))
    mean, scale = features.mean(0), features.std(0) + 1e-6
    x = (features - mean) / scale
    gram = x.T @ x + ridge * len(x) * np.eye(x.shape[1])
    weights = np.linalg.solve(gram, x.T @ (target - target.mean())) / scale
    hidden = (features.shape[1] - 1) // 2
    bias = float(target.mean() - mean @ weights)
    return LengthRegression(weights[:hidden], weights[hidden : 2 * hidden], float(weights[-1]), bias)


def model_name(config: ModelConfig) -> str | None:
    """The name a model's predictor file goes by: its GGUF's or folder's name (None for
    random weights, which have nothing to predict)."""
    from workers.model_loader import gguf_source  # transformers: not for the scheduler's import

    if config.source.startswith("random:"):
        return None
    gguf = gguf_source(config.source)
    return gguf.stem if gguf is not None else Path(config.source.rstrip("/")).name


def model_predictor_path(config: ModelConfig) -> Path:
    """Where `inflight train-length-predictor` writes the model's predictor: the model cache."""
    name = model_name(config)
    if name is None:
        raise ValueError("a model of random weights has no length predictor")
    return config.cache_dir / f"{name}{FILE_SUFFIX}"


def load_predictor(config: ModelConfig, embeddings: np.ndarray) -> LengthPredictor | None:
    """The model's predictor: the one trained into the model cache, else the one shipped
    in `workers/length_predictors/`, else None."""
    name = model_name(config)
    if name is None:
        return None
    for path in (config.cache_dir / f"{name}{FILE_SUFFIX}", SHIPPED / f"{name}{FILE_SUFFIX}"):
        if path.is_file():
            return LengthRegression.load(path).fold(embeddings)
    return None


def policy_predictor(
    scheduler: SchedulerConfig, model: ModelConfig, embeddings: Callable[[], np.ndarray]
) -> LengthPredictor | OracleLengths | None:
    """What orders the queue under `scheduler.length_policy` (None: first come, first
    served); `embeddings` gives the model's input embeddings [vocab, hidden] as float32."""
    oracle = scheduler.length_oracle  # given with the oracle policy (SchedulerConfig checks)
    if scheduler.length_policy == "oracle" and oracle is not None:
        return OracleLengths.load(oracle)
    if scheduler.length_policy == "predicted" and model_name(model) is not None:
        return load_predictor(model, embeddings())
    return None


def kendall_tau(predicted, actual) -> float:
    """Kendall's τ-b between two rankings (ties count as neither concordant nor discordant)."""
    a, b = np.asarray(predicted, dtype=np.float64), np.asarray(actual, dtype=np.float64)
    da, db = np.sign(a[:, None] - a[None, :]), np.sign(b[:, None] - b[None, :])
    upper = np.triu_indices(len(a), 1)
    da, db = da[upper], db[upper]
    denominator = math.sqrt(np.count_nonzero(da) * np.count_nonzero(db))
    return float((da * db).sum() / denominator) if denominator else 0.0
