"""RL content, above the runtime (forge/) and below the actors: the data that flows through a job (completions,
episodes, train batches, sampling parameters), the tasks and environments that make prompts and rewards, and the
tiny model the CPU configs train. Imports forge/ only; never actors/ or apps/."""
