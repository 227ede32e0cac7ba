import math
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import engines
from actors.engines import Engine, make_engine
from actors.engines.hf import HFEngine
from actors.logprobs import token_logprobs
from forge import sampling
from forge.sampling import MAX_KEPT_TOKENS
from forge.tiny_model import build_tiny_checkpoint
from forge.types import Episode, SamplingParams, TrainBatch

PROMPTS = ["1+2=", "12+34=", "what is 99+1? 99+1="]  # different lengths: left padding in every batch


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    # The tiny model's matmuls take microseconds; extra intra-op threads only contend on a shared CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture
def engine(checkpoint):
    return HFEngine(checkpoint, seed=0)


def teacher_forced(model, prompt_ids, token_ids, temperature):
    """Log-probs of `token_ids` after `prompt_ids`, one unpadded forward pass without a cache."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs, logprobs.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_behaviour_logprobs_match_a_teacher_forced_forward(engine, checkpoint, temperature):
    tokenizer = engine.tokenizer
    # Stopping on common characters gives completions of many different lengths within one batch.
    stops = tokenizer.convert_tokens_to_ids(list("02468ae"))
    params = SamplingParams(n=4, max_tokens=12, temperature=temperature, stop_token_ids=stops, seed=1)
    results = engine.generate(PROMPTS, params)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    lengths = set()
    for prompt, completions in zip(PROMPTS, results):
        assert len(completions) == 4
        for completion in completions:
            assert completion.prompt_ids == tokenizer.encode(prompt)
            all_logprobs, expected = teacher_forced(reference, completion.prompt_ids, completion.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)
            if temperature == 0:
                assert completion.token_ids == all_logprobs.argmax(-1).tolist()
            assert completion.policy_versions == [0] * len(completion.token_ids)
            assert completion.kept_token_ids is None  # nothing truncated: the trainer uses the full vocabulary
            assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            lengths.add(len(completion.token_ids))
    assert len(lengths) > 1


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.8), (1.0, 5, 1.0), (0.7, 20, 0.9)])
def test_trainer_replays_the_kept_sets_of_truncated_sampling(engine, checkpoint, temperature, top_k, top_p):
    """The trainer's log-probs (actors.logprobs.token_logprobs over the batch's kept sets, teacher-forced through
    Completion -> Episode -> TrainBatch) equal the behaviour log-probs of top-k / top-p sampling within 1e-5."""
    stops = engine.tokenizer.convert_tokens_to_ids(list("02468ae"))
    params = SamplingParams(n=4, max_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p,
                            stop_token_ids=stops, seed=1)
    completions = [c for group in engine.generate(PROMPTS, params) for c in group]
    episodes = [Episode.from_completion(c, episode_id=i, group_id=0, reward=0.0) for i, c in enumerate(completions)]
    batch = TrainBatch.from_episodes(episodes, engine.pad_token_id)
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    with torch.no_grad():
        logits = reference(batch.input_ids).logits[:, :-1]  # right padding changes no earlier logit
    targets, on_response = batch.input_ids[:, 1:], batch.response_mask.bool()
    replayed = token_logprobs(logits, targets, temperature, batch.kept_token_ids)
    torch.testing.assert_close(replayed[on_response], batch.behaviour_logprobs[on_response], atol=1e-5, rtol=0)
    # Without the kept sets the trainer measures another policy: the full vocabulary's log-probs are lower.
    full = token_logprobs(logits, targets, temperature)
    assert bool((full[on_response] < batch.behaviour_logprobs[on_response] - 1e-3).all())

    # The kept sets are what the sampler kept: exactly top_k tokens, or the smallest most-likely prefix holding
    # top_p of the mass, each holding the sampled token; and every token still carries its policy version.
    probs = (logits.float() / temperature).softmax(-1)
    for row, completion in enumerate(completions):
        kept = completion.kept_token_ids
        assert kept.dtype == torch.int32 and kept.shape[0] == len(completion.token_ids)
        assert completion.policy_versions == [0] * len(completion.token_ids)
        start = len(completion.prompt_ids) - 1
        for step, token in enumerate(completion.token_ids):
            ids = kept[step][kept[step] >= 0].long()
            assert token in ids.tolist() and len(set(ids.tolist())) == len(ids)
            p = probs[row, start + step]
            assert p[ids].min() >= p.topk(len(ids)).values[-1] - 1e-6  # the most likely tokens
            if top_p == 1:
                assert len(ids) == top_k
                continue
            width = min(top_k or MAX_KEPT_TOKENS, p.numel())
            top = p.topk(width).values / p.topk(width).values.sum()  # renormalised over the top_k first
            assert top[: len(ids) - 1].sum() <= top_p + 1e-5  # the last kept token was still needed ...
            assert top[: len(ids)].sum() > top_p - 1e-5 or len(ids) == width  # ... and it was the last one needed


def test_top_p_keeps_at_most_max_kept_tokens(engine, checkpoint, monkeypatch):
    """Past the bound top_p samples from the MAX_KEPT_TOKENS most likely tokens: the recorded set is complete and
    the replay exact (a top_k above the bound is refused outright)."""
    monkeypatch.setattr(sampling, "MAX_KEPT_TOKENS", 3)
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, top_p=0.99, seed=2)
    completions = [c for group in engine.generate(PROMPTS, params) for c in group]
    assert all(c.kept_token_ids.shape[1] == 3 for c in completions)  # the near-uniform tiny model needs more
    batch = TrainBatch.from_episodes(
        [Episode.from_completion(c, episode_id=i, group_id=0, reward=0.0) for i, c in enumerate(completions)],
        engine.pad_token_id)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(checkpoint)(batch.input_ids).logits[:, :-1]
    on_response = batch.response_mask.bool()
    replayed = token_logprobs(logits, batch.input_ids[:, 1:], 1.0, batch.kept_token_ids)
    torch.testing.assert_close(replayed[on_response], batch.behaviour_logprobs[on_response], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"SamplingParams.top_k=4: must be <= 3"):
        SamplingParams(top_k=4)


def test_greedy_is_deterministic_and_independent_of_the_batch(engine):
    greedy = SamplingParams(n=2, max_tokens=10, temperature=0.0)
    batched = engine.generate(PROMPTS, greedy)
    assert engine.generate(PROMPTS, greedy) == batched
    alone = engine.generate([PROMPTS[1]], greedy)[0]
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched[1]]
    assert batched[0][0].token_ids == batched[0][1].token_ids


def test_n_samples_per_prompt_differ_and_a_request_seed_reproduces_them(engine):
    params = SamplingParams(n=5, max_tokens=8, temperature=1.0, seed=7)
    first = engine.generate(PROMPTS, params)
    assert [len(group) for group in first] == [5, 5, 5]
    assert len({tuple(c.token_ids) for c in first[2]}) > 1
    assert engine.generate(PROMPTS, params) == first
    token_id_prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert engine.generate(token_id_prompts, params) == first


@pytest.mark.parametrize("top_k, top_p", [(1, 1.0), (0, 1e-6), (50, 1e-6)])
def test_a_single_kept_token_is_sampled_with_probability_one(engine, top_k, top_p):
    greedy = engine.generate(PROMPTS, SamplingParams(n=1, max_tokens=8, temperature=0.0))
    narrow = engine.generate(PROMPTS, SamplingParams(n=3, max_tokens=8, temperature=1.0, top_k=top_k, top_p=top_p))
    for [expected], samples in zip(greedy, narrow):
        for sample in samples:
            assert sample.token_ids == expected.token_ids  # only the top token survives the filter
            assert sample.logprobs == [0.0] * len(sample.token_ids)  # ... and is drawn with probability 1
            assert sample.kept_token_ids.tolist() == [[token] for token in sample.token_ids]


def _with_lm_head(engine, make_head):
    state = {name: tensor.detach().clone() for name, tensor in engine.model.state_dict().items()}
    state["lm_head.weight"] = make_head(state["lm_head.weight"])
    return state


def test_stops_per_sequence_at_eos_and_at_max_tokens(engine):
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    [[a]], [[b]] = engine.generate([PROMPTS[0]], greedy), engine.generate([PROMPTS[2]], greedy)
    eos = engine.tokenizer.eos_token_id
    assert a.token_ids[0] != b.token_ids[0] and eos not in a.token_ids + b.token_ids
    assert a.finish_reason == "length" and len(a.token_ids) == 6

    # Swap the output rows of EOS and of prompt 0's first greedy token: prompt 0 now ends at once.
    def swap(head):
        head[[eos, a.token_ids[0]]] = head[[a.token_ids[0], eos]]
        return head

    engine.load_weights(_with_lm_head(engine, swap), version=1)
    [[a2], [b2]] = engine.generate([PROMPTS[0], PROMPTS[2]], greedy)
    assert a2.token_ids == [eos] and a2.finish_reason == "stop" and a2.text == ""
    assert a2.policy_versions == [1]
    assert b2.finish_reason == "length" and len(b2.token_ids) == 6


def test_generation_stops_at_the_model_window(engine):
    window = engine.max_model_len
    [[completion]] = engine.generate([[5] * (window - 3)], SamplingParams(max_tokens=16, temperature=0.0))
    assert len(completion.token_ids) == 3 and completion.finish_reason == "length"


def test_weights_staged_mid_generation_apply_between_decode_steps(engine):
    vocab = engine.model.config.vocab_size
    zero_head = _with_lm_head(engine, torch.zeros_like)  # version 1 predicts a uniform distribution
    forward = engine.model.forward
    calls, in_second_step, staged = [], threading.Event(), threading.Event()

    def paused_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the decode step for token 1: stage from another thread while it runs
            in_second_step.set()
            assert staged.wait(10)
        return forward(*args, **kwargs)

    def stage_from_another_thread():
        assert in_second_step.wait(10)
        engine.stage_weights(zero_head, version=1)
        staged.set()

    engine.model.forward = paused_forward
    stager = threading.Thread(target=stage_from_another_thread)
    stager.start()
    [[completion]] = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0.0))
    stager.join()

    assert completion.policy_versions == [0, 0, 1, 1, 1, 1]
    assert engine.policy_version == 1
    uniform = -math.log(vocab)
    assert all(abs(lp - uniform) > 1e-3 for lp in completion.logprobs[:2])
    assert completion.logprobs[2:] == pytest.approx([uniform] * 4, abs=1e-6)


def test_weights_staged_while_idle_apply_at_once(engine):
    engine.stage_weights(_with_lm_head(engine, torch.zeros_like), version=3)
    assert engine.policy_version == 3
    assert float(engine.model.lm_head.weight.abs().sum()) == 0.0


def test_mismatching_state_dict_is_refused_and_old_weights_kept(engine):
    before = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    bad = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in engine.parameter_specs().items()}
    del bad["model.norm.weight"]
    bad["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    bad["model.bogus.weight"] = torch.zeros(1)
    for load in (engine.load_weights, engine.stage_weights):
        with pytest.raises(ValueError) as error:
            load(bad, version=1)
        message = str(error.value)
        for name in ("model.norm.weight", "model.bogus.weight", "model.layers.0.mlp.up_proj.weight", "(3, 3)"):
            assert name in message
    with pytest.raises(ValueError, match="version=-1"):
        engine.load_weights(before, version=-1)
    assert engine.policy_version == 0
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_bad_prompts_are_refused_naming_the_request(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate(["1+1=", ""], SamplingParams())
    with pytest.raises(ValueError, match=f"prompt 0 has {engine.max_model_len} tokens"):
        engine.generate([[5] * engine.max_model_len], SamplingParams())
    with pytest.raises(ValueError, match="top_k=-1"):
        engine.generate(["1+1="], SamplingParams(top_k=-1))


def test_make_engine(checkpoint, monkeypatch):
    engine = make_engine("hf", model=checkpoint)
    assert isinstance(engine, HFEngine) and isinstance(engine, Engine)
    with pytest.raises(ValueError, match=r"kind='sglang'.*\['hf', 'vllm'\]"):
        make_engine("sglang")
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)  # as on a host without vllm
    with pytest.raises(ImportError, match="vllm package is not installed"):
        make_engine("vllm", model=checkpoint)
