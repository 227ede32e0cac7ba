"""What a GRPO run starts from: its task and reward, and its actors (its model: `rollouts.warm_started_model`, a
distillation teacher's: `rollouts.teacher_model`).

    task = make_task(cfg)
    actors = await start_actors(cfg, model_path, teacher_path)  # trainer, replay buffer, generators, reference/teacher
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Awaitable, Callable

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from actors.engine_scorer import EngineScorer
from actors.engines.vllm_args import lora_engine_args
from actors.generator import Generator
from actors.reference_model import ReferenceActor, ReferenceConfig
from actors.replay_buffer import ReplayBufferActor
from actors.trainer import TrainerActor
from apps.grpo.config import GRPOConfig
from forge.provisioner import get_provisioner
from rl import tasks
from rl.tasks.protocol import Task
from forge.config import load_callable
from forge.service import Service
from forge.weights.startup import start_weight_store

WEIGHTS = "policy"  # the weight store namespace the trainer publishes to and the generators follow


def make_task(cfg: GRPOConfig) -> Task:
    return tasks.make_task(cfg.task, seed=cfg.seed, model=cfg.model)


def reward_function(cfg: GRPOConfig, task: Task) -> tuple[Callable[[str, str], float], float | None]:
    """The reward and its timeout: the user's `task.reward` on threads under `task.reward_timeout_s`, or the
    task's own exact-match reward inline (None: it cannot hang)."""
    if cfg.task.reward:
        return load_callable(cfg.task.reward, field="task.reward"), cfg.task.reward_timeout_s
    return task.reward, None


def reference_config(cfg: GRPOConfig, model_path: str) -> ReferenceConfig:
    """The frozen reference: the policy's initial weights, the trainer's `init_checkpoint` when it starts from one
    (with LoRA, the base the adapters train on), scored as the trainer scores."""
    t = cfg.trainer
    return ReferenceConfig(model_path=model_path, family=t.family, dtype=t.dtype, device=t.device,
                           init_checkpoint=t.init_checkpoint, temperature=t.temperature,
                           chunk_rows=cfg.reference.chunk_rows)


def teacher_config(cfg: GRPOConfig, teacher_path: str) -> ReferenceConfig:
    """The distillation teacher: a frozen model like the reference, with its own checkpoint's weights, scored as the
    trainer scores (its family, dtype and temperature)."""
    t = cfg.trainer
    return ReferenceConfig(model_path=teacher_path, family=t.family, dtype=t.dtype, device=t.device,
                           temperature=t.temperature, chunk_rows=cfg.teacher.chunk_rows)


def spawn_scorer(cfg: GRPOConfig, model_path: str, teacher_path: str | None) -> tuple[str, Awaitable] | None:
    """(what it is, its spawn) for the mesh that scores every episode: the reference model, or the teacher (TorchTitan
    like the reference, or an hf / vLLM engine: `teacher.engine`); None without either."""
    r = cfg.resources
    if cfg.reference.enabled:
        config, name = reference_config(cfg, model_path), "reference"
    elif teacher_path is None:
        return None
    elif cfg.teacher.on_engine:
        engine = EngineScorer.options(with_gpus=r.with_gpus, gpus_per_proc=cfg.scorer_gpus, mesh_name="teacher")
        return (f"teacher ({cfg.teacher.engine} engine)",
                engine.as_actor(cfg.teacher_engine(teacher_path), cfg.trainer.temperature))
    else:
        config, name = teacher_config(cfg, teacher_path), "teacher"
    return name, ReferenceActor.options(procs=r.reference_procs, with_gpus=r.with_gpus, mesh_name=name).as_actor(config)


@dataclass
class JobActors:
    """The job's running parts. An actor mesh is typed as its actor class, as `ForgeActor.as_actor` returns it (its
    endpoints are called through the mesh: `trainer.train_step.call(batch)`)."""

    trainer: TrainerActor  # train_step, publish_weights, checkpoints, export_hf
    buffer: ReplayBufferActor
    generators: Service  # the Generator replicas
    # The mesh scoring every episode (its log-probs are the batch's ref_logprobs): the reference model (a
    # ReferenceActor) when reference.enabled, the teacher when teacher.model (a ReferenceActor, or an EngineScorer with
    # teacher.engine hf or vllm); None without either.
    scorer: ReferenceActor | EngineScorer | None
    tokenizer: PreTrainedTokenizerBase  # the model's, for what the job encodes itself (the weight-sync canary)
    pad_id: int


async def start_actors(cfg: GRPOConfig, model_path: str, teacher_path: str | None = None) -> JobActors:
    """Spawn every actor of the job at once (and the weight store they share); `teacher_path`: the distillation
    teacher's checkpoint (`teacher.model` resolved: rollouts.teacher_model)."""
    r = cfg.resources
    provisioner = get_provisioner()
    await start_weight_store(provisioner)
    scorer = spawn_scorer(cfg, model_path, teacher_path)
    print(f"starting actors: trainer x{r.trainer_procs}, generator x{r.generator_replicas} replicas, replay buffer"
          f"{f', {scorer[0]}' if scorer else ''}", flush=True)
    trainer_cfg = replace(cfg.trainer, model_path=model_path, max_steps=max(cfg.trainer.max_steps, cfg.steps))
    generator_cfg = replace(cfg.generator, model=model_path, weight_namespace=WEIGHTS)
    lora = cfg.trainer.lora
    if lora is not None and cfg.generator.engine == "vllm":  # every version is a LoRA request
        generator_cfg.engine_args = {**cfg.generator.engine_args, **lora_engine_args(lora.rank, lora.target_modules)}
    spawns = [
        TrainerActor.options(procs=r.trainer_procs, with_gpus=r.with_gpus, mesh_name="trainer").as_actor(
            trainer_cfg, weight_namespace=WEIGHTS),
        ReplayBufferActor.options(mesh_name="replay_buffer").as_actor(cfg.replay_buffer),
        Generator.options(num_replicas=r.generator_replicas, procs=r.generator_procs, with_gpus=r.with_gpus,
                          gpus_per_proc=cfg.generator_gpus_per_proc, mesh_name="generator").as_service(generator_cfg),
    ]
    if scorer is not None:
        spawns.append(scorer[1])
    trainer, buffer, generators, *scorers = await asyncio.gather(*spawns)
    for mesh in provisioner.meshes.values():  # which process is which, for ps/top/py-spy and fault reports
        print(f"provisioned mesh {mesh.name}: {len(mesh.processes)} procs (pids [{', '.join(map(str, mesh.processes))}])"
              f"{f', gpus {mesh.gpus}' if mesh.gpus else ''}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return JobActors(trainer, buffer, generators, scorers[0] if scorers else None, tokenizer, pad_id)
