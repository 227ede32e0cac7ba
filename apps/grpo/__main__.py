import sys

from apps.grpo.cli import main

sys.exit(main())
