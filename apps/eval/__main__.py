import sys

from apps.eval.cli import main

sys.exit(main())
