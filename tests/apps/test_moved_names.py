"""The names moved so that no app imports another still import from their old modules for one release, each with a
DeprecationWarning naming the new place, and are the same objects (pure)."""

import importlib

import pytest

MOVED = [
    ("apps.grpo.config", "read_hf_config", "actors.model_files"),
    ("apps.grpo.config", "read_checkpoint_file", "actors.model_files"),
    ("apps.grpo.config", "check_chat_template", "actors.model_files"),
    ("apps.grpo.config", "check_same_tokenizer", "actors.model_files"),
    ("apps.grpo.checkpoints", "JobCheckpoints", "apps.run_checkpoints"),
    ("apps.grpo.checkpoints", "CheckpointConfig", "apps.run_checkpoints"),
    ("apps.sft.data", "transcript_example", "rl.demonstrations"),
    ("apps.eval.evaluate", "evaluate_task", "apps.held_out.evaluate"),
    ("apps.eval.evaluate", "Reward", "apps.held_out.evaluate"),
    ("apps.eval.scores", "pass_at_k", "apps.held_out.scores"),
    ("apps.eval.scores", "score_task", "apps.held_out.scores"),
    ("apps.eval.samplers", "RolloutSampler", "apps.held_out.samplers"),
    ("apps.eval.samplers", "EnvironmentFailed", "apps.held_out.samplers"),
    # the REST service's modules, each named for its one job (apps/server/moved.py)
    ("apps.server.session_registry", "SessionRegistry", "apps.server.sessions"),
    ("apps.server.session_registry", "refusal_summary", "apps.server.sessions"),
    ("apps.server.checkpoint_store", "CheckpointStore", "apps.server.checkpoints"),
    ("apps.server.checkpoint_store", "RECORD", "apps.server.checkpoints"),
    ("apps.server.checkpointing", "Checkpointing", "apps.server.checkpoints"),
    ("apps.server.training_actor", "ServerTrainer", "apps.server.trainer"),
    ("apps.server.training_actor", "ServerTrainerActor", "apps.server.trainer"),
    ("apps.server.adapter_sampler", "AdapterSampler", "apps.server.lora_trainer"),
    ("apps.server.adapter_sampler", "shared_base_model", "apps.server.lora_trainer"),
    ("apps.server.tinker_routes", "TinkerPaths", "apps.server.tinker.routes"),
    ("apps.server.tinker_routes", "build_tinker_routes", "apps.server.tinker.routes"),
    ("apps.server.tinker_service", "TinkerService", "apps.server.tinker.service"),
    ("apps.server.tinker_service", "tinker_path", "apps.server.tinker.service"),
    ("apps.server.tinker_wire", "decode_forward_backward", "apps.server.tinker.wire"),
    ("apps.server.tinker_wire", "encode_forward_backward_output", "apps.server.tinker.wire"),
    ("apps.server.tinker_wire", "encode_sample_response", "apps.server.tinker.wire"),
    ("apps.server.tinker_wire", "WireSequence", "apps.server.tinker.wire"),
    ("apps.server.futures", "FutureStore", "apps.server.tinker.futures"),
    ("apps.server.batches", "tinker_batch", "apps.server.tinker.batches"),
]


@pytest.mark.parametrize("old,name,new", MOVED, ids=[f"{o}.{n}" for o, n, _ in MOVED])
def test_a_moved_name_imports_from_its_old_module_with_a_deprecation_warning(old, name, new):
    with pytest.warns(DeprecationWarning, match=rf"^{old}.{name} is deprecated: use {new}.{name}$"):
        value = getattr(importlib.import_module(old), name)
    assert value is getattr(importlib.import_module(new), name)


@pytest.mark.parametrize("old", sorted({old for old, _, _ in MOVED}))
def test_a_name_that_never_was_there_is_still_an_attribute_error(old):
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        getattr(importlib.import_module(old), "no_such_name")


def test_every_apps_server_module_moved_is_checked_here():
    from apps.server.moved import MOVED as SERVER_MOVED

    assert {(old, new) for old, (new, _) in SERVER_MOVED.items()} <= {(old, new) for old, _, new in MOVED}
