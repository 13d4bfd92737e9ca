"""`python -m clawd.engine.local --model DIR ...`: run the local CPU engine (see clawd.engine.local.server)."""
import sys

from clawd import startup

startup.loading()  # until the model is loaded (Engine.load)
from clawd.engine.local.server import main  # noqa: E402  (imports torch)

if __name__ == "__main__":
    sys.exit(main())
