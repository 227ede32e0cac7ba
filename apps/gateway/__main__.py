import sys

from apps.gateway.main import main

sys.exit(main())
