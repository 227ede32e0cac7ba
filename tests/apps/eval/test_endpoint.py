"""apps.eval against an OpenAI-compatible endpoint: a stub server on 127.0.0.1 that answers each arithmetic prompt
with a known number of correct samples and fails some prompts with HTTP 500 (no forge process starts)."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from apps.eval.cli import main
from rl.tasks.arithmetic import ArithmeticTask

N, PROMPTS, KEY = 4, 24, "sk-stub-secret"
ERROR = {"error": "stub: internal error"}


def correct_samples(prompt: str) -> int:
    a, b = map(int, prompt.rstrip("=").split("+"))
    return (a + b) % (N + 1)


def fails(prompt: str) -> bool:
    return int(prompt.split("+")[0]) % 7 == 0


def texts(prompt: str, n: int) -> list[str]:
    """`correct_samples(prompt)` right answers (reversed digits, as the task writes them), then wrong ones."""
    a, b = map(int, prompt.rstrip("=").split("+"))
    right = str(a + b)[::-1]
    return [right if j < correct_samples(prompt) else right + "9" for j in range(n)]


class Stub(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict, str | None]] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.requests.append((self.path, body, self.headers.get("Authorization")))
        if self.path == "/v1/completions":
            prompt, n = body["prompt"], body["n"]
            reply = {"choices": [{"index": j, "text": t} for j, t in enumerate(texts(prompt, n))]}
        elif self.path == "/v1/chat/completions":  # as forge's gateway: one choice per request
            prompt = body["messages"][0]["content"]
            reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": texts(prompt, N)[0]}}]}
        else:
            self._reply(404, {"error": "no such path"})
            return
        self._reply(500, ERROR) if fails(prompt) else self._reply(200, reply)

    def _reply(self, status: int, reply: dict) -> None:
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    request_queue_size = 256  # 64 requests in flight: the default backlog (5) resets connections
    daemon_threads = True


@pytest.fixture(scope="module")
def server():
    httpd = Server(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()
    httpd.server_close()


def evaluate(server: str, out, *overrides: str) -> dict:
    Stub.requests.clear()
    code = main(["--config", "configs/eval_tiny.yaml", f"+endpoint.base_url={server}", f"output_dir={out}",
                 f"num_prompts={PROMPTS}", f"sampling.num_samples={N}", "sampling.pass_k=[1,2,4]",
                 "+endpoint.retries=1", f"+endpoint.api_key={KEY}", *overrides])
    assert code == 0
    return json.loads((out / "results.json").read_text())


def test_completions_pass_at_k_mean_and_failures_by_hand(server, tmp_path, capsys):
    results = evaluate(server, tmp_path)
    (version,) = results["results"]
    score = version["tasks"]["arithmetic"]
    problems = ArithmeticTask(seed=0, num_digits=2, held_out=500, reverse_answer=True).held_out()[:PROMPTS]
    ok = [p.prompt for p in problems if not fails(p.prompt)]
    assert 0 < len(ok) < PROMPTS  # the stub fails some prompts: the case under test
    for k in (1, 2, 4):
        by_hand = [1 - math.comb(N - correct_samples(p), k) / math.comb(N, k) for p in ok]
        assert score[f"pass@{k}"] == pytest.approx(sum(by_hand) / len(ok))
    assert score["mean_reward"] == pytest.approx(sum(correct_samples(p) / N for p in ok) / len(ok))
    failed = (PROMPTS - len(ok)) * N
    assert score["failed_samples"] == failed and score["samples"] == PROMPTS * N
    assert score["failures"] == {f"EndpointError: POST completions: HTTP 500: {json.dumps(ERROR)}": failed}
    # Each failing prompt was tried twice (retries=1), each other once; the key went along, never into the output.
    attempts = [body["prompt"] for _, body, _ in Stub.requests]
    assert sorted(attempts) == sorted(ok + 2 * [p.prompt for p in problems if fails(p.prompt)])
    assert {auth for _, _, auth in Stub.requests} == {f"Bearer {KEY}"}
    assert results["config"]["endpoint"]["api_key"] == "<redacted>"
    captured = capsys.readouterr()
    assert KEY not in captured.out + captured.err + (tmp_path / "results.json").read_text()
    assert f"{failed} samples failed (left out of the scores)" in captured.err  # reported, not only in the JSON
    assert "pass@4" in captured.out and f"mean@{N}" in captured.out  # the console table


def test_chat_one_sample_per_request_seeded(server, tmp_path):
    results = evaluate(server, tmp_path, "+endpoint.api=chat", "sampling.seed=100", "save_samples=true")
    score = results["results"][0]["tasks"]["arithmetic"]
    problems = ArithmeticTask(seed=0, num_digits=2, held_out=500, reverse_answer=True).held_out()[:PROMPTS]
    ok = [p.prompt for p in problems if not fails(p.prompt)]
    # The stub's chat answer is its first completion: right whenever the prompt has a correct sample.
    assert score["pass@1"] == pytest.approx(sum(correct_samples(p) > 0 for p in ok) / len(ok))
    chats = [(body["n"], body["seed"]) for path, body, _ in Stub.requests if path == "/v1/chat/completions"]
    assert {n for n, _ in chats} == {1} and len(chats) == len(ok) * N + 2 * N * (PROMPTS - len(ok))
    assert len({seed for _, seed in chats}) == PROMPTS * N  # prompt i's sample j: its own seed
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == PROMPTS * N
    assert sum(s["error"] is not None for s in samples) == score["failed_samples"] == (PROMPTS - len(ok)) * N
