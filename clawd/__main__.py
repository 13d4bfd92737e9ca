import sys

from clawd.cli import main

sys.exit(main())
