"""``python -m ddtree.server [--port 8000 ...]`` = ``ddtree serve``."""
import sys

from ddtree.server.cli import main

sys.exit(main())
