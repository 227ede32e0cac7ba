import sys

from forge.native import main

sys.exit(main())
