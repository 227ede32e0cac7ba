"""Chat mode of the multi-turn rollout (rl.environments.chat): every turn wrapped by the model's chat template, by
token ids, against character-level tokenizers with real templates (built here, no hub)."""

from __future__ import annotations

import pytest

from rl.environments.chat import ChatTemplate
from rl.environments.config import EnvironmentConfig
from rl.environments.protocol import StepResult
from rl.environments.rollout import run_episodes
from forge.metrics import drain_local
from rl.tiny_model import build_tokenizer
from rl.types import Completion, SamplingParams
from tests.rl.tasks.test_chat import BOS_TEMPLATE, CHATML, chat_tokenizer
from tests.support import tokenizer_merging_across_turns

# Qwen3's way with history: an earlier assistant turn is shown without its thinking, so the template's rendering of a
# longer conversation does not start with its rendering of a shorter one.
QWEN3_LIKE = (
    "{% set ns = namespace(last_user=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 < ns.last_user %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chatml():
    return chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class ChatModel:
    """Writes `turns[k]` (text) on its k-th turn of its one episode, followed by `end` (None: cut by length); records
    every prompt and the stop tokens it was given."""

    def __init__(self, tokenizer, turns: list[str], end: int | None) -> None:
        self.tokenizer, self.turns, self.end = tokenizer, turns, end
        self.prompts: list[list[int]] = []
        self.stop_token_ids: list[list[int]] = []

    async def __call__(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        self.stop_token_ids.append(list(params.stop_token_ids))
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            text = self.turns[min(len(self.prompts), len(self.turns)) - 1]
            tokens = ids(self.tokenizer, text) + ([self.end] if self.end is not None else [])
            out.append(Completion(prompt_ids=list(prompt), token_ids=tokens, text=text,
                                  logprobs=[-0.5] * len(tokens), policy_versions=[3] * len(tokens),
                                  finish_reason="stop" if self.end is not None else "length"))
        return out


class Tool:
    """Replies `replies[k]` to the model's k-th turn; done (reward 1) after the last."""

    def __init__(self, first: str, replies: list[str]) -> None:
        self.first, self.replies, self.actions = first, replies, []

    async def reset(self, task) -> str:
        return self.first

    async def step(self, action: str) -> StepResult:
        self.actions.append(action)
        done = len(self.actions) > len(self.replies)
        return StepResult(observation="" if done else self.replies[len(self.actions) - 1], reward=float(done),
                          done=done)


async def play(tokenizer, model, env, *, end_token_ids=(), system_prompt=None, **limits):
    chat = ChatTemplate(tokenizer, system_prompt=system_prompt)
    config = EnvironmentConfig(**{"max_turns": 5, "max_total_tokens": 512, **limits})
    (t,) = await run_episodes(model, [env], [None], SamplingParams(n=1, max_tokens=32), config,
                              encode=lambda text: pytest.fail("chat mode encodes no text itself"),
                              end_token_ids=end_token_ids, chat=chat)
    drain_local()
    return t


def conversation(env: Tool, model: ChatModel, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": env.first}]
    for k in range(turns):
        messages.append({"role": "assistant", "content": model.turns[k]})
        if k < len(env.replies):
            messages.append({"role": "user", "content": env.replies[k]})
    return messages


async def test_a_chat_episode_is_the_templates_rendering_of_the_whole_conversation(chatml):
    im_end, eos = chatml.convert_tokens_to_ids("<|im_end|>"), chatml.eos_token_id
    model = ChatModel(chatml, ["c?", "d?", "91"], end=im_end)
    env = Tool("12+c=", ["7;", "4;"])
    t = await play(chatml, model, env, end_token_ids=[eos, im_end])
    # 3 model turns: the end-of-turn token ended the first two turns, not the episode (even named an end token).
    assert (t.end, len(t.turns), t.reward) == ("done", 3, 1.0)
    rendered = chatml.apply_chat_template(conversation(env, model, 3), tokenize=True, return_dict=False)
    newline = ids(chatml, "\n")
    assert t.ids + newline == rendered  # the template ends its last turn with a newline the episode does not need
    assert t.prompt_ids == chatml.apply_chat_template(conversation(env, model, 0), add_generation_prompt=True, return_dict=False)
    # The mask covers exactly the model's tokens, its end-of-turn tokens included; the template's are the environment's.
    model_tokens = [tok for k in range(3) for tok in ids(chatml, model.turns[k]) + [im_end]]
    assert [tok for tok, m in zip(t.completion_ids, t.mask) if m] == model_tokens
    assert [t.completion_ids[s:e] for s, e in t.turns] == [ids(chatml, text) + [im_end] for text in model.turns]
    assert t.versions == [3 if m else -1 for m in t.mask] and t.logprobs == [-0.5 if m else 0.0 for m in t.mask]
    # Each turn's prompt is the previous one's exact ids plus the template's; every turn stops at the end of turn.
    assert model.prompts[1] == model.prompts[0] + t.completion_ids[: len(model.prompts[1]) - len(t.prompt_ids)]
    assert all(im_end in stop for stop in model.stop_token_ids)
    assert env.actions == model.turns


async def test_a_turn_cut_by_length_is_ended_by_the_templates_token_as_the_environments(chatml):
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    model = ChatModel(chatml, ["c?", "91"], end=None)  # no turn ends with its end-of-turn token
    env = Tool("12+c=", ["7;"])
    t = await play(chatml, model, env)
    assert (t.end, len(t.turns)) == ("done", 2)
    first_turn_end = t.turns[0][1]
    assert t.completion_ids[first_turn_end] == im_end and t.mask[first_turn_end] == 0
    # The whole conversation as the template writes it, up to the last turn the model did not end.
    rendered = chatml.apply_chat_template(conversation(env, model, 2), tokenize=True, return_dict=False)
    assert t.ids == rendered[: len(t.ids)] and rendered[len(t.ids):] == [im_end, *ids(chatml, "\n")]
    assert sum(t.mask) == len(ids(chatml, "c?")) + len(ids(chatml, "91"))


async def test_when_eos_is_the_end_of_turn_it_ends_turns_and_a_distinct_eos_still_ends_the_episode():
    tokenizer = chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))
    tokenizer.eos_token = "<|im_end|>"  # Qwen3's instruct models: EOS is the end of turn
    model = ChatModel(tokenizer, ["c?", "91"], end=tokenizer.eos_token_id)
    t = await play(tokenizer, model, Tool("12+c=", ["7;"]), end_token_ids=[tokenizer.eos_token_id])
    assert (t.end, len(t.turns), t.reward) == ("done", 2, 1.0)
    # A tokenizer whose EOS is not the end of turn: the model writing EOS ends the episode, as in plain mode.
    chatml = chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))
    eos_model = ChatModel(chatml, ["c?", "91"], end=chatml.eos_token_id)
    t = await play(chatml, eos_model, Tool("12+c=", ["7;"]), end_token_ids=[chatml.eos_token_id])
    assert (t.end, len(t.turns), t.reward) == ("done", 1, 0.0)


async def test_a_template_with_bos_and_its_own_end_of_turn_and_a_system_prompt():
    tokenizer = chat_tokenizer(BOS_TEMPLATE, ("<s>", "<|eot|>"), add_bos=True)
    eot = tokenizer.convert_tokens_to_ids("<|eot|>")
    model = ChatModel(tokenizer, ["c?", "91"], end=eot)
    env = Tool("12+c=", ["7;"])
    t = await play(tokenizer, model, env, system_prompt="Ask, then add.")
    system = [{"role": "system", "content": "Ask, then add."}]
    assert t.ids == tokenizer.apply_chat_template(system + conversation(env, model, 2), tokenize=True, return_dict=False)
    assert t.ids.count(tokenizer.bos_token_id) == 1 and t.ids[0] == tokenizer.bos_token_id
    assert ChatTemplate(tokenizer).end_of_turn_id == eot


async def test_a_template_that_shows_earlier_turns_differently_changes_nothing_the_model_wrote():
    qwen3 = chat_tokenizer(QWEN3_LIKE, ("<|im_start|>", "<|im_end|>"))
    im_end = qwen3.convert_tokens_to_ids("<|im_end|>")
    model = ChatModel(qwen3, ["<think>ask</think>c?", "<think>add</think>91"], end=im_end)
    env = Tool("12+c=", ["7;"])
    t = await play(qwen3, model, env)
    # The thinking stays where the model wrote it: the sequence is the conversation as a template that keeps it shows.
    chatml = chat_tokenizer(CHATML, ("<|im_start|>", "<|im_end|>"))
    assert t.ids + ids(qwen3, "\n") == chatml.apply_chat_template(conversation(env, model, 2), tokenize=True, return_dict=False)
    assert qwen3.apply_chat_template(conversation(env, model, 2), tokenize=True, return_dict=False) != t.ids + ids(qwen3, "\n")


async def test_token_id_observations_are_the_environments_own_tokens(chatml):
    class IdsTool(Tool):
        async def reset(self, task) -> list[int]:
            return [5, 6]

        async def step(self, action: str) -> StepResult:
            result = await super().step(action)
            return StepResult([7, 8], result.reward, result.done) if not result.done else result

    t = await play(chatml, ChatModel(chatml, ["c?", "91"], end=chatml.convert_tokens_to_ids("<|im_end|>")),
                   IdsTool("", ["x"]))
    assert t.prompt_ids == [5, 6] and t.completion_ids[t.turns[0][1]:t.turns[1][0]] == [7, 8]


def test_a_tokenizer_without_a_chat_template_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"environment.chat_template=true: the model's tokenizer .* has no chat "
                                         r"template; set environment.chat_template=false"):
        ChatTemplate(build_tokenizer())


def test_a_template_that_drops_the_models_turn_is_refused(chatml):
    tokenizer = chat_tokenizer("{% for m in messages %}{% if m.role != 'assistant' %}{{ m.content }}{% endif %}"
                               "{% endfor %}", ("<|im_end|>",))
    with pytest.raises(ValueError, match="does not write an assistant message's text once"):
        ChatTemplate(tokenizer)


def test_a_template_whose_tokens_merge_with_the_models_turn_is_refused():
    # A BPE merge across the end of the model's text ("e" + "!"): the template's tokens after a turn are not its own.
    tokenizer = tokenizer_merging_across_turns()
    tokenizer.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}!\n{% endfor %}" \
                              "{% if add_generation_prompt %}assistant: {% endif %}"
    with pytest.raises(ValueError, match="not prefix-stable"):
        ChatTemplate(tokenizer)


def test_a_template_that_refuses_a_system_message_names_the_field(chatml):
    tokenizer = chat_tokenizer("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
                               "{% endif %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}",
                               ("<|im_start|>", "<|im_end|>"))
    with pytest.raises(ValueError, match=r"no system\); leave environment.system_prompt unset"):
        ChatTemplate(tokenizer, system_prompt="be brief")
    assert ChatTemplate(tokenizer).end_of_turn_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_a_system_prompt_needs_chat_mode():
    with pytest.raises(ValueError, match=r"system_prompt='be brief': a system message needs chat_template=true"):
        EnvironmentConfig(system_prompt="be brief")
    assert EnvironmentConfig(chat_template=True, system_prompt="be brief").system_prompt == "be brief"
