"""Fleet scenarios beyond one hot prompt (`kite bench fleet`, issue 38): multi-turn sessions, and a fresh
prefix arriving on every worker at once. Each runs once per system on prompts no system has seen, so what
a system reuses is what it kept of this scenario's own requests; the greedy answers are compared.

  multi-turn   `sessions` chats, each over its own ~1,000-token document, `turns` questions one after the
               other (the answers appended to the history, as a chat client does), `concurrency` chats at
               a time, each with a session id (KITE's `kite.session_id`; plain vLLM ignores it). A later
               turn's history is the previous turn's prompt and answer: reuse = cached tokens
               (usage.prompt_tokens_details) / (that prompt's tokens + the answer's tokens); block
               granularity and the chat template's tokens around the answer keep it a few points under 1.
  fresh prefix `requests` questions over one fresh ~1,800-token prefix, all sent at once. Computed tokens
               are the prompts' tokens less their cached ones; the ideal computes the shared prefix once:
               the prompts' tokens less (requests - 1) x the shared prefix, as a probe sent after them
               finds it cached (the most any of the systems' probes found: block-aligned).
"""

from __future__ import annotations

import statistics
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kite_cli.bench.vllm_peer import Client, Reply, document

SESSION_DOCUMENTS = 200  # document numbers of the chats' documents: none of the other scenarios' (0-99)
FRESH_DOCUMENT = 300
FRESH_SENTENCES = 33  # ~1,800 tokens


def turn_question(session: int, turn: int) -> str:
    return f"Question {turn} of chat {session}: which station of the document filed report {session}-{turn}?"


def run_session(client: Client, session: int, num_turns: int, tag: str) -> list[Reply]:
    messages = [{"role": "system", "content": document(SESSION_DOCUMENTS + session)}]
    replies = []
    for turn in range(num_turns):
        messages.append({"role": "user", "content": turn_question(session, turn)})
        reply = client.chat(messages, session_id=f"{tag}-{session}")
        messages.append({"role": "assistant", "content": reply.answer})
        replies.append(reply)
    return replies


def multi_turn(client: Client, num_sessions: int, num_turns: int, concurrency: int, tag: str) -> dict:
    with ThreadPoolExecutor(concurrency) as pool:
        chats = list(pool.map(lambda s: run_session(client, s, num_turns, tag), range(num_sessions)))
    reuse = [later.cached_tokens / (earlier.prompt_tokens + earlier.completion_tokens)
             for replies in chats for earlier, later in zip(replies, replies[1:]) if earlier.prompt_tokens]
    workers = [{r.worker for r in replies} - {""} for replies in chats]
    return {"sessions": num_sessions, "turns": num_turns,
            "history_reuse_mean": statistics.mean(reuse) if reuse else float("nan"),
            "history_reuse_min": min(reuse) if reuse else float("nan"),
            "first_turn_ttft_p50_s": statistics.median(replies[0].ttft_s for replies in chats),
            "later_turn_ttft_p50_s": statistics.median(r.ttft_s for replies in chats for r in replies[1:]),
            # a KITE chat that moved worker mid-session (none from plain vLLM, which names no worker)
            "sessions_on_several_workers": sum(len(w) > 1 for w in workers),
            "answers": [[r.answer for r in replies] for replies in chats]}


def fresh_prefix(client: Client, num_requests: int) -> dict:
    prefix = document(FRESH_DOCUMENT, FRESH_SENTENCES)
    questions = [f"Question {i}: in which year did station {300 * 31 + i} record its rentals?"
                 for i in range(num_requests)]
    with ThreadPoolExecutor(num_requests) as pool:
        replies = list(pool.map(lambda q: client.chat([{"role": "system", "content": prefix},
                                                       {"role": "user", "content": q}]), questions))
    probe = client.chat([{"role": "system", "content": prefix},
                         {"role": "user", "content": "Which district is this document about?"}])
    spread = Counter(r.worker or "?" for r in replies)
    return {"requests": num_requests, "prompt_tokens": sum(r.prompt_tokens for r in replies),
            "computed_tokens": sum(r.prompt_tokens - r.cached_tokens for r in replies),
            "probe_cached_tokens": probe.cached_tokens, "ttft_p50_s": statistics.median(r.ttft_s for r in replies),
            "ttft_max_s": max(r.ttft_s for r in replies), "per_worker_requests": dict(spread),
            "answers": [r.answer for r in replies]}


def fresh_prefix_ideal(by_system: dict[str, dict]) -> int:
    """The shared prefix once plus each request's own suffix, with the prefix as the systems' probes
    found it cached (the largest: a probe routed away from every holder finds less)."""
    shared = max(r["probe_cached_tokens"] for r in by_system.values())
    any_run = next(iter(by_system.values()))
    return any_run["prompt_tokens"] - (any_run["requests"] - 1) * shared


def report(multi: dict[str, dict], fresh: dict[str, dict], mine: str) -> None:
    if multi:
        print("\nmulti-turn sessions (reuse = cached tokens / the previous turn's prompt and answer tokens, turns 2 on)")
        for name, r in multi.items():
            print(f"  {name:<20} {r['sessions']} chats x {r['turns']} turns: history reuse mean "
                  f"{r['history_reuse_mean']:.1%}, min {r['history_reuse_min']:.1%}; TTFT p50 first turns "
                  f"{r['first_turn_ttft_p50_s']:.3f} s, later turns {r['later_turn_ttft_p50_s']:.3f} s; "
                  f"chats on several workers {r['sessions_on_several_workers']}")
        print("  identical answers with " + mine + ": " + ", ".join(
            f"{name} {same_answers(multi[mine]['answers'], r['answers'])}" for name, r in multi.items() if name != mine))
    if fresh:
        ideal = fresh_prefix_ideal(fresh)
        print(f"\na fresh prefix, requests sent at once (ideal: the prefix once plus each suffix = {ideal} tokens)")
        for name, r in fresh.items():
            spread = " ".join(f"{w}={n}" for w, n in sorted(r["per_worker_requests"].items()))
            print(f"  {name:<20} {r['requests']} requests: computed {r['computed_tokens']} of "
                  f"{r['prompt_tokens']} prompt tokens = {r['computed_tokens'] / ideal:.2f}x the ideal; TTFT p50 "
                  f"{r['ttft_p50_s']:.3f} s, max {r['ttft_max_s']:.3f} s; probe cached {r['probe_cached_tokens']}; "
                  f"{spread}")
        print("  identical answers with " + mine + ": " + ", ".join(
            f"{name} {same_answers([fresh[mine]['answers']], [r['answers']])}" for name, r in fresh.items()
            if name != mine))


def same_answers(mine: list[list[str]], theirs: list[list[str]]) -> str:
    pairs = [(a, b) for m, t in zip(mine, theirs) for a, b in zip(m, t)]
    return f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
