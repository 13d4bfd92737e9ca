"""`python -m clawd.engine.local --model DIR ...`: run the local CPU engine (see clawd.engine.local.server)."""
import sys

from clawd.engine.local.server import main

if __name__ == "__main__":
    sys.exit(main())
