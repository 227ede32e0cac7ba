"""Load test of the online-RL gateway (localhost only): N concurrent sessions of a few chat turns each.

    python -m apps.gateway --config configs/gateway_tiny.yaml &
    python -m bench.gateway_load --base-url http://127.0.0.1:8090 --sessions 50 --turns 3

Each session: /rl/start_session (admin key; retried after a pause on 429, the staleness bound), `turns` chat
completions on the growing conversation (one 2-digit addition per turn, the replies re-sent verbatim, so the
session is one episode), a reward per turn (1 for the right sum), /rl/end_session. It prints p50/p99 latency of
the chat completions and of whole sessions, the gateway's history breaks, and checks that no trajectory was lost:
every episode the sessions exported reached the replay buffer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class LoadResult:
    sessions: int
    turns: int
    chat_latencies_s: list[float] = field(default_factory=list)
    session_latencies_s: list[float] = field(default_factory=list)
    start_retries_429: int = 0
    exported_episodes: int = 0
    correct: int = 0
    ended_at_eos: int = 0  # replies whose finish_reason is "stop": their EOS is in the ids, not in the re-sent text
    failures: list[str] = field(default_factory=list)
    buffer_added: int = 0  # episodes the buffer received during the run
    history_breaks: int = 0  # requests that did not continue their conversation's exact ids (the gateway's count)
    stats: dict = field(default_factory=dict)
    wall_s: float = 0.0

    @property
    def lost(self) -> int:
        return self.exported_episodes - self.buffer_added

    def summary(self) -> dict:
        return {
            "sessions": self.sessions, "turns": self.turns, "chat_requests": len(self.chat_latencies_s),
            "chat_p50_ms": 1000 * percentile(self.chat_latencies_s, 50),
            "chat_p99_ms": 1000 * percentile(self.chat_latencies_s, 99),
            "session_p50_ms": 1000 * percentile(self.session_latencies_s, 50),
            "session_p99_ms": 1000 * percentile(self.session_latencies_s, 99),
            "chat_requests_per_s": len(self.chat_latencies_s) / self.wall_s if self.wall_s else 0.0,
            "start_retries_429": self.start_retries_429, "exported_episodes": self.exported_episodes,
            "buffer_added": self.buffer_added, "history_breaks": self.history_breaks, "lost": self.lost, "failures": len(self.failures),
            "accuracy": self.correct / max(1, len(self.chat_latencies_s)), "ended_at_eos": self.ended_at_eos,
            "train_steps": self.stats.get("train_steps"), "policy_version": self.stats.get("policy_version"),
            "wall_s": self.wall_s,
        }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


async def _session(client: httpx.AsyncClient, index: int, admin_key: str, turns: int, rng: random.Random,
                   result: LoadResult, max_wait_s: float) -> None:
    started = time.perf_counter()
    admin = {"Authorization": f"Bearer {admin_key}"}
    deadline = time.monotonic() + max_wait_s
    while True:
        response = await client.post("/rl/start_session", json={"task_id": f"load-{index}-{rng.getrandbits(32):x}"},
                                     headers=admin)
        if response.status_code != 429:
            break
        result.start_retries_429 += 1
        if time.monotonic() > deadline:
            raise RuntimeError(f"session {index}: still 429 after {max_wait_s}s")
        await asyncio.sleep(0.2 + rng.random() * 0.3)
    response.raise_for_status()
    key = response.json()["api_key"]
    auth = {"Authorization": f"Bearer {key}"}
    messages: list[dict] = []
    for _ in range(turns):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        messages.append({"role": "user", "content": f"{a}+{b}="})
        tick = time.perf_counter()
        response = await client.post("/v1/chat/completions", json={"model": "default", "messages": messages},
                                     headers=auth)
        result.chat_latencies_s.append(time.perf_counter() - tick)
        response.raise_for_status()
        body = response.json()
        text = body["choices"][0]["message"]["content"]
        result.ended_at_eos += body["choices"][0]["finish_reason"] == "stop"
        messages.append({"role": "assistant", "content": text})
        reward = float(text.strip() == str(a + b))
        result.correct += int(reward)
        (await client.post("/rl/set_reward", json={"reward": reward, "interaction_id": body["id"]},
                           headers=auth)).raise_for_status()
    response = await client.post("/rl/end_session", json={}, headers=auth)
    response.raise_for_status()
    result.exported_episodes += response.json()["exported_episodes"]
    result.session_latencies_s.append(time.perf_counter() - started)


async def run_load(base_url: str, admin_key: str, *, sessions: int = 50, turns: int = 3, seed: int = 0,
                   max_wait_s: float = 300.0, settle_s: float = 10.0) -> LoadResult:
    """Drive `sessions` concurrent sessions; afterwards compare exported episodes with the buffer's count."""
    result = LoadResult(sessions, turns)
    admin = {"Authorization": f"Bearer {admin_key}"}
    limits = httpx.Limits(max_connections=sessions + 10, max_keepalive_connections=sessions + 10)
    async with httpx.AsyncClient(base_url=base_url, timeout=max_wait_s, limits=limits) as client:
        before = (await client.get("/rl/stats", headers=admin)).json()
        started = time.perf_counter()
        outcomes = await asyncio.gather(*(_session(client, i, admin_key, turns, random.Random(f"{seed}-{i}"), result,
                                                   max_wait_s) for i in range(sessions)), return_exceptions=True)
        result.wall_s = time.perf_counter() - started
        result.failures = [f"{type(o).__name__}: {o}" for o in outcomes if isinstance(o, BaseException)]
        # Exports are synchronous (end_session returns after the buffer took the episodes); a short settle
        # only lets the stats catch up with a training step in progress.
        deadline = time.monotonic() + settle_s
        while True:
            after = (await client.get("/rl/stats", headers=admin)).json()
            result.buffer_added = after["buffer"]["added"] - before["buffer"]["added"]
            result.history_breaks = after["history_breaks"] - before["history_breaks"]
            if result.buffer_added >= result.exported_episodes or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        result.stats = after
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8090")
    parser.add_argument("--admin-key", default="forge-admin-key-change-me")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-wait-s", type=float, default=300.0)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.base_url.startswith(("http://127.0.0.1", "http://localhost")):
        print(f"--base-url={args.base_url}: this load test runs against localhost only", file=sys.stderr)
        return 2
    result = asyncio.run(run_load(args.base_url, args.admin_key, sessions=args.sessions, turns=args.turns,
                                  seed=args.seed, max_wait_s=args.max_wait_s))
    s = result.summary()
    print(f"{s['sessions']} sessions x {s['turns']} turns: {s['chat_requests']} chat completions in {s['wall_s']:.1f}s "
          f"({s['chat_requests_per_s']:.1f}/s)")
    print(f"chat completion latency: p50 {s['chat_p50_ms']:.0f} ms, p99 {s['chat_p99_ms']:.0f} ms")
    print(f"whole session latency:   p50 {s['session_p50_ms']:.0f} ms, p99 {s['session_p99_ms']:.0f} ms")
    print(f"start_session 429 retries: {s['start_retries_429']}; training steps so far: {s['train_steps']} "
          f"(policy version {s['policy_version']}); answers correct: {s['accuracy']:.1%}; replies ended at EOS: "
          f"{s['ended_at_eos']}")
    print(f"trajectories: exported {s['exported_episodes']} episodes (one per conversation; {s['history_breaks']} "
          f"history breaks), buffer received {s['buffer_added']}, lost {s['lost']}; failed sessions: {s['failures']}")
    for failure in result.failures[:5]:
        print(f"  {failure}")
    print(json.dumps(s))
    return 0 if s["lost"] == 0 and not result.failures else 1


if __name__ == "__main__":
    sys.exit(main())
