"""Fingerprinter entrypoint: load the tokenizer, serve (kite_fingerprinter.service), drain on SIGTERM."""

from __future__ import annotations

from prometheus_client import start_http_server

from kite_shared import adapters, model_store
from kite_shared.config import FingerprinterConfig, ModelConfig, load
from kite_shared.service import ServiceRuntime, exit_on_signal_until_connected, run_service
from kite_fingerprinter.core import Fingerprinter
from kite_fingerprinter.service import FingerprinterService


def build_core(model_cfg: ModelConfig, cfg: FingerprinterConfig) -> Fingerprinter:
    local = model_store.prepare(model_cfg)
    identity = model_store.identity(local, model_cfg)
    return Fingerprinter(
        tokenizer=model_store.load_tokenizer(local), identity=identity,
        model_name=local.name, block_size=model_cfg.block_size, max_context_tokens=local.max_context_tokens,
        default_max_tokens=cfg.default_max_tokens,
        adapters=adapters.load_configured(model_cfg, local, identity))


def adapter_loader(model_cfg: ModelConfig):
    """`kite adapter load`'s check for this fingerprinter's base."""
    local = model_store.prepare(model_cfg)
    return adapters.loader(model_cfg, local, model_store.identity(local, model_cfg))


def main() -> None:
    exit_on_signal_until_connected("fingerprinter")  # loading the tokenizer may take a while
    cfg = load(FingerprinterConfig)
    model_cfg = load(ModelConfig)
    core = build_core(model_cfg, cfg)
    load_adapter = adapter_loader(model_cfg)
    if cfg.metrics_port:
        start_http_server(cfg.metrics_port, addr="0.0.0.0")

    async def setup(rt: ServiceRuntime) -> None:
        await FingerprinterService(rt, core, cfg, load_adapter).start()

    run_service("fingerprinter", setup)


if __name__ == "__main__":
    main()
