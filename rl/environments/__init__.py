"""Multi-turn environments: the protocol, token-exact trajectories, the rollout loop, and actor isolation.

    env = task.environment()                       # any object with async reset(problem) and step(action)
    first_prompt = await env.reset(problem)        # text (or token ids) the model sees first
    result = await env.step(model_turn_text)       # StepResult(observation, reward, done, info)

Tools are environments: a tool call is an action, the tool's output the next observation.
`rl.environments.rollout.run_episodes` plays a group of episodes against a generator, token in / token out;
`config.EnvironmentConfig` (plain Python, no torch) holds its limits; with `chat_template`, `chat.ChatTemplate` wraps
each turn in the model's chat template, by token ids. This package file imports nothing, so the
config can be read before the training stack is imported.
"""
