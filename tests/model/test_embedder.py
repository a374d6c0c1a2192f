"""The semantic cache's embedder loads its packaged model offline and embeds as the cache expects."""

from __future__ import annotations

import numpy as np
import pytest

from kite_shared.embedder import DIMENSIONS, Embedder

pytestmark = pytest.mark.model


def test_embeddings_are_unit_vectors_that_rank_a_paraphrase_above_another_question(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded: the weights are in the package
    vectors = Embedder().embed(["What is the capital of France?", "Which city is the capital of France?",
                                "How do I bake sourdough bread?"])
    assert vectors.shape == (3, DIMENSIONS) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    paraphrase, unrelated = float(vectors[0] @ vectors[1]), float(vectors[0] @ vectors[2])
    assert paraphrase > 0.8 > 0.3 > unrelated
