import sys

from apps.sft.cli import main

sys.exit(main())
