import sys

from aiperf_core.cli import main

sys.exit(main())
