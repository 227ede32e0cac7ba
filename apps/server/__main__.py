import sys

from apps.server.main import main

sys.exit(main())
