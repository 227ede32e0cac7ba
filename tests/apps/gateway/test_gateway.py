"""apps.gateway, the OpenAI-compatible online-RL gateway, over real HTTP on localhost with the real `openai`
client: every endpoint and error code, session timeout and refresh, training and weight updates without a
restart, and a bounded load test (50 concurrent sessions) in which no exported trajectory is lost.

One gateway (`python -m apps.gateway`, a subprocess) is started for the module; it starts Monarch
processes (a Generator as_service, the trainer and the replay buffer as_actor), so `make test` runs this
module in its own pytest process. Session export and reward bookkeeping are also tested without processes.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from forge.provisioner import free_port
from tests.docs.snippets import python_blocks, run_block
from tests.apps.app_faults import Endpoint, actor, kill_the_generator_for_good, newest_job_process
from tests.support import start_http_app, stop_http_app
from apps.gateway.app import build_app
from apps.gateway.chat import PromptEncoder
from apps.gateway.config import GatewayConfig
from apps.gateway.errors import openai_error
from apps.gateway.runtime import Gateway
from apps.gateway.schemas import ChatMessage
from apps.gateway.sessions import Interaction, RLSession, trajectory_episodes
from apps.http.errors import ServiceError
from apps.http.serving import install_error_handlers
from bench.gateway_load import percentile, run_load
from apps.app_config import load_app_config
from rl.tiny_model import DEFAULT_MODEL_ARGS, build_tokenizer
from rl.types import Completion, Episode, TrainBatch

ROOT = Path(__file__).resolve().parents[3]
ADMIN = "test-admin-key-0123"
pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.timeout(600)]


# --- pieces without processes ------------------------------------------------------------------------
def _interaction(i: int, reward: float | None, tokens: int = 2, trainable: bool = True) -> Interaction:
    return Interaction(f"c{i}", [5, 6], list(range(7, 7 + tokens)), [-0.1] * tokens, [i] * tokens, trainable, reward)


def test_trajectory_rewards_propagate_back_with_the_turn_discount():
    session = RLSession("s", "k", 60, interactions=[_interaction(0, None), _interaction(1, 0.5),
                                                         _interaction(2, None), _interaction(3, 1.0)])
    # Each prompt is [5, 6] again, not the previous ids continued: four conversations, three history breaks.
    episodes, skipped, breaks = trajectory_episodes(session, discount=0.5, group_id=7, first_episode_id=10)
    assert [e.reward for e in episodes] == [0.25, 0.5, 0.5, 1.0] and skipped == 0 and breaks == 3
    assert [e.episode_id for e in episodes] == [10, 11, 12, 13] and {e.group_id for e in episodes} == {7}
    assert episodes[0].prompt_ids == [5, 6] and episodes[0].policy_versions == [0, 0]


def test_untrainable_or_empty_interactions_are_skipped_and_counted():
    session = RLSession("s", "k", 60, interactions=[_interaction(0, 1.0, trainable=False),
                                                         _interaction(1, None, tokens=0), _interaction(2, None)])
    episodes, skipped, _ = trajectory_episodes(session, discount=1.0, group_id=0, first_episode_id=0)
    assert skipped == 2 and [e.reward for e in episodes] == [0.0]


def _chat(encoder: PromptEncoder, session: RLSession, messages: list[ChatMessage], reply: list[int],
          trainable: bool = True) -> str:
    """What the gateway does for one request (runtime.Gateway.chat without the generator): the prompt from the
    session's conversation, `reply` as the generated ids, the interaction recorded; returns the reply's text."""
    tokenizer, k = encoder.tokenizer, len(session.interactions)
    prompt = encoder.encode(messages, session.context)
    completion = Completion(prompt_ids=prompt, token_ids=reply, text=tokenizer.decode(reply, skip_special_tokens=True),
                            logprobs=[-0.5 - k] * len(reply), finish_reason="stop" if
                            reply[-1:] == [tokenizer.eos_token_id] else "length", policy_versions=[k] * len(reply))
    session.interactions.append(Interaction(f"c{k}", prompt, reply, completion.logprobs, completion.policy_versions,
                                            trainable))
    session.context = encoder.context(messages, completion)
    return completion.text


def _conversation(tokenizer, users: list[str], replies: list[list[int]], trainable: list[bool] | None = None,
                  fmt: str = "plain") -> RLSession:
    """Requests as an OpenAI client makes them: each re-sends the previous messages, the assistant's reply (the text
    the gateway answered) and a new user message."""
    encoder, messages, session = PromptEncoder(tokenizer, fmt, 256), [], RLSession("s", "k", 60)
    for k, (user, reply) in enumerate(zip(users, replies)):
        messages.append(ChatMessage(role="user", content=user))
        text = _chat(encoder, session, messages, reply, True if trainable is None else trainable[k])
        messages.append(ChatMessage(role="assistant", content=text))
    return session


def test_a_plain_conversation_of_several_requests_is_one_token_exact_episode():
    tokenizer = build_tokenizer()
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.eos_token_id
    # Every reply ends at EOS, which the re-sent plain text cannot carry: the prompts continue the exact ids instead.
    users, replies = ["12+34=", " 5+5=", " 3+4="], [ids("46") + [eos], ids("10") + [eos], ids("7") + [eos]]
    session = _conversation(tokenizer, users, replies)
    assert session.interactions[1].prompt_ids == ids("12+34=") + replies[0] + ids(" 5+5=")
    session.interactions[-1].reward = 0.75
    (episode,), skipped, breaks = trajectory_episodes(session, discount=1.0, group_id=3, first_episode_id=0)
    assert (skipped, breaks, episode.reward) == (0, 0, 0.75)
    # Exactly what the model saw and wrote, in order: the first prompt, then reply, message, reply, message, reply.
    assert episode.prompt_ids == ids("12+34=")
    assert episode.completion_ids == replies[0] + ids(" 5+5=") + replies[1] + ids(" 3+4=") + replies[2]
    assert episode.completion_mask == [1, 1, 1] + [0] * 5 + [1, 1, 1] + [0] * 5 + [1, 1]
    assert episode.behaviour_logprobs == [-0.5] * 3 + [0.0] * 5 + [-1.5] * 3 + [0.0] * 5 + [-2.5] * 2
    assert episode.policy_versions == [0] * 3 + [-1] * 5 + [1] * 3 + [-1] * 5 + [2] * 2
    batch = TrainBatch.from_episodes([episode], pad_id=tokenizer.pad_token_id)
    mask = batch.response_mask[0].bool()
    assert batch.input_ids[0].tolist() == episode.prompt_ids + episode.completion_ids
    assert batch.input_ids[0, 1:][mask].tolist() == [t for r in replies for t in r]  # the loss sees the replies only
    assert (batch.policy_versions[0][~mask] == -1).all() and batch.behaviour_logprobs[0][mask].tolist() == \
        [-0.5] * 3 + [-1.5] * 3 + [-2.5] * 2


def test_a_request_that_does_not_re_send_the_conversation_starts_a_new_episode_and_is_counted():
    tokenizer = build_tokenizer()
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.eos_token_id
    encoder = PromptEncoder(tokenizer, "plain", 256)
    user = lambda text: ChatMessage(role="user", content=text)  # noqa: E731
    said = lambda text: ChatMessage(role="assistant", content=text)  # noqa: E731
    for history in ([user("1+2="), said("2")],  # a message edited
                    [user("1+1="), said("3")],  # a reply other than the one the gateway answered
                    [user("1+1=")],  # the reply left out
                    []):  # a new conversation
        session = RLSession("s", "k", 60)
        first = _chat(encoder, session, [user("1+1=")], ids("2") + [eos])
        assert first == "2"
        _chat(encoder, session, history + [user("2+2=")], ids("4") + [eos])
        session.interactions[-1].reward = 1.0
        export = trajectory_episodes(session, discount=0.5, group_id=0, first_episode_id=0)
        assert (export.history_breaks, len(export.episodes)) == (1, 2), history
        # Re-encoded from its messages: the model sees (and the episode holds) the new conversation as sent.
        assert export.episodes[1].prompt_ids == ids("".join(m.text() for m in history) + "2+2=")
        assert [e.reward for e in export.episodes] == [0.5, 1.0]
    # The same messages again, verbatim, continue: only a re-sent conversation chains.
    session = RLSession("s", "k", 60)
    _chat(encoder, session, [user("1+1=")], ids("2") + [eos])
    _chat(encoder, session, [user("1+1="), said("2"), user("2+2=")], ids("4"))
    assert trajectory_episodes(session, discount=1.0, group_id=0, first_episode_id=0).history_breaks == 0
    # An off-temperature reply stays in its conversation as context, masked out.
    session = _conversation(tokenizer, ["1+1=", "2+2="], [ids("2"), ids("4")], trainable=[False, True])
    (episode,), skipped, breaks = trajectory_episodes(session, discount=1.0, group_id=0, first_episode_id=0)
    assert (skipped, breaks) == (1, 0) and episode.completion_ids == ids("22+2=4")
    assert episode.completion_mask == [0, 0, 0, 0, 0, 1] and episode.policy_versions == [-1] * 5 + [1]


def test_a_template_conversation_continues_the_reply_as_sampled():
    tokenizer = build_tokenizer()
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = tokenizer.eos_token_id
    # A template that renders the end token after each reply and strips a thinking block from earlier replies
    # (as Qwen3's does): re-rendering would change what the model saw; the prompt keeps the reply as sampled and
    # adds what the template puts after it, less the end token the model generated itself.
    tokenizer.chat_template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
                               "{{ m.content.split('</think>')[-1] }}{{ eos_token }}{% else %}{{ m.content }}{% endif %}"
                               "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    for reply in ("2", "<think>1+1</think>2"):
        session = _conversation(tokenizer, ["1+1=", "2+2="], [ids(reply) + [eos], ids("4") + [eos]], fmt="template")
        export = trajectory_episodes(session, discount=1.0, group_id=0, first_episode_id=0)
        assert (export.history_breaks, len(export.episodes)) == (0, 1)
        assert session.interactions[1].prompt_ids == ids("<user>1+1=<assistant>" + reply) + [eos] + \
            ids("<user>2+2=<assistant>")
        turn = ids("<user>2+2=<assistant>")
        assert export.episodes[0].completion_mask == [1] * (len(ids(reply)) + 1) + [0] * len(turn) + [1, 1]
    # A reply cut at max_tokens (no end token generated): the template's end token follows it as context.
    session = _conversation(tokenizer, ["1+1=", "2+2="], [ids("2"), ids("4")], fmt="template")
    assert session.interactions[1].prompt_ids == ids("<user>1+1=<assistant>2") + [eos] + ids("<user>2+2=<assistant>")
    assert trajectory_episodes(session, discount=1.0, group_id=0, first_episode_id=0).episodes[0].completion_mask == \
        [1] + [0] * (1 + len(turn)) + [1]
    # A template that rewrites the reply itself cannot be continued: re-rendered, a new episode, counted.
    tokenizer.chat_template = tokenizer.chat_template.replace("m.content.split('</think>')[-1]", "m.content | upper")
    session = _conversation(tokenizer, ["hi", "2+2="], [ids("ok") + [eos], ids("4") + [eos]], fmt="template")
    assert trajectory_episodes(session, discount=1.0, group_id=0, first_episode_id=0).history_breaks == 1
    assert session.interactions[1].prompt_ids == ids("<user>hi<assistant>OK") + [eos] + ids("<user>2+2=<assistant>")


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile([3.0], 99) == 3.0


# --- the running gateway -----------------------------------------------------------------------------
class RewardBody(BaseModel):
    reward: float


def test_errors_reach_the_openai_client_in_openais_shape():
    app = FastAPI()
    install_error_handlers(app, openai_error)

    @app.post("/v1/conflict")
    async def conflict():
        raise ServiceError(409, "session 'a' is bound to another API key")

    @app.post("/v1/typed")
    async def typed(body: RewardBody):
        return {}

    @app.post("/v1/crash")
    async def crash():
        raise RuntimeError("the replay buffer is gone")

    client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", max_retries=0,
                           http_client=TestClient(app, raise_server_exceptions=False))
    with pytest.raises(openai.ConflictError) as error:
        client.post("/conflict", cast_to=object, body={})
    assert error.value.body == {"message": "session 'a' is bound to another API key", "type": "conflict_error",
                                "param": None, "code": "conflict"}
    assert "bound to another API key" in str(error.value)
    with pytest.raises(openai.UnprocessableEntityError) as error:
        client.post("/typed", cast_to=object, body={"reward": "high"})
    assert (error.value.param, error.value.type, error.value.code) == ("reward", "invalid_request_error",
                                                                       "invalid_request")
    assert error.value.body["message"].startswith("reward: Input should be a valid number")
    with pytest.raises(openai.InternalServerError) as error:
        client.post("/crash", cast_to=object, body={})
    assert (error.value.type, error.value.code) == ("server_error", "internal_error")
    assert error.value.body["message"] == "server-side failure: RuntimeError: the replay buffer is gone"
    missing = TestClient(app).get("/v1/nowhere")  # routing errors too
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def _one_token_reply(prompt_ids, params):
    return [Completion(prompt_ids=list(prompt_ids), token_ids=[7], text="4", logprobs=[-0.1], finish_reason="length",
                       policy_versions=[0])]


def test_a_generation_or_export_past_rl_call_timeout_s_is_504_naming_it_and_nothing_waits_on(tmp_path):
    # The gateway's own code (runtime.py, app.py) over HTTP, without processes: a generator service and a replay
    # buffer that never answer stand in for the actors (a module gateway cannot be given a call that hangs).
    cfg = load_app_config(ROOT / "configs/gateway_tiny.yaml", [f"model_cache={tmp_path}", f"rl.admin_api_key={ADMIN}",
                                                               "rl.call_timeout_s=0.5"], GatewayConfig)
    gateway = Gateway(cfg, cfg.model)
    stuck = Endpoint()
    gateway.generators, gateway.buffer = actor(generate=stuck), actor(add=stuck)
    chat = {"model": "default", "messages": [{"role": "user", "content": "2+2="}]}
    with TestClient(build_app(gateway)) as client:
        session = client.post("/rl/start_session", json={}, headers=_admin()).json()
        key = _bearer(session["api_key"])
        timed_out = client.post("/v1/chat/completions", json=chat, headers=key)
        assert timed_out.status_code == 504, timed_out.text
        assert timed_out.json()["error"] == {"message": "generation did not finish within rl.call_timeout_s=0.5s",
                                             "type": "server_error", "param": None, "code": "timeout"}
        assert stuck.cancelled == 1 and gateway.sessions.lookup(session["api_key"]).busy == 0
        gateway.generators = actor(generate=Endpoint(_one_token_reply))  # the session goes on: answered, then exported
        assert client.post("/v1/chat/completions", json=chat, headers=key).status_code == 200
        export = client.post("/rl/end_session", json={}, headers=key)
        assert export.status_code == 504 and stuck.cancelled == 2
        assert export.json()["error"]["message"] == "the replay buffer did not answer within rl.call_timeout_s=0.5s"
        assert gateway.counts["export_failures"] == 1


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("gateway")
    command = [sys.executable, "-m", "apps.gateway", "--config", "configs/gateway_tiny.yaml", f"http.port={free_port()}",
               f"run_dir={run_dir}", f"rl.admin_api_key={ADMIN}", "replay_buffer.batch_size=32",
               "replay_buffer.max_policy_age=1", "warm_start.max_steps=20"]  # as in server/test_service.py
    proc, base_url = start_http_app(command, run_dir / "gateway.log", ROOT)
    yield {"url": base_url, "proc": proc, "run_dir": run_dir}
    code = stop_http_app(proc)
    output = (run_dir / "gateway.log").read_text()
    assert code == 128 + signal.SIGTERM, output[-4000:]  # forge.lifecycle: stopped by a signal
    assert "forge online-RL gateway stopped" in output


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway["url"], timeout=120) as client:
        yield client


def _v1(http: httpx.Client) -> str:
    return str(http.base_url).rstrip("/") + "/v1"


def _admin() -> dict:
    return {"Authorization": f"Bearer {ADMIN}"}


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _start(http: httpx.Client, **body) -> dict:
    """Start a session, retrying while the gateway is at its staleness bound (429 until a training step runs:
    what a client is told to do; earlier tests may have filled the buffer)."""
    deadline = time.monotonic() + 180
    while True:
        response = http.post("/rl/start_session", json=body, headers=_admin())
        if response.status_code != 429 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert response.status_code == 200, response.text
    return response.json()


def _wait_for_capacity(http: httpx.Client) -> None:
    session = _start(http)
    assert http.post("/rl/end_session", headers=_bearer(session["api_key"])).status_code == 200


def _stats(http: httpx.Client) -> dict:
    return http.get("/rl/stats", headers=_admin()).json()


def test_health_and_openapi(http):
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["generator_replicas_healthy"] == 1
    paths = set(http.get("/openapi.json").json()["paths"])
    assert {"/health", "/v1/chat/completions", "/chat/completions", "/v1/models", "/rl/start_session",
            "/rl/set_reward", "/rl/end_session", "/rl/stats"} <= paths


def test_missing_or_wrong_keys_are_401(http):
    assert http.post("/rl/start_session", json={}).status_code == 401
    assert http.post("/rl/start_session", json={}, headers=_bearer("wrong-admin-key")).status_code == 401
    assert http.get("/rl/stats").status_code == 401
    chat = {"messages": [{"role": "user", "content": "1+1="}]}
    missing = http.post("/v1/chat/completions", json=chat)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert http.post("/v1/chat/completions", json=chat, headers=_bearer("sk-sess-unknown")).status_code == 401
    assert http.post("/rl/set_reward", json={"reward": 1}, headers=_bearer(ADMIN)).status_code == 401
    assert http.post("/rl/end_session", json={}).status_code == 401
    client = openai.OpenAI(base_url=_v1(http), api_key="sk-sess-unknown", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "1+1="}])
    assert (refused.value.type, refused.value.code) == ("authentication_error", "invalid_api_key")
    assert "API key" in refused.value.body["message"]


def test_openai_client_session_rewards_and_export(http):
    session = _start(http, task_id="openai-test")
    assert session["session_id"] == "openai-test" and session["api_key"].startswith("sk-sess-")
    before = _stats(http)
    client = openai.OpenAI(base_url=_v1(http), api_key=session["api_key"], max_retries=0)
    first = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "12+34="}],
                                           logprobs=True)
    text = first.choices[0].message.content
    assert isinstance(text, str) and first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens == 6 and first.usage.completion_tokens >= 1
    assert len(first.choices[0].logprobs.content) == first.usage.completion_tokens
    recorded = first.model_extra["forge"]
    assert recorded["session_id"] == "openai-test" and recorded["interaction_id"] == first.id
    assert len(recorded["policy_versions"]) == first.usage.completion_tokens and recorded["trainable"]
    # Without /v1 in the base URL the client posts to /chat/completions, also served.
    plain = openai.OpenAI(base_url=str(http.base_url), api_key=session["api_key"], max_retries=0)
    second = plain.chat.completions.create(model="default", messages=[
        {"role": "user", "content": "12+34="}, {"role": "assistant", "content": text}, {"role": "user", "content": "5+5="}])
    # The second prompt continues the first's exact ids: the reply's tokens (its EOS too, when it ended there).
    assert second.usage.prompt_tokens == 6 + first.usage.completion_tokens + 4
    assert client.models.list().data[0].id == "default"

    key = _bearer(session["api_key"])
    by_id = http.post("/rl/set_reward", json={"reward": 0.5, "interaction_id": first.id}, headers=key)
    assert by_id.json() == {"session_id": "openai-test", "interaction_id": first.id, "reward": 0.5}
    last = http.post("/rl/set_reward", json={"reward": 1.0}, headers=key)
    assert last.json()["interaction_id"] == second.id
    unknown = http.post("/rl/set_reward", json={"reward": 1.0, "interaction_id": "chatcmpl-nope"}, headers=key)
    assert unknown.status_code == 404 and "chatcmpl-nope" in unknown.json()["error"]["message"]
    ended = http.post("/rl/end_session", json={}, headers=key).json()
    # The second request re-sent the conversation verbatim: one episode.
    assert ended == {"session_id": "openai-test", "interactions": 2, "exported_episodes": 1,
                     "history_breaks": 0, "reason": "ended by the client", "episodes": None}
    after = _stats(http)
    assert after["exported_episodes"] - before["exported_episodes"] == 1
    assert after["buffer"]["added"] - before["buffer"]["added"] == 1
    assert after["history_breaks"] - before["history_breaks"] == 0
    with pytest.raises(openai.AuthenticationError):  # the key ended with its session
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "1+1="}])


def test_a_three_request_conversation_through_the_openai_client_exports_one_token_exact_episode(http):
    tokenizer = build_tokenizer()  # the tiny model's (character-level): the test renders what the gateway saw
    session = _start(http)
    client = openai.OpenAI(base_url=_v1(http), api_key=session["api_key"], max_retries=0)
    messages, replies = [], []
    for user in ("12+34=", "5+5=", "3+4="):  # replies usually end at EOS (plain text cannot carry it): still one
        messages.append({"role": "user", "content": user})
        reply = client.chat.completions.create(model="default", messages=messages, logprobs=True)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    key = _bearer(session["api_key"])
    http.post("/rl/set_reward", json={"reward": 0.75}, headers=key)
    ended = http.post("/rl/end_session", json={"return_episodes": True}, headers=key).json()
    assert (ended["history_breaks"], ended["exported_episodes"], len(ended["episodes"])) == (0, 1, 1)
    (exported,) = ended["episodes"]
    tokens = [[tokenizer.convert_tokens_to_ids(t.token) for t in r.choices[0].logprobs.content] for r in replies]
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    # Exactly what the model read and wrote: each user message's tokens, each reply's generated ids (EOS included).
    assert exported["prompt_ids"] == encode("12+34=")
    assert exported["prompt_ids"] + exported["completion_ids"] == \
        encode("12+34=") + tokens[0] + encode("5+5=") + tokens[1] + encode("3+4=") + tokens[2]
    assert [r.usage.prompt_tokens for r in replies[1:]] == [6 + len(tokens[0]) + 4,
                                                            6 + len(tokens[0]) + 4 + len(tokens[1]) + 4]
    expected_mask = [1] * len(tokens[0]) + [0] * 4 + [1] * len(tokens[1]) + [0] * 4 + [1] * len(tokens[2])
    assert exported["completion_mask"] == expected_mask and exported["reward"] == 0.75
    mask = [bool(m) for m in exported["completion_mask"]]
    assert [lp for lp, m in zip(exported["behaviour_logprobs"], mask) if m] == pytest.approx(
        [t.logprob for r in replies for t in r.choices[0].logprobs.content])
    assert [v for v, m in zip(exported["policy_versions"], mask) if m] == \
        [v for r in replies for v in r.model_extra["forge"]["policy_versions"]]
    episode = Episode(episode_id=0, group_id=0, prompt_ids=exported["prompt_ids"],
                      completion_ids=exported["completion_ids"], behaviour_logprobs=exported["behaviour_logprobs"],
                      policy_versions=exported["policy_versions"], reward=exported["reward"],
                      completion_mask=exported["completion_mask"])
    batch = TrainBatch.from_episodes([episode], pad_id=tokenizer.pad_token_id)
    assert batch.response_mask.sum() == sum(len(r) for r in tokens)
    assert (batch.policy_versions[~batch.response_mask.bool()] == -1).all()


def test_streamed_completions_arrive_as_openai_chunks_and_are_recorded(http):
    session = _start(http, task_id="stream-test")
    client = openai.OpenAI(base_url=_v1(http), api_key=session["api_key"], max_retries=0)
    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "12+34="}],
                                                 stream=True, stream_options={"include_usage": True}, logprobs=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    logprobs = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert finish in (["stop"], ["length"]) and not chunks[-1].choices
    assert usage.prompt_tokens == 6 and len(logprobs) == usage.completion_tokens >= 1
    # The content is the sampled tokens' text (empty when the first token sampled was EOS).
    tokenizer = build_tokenizer()
    assert text == tokenizer.decode([tokenizer.convert_tokens_to_ids(t.token) for t in logprobs],
                                    skip_special_tokens=True)
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    record = next(c.model_extra["forge"] for c in chunks if c.model_extra.get("forge"))
    assert record["interaction_id"] == chunks[0].id and len(record["policy_versions"]) == usage.completion_tokens
    key = _bearer(session["api_key"])
    assert http.post("/rl/set_reward", json={"reward": 1.0}, headers=key).json()["interaction_id"] == chunks[0].id
    # Without stream_options, no usage chunk; errors still come before any event, as JSON with their codes.
    plain = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "1+1="}],
                                                stream=True))
    assert all(c.usage is None for c in plain) and plain[-1].choices[0].finish_reason in ("stop", "length")
    assert http.post("/rl/end_session", headers=key).json()["interactions"] == 2
    with pytest.raises(openai.AuthenticationError):  # the session ended
        next(iter(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "1+1="}],
                                                 stream=True)))


def test_reward_before_any_interaction_is_409_and_off_policy_sampling_is_answered_but_not_trained(http):
    session = _start(http)
    key = _bearer(session["api_key"])
    early = http.post("/rl/set_reward", json={"reward": 1.0}, headers=key)
    assert early.status_code == 409 and "no interaction yet" in early.json()["error"]["message"]
    before = _stats(http)
    trainable = {}
    # trainer.temperature is 1.0 (configs/gateway_tiny.yaml): greedy, another temperature, or top-p filtering give
    # log-probs that are not the trainer's; the trainer's temperature, asked for explicitly, is trained.
    for sampling in ({"temperature": 0}, {"temperature": 0.7}, {"top_p": 0.9}, {"temperature": 1.0, "top_p": 0.5},
                     {"temperature": 1.0, "top_p": 1.0}):
        reply = http.post("/v1/chat/completions", headers=key, json={
            "model": "default", "messages": [{"role": "user", "content": "3+4="}], **sampling})
        assert reply.status_code == 200, (sampling, reply.text)
        trainable[str(sampling)] = reply.json()["forge"]["trainable"]
    assert list(trainable.values()) == [False, False, False, False, True], trainable
    # Each request re-encodes "3+4=" alone: five one-interaction episodes, of which only the last is trained.
    ended = http.post("/rl/end_session", headers=key).json()
    assert ended["interactions"] == 5 and ended["exported_episodes"] == 1
    after = _stats(http)
    assert after["skipped_interactions"] - before["skipped_interactions"] == 4


def test_conflicts_are_409_and_refresh_ends_and_exports_the_old_session(http):
    first = _start(http, task_id="refresh-me")
    taken = http.post("/rl/start_session", json={"task_id": "refresh-me"}, headers=_admin())
    assert taken.status_code == 409 and "bound to another API key" in taken.json()["error"]["message"]
    bound = http.post("/rl/start_session", json={"api_key": first["api_key"], "refresh": False}, headers=_admin())
    assert bound.status_code == 409 and "already bound to session 'refresh-me'" in bound.json()["error"]["message"]
    key = _bearer(first["api_key"])
    chat = {"model": "default", "messages": [{"role": "user", "content": "20+22="}]}
    assert http.post("/chat/completions", json=chat, headers=key).status_code == 200
    before = _stats(http)
    refreshed = _start(http, task_id="refreshed", api_key=first["api_key"])
    assert refreshed["ended_session"] == "refresh-me" and refreshed["api_key"] == first["api_key"]
    after = _stats(http)
    assert after["exported_episodes"] - before["exported_episodes"] == 1
    assert after["sessions_ended"].get("refreshed", 0) == before["sessions_ended"].get("refreshed", 0) + 1
    # The same key now talks to the new session.
    assert http.post("/chat/completions", json=chat, headers=key).json()["forge"]["session_id"] == "refreshed"
    assert http.post("/rl/end_session", headers=key).json()["session_id"] == "refreshed"


def test_malformed_bodies_are_422_with_field_errors(http):
    session = _start(http)
    key = _bearer(session["api_key"])
    cases = [({"model": "default"}, "messages"),
             ({"messages": [{"role": "user", "content": "1+1="}], "n": 2}, "n"),
             ({"messages": [{"role": "robot", "content": "1+1="}]}, "messages.0.role"),
             ({"messages": [{"role": "user", "content": "1+1="}], "max_tokens": 0}, "max_tokens")]
    for body, param in cases:  # OpenAI's error shape: the first field at fault is `param`, the message names it
        response = http.post("/v1/chat/completions", json=body, headers=key)
        assert response.status_code == 422, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: ")
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_request")
    too_many = http.post("/v1/chat/completions", headers=key, json={
        "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 10_000})
    assert too_many.status_code == 422 and "chat.max_tokens_limit" in too_many.json()["error"]["message"]
    reward = http.post("/rl/set_reward", json={"reward": "high"}, headers=key)
    assert reward.status_code == 422 and reward.json()["error"]["param"] == "reward"
    start = http.post("/rl/start_session", json={"task_id": "has spaces"}, headers=_admin())
    assert start.status_code == 422 and start.json()["error"]["param"] == "task_id"
    client = openai.OpenAI(base_url=_v1(http), api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "1+1="}], n=3)
    assert refused.value.param == "n" and refused.value.type == "invalid_request_error"
    assert "n: " in refused.value.message and refused.value.body["message"].startswith("n: ")
    http.post("/rl/end_session", headers=key)


def test_a_prompt_longer_than_the_model_window_is_400_naming_messages_its_length_and_the_window(http):
    session = _start(http)
    key = _bearer(session["api_key"])
    window = DEFAULT_MODEL_ARGS["max_position_embeddings"]  # the tiny model's (one token per character)
    too_long = http.post("/v1/chat/completions", headers=key, json={
        "model": "default", "messages": [{"role": "user", "content": "1+1=" * 75}]})
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"] == {
        "message": f"messages: the prompt has 300 tokens; the model's window is {window} (at most {window - 1} "
                   "prompt tokens leave room to generate)",
        "type": "invalid_request_error", "param": "messages", "code": "bad_request"}
    assert "400" in http.get("/openapi.json").json()["paths"]["/v1/chat/completions"]["post"]["responses"]
    client = openai.OpenAI(base_url=_v1(http), api_key=session["api_key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:  # what an OpenAI client raises
        client.chat.completions.create(model="default", messages=[{"role": "user", "content": "9" * window}])
    assert refused.value.param == "messages" and f"the prompt has {window} tokens" in refused.value.message
    # Refused before anything was generated or recorded: the session goes on.
    assert http.post("/v1/chat/completions", headers=key, json={
        "model": "default", "messages": [{"role": "user", "content": "1+1="}]}).status_code == 200
    assert http.post("/rl/end_session", headers=key).json()["interactions"] == 1


def test_an_idle_session_times_out_and_is_exported(http):
    before = _stats(http)  # taken first: on a loaded host the session may time out before the next line returns
    session = _start(http, task_id="sleepy", timeout_seconds=1.5)
    key = _bearer(session["api_key"])
    chat = {"model": "default", "messages": [{"role": "user", "content": "9+9="}]}
    assert http.post("/v1/chat/completions", json=chat, headers=key).status_code == 200
    deadline = time.monotonic() + 120
    while (after := _stats(http))["exported_episodes"] == before["exported_episodes"]:  # stats touch no session
        assert time.monotonic() < deadline, after
        time.sleep(0.5)
    assert after["exported_episodes"] - before["exported_episodes"] == 1
    assert after["sessions_ended"]["timeout"] == before["sessions_ended"].get("timeout", 0) + 1
    assert http.post("/v1/chat/completions", json=chat, headers=key).status_code == 401


def test_load_50_concurrent_sessions_lose_no_trajectory(gateway, http):
    result = asyncio.run(run_load(gateway["url"], ADMIN, sessions=50, turns=2, seed=1, max_wait_s=240))
    summary = result.summary()
    print(f"\ngateway load test: 50 sessions x 2 turns: chat p50 {summary['chat_p50_ms']:.0f} ms, "
          f"p99 {summary['chat_p99_ms']:.0f} ms; session p50 {summary['session_p50_ms']:.0f} ms, "
          f"p99 {summary['session_p99_ms']:.0f} ms; 429 retries {summary['start_retries_429']}")
    assert result.failures == []
    # One episode per conversation: every session re-sends its conversation verbatim (no history break).
    assert summary["chat_requests"] == 100 and result.exported_episodes == 50 and result.history_breaks == 0
    assert result.lost == 0 and result.buffer_added == result.exported_episodes
    stats = _stats(http)
    assert stats["export_failures"] == 0
    buffer = stats["buffer"]
    # Nothing vanished: every episode the buffer took is trained (consumed), held or dropped with a reason.
    assert buffer["added"] == buffer["held"] + buffer["consumed"] + buffer["dropped_too_old"] + buffer["dropped_buffer_full"]


def test_training_runs_and_new_weights_reach_the_generators_without_a_restart(gateway, http):
    before = _stats(http)
    # Conversations of its own, more than one training batch (replay_buffer.batch_size=32 here): a step must follow.
    load = asyncio.run(run_load(gateway["url"], ADMIN, sessions=40, turns=2, seed=2, max_wait_s=240))
    assert load.failures == [] and load.exported_episodes >= 40 and load.lost == 0
    deadline = time.monotonic() + 240
    while _stats(http)["train_steps"] <= before["train_steps"]:
        assert time.monotonic() < deadline, _stats(http)
        time.sleep(1)
    version = _stats(http)["policy_version"]
    assert version > before["policy_version"]
    session = _start(http)
    key = _bearer(session["api_key"])
    chat = {"model": "default", "messages": [{"role": "user", "content": "31+11="}]}
    deadline = time.monotonic() + 240
    while True:  # generators poll the weight store and swap the new version in between decode steps
        versions = http.post("/v1/chat/completions", json=chat, headers=key).json()["forge"]["policy_versions"]
        if min(versions) >= version:
            break
        assert time.monotonic() < deadline, (version, versions)
        time.sleep(0.5)
    assert http.get("/health").json()["policy_version"] >= version
    http.post("/rl/end_session", headers=key)


def test_no_capacity_is_429(http):
    capacity = _stats(http)["capacity"]
    opened, refused = [], None
    for _ in range(capacity + 300):  # open sessions alone fill the capacity, whatever training frees meanwhile
        response = http.post("/rl/start_session", json={}, headers=_admin())
        if response.status_code == 429:
            refused = response
            break
        opened.append(response.json()["api_key"])
    assert refused is not None and "staleness bound" in refused.json()["error"]["message"]
    assert len(opened) <= capacity
    for key in opened:
        assert http.post("/rl/end_session", headers=_bearer(key)).status_code == 200


def test_the_serving_docs_gateway_snippet_runs_against_the_gateway(gateway, http):
    _wait_for_capacity(http)  # the snippet starts its session once, as the docs show
    defaults = (ROOT / "configs/gateway_tiny.yaml").read_text()
    assert "port: 8090" in defaults and "admin_api_key: forge-admin-key-change-me" in defaults  # what the docs show
    [snippet] = [block for block in python_blocks("serving.md") if "/rl/start_session" in block]
    done = run_block(snippet, {"http://127.0.0.1:8090": gateway["url"], "forge-admin-key-change-me": ADMIN})
    assert done["session"]["session_id"] == "demo-0" and done["reply"].model_extra["forge"]["session_id"] == "demo-0"
    assert done["ended"]["interactions"] == 1


def test_no_healthy_generator_replica_is_502_naming_its_failure_and_the_rest_of_the_gateway_goes_on(gateway, http):
    # The module gateway's last test: it leaves the gateway without a generator.
    session = _start(http)
    key = _bearer(session["api_key"])
    chat = {"model": "default", "messages": [{"role": "user", "content": "5+5="}]}

    def serves() -> None:  # a restarted replica answers (a chat made during the restart waits for it)
        assert http.post("/v1/chat/completions", json=chat, headers=key).status_code == 200

    # The gateway spawns its generator last: the newest of its processes.
    kill_the_generator_for_good(gateway["proc"].pid, gateway["run_dir"] / "gateway.log",
                                newest_job_process(gateway["proc"].pid), serves)
    refused = http.post("/v1/chat/completions", json=chat, headers=key)
    assert refused.status_code == 502, refused.text
    error = refused.json()["error"]
    assert (error["type"], error["code"]) == ("server_error", "no_healthy_generator")
    assert error["message"].startswith("service generator: no healthy replica left (replica 0: ")
    assert http.get("/health").json()["generator_replicas_healthy"] == 0
    ended = http.post("/rl/end_session", headers=key)  # the session's chats are still exported
    assert ended.status_code == 200 and ended.json()["interactions"] == 3


def test_bad_config_fails_before_any_process_starts():
    result = subprocess.run([sys.executable, "-m", "apps.gateway", "--config", "configs/gateway_tiny.yaml",
                             "replay_buffer.batch_size=30", "trainer.minibatches=4"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "replay_buffer.batch_size=30: must be a multiple of trainer.minibatches=4" in result.stderr
    assert "provisioned mesh" not in result.stdout + result.stderr
