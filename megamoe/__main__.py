import sys

from megamoe.cli import main

sys.exit(main())
