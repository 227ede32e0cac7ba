"""What a GRPO run starts from: its task and reward, and its actors (its model: `rollouts.warm_started_model`).

    task = make_task(cfg)
    actors = await start_actors(cfg, model_path)               # trainer, replay buffer, generator service, reference
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any, Callable

from transformers import AutoTokenizer

from actors.engines.vllm_args import lora_engine_args
from actors.generator import Generator
from actors.reference_model import ReferenceActor, ReferenceConfig
from actors.replay_buffer import ReplayBufferActor
from actors.trainer import TrainerActor
from apps.grpo.config import GRPOConfig
from forge.provisioner import get_provisioner
from rl import tasks
from forge.config import load_callable

WEIGHTS = "policy"  # the weight store namespace the trainer publishes to and the generators follow


def make_task(cfg: GRPOConfig):
    return tasks.make_task(cfg.task, seed=cfg.seed, model=cfg.model)


def reward_function(cfg: GRPOConfig, task) -> tuple[Callable[[str, str], float], float | None]:
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


@dataclass
class JobActors:
    trainer: Any  # TrainerActor mesh: train_step, publish_weights, checkpoints, export_hf
    buffer: Any  # ReplayBufferActor
    generators: Any  # Service of Generator replicas
    reference: Any | None  # ReferenceActor mesh when reference.enabled
    tokenizer: Any  # the model's, for what the job encodes itself (the weight-sync canary)
    pad_id: int


async def start_actors(cfg: GRPOConfig, model_path: str) -> JobActors:
    """Spawn every actor of the job at once (and the weight store they share)."""
    r = cfg.resources
    provisioner = get_provisioner()
    await provisioner.start_weight_store()
    print(f"starting actors: trainer x{r.trainer_procs}, generator x{r.generator_replicas} replicas, replay buffer"
          f"{', reference' if cfg.reference.enabled else ''}", flush=True)
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
    if cfg.reference.enabled:
        spawns.append(ReferenceActor.options(procs=r.reference_procs, with_gpus=r.with_gpus,
                                             mesh_name="reference").as_actor(reference_config(cfg, model_path)))
    trainer, buffer, generators, *reference = await asyncio.gather(*spawns)
    for mesh in provisioner.meshes.values():  # which process is which, for ps/top/py-spy and fault reports
        print(f"provisioned mesh {mesh.name}: {len(mesh.processes)} procs (pids [{', '.join(map(str, mesh.processes))}])"
              f"{f', gpus {mesh.gpus}' if mesh.gpus else ''}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return JobActors(trainer, buffer, generators, reference[0] if reference else None, tokenizer, pad_id)
