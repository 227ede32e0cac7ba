"""Built-in actors: generator, replay buffer, trainer, reference model, rewards."""
