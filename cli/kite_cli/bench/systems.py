"""The systems a benchmark compares, each a callable `(messages, max_tokens) -> Outcome`.

- KiteSystem: a KITE gateway over HTTP (streaming chat completions); reuse on or off per request
  (`"kite": {"reuse": false}`); every run gets its own `cache_salt`, so each run starts with a cold cache
  and runs do not feed each other.
- TransformersSystem: plain `model.generate` in this process on the same converted checkpoint the worker
  serves (no services, no reuse): KITE's overhead.
- LlamaCppSystem: llama-cpp-python on the same GGUF file, with its `LlamaRAMCache` prompt cache.
- Plain vLLM is compared by `kite bench vllm-peer` (vllm_peer.py, `make bench-vllm`), not in a workload
  run: each vLLM server takes one to three minutes to start and the two must not share the two cores;
  `vllm_skip_reason()` says so.

All systems decode greedily (temperature 0) from the same token ids: the chat template is applied once,
by the same tokenizer the fingerprinter uses.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from dataclasses import dataclass

import httpx


@dataclass
class Outcome:
    ttft: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    text: str
    error: str | None = None
    retries: int = 0  # 503 answers (overloaded) retried after their Retry-After


class KiteSystem:
    def __init__(self, url: str, reuse: bool, salt: str, timeout_s: float = 600.0, api_key: str | None = None,
                 max_retries: int = 30) -> None:
        self.url = url.rstrip("/")
        self.reuse = reuse
        self.salt = salt
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.max_retries = max_retries
        self.model = served_model(self.url, self.headers)
        # One client for every request, as a real client keeps one: building an httpx.Client costs about
        # 20 ms (its TLS context), which a per-request client would add to every measured TTFT.
        self._http = httpx.Client(timeout=timeout_s)

    def __call__(self, messages: list[dict], max_tokens: int) -> Outcome:
        """One request; a 503 (KITE's admission control: overloaded) is retried after its Retry-After, as a
        well-behaved client would, and the times count from the first attempt."""
        started = time.perf_counter()
        retries = 0
        while True:
            out, retry_after = self._attempt(messages, max_tokens, started)
            if retry_after is None or retries >= self.max_retries or \
                    time.perf_counter() - started + retry_after > self.timeout_s:
                out.retries = retries
                return out
            retries += 1
            time.sleep(retry_after)

    def _attempt(self, messages: list[dict], max_tokens: int, started: float) -> tuple[Outcome, float | None]:
        meta: dict = {}
        out = self._send(messages, max_tokens, started, meta)
        if out.error and out.error.startswith("HTTP 503"):
            return out, meta.get("retry_after", 1.0)
        return out, None

    def _send(self, messages: list[dict], max_tokens: int, started: float, meta: dict) -> Outcome:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "kite": {"reuse": self.reuse},
                "cache_salt": self.salt}
        ttft = None
        parts: list[str] = []
        usage = None
        try:
            with self._http.stream("POST", self.url + "/v1/chat/completions", json=body,
                                   headers=self.headers) as response:
                if response.status_code != 200:
                    response.read()
                    try:
                        meta["retry_after"] = max(0.1, float(response.headers.get("Retry-After", "1")))
                    except ValueError:
                        meta["retry_after"] = 1.0
                    return Outcome(None, 0, 0, 0, "", f"HTTP {response.status_code}: {response.text[:200]}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        return Outcome(ttft, 0, 0, 0, "".join(parts), f"stream error: {event['error']}")
                    for choice in event.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if ttft is None:
                                ttft = time.perf_counter() - started
                            parts.append(content)
                    if event.get("usage"):
                        usage = event["usage"]
        except (httpx.HTTPError, ValueError) as exc:
            return Outcome(ttft, 0, 0, 0, "".join(parts), f"{type(exc).__name__}: {exc}")
        if usage is None:
            return Outcome(ttft, 0, 0, 0, "".join(parts), "no usage in the stream")
        details = usage.get("prompt_tokens_details") or {}
        return Outcome(ttft, usage["prompt_tokens"], usage["completion_tokens"],
                       int(details.get("cached_tokens") or 0), "".join(parts))


def served_model(url: str, headers: dict | None = None) -> str:
    req = urllib.request.Request(url.rstrip("/") + "/v1/models", headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["data"][0]["id"]


def chat_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt token ids exactly as the fingerprinter builds them."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def load_reference_tokenizer():
    """The tokenizer of the converted checkpoint the worker serves (converts the GGUF on first use)."""
    from kite_shared.config import ModelConfig, load
    from kite_shared.model_store import load_tokenizer, prepare

    return load_tokenizer(prepare(load(ModelConfig)))


class TransformersSystem:
    """`model.generate` (greedy) in this process; the first streamed token gives the TTFT."""

    def __init__(self) -> None:
        import torch
        from kite_shared.config import ModelConfig, load
        from kite_shared.model_store import load_causal_lm, load_tokenizer, prepare

        cfg = load(ModelConfig)
        local = prepare(cfg)
        self.torch = torch
        self.tokenizer = load_tokenizer(local)
        self.model = load_causal_lm(local, cfg)
        self.eos = self.model.generation_config.eos_token_id

    def __call__(self, messages: list[dict], max_tokens: int) -> Outcome:
        from transformers.generation.streamers import BaseStreamer

        ids = chat_token_ids(self.tokenizer, messages)
        started = time.perf_counter()
        first: list[float] = []

        class _FirstToken(BaseStreamer):
            calls = 0

            def put(self, value) -> None:
                self.calls += 1
                if self.calls == 2:  # the first call carries the prompt
                    first.append(time.perf_counter() - started)

            def end(self) -> None:
                pass

        inputs = self.torch.tensor([ids], dtype=self.torch.long)
        with self.torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=self.torch.ones_like(inputs), max_new_tokens=max_tokens,
                                      do_sample=False, streamer=_FirstToken(), pad_token_id=self.eos if isinstance(
                                          self.eos, int) else (self.eos or [0])[0])
        new = out[0, len(ids):].tolist()
        eos = {self.eos} if isinstance(self.eos, int) else set(self.eos or [])
        while new and new[-1] in eos:
            new.pop()
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Outcome(first[0] if first else None, len(ids), len(new), 0, text)


def llamacpp_unavailable_reason() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except Exception as exc:  # ImportError, or a shared library that failed to load
        return (f"llama-cpp-python is not installed or does not load ({type(exc).__name__}: {exc}); "
                "install the optional extra: pip install -e '.[bench-llamacpp]' (compiles llama.cpp)")
    return None


class LlamaCppSystem:
    """llama-cpp-python on the GGUF the KITE model is converted from, with a LlamaRAMCache prompt cache.

    Drives `Llama.generate` with the prompt cache handled as `create_completion` does (restore the longest
    cached prefix when it beats what the context already holds; save the state after the answer), so that
    generation stops on the same end-of-turn token ids as the other systems (the GGUF's own EOS is not
    SmolLM2's `<|im_end|>`) and the reused prefix is known exactly: `cached_tokens` is the prompt prefix
    llama.cpp does not evaluate again (at most len(prompt) - 1: the last prompt token is always evaluated).
    """

    def __init__(self, tokenizer, n_ctx: int = 4096, cache_bytes: int = 2 << 30) -> None:
        from llama_cpp import Llama, LlamaRAMCache

        from kite_shared.model_store import default_gguf_path

        self.gguf = default_gguf_path()
        self.tokenizer = tokenizer
        self.llm = Llama(model_path=str(self.gguf), n_ctx=n_ctx, n_threads=os.cpu_count() or 1,
                         n_batch=512, seed=0, verbose=False)
        self.cache = LlamaRAMCache(capacity_bytes=cache_bytes)
        self.stop_ids = {int(t) for t in (tokenizer.convert_tokens_to_ids(["<|im_end|>"])
                                           + [tokenizer.eos_token_id, self.llm.token_eos()])
                         if t is not None and t >= 0}
        self.version = __import__("llama_cpp").__version__

    def reset(self) -> None:
        """Forget every cached prompt (a new RAM cache, an empty context): each workload starts cold."""
        from llama_cpp import LlamaRAMCache

        self.cache = LlamaRAMCache(capacity_bytes=self.cache.capacity_bytes)
        self.llm.reset()

    def __call__(self, messages: list[dict], max_tokens: int) -> Outcome:
        from llama_cpp import Llama

        ids = chat_token_ids(self.tokenizer, messages)
        started = time.perf_counter()
        ttft = None
        out: list[int] = []
        try:
            try:
                item = self.cache[ids]  # longest cached prefix; KeyError when none
                if Llama.longest_token_prefix(item.input_ids.tolist(), ids) > \
                        Llama.longest_token_prefix(self.llm._input_ids.tolist(), ids):
                    self.llm.load_state(item)
            except KeyError:
                pass
            reused = max(0, min(Llama.longest_token_prefix(self.llm._input_ids.tolist(), ids), len(ids) - 1))
            for token in self.llm.generate(ids, temp=0.0, top_k=1, reset=True):
                if ttft is None:
                    ttft = time.perf_counter() - started
                if token in self.stop_ids:
                    break
                out.append(token)
                if len(out) >= max_tokens:
                    break
            self.cache[ids + out] = self.llm.save_state()
        except Exception as exc:
            return Outcome(ttft, len(ids), len(out), 0, "", f"{type(exc).__name__}: {exc}")
        return Outcome(ttft, len(ids), len(out), reused, self.tokenizer.decode(out, skip_special_tokens=True))


def vllm_skip_reason() -> str:
    return ("skipped here: plain vLLM against KITE-on-vLLM with the same engine flags is "
            "`kite bench vllm-peer` (make bench-vllm), which runs the two servers one after the other")


_METRIC_LINE = re.compile(r'^kite_tier_(\w+?)_total(?:\{([^}]*)\})?\s+(\S+)$')


def parse_tier_metrics(text: str) -> dict[str, float]:
    """Prometheus `kite_tier_<name>_total{labels} value` counter lines -> {"<name>/<label values>": value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line.strip())
        if not m:
            continue
        labels = dict(kv.split("=", 1) for kv in (m.group(2) or "").split(",") if "=" in kv)
        label = ",".join(v.strip('"') for _, v in sorted(labels.items()))
        key = f"{m.group(1)}/{label}" if label else m.group(1)
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def scrape_tier_metrics(url: str | None) -> dict[str, float] | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return parse_tier_metrics(r.read().decode())
    except OSError:
        return None
