import math
import random
import threading
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from actors import engines
from actors.engines import Engine, make_engine
from actors.engines.hf import HFEngine
from actors.engines.prefix_cache import BLOCK
from actors.logprobs import token_logprobs
from rl import sampling
from forge.metrics import drain_local
from rl.sampling import MAX_KEPT_TOKENS
from rl.tiny_model import SPECIAL_TOKENS, build_tiny_checkpoint
from rl.types import Episode, SamplingParams, TrainBatch

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


def assert_same_up_to_rounding(groups, expected):
    """Equal completions, log-probs within float rounding: a repeated prompt is served from the KV the engine kept
    (the same arithmetic in another batch shape)."""
    for group, expected_group in zip(groups, expected, strict=True):
        for completion, reference in zip(group, expected_group, strict=True):
            torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(reference.logprobs),
                                       atol=1e-5, rtol=0)
            assert replace(completion, logprobs=reference.logprobs) == reference


def test_greedy_is_deterministic_and_independent_of_the_batch(engine, checkpoint):
    greedy = SamplingParams(n=2, max_tokens=10, temperature=0.0)
    batched = engine.generate(PROMPTS, greedy)
    assert HFEngine(checkpoint, kv_reuse_tokens=0).generate(PROMPTS, greedy) == batched
    assert_same_up_to_rounding(engine.generate(PROMPTS, greedy), batched)
    alone = engine.generate([PROMPTS[1]], greedy)[0]
    assert [c.token_ids for c in alone] == [c.token_ids for c in batched[1]]
    assert batched[0][0].token_ids == batched[0][1].token_ids


def test_n_samples_per_prompt_differ_and_a_request_seed_reproduces_them(engine):
    params = SamplingParams(n=5, max_tokens=8, temperature=1.0, seed=7)
    first = engine.generate(PROMPTS, params)
    assert [len(group) for group in first] == [5, 5, 5]
    assert len({tuple(c.token_ids) for c in first[2]}) > 1
    assert_same_up_to_rounding(engine.generate(PROMPTS, params), first)
    token_id_prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert_same_up_to_rounding(engine.generate(token_id_prompts, params), first)


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
    assert make_engine("hf", model=checkpoint, kv_reuse_tokens=0)._prefix_cache is None  # generator.engine_args reach it
    with pytest.raises(ValueError, match=r"kind='sglang'.*\['hf', 'vllm'\]"):
        make_engine("sglang")
    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)  # as on a host without vllm
    with pytest.raises(ImportError, match="vllm package is not installed"):
        make_engine("vllm", model=checkpoint)


# ----- KV reuse across turns: a prompt continuing a kept sequence prefills only its new tokens -----


def random_ids(rng: random.Random, vocab_size: int, count: int) -> list[int]:
    return [rng.randrange(len(SPECIAL_TOKENS), vocab_size) for _ in range(count)]


def cached_tokens(engine: HFEngine, prompts: list[list[int]], params: SamplingParams):
    """The completions and the generator/prefix_cached_tokens the call recorded."""
    drain_local()
    groups = engine.generate(prompts, params)
    return groups, drain_local()["generator/prefix_cached_tokens"].total


def kept_length(completions, prompt_ids: list[int], token_ids: list[int]) -> int:
    """How many tokens of a finished row the engine keeps KV for: its prompt and its tokens but a last one that was
    never fed back (the batch ran as many steps as its longest completion)."""
    steps = max(len(c.token_ids) for c in completions)
    return len(prompt_ids) + min(len(token_ids), steps - 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_later_turns_reuse_kept_kv_and_match_a_full_prefill(checkpoint, temperature):
    """Three turns of conversations of different lengths, each turn one batch (left padding, rows hitting
    different prefix lengths, a new conversation that hits nothing, n=2 rows sharing a kept prefix, rows stopping
    at different steps): tokens equal and log-probs within 1e-5 of an engine that prefills everything, and the
    recorded cached tokens are exactly the kept prefixes."""
    reuse, full = HFEngine(checkpoint, seed=0), HFEngine(checkpoint, seed=0, kv_reuse_tokens=0)
    vocab, rng = reuse.model.config.vocab_size, random.Random(0)
    prompts = [random_ids(rng, vocab, length) for length in (41, 23, 57)]
    expected_cached = 0
    for turn, n in enumerate([1, 1, 2]):
        params = SamplingParams(n=n, max_tokens=10, temperature=temperature, seed=5 + turn)
        # Stop at the third token conversation 0 would produce: rows end at different steps.
        params = replace(params, stop_token_ids=[full.generate(prompts[:1], params)[0][0].token_ids[2]])
        got, cached = cached_tokens(reuse, prompts, params)
        want, not_cached = cached_tokens(full, prompts, params)
        assert not_cached == 0
        assert cached == expected_cached and (turn == 0) == (cached == 0)
        for prompt, group, reference in zip(prompts, got, want):
            assert len(group) == n
            for completion, fresh in zip(group, reference):
                assert completion.prompt_ids == prompt
                assert completion.token_ids == fresh.token_ids
                torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(fresh.logprobs),
                                           atol=1e-5, rtol=0)
        completions = [c for group in got for c in group]
        assert len({len(c.token_ids) for c in completions}) > 1  # rows stopped at different steps
        # The next turn: every conversation's first completion + an observation, and one new conversation.
        prompts = [g[0].prompt_ids + g[0].token_ids + random_ids(rng, vocab, 5) for g in got]
        expected_cached = sum(kept_length(completions, g[0].prompt_ids, g[0].token_ids) for g in got)
        prompts.append(random_ids(rng, vocab, 30 + turn))


def test_a_prompt_that_is_a_prefix_of_a_kept_sequence_reuses_all_but_its_last_token(checkpoint):
    engine, full = HFEngine(checkpoint, seed=0), HFEngine(checkpoint, seed=0, kv_reuse_tokens=0)
    prompt = random_ids(random.Random(1), engine.model.config.vocab_size, 40)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    [[first]], _ = cached_tokens(engine, [prompt], greedy)
    for asked in (prompt, prompt[:33]):  # the same prompt again (a retry), and a prefix of it
        [[again]], cached = cached_tokens(engine, [asked], greedy)
        assert cached == len(asked) - 1
        [[fresh]] = full.generate([asked], greedy)
        assert again.token_ids == fresh.token_ids
        torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0)
    assert first.token_ids == full.generate([prompt], greedy)[0][0].token_ids


def test_equal_length_prompts_that_all_hit_reuse_the_shortest_prefix(checkpoint):
    """Then the batch has no padding at all (transformers drops the mask: the fast kernels)."""
    engine, full = HFEngine(checkpoint, seed=0), HFEngine(checkpoint, seed=0, kv_reuse_tokens=0)
    rng = random.Random(6)
    a, b = (random_ids(rng, engine.model.config.vocab_size, 40) for _ in range(2))
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    [[first], _] = engine.generate([a, b], greedy)
    prompts = [a + first.token_ids + [9, 9, 9], b[:30] + [9] * 17]  # 47 tokens each; 43 and 30 kept
    got, cached = cached_tokens(engine, prompts, greedy)
    assert cached == 2 * 30
    for [completion], [fresh] in zip(got, full.generate(prompts, greedy)):
        assert completion.token_ids == fresh.token_ids
        torch.testing.assert_close(torch.tensor(completion.logprobs), torch.tensor(fresh.logprobs), atol=1e-5, rtol=0)


def _scaled(engine: HFEngine, factor: float) -> dict[str, torch.Tensor]:
    """Every weight times `factor`: new KV for the same tokens (RMSNorm undoes a scale, so the layers'
    projections are changed, not the embeddings alone)."""
    return {name: (t * factor if "proj" in name else t.clone()) for name, t in engine.model.state_dict().items()}


def _lora(engine: HFEngine, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    adapter = {}
    for module in ("model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"):
        out_dim, in_dim = engine.model.state_dict()[f"{module}.weight"].shape
        adapter[f"{module}.lora_A.weight"] = torch.randn(2, in_dim, generator=generator)
        adapter[f"{module}.lora_B.weight"] = torch.randn(out_dim, 2, generator=generator)
    return adapter


@pytest.mark.parametrize("swap", ["load_weights", "stage_weights", "lora"])
def test_a_weight_change_drops_the_kept_kv(checkpoint, swap):
    """After a swap the next turn prefills everything, and equals an engine that got the same weights and kept
    nothing (KV that the old weights computed would give other log-probs)."""
    engine, full = HFEngine(checkpoint, seed=0), HFEngine(checkpoint, seed=0, kv_reuse_tokens=0)
    rng = random.Random(2)
    prompts = [random_ids(rng, engine.model.config.vocab_size, length) for length in (35, 50)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    first, _ = cached_tokens(engine, prompts, greedy)
    weights = _lora(engine, 0) if swap == "lora" else _scaled(engine, 1.5)
    for target in (engine, full):
        (target.load_weights if swap == "load_weights" else target.stage_weights)(weights, 1)
    assert len(engine._prefix_cache) == 0 and engine._prefix_cache.tokens == 0
    following = [g[0].prompt_ids + g[0].token_ids + [7, 8, 9] for g in first]
    got, cached = cached_tokens(engine, following, greedy)
    assert cached == 0
    want = full.generate(following, greedy)
    for [a], [b] in zip(got, want):
        assert a.token_ids == b.token_ids and a.policy_versions == [1] * len(a.token_ids)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    # ... and the new weights' KV is kept and reused from then on.
    _, cached = cached_tokens(engine, [following[0] + got[0][0].token_ids + [5]], greedy)
    assert cached == len(following[0]) + len(got[0][0].token_ids) - 1


def test_a_batch_whose_weights_changed_mid_generation_keeps_no_kv(checkpoint):
    engine = HFEngine(checkpoint, seed=0)
    new_weights = _scaled(engine, 1.5)
    forward, calls = engine.model.forward, []

    def forward_then_stage(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # staged while the batch decodes: applied at the next step boundary
            engine.stage_weights(new_weights, 1)
        return forward(*args, **kwargs)

    engine.model.forward = forward_then_stage
    prompt = random_ids(random.Random(3), engine.model.config.vocab_size, 40)
    [[completion]] = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))
    engine.model.forward = forward
    assert completion.policy_versions == [0, 0, 1, 1, 1]
    assert len(engine._prefix_cache) == 0  # its KV mixes two versions' weights: not kept
    _, cached = cached_tokens(engine, [prompt + completion.token_ids], SamplingParams(max_tokens=2))
    assert cached == 0


def test_kept_kv_is_bounded_least_recently_used_first(checkpoint):
    bound = 130
    engine = HFEngine(checkpoint, seed=0, kv_reuse_tokens=bound)
    rng = random.Random(4)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    a, b, c = (random_ids(rng, engine.model.config.vocab_size, 40) for _ in range(3))
    for prompt in (a, b):
        engine.generate([prompt], greedy)  # keeps 40 + 3 tokens each (the 4th was never fed back)
    assert len(engine._prefix_cache) == 2 and engine._prefix_cache.tokens == 86
    _, cached = cached_tokens(engine, [a + [9] * BLOCK], greedy)
    assert cached == len(a)  # a's kept sequence (a + its first 3 tokens) up to where the prompts part
    # Its own 59 tokens pushed out b, added after a but used less recently.
    assert engine._prefix_cache.tokens == 43 + 59
    _, cached = cached_tokens(engine, [b + [9] * BLOCK], greedy)
    assert cached == 0
    engine.generate([c * 4], greedy)  # 163 tokens to keep: more than the bound, not kept
    assert engine._prefix_cache.tokens <= bound and all(len(ids) < 100 for ids in engine._prefix_cache._sequences)


def test_reuse_off_and_bad_bounds(checkpoint):
    off = HFEngine(checkpoint, kv_reuse_tokens=0)
    prompt = random_ids(random.Random(5), off.model.config.vocab_size, 40)
    off.generate([prompt], SamplingParams(max_tokens=3))
    _, cached = cached_tokens(off, [prompt + [9] * 4], SamplingParams(max_tokens=3))
    assert cached == 0 and off._prefix_cache is None
    with pytest.raises(ValueError, match=r"HFEngine.kv_reuse_tokens=-1: must be >= 0"):
        HFEngine(checkpoint, kv_reuse_tokens=-1)
    assert HFEngine.from_model(off.model, off.tokenizer)._prefix_cache is None  # a model trained in place: nothing kept
