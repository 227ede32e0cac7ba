import sys

from apps.grpo.main import main

sys.exit(main())
