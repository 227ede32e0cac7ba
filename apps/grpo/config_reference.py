"""The GRPO job's configuration reference, rendered from its config dataclasses: every key, its type, default and help.

    python -m apps.grpo.config_reference > docs/configuration.md

The tables are apps/config_reference.py's (a key's help is its field's docstring); this adds the page's title and
introduction. tests/docs/test_configuration.py renders the reference and compares it with docs/configuration.md;
`python -m apps.grpo --help` prints the same text. Plain Python: no torch or Monarch import.
"""

from __future__ import annotations

import sys

from apps.config_reference import sections
from apps.grpo.config import GRPOConfig

REGENERATE = "python -m apps.grpo.config_reference > docs/configuration.md"
INTRO = f"""\
# Configuration reference: `python -m apps.grpo`

Generated from the config dataclasses (`apps/grpo/config.py` and the sections it nests): edit a field's docstring,
then run `{REGENERATE}`.
`tests/docs/test_configuration.py` fails when this page differs from what that prints, and
`python -m apps.grpo --help` prints the same reference.

A job is a YAML file plus overrides: `python -m apps.grpo --config configs/X.yaml key=value +new.key=v ~a.b`
(`key=value` changes a key, `+key=value` adds one, `~key` deletes one; `--resume` continues from the newest
checkpoint in `checkpoint.folder`). The defaults below are the dataclasses'; the files in `configs/` set their own,
and where the tiny configs differ the help says so ("tiny"). A bad value fails before any process starts, naming
the key, the value and what is allowed, e.g. `config error: replay_buffer.batch_sise=8: unknown key. Did you mean
'replay_buffer.batch_size'?`.
"""


def reference() -> str:
    """The whole reference, as docs/configuration.md holds it."""
    return INTRO + "\n" + "\n".join(sections(GRPOConfig, "", ""))


if __name__ == "__main__":
    sys.stdout.write(reference())
