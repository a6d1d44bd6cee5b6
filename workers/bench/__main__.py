"""`python -m workers.bench`: the benchmark CLI (also how the benchmark starts its child processes)."""

import sys

from workers.bench.main import main

sys.exit(main())
