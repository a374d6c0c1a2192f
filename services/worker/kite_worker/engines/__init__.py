"""The worker's engines behind one contract (base.py), and the factory that builds the one KITE_ENGINE names.

    base.py        the contract: Engine, EngineHooks, EngineLoad, RequestRejected
    admission.py   the checks every request passes in either engine
    vllm/          KITE_ENGINE=vllm: vLLM's v1 engine and KITE's KV connector
    reference/     KITE_ENGINE=transformers: the reference engine

As vLLM's KVConnectorFactory does, the registry names each engine's module and class, and only the chosen
engine's module is imported (the reference engine's worker never imports vLLM's front end, nor the
other way round).
"""

from __future__ import annotations

import importlib

from kite_shared.adapters import Adapter
from kite_shared.config import ModelConfig, WorkerConfig
from kite_shared.model_store import LocalModel, ModelIdentity
from kite_worker.engines.base import Engine
from kite_worker.shadow import ShadowVerifier

# KITE_ENGINE -> (module, class implementing base.Engine)
ENGINES = {
    "vllm": ("kite_worker.engines.vllm.engine", "VllmEngine"),
    "transformers": ("kite_worker.engines.reference.engine", "ReferenceEngine"),
}


def create_engine(local: LocalModel, identity: ModelIdentity, adapters: dict[str, Adapter],
                  model_cfg: ModelConfig, worker_cfg: WorkerConfig, instance_id: str) -> Engine:
    """The engine KITE_ENGINE names, its model loaded (vLLM: its processes started)."""
    module, name = ENGINES[model_cfg.engine]
    engine_class = getattr(importlib.import_module(module), name)
    shadow = None
    if worker_cfg.shadow_fraction > 0 and worker_cfg.reuse:  # without reuse there is no hit to check
        shadow = ShadowVerifier.for_storage_dtype(worker_cfg.shadow_fraction, identity.execution.kv_storage_dtype,
                                                  worker_cfg.shadow_kl_tolerance)
    return engine_class.create(local, identity, adapters, model_cfg, worker_cfg, instance_id, shadow)
