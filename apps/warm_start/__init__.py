"""The supervised warm start a job may run before RL: a short fine-tune on a task's reference answers
(single-turn, `supervised`) or correct episodes (`multiturn`), cached by its inputs."""
